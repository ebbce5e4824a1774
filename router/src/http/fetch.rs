//! Image URLs the front fetches itself. Only when the operator allowlisted hosts
//! (`--allowed-image-hosts`), and then only `http`/`https` URLs whose host is on the list
//! exactly (no credentials in the URL), never following a redirect (so an allowed host cannot
//! send the server elsewhere), within a size cap and a time limit. Without an allowlist no URL is
//! ever fetched: a client could otherwise make the server reach hosts on its own network (SSRF).
//! `https` checks the server's certificate against the system's CA bundle (`SSL_CERT_FILE`, or
//! Debian's `/etc/ssl/certs/ca-certificates.crt`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper::header;
use hyper_util::rt::TokioIo;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::rustls;

/// Where and how images may be fetched.
#[derive(Clone)]
pub struct RemoteImages {
    /// Host names or addresses, lower case.
    hosts: Vec<String>,
    timeout: Duration,
    tls: Option<tokio_rustls::TlsConnector>,
}

impl std::fmt::Debug for RemoteImages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteImages")
            .field("hosts", &self.hosts)
            .field("timeout", &self.timeout)
            .field("https", &self.tls.is_some())
            .finish()
    }
}

/// A URL split into what the fetch needs.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Target {
    https: bool,
    host: String,
    port: u16,
    /// Path and query (`/` at least).
    path: String,
}

/// The system's CA bundle, if there is one.
fn ca_bundle() -> Option<PathBuf> {
    std::env::var_os("SSL_CERT_FILE")
        .map(PathBuf::from)
        .or_else(|| Some(PathBuf::from("/etc/ssl/certs/ca-certificates.crt")))
        .filter(|p| p.is_file())
}

fn tls_connector(bundle: &Path) -> anyhow::Result<tokio_rustls::TlsConnector> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(bundle)
        .map_err(|e| anyhow::anyhow!("reading {}: {e}", bundle.display()))?
    {
        let cert = cert.map_err(|e| anyhow::anyhow!("reading {}: {e}", bundle.display()))?;
        // A certificate the parser rejects is skipped, as other TLS clients do.
        let _ = roots.add(cert);
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

fn parse(url: &str) -> Result<Target, String> {
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| "an image URL must be a data URL or an http(s) URL".to_string())?;
    let https = match scheme.to_ascii_lowercase().as_str() {
        "http" => false,
        "https" => true,
        other => return Err(format!("image URLs of scheme `{other}` are not fetched")),
    };
    let split = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(split);
    if authority.contains('@') {
        return Err("image URLs with credentials are not fetched".into());
    }
    let (host, port) = match authority.strip_prefix('[') {
        Some(v6) => {
            let (h, after) = v6.split_once(']').ok_or("a bad IPv6 address in the URL")?;
            (h.to_string(), after.strip_prefix(':'))
        }
        None => match authority.rsplit_once(':') {
            Some((h, p)) => (h.to_string(), Some(p)),
            None => (authority.to_string(), None),
        },
    };
    let port = match port {
        None => {
            if https {
                443
            } else {
                80
            }
        }
        Some(p) => p
            .parse()
            .map_err(|_| format!("the URL's port `{p}` is not a number"))?,
    };
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    if host.is_empty() {
        return Err("the image URL has no host".into());
    }
    let tail = tail.split('#').next().unwrap_or("");
    let path = match tail.chars().next() {
        Some('/') => tail.to_string(),
        _ => format!("/{tail}"),
    };
    Ok(Target {
        https,
        host,
        port,
        path,
    })
}

impl RemoteImages {
    /// Fetches from `hosts` only (names or addresses, matched exactly), each fetch within
    /// `timeout`.
    pub fn new(hosts: &[String], timeout: Duration) -> anyhow::Result<Self> {
        let tls = ca_bundle().map(|b| tls_connector(&b)).transpose()?;
        Ok(RemoteImages {
            hosts: hosts
                .iter()
                .map(|h| h.trim().trim_end_matches('.').to_ascii_lowercase())
                .filter(|h| !h.is_empty())
                .collect(),
            timeout,
            tls,
        })
    }

    fn check(&self, url: &str) -> Result<Target, String> {
        let t = parse(url)?;
        if !self.hosts.contains(&t.host) {
            return Err(format!(
                "images are not fetched from `{}`: it is not an allowed image host",
                t.host
            ));
        }
        Ok(t)
    }

    /// The image at `url` and its declared media type, at most `max_bytes`.
    pub async fn fetch(&self, url: &str, max_bytes: usize) -> Result<(Vec<u8>, String), String> {
        let t = self.check(url)?;
        let limit = self.timeout;
        tokio::time::timeout(limit, self.fetch_target(&t, max_bytes))
            .await
            .map_err(|_| format!("fetching the image took longer than {limit:?}"))?
    }

    async fn fetch_target(
        &self,
        t: &Target,
        max_bytes: usize,
    ) -> Result<(Vec<u8>, String), String> {
        let tcp = tokio::net::TcpStream::connect((t.host.as_str(), t.port))
            .await
            .map_err(|e| format!("cannot connect to {}:{}: {e}", t.host, t.port))?;
        if !t.https {
            return exchange(tcp, t, max_bytes).await;
        }
        let tls = self
            .tls
            .as_ref()
            .ok_or("https image URLs need the system's CA certificates, which are missing")?;
        let name = ServerName::try_from(t.host.clone())
            .map_err(|e| format!("`{}` is not a TLS server name: {e}", t.host))?;
        let stream = tls
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS with {}: {e}", t.host))?;
        exchange(stream, t, max_bytes).await
    }
}

