//! Who may call the fronts and how often: API keys and per-client rate limits, shared by the
//! HTTP and gRPC fronts. Both hand the presented credentials to [`Access::admit`] and map its
//! [`ApiError`] at their own edge (HTTP 401/429, gRPC `UNAUTHENTICATED`/`RESOURCE_EXHAUSTED`).
//!
//! Keys are read from a file and kept only as SHA-256 digests; a presented key is hashed and
//! compared with every stored digest in constant time. Without a key file there is no
//! authentication at all (loopback and development only).

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use sha2::{Digest, Sha256};
use subtle::{Choice, ConditionallySelectable, ConstantTimeEq};

use super::error::ApiError;

/// The accepted API keys, as SHA-256 digests only.
pub struct ApiKeys {
    digests: Vec<[u8; 32]>,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiKeys")
            .field("keys", &self.digests.len())
            .finish()
    }
}

impl ApiKeys {
    /// Reads a key file: one key per line, `#` comments and blank lines ignored, surrounding
    /// whitespace trimmed. The file's bytes are overwritten once hashed.
    pub fn from_file(path: &Path) -> anyhow::Result<ApiKeys> {
        let mut bytes =
            std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        warn_if_shared(path);
        let keys = Self::parse(&bytes);
        wipe(&mut bytes);
        keys.with_context(|| format!("in the API key file {}", path.display()))
    }

    /// Parses the key file format (see [`ApiKeys::from_file`]). Errors name the line, never the
    /// key.
    pub fn parse(text: &[u8]) -> anyhow::Result<ApiKeys> {
        let mut digests: Vec<[u8; 32]> = Vec::new();
        for (i, line) in text.split(|&b| b == b'\n').enumerate() {
            let key = line.trim_ascii();
            if key.is_empty() || key.starts_with(b"#") {
                continue;
            }
            if let Some(bad) = key.iter().find(|b| !b.is_ascii_graphic()) {
                anyhow::bail!(
                    "line {}: a key may hold only visible ASCII characters (found byte {bad:#04x})",
                    i + 1
                );
            }
            let digest: [u8; 32] = Sha256::digest(key).into();
            if !digests.contains(&digest) {
                digests.push(digest);
            }
        }
        anyhow::ensure!(
            !digests.is_empty(),
            "no API keys (every line is blank or a comment)"
        );
        Ok(ApiKeys { digests })
    }

    /// How many distinct keys there are.
    pub fn len(&self) -> usize {
        self.digests.len()
    }

    pub fn is_empty(&self) -> bool {
        self.digests.is_empty()
    }

    /// The index of `presented` among the keys. Every stored digest is compared, each in
    /// constant time, whatever matches.
    pub fn find(&self, presented: &[u8]) -> Option<usize> {
        let digest: [u8; 32] = Sha256::digest(presented).into();
        let mut found = Choice::from(0);
        let mut index = 0u32;
        for (i, stored) in self.digests.iter().enumerate() {
            let eq = stored.ct_eq(&digest);
            index.conditional_assign(&(i as u32), eq);
            found |= eq;
        }
        bool::from(found).then_some(index as usize)
    }
}

/// Overwrite a buffer that held keys before it is freed.
fn wipe(bytes: &mut [u8]) {
    bytes.fill(0);
    std::hint::black_box(&bytes);
}

#[cfg(unix)]
fn warn_if_shared(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path) {
        if meta.permissions().mode() & 0o077 != 0 {
            tracing::warn!(
                file = %path.display(),
                "the API key file is readable by other users; chmod 600 it"
            );
        }
    }
}

#[cfg(not(unix))]
fn warn_if_shared(_path: &Path) {}

/// A token-bucket rate: `rps` requests per second on average, `burst` at once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateLimit {
    pub rps: f64,
    pub burst: u32,
}

/// Whose bucket a request draws from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Client {
    /// The index of an API key.
    Key(usize),
    /// The peer address, when no keys are configured.
    Ip(IpAddr),
    /// No key and no peer address known (in-process callers).
    Unknown,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// Buckets kept before idle (full) ones are dropped.
const MAX_BUCKETS: usize = 65_536;

/// One token bucket per [`Client`].
#[derive(Debug)]
pub struct RateLimiter {
    limit: RateLimit,
    buckets: Mutex<HashMap<Client, Bucket>>,
}

impl RateLimiter {
    pub fn new(limit: RateLimit) -> Self {
        RateLimiter {
            limit,
            buckets: Mutex::default(),
        }
    }

