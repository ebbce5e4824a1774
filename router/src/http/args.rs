//! The front's flags, shared by `tessera serve`, `tessera router` and `tessera up`.

use std::path::PathBuf;
use std::sync::Arc;

use super::access::{ApiKeys, RateLimit};
use super::FrontOptions;

/// API keys, rate limits and request limits of the HTTP and gRPC fronts (each also from
/// `TESSERA_*` env).
#[derive(clap::Args, Clone, Debug, PartialEq)]
pub struct FrontArgs {
    /// File of API keys, one per line (`#` comments and blank lines ignored); only their SHA-256
    /// digests are kept. With it, every route but /health and /metrics (and gRPC `Generate`)
    /// needs `Authorization: Bearer <key>` or `x-api-key: <key>`. Without it nothing is
    /// authenticated: for loopback and development only.
    #[arg(long, env = "TESSERA_API_KEY_FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Requests per second allowed to each API key (to each client IP without keys); past it
    /// requests get 429 with `Retry-After`. Unset: no rate limit.
    #[arg(long, env = "TESSERA_RATE_LIMIT_RPS", value_parser = parse_rps)]
    pub rate_limit_rps: Option<f64>,
    /// Requests a client may send at once before `--rate-limit-rps` holds it back (default: the
    /// rate rounded up).
    #[arg(
        long,
        env = "TESSERA_RATE_LIMIT_BURST",
        requires = "rate_limit_rps",
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub rate_limit_burst: Option<u32>,
    /// Largest request body accepted (bytes); larger ones get 413.
    #[arg(long, env = "TESSERA_MAX_BODY_BYTES", default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
    /// Longest prompt accepted, in tokens (default: the model's context); longer ones get 400.
    #[arg(long, env = "TESSERA_MAX_PROMPT_TOKENS", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_prompt_tokens: Option<u64>,
    /// Log each request's prompt (decoded text) and parameters at info level. Prompts are
    /// never logged otherwise, at any log level.
    #[arg(long, env = "TESSERA_LOG_REQUESTS")]
    pub log_requests: bool,
    /// Largest image accepted in a chat request, in bytes of the encoded file (after base64
    /// decoding); larger ones get 400. Images come as `data:` URLs only: the server never
    /// fetches a URL a client names. Base64 adds a third: raise `--max-body-bytes` with it.
    #[arg(long, env = "TESSERA_MAX_IMAGE_BYTES", default_value_t = 5 << 20)]
    pub max_image_bytes: usize,
    /// Images one chat request may carry at most; more get 400.
    #[arg(long, env = "TESSERA_MAX_IMAGES_PER_REQUEST", default_value_t = 8)]
    pub max_images_per_request: usize,
    /// Hosts (names or addresses, comma-separated, matched exactly) that `http(s)` image URLs
    /// may name; the front then fetches them itself, without following redirects, within
    /// `--max-image-bytes` and `--image-fetch-timeout-ms`. Unset: image URLs get 400 and only
    /// `data:` URLs are taken (a client cannot make the server reach its network).
    #[arg(long, env = "TESSERA_ALLOWED_IMAGE_HOSTS", value_delimiter = ',')]
    pub allowed_image_hosts: Vec<String>,
    /// Longest fetch of one image URL, in milliseconds (connect, TLS, response).
    #[arg(long, env = "TESSERA_IMAGE_FETCH_TIMEOUT_MS", default_value_t = 10_000)]
    pub image_fetch_timeout_ms: u64,
}

fn parse_rps(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(r) if r.is_finite() && r > 0.0 => Ok(r),
        _ => Err(format!(
            "`{s}` is not a positive number of requests per second"
        )),
    }
}

impl FrontArgs {
    /// The rate limit the flags ask for.
    pub fn rate_limit(&self) -> Option<RateLimit> {
        self.rate_limit_rps.map(|rps| RateLimit {
            rps,
            burst: self
                .rate_limit_burst
                .unwrap_or_else(|| rps.ceil().clamp(1.0, f64::from(u32::MAX)) as u32),
        })
    }