/// One GET over `io`; the body, at most `max_bytes`, and its `content-type`.
async fn exchange<S>(io: S, t: &Target, max_bytes: usize) -> Result<(Vec<u8>, String), String>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let failed = |e: &dyn std::fmt::Display| format!("fetching the image: {e}");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .map_err(|e| failed(&e))?;
    let conn = tokio::spawn(conn);
    let default_port = if t.https { 443 } else { 80 };
    let host = match (t.host.contains(':'), t.port == default_port) {
        (true, true) => format!("[{}]", t.host),
        (true, false) => format!("[{}]:{}", t.host, t.port),
        (false, true) => t.host.clone(),
        (false, false) => format!("{}:{}", t.host, t.port),
    };
    let req = hyper::Request::get(t.path.as_str())
        .header(header::HOST, host)
        .header(header::USER_AGENT, "tessera-router")
        .body(Empty::<Bytes>::new())
        .map_err(|e| failed(&e))?;
    let result = async {
        let resp = sender.send_request(req).await.map_err(|e| failed(&e))?;
        let status = resp.status();
        if status.is_redirection() {
            return Err(format!(
                "the image URL answered {status} (a redirect): redirects are not followed"
            ));
        }
        if !status.is_success() {
            return Err(format!("the image URL answered {status}"));
        }
        let declared = resp
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > max_bytes as u64) {
            return Err(format!(
                "the image is {} bytes, the limit is {max_bytes}",
                declared.unwrap_or_default()
            ));
        }
        let mime = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(|v| {
                v.split(';')
                    .next()
                    .unwrap_or("")
                    .trim()
                    .to_ascii_lowercase()
            })
            .unwrap_or_default();
        let mut body = resp.into_body();
        let mut out = Vec::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| failed(&e))?;
            if let Ok(data) = frame.into_data() {
                if out.len() + data.len() > max_bytes {
                    return Err(format!(
                        "the image is larger than the limit of {max_bytes} bytes"
                    ));
                }
                out.extend_from_slice(&data);
            }
        }
        Ok((out, mime))
    }
    .await;
    conn.abort();
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn urls_parse_into_host_port_and_path() {
        let t = parse("HTTPS://Img.Example.com./a/b.png?x=1#frag").unwrap();
        assert_eq!(
            t,
            Target {
                https: true,
                host: "img.example.com".into(),
                port: 443,
                path: "/a/b.png?x=1".into()
            }
        );
        let t = parse("http://127.0.0.1:8080").unwrap();
        assert_eq!((t.port, t.path.as_str()), (8080, "/"));
        let t = parse("http://[::1]:9/x").unwrap();
        assert_eq!((t.host.as_str(), t.port), ("::1", 9));
        for bad in [
            "ftp://example.com/x",
            "file:///etc/passwd",
            "http://user:pw@example.com/",
            "http://example.com:http/",
            "http:///x",
            "example.com/x",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    /// A one-shot HTTP server answering every request with `response`.
    async fn serve(response: Vec<u8>) -> String {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let mut buf = vec![0u8; 4096];
                let _ = s.read(&mut buf).await;
                let _ = s.write_all(&response).await;
                let _ = s.shutdown().await;
            }
        });
        addr
    }

    fn ok(body: &[u8], content_type: &str) -> Vec<u8> {
        let mut r = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\r\n",
            body.len()
        )
        .into_bytes();
        r.extend_from_slice(body);
        r
    }

    #[tokio::test]
    async fn only_allowed_hosts_within_limits_and_no_redirects() {
        let remote = RemoteImages::new(&["127.0.0.1".into()], Duration::from_secs(5)).unwrap();
        let good = serve(ok(b"\x89PNG fake", "image/png; charset=x")).await;
        let (bytes, mime) = remote
            .fetch(&format!("http://{good}/cat.png"), 100)
            .await
            .unwrap();
        assert_eq!(
            (bytes.as_slice(), mime.as_str()),
            (&b"\x89PNG fake"[..], "image/png")
        );
        let e = remote
            .fetch(&format!("http://{good}/cat.png"), 4)
            .await
            .unwrap_err();
        assert!(e.contains("limit"), "{e}");
        let port = good.rsplit(':').next().unwrap();
        let e = remote
            .fetch(&format!("http://localhost:{port}/cat.png"), 100)
            .await
            .unwrap_err();
        assert!(e.contains("not an allowed image host"), "{e}");
        let moved = serve(
            b"HTTP/1.1 302 Found\r\nlocation: http://169.254.169.254/\r\ncontent-length: 0\r\n\r\n"
                .to_vec(),
        )
        .await;
        let e = remote
            .fetch(&format!("http://{moved}/x"), 100)
            .await
            .unwrap_err();
        assert!(e.contains("redirects are not followed"), "{e}");
        let missing = serve(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n".to_vec()).await;
        let e = remote
            .fetch(&format!("http://{missing}/x"), 100)
            .await
            .unwrap_err();
        assert!(e.contains("404"), "{e}");
        // No content-length: the cap holds on the streamed body.
        let mut chunked = b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n".to_vec();
        chunked.extend(vec![b'x'; 5000]);
        let big = serve(chunked).await;
        let e = remote
            .fetch(&format!("http://{big}/x"), 1000)
            .await
            .unwrap_err();
        assert!(e.contains("limit"), "{e}");
        // A host that never answers: the time limit holds.
        let slow_l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let slow = slow_l.local_addr().unwrap().to_string();
        let quick = RemoteImages::new(&["127.0.0.1".into()], Duration::from_millis(200)).unwrap();
        let e = quick
            .fetch(&format!("http://{slow}/x"), 100)
            .await
            .unwrap_err();
        assert!(e.contains("longer than"), "{e}");
        drop(slow_l);
    }
}