    /// Take one token from `client`'s bucket at `now`; when it is empty, how long until one
    /// is back.
    pub fn acquire(&self, client: Client, now: Instant) -> Result<(), Duration> {
        let RateLimit { rps, burst } = self.limit;
        let burst = f64::from(burst);
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        if buckets.len() >= MAX_BUCKETS && !buckets.contains_key(&client) {
            let refill = Duration::from_secs_f64(burst / rps);
            buckets.retain(|_, b| now.saturating_duration_since(b.at) < refill);
        }
        let b = buckets.entry(client).or_insert(Bucket {
            tokens: burst,
            at: now,
        });
        let elapsed = now.saturating_duration_since(b.at).as_secs_f64();
        b.tokens = (b.tokens + elapsed * rps).min(burst);
        b.at = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - b.tokens) / rps))
        }
    }
}

/// The front's access policy: keys (optional) and a rate limit (optional).
#[derive(Debug, Default)]
pub struct Access {
    keys: Option<Arc<ApiKeys>>,
    limiter: Option<RateLimiter>,
}

impl Access {
    pub fn new(keys: Option<Arc<ApiKeys>>, limit: Option<RateLimit>) -> Self {
        Access {
            keys,
            limiter: limit.map(RateLimiter::new),
        }
    }

    /// Admit one request given its `authorization` and `x-api-key` values and its peer:
    /// 401 without a valid key (when keys are configured), 429 over the rate limit.
    pub fn admit(
        &self,
        authorization: Option<&[u8]>,
        x_api_key: Option<&[u8]>,
        peer: Option<IpAddr>,
    ) -> Result<(), ApiError> {
        let client = match &self.keys {
            None => peer.map_or(Client::Unknown, Client::Ip),
            Some(keys) => Client::Key(authenticate(keys, authorization, x_api_key)?),
        };
        match &self.limiter {
            None => Ok(()),
            Some(l) => l.acquire(client, Instant::now()).map_err(|wait| {
                // Whole seconds, rounded up, at least 1.
                let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
                ApiError::rate_limited(secs.max(1))
            }),
        }
    }
}

/// The key's index, from `Authorization: Bearer <key>` or else `x-api-key: <key>`.
fn authenticate(
    keys: &ApiKeys,
    authorization: Option<&[u8]>,
    x_api_key: Option<&[u8]>,
) -> Result<usize, ApiError> {
    let presented = match (authorization, x_api_key) {
        (Some(auth), _) => bearer_token(auth).ok_or_else(|| {
            ApiError::unauthorized(
                "The Authorization header must be `Bearer <API key>`.",
                "invalid_api_key",
            )
        })?,
        (None, Some(key)) => key,
        (None, None) => {
            return Err(ApiError::unauthorized(
                "You didn't provide an API key. Send it as `Authorization: Bearer <API key>`.",
                "missing_api_key",
            ))
        }
    };
    keys.find(presented)
        .ok_or_else(|| ApiError::unauthorized("Incorrect API key provided.", "invalid_api_key"))
}