    /// These flags as [`FrontOptions`] (the key file read and hashed); the other fields at
    /// their defaults.
    pub fn options(&self) -> anyhow::Result<FrontOptions> {
        let api_keys = match &self.api_key_file {
            Some(path) => {
                let keys = ApiKeys::from_file(path)?;
                tracing::info!(keys = keys.len(), "API keys required");
                Some(Arc::new(keys))
            }
            None => None,
        };
        Ok(FrontOptions {
            max_body_bytes: self.max_body_bytes,
            max_prompt_tokens: self.max_prompt_tokens.map(|n| n as usize),
            api_keys,
            rate_limit: self.rate_limit(),
            log_requests: self.log_requests,
            image_rules: super::images::ImageRules {
                max_images: self.max_images_per_request,
                max_image_bytes: self.max_image_bytes,
            },
            remote_images: match self.allowed_image_hosts.is_empty() {
                true => None,
                false => Some(Arc::new(super::fetch::RemoteImages::new(
                    &self.allowed_image_hosts,
                    std::time::Duration::from_millis(self.image_fetch_timeout_ms),
                )?)),
            },
            ..FrontOptions::default()
        })
    }

    /// The same flags on a command line (for a child process), the unset ones left out.
    pub fn to_args(&self) -> Vec<String> {
        let mut v = Vec::new();
        let mut flag = |name: &str, value: String| v.extend([format!("--{name}"), value]);
        if let Some(p) = &self.api_key_file {
            flag("api-key-file", p.display().to_string());
        }
        if let Some(r) = self.rate_limit_rps {
            flag("rate-limit-rps", r.to_string());
        }
        if let Some(b) = self.rate_limit_burst {
            flag("rate-limit-burst", b.to_string());
        }
        flag("max-body-bytes", self.max_body_bytes.to_string());
        if let Some(n) = self.max_prompt_tokens {
            flag("max-prompt-tokens", n.to_string());
        }
        flag("max-image-bytes", self.max_image_bytes.to_string());
        flag(
            "max-images-per-request",
            self.max_images_per_request.to_string(),
        );
        if !self.allowed_image_hosts.is_empty() {
            flag("allowed-image-hosts", self.allowed_image_hosts.join(","));
        }
        flag(
            "image-fetch-timeout-ms",
            self.image_fetch_timeout_ms.to_string(),
        );
        if self.log_requests {
            v.push("--log-requests".into());
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(clap::Parser)]
    struct Cmd {
        #[command(flatten)]
        front: FrontArgs,
    }

    fn parse(argv: &[&str]) -> Result<FrontArgs, clap::Error> {
        let mut all = vec!["cmd"];
        all.extend_from_slice(argv);
        <Cmd as clap::Parser>::try_parse_from(all).map(|c| c.front)
    }

    #[test]
    fn flags_parse_and_round_trip() {
        let a = parse(&[
            "--api-key-file",
            "/etc/tessera/keys",
            "--rate-limit-rps",
            "2.5",
            "--rate-limit-burst",
            "4",
            "--max-body-bytes",
            "1024",
            "--max-prompt-tokens",
            "100",
        ])
        .unwrap();
        assert_eq!(a.rate_limit(), Some(RateLimit { rps: 2.5, burst: 4 }));
        let argv = a.to_args();
        let back = parse(&argv.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        assert_eq!(back, a);
    }

    #[test]
    fn the_burst_defaults_to_the_rate_and_bad_values_are_refused() {
        if std::env::vars().any(|(k, _)| k.starts_with("TESSERA_RATE_LIMIT")) {
            return;
        }
        let a = parse(&["--rate-limit-rps", "2.5"]).unwrap();
        assert_eq!(a.rate_limit(), Some(RateLimit { rps: 2.5, burst: 3 }));
        let a = parse(&["--rate-limit-rps", "0.2"]).unwrap();
        assert_eq!(a.rate_limit().unwrap().burst, 1);
        for bad in [
            &["--rate-limit-rps", "0"][..],
            &["--rate-limit-rps", "-1"],
            &["--rate-limit-rps", "NaN"],
            &["--rate-limit-rps", "inf"],
            &["--rate-limit-rps", "1", "--rate-limit-burst", "0"],
            &["--rate-limit-burst", "3"],
            &["--max-prompt-tokens", "0"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_missing_or_empty_key_file_stops_start_up() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope");
        let a = parse(&["--api-key-file", missing.to_str().unwrap()]).unwrap();
        assert!(a.options().is_err());
        let empty = dir.path().join("empty");
        std::fs::write(&empty, "# nothing yet\n").unwrap();
        let a = parse(&["--api-key-file", empty.to_str().unwrap()]).unwrap();
        let err = format!("{:#}", a.options().unwrap_err());
        assert!(err.contains("no API keys"), "{err}");
    }
}