/// `<key>` of `Bearer <key>` (scheme case-insensitive).
fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let value = value.trim_ascii();
    let (scheme, rest) = value.split_at_checked(6)?;
    let token = rest.trim_ascii_start();
    (scheme.eq_ignore_ascii_case(b"bearer") && token.len() < rest.len() && !token.is_empty())
        .then_some(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str =
        "# keys of the team\n\nsk-alpha-123\n   sk-beta-456  \n#sk-commented\nsk-alpha-123\n";

    #[test]
    fn the_key_store_holds_only_digests() {
        let keys = ApiKeys::parse(FILE.as_bytes()).unwrap();
        assert_eq!(
            keys.len(),
            2,
            "blank, comment and duplicate lines are skipped"
        );
        let want: Vec<[u8; 32]> = ["sk-alpha-123", "sk-beta-456"]
            .iter()
            .map(|k| Sha256::digest(k.as_bytes()).into())
            .collect();
        assert_eq!(keys.digests, want);
        // No stored byte string contains a key, and Debug shows neither keys nor digests.
        let stored: Vec<u8> = keys.digests.concat();
        for key in ["sk-alpha-123", "sk-beta-456", "alpha", "beta"] {
            assert!(!stored.windows(key.len()).any(|w| w == key.as_bytes()));
        }
        assert_eq!(format!("{keys:?}"), "ApiKeys { keys: 2 }");
    }

    #[test]
    fn the_key_file_is_read_then_wiped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys");
        std::fs::write(&path, FILE).unwrap();
        let keys = ApiKeys::from_file(&path).unwrap();
        assert_eq!(keys.find(b"sk-beta-456"), Some(1));
        let mut buf = b"sk-secret".to_vec();
        wipe(&mut buf);
        assert_eq!(buf, vec![0; 9]);
    }

    #[test]
    fn keys_are_found_by_exact_match_only() {
        let keys = ApiKeys::parse(FILE.as_bytes()).unwrap();
        assert_eq!(keys.find(b"sk-alpha-123"), Some(0));
        assert_eq!(keys.find(b"sk-beta-456"), Some(1));
        for wrong in [&b"sk-alpha-12"[..], b"sk-alpha-1234", b"", b"#sk-commented"] {
            assert_eq!(keys.find(wrong), None);
        }
    }

    #[test]
    fn bad_key_files_are_refused_without_showing_the_key() {
        for (text, why) in [
            ("", "no API keys"),
            ("# only a comment\n\n", "no API keys"),
            ("sk-good\nsk bad\n", "line 2"),
        ] {
            let err = format!("{:#}", ApiKeys::parse(text.as_bytes()).unwrap_err());
            assert!(err.contains(why), "{err}");
            assert!(!err.contains("sk"), "{err}");
        }
    }

    #[test]
    fn credentials_are_read_from_either_header() {
        let keys = ApiKeys::parse(FILE.as_bytes()).unwrap();
        let ok = |a: Option<&str>, x: Option<&str>| {
            authenticate(&keys, a.map(str::as_bytes), x.map(str::as_bytes))
        };
        assert_eq!(ok(Some("Bearer sk-alpha-123"), None), Ok(0));
        assert_eq!(ok(Some("bearer   sk-beta-456 "), None), Ok(1));
        assert_eq!(ok(None, Some("sk-beta-456")), Ok(1));
        for (a, x, code) in [
            (None, None, "missing_api_key"),
            (Some("Bearer sk-wrong"), None, "invalid_api_key"),
            (Some("sk-alpha-123"), None, "invalid_api_key"),
            (Some("Basic sk-alpha-123"), None, "invalid_api_key"),
            (Some("Bearersk-alpha-123"), None, "invalid_api_key"),
            (Some("Bearer "), None, "invalid_api_key"),
            (None, Some("sk-wrong"), "invalid_api_key"),
            // A wrong Authorization header is not rescued by a right x-api-key.
            (
                Some("Bearer sk-wrong"),
                Some("sk-alpha-123"),
                "invalid_api_key",
            ),
        ] {
            let e = ok(a, x).unwrap_err();
            assert_eq!(e.status.as_u16(), 401, "{a:?} {x:?}");
            assert_eq!(e.code, Some(code), "{a:?} {x:?}");
        }
    }

    #[test]
    fn token_buckets_refill_at_the_rate() {
        let l = RateLimiter::new(RateLimit { rps: 2.0, burst: 3 });
        let t0 = Instant::now();
        let a = Client::Key(0);
        for _ in 0..3 {
            l.acquire(a, t0).unwrap();
        }
        assert_eq!(l.acquire(a, t0), Err(Duration::from_millis(500)));
        // Another client has its own bucket.
        l.acquire(Client::Key(1), t0).unwrap();
        // Half a token back after 250 ms: still refused, for the other 250 ms.
        let wait = l.acquire(a, t0 + Duration::from_millis(250)).unwrap_err();
        assert!((wait.as_secs_f64() - 0.25).abs() < 1e-9, "{wait:?}");
        l.acquire(a, t0 + Duration::from_millis(500)).unwrap();
        // Never more than the burst, however long the client was idle.
        let later = t0 + Duration::from_secs(3600);
        for _ in 0..3 {
            l.acquire(a, later).unwrap();
        }
        assert!(l.acquire(a, later).is_err());
    }

    #[test]
    fn limited_clients_get_a_retry_after_of_whole_seconds() {
        let access = Access::new(None, Some(RateLimit { rps: 0.1, burst: 1 }));
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        access.admit(None, None, Some(ip)).unwrap();
        let e = access.admit(None, None, Some(ip)).unwrap_err();
        assert_eq!(e.status.as_u16(), 429);
        assert_eq!(e.retry_after, Some(10));
        // Another address is not limited by the first one's requests.
        access
            .admit(None, None, Some("10.0.0.2".parse().unwrap()))
            .unwrap();
    }
}
