//! The HTTP/1.1 client of `tessera bench`: one connection per request (`Connection: close`),
//! plain HTTP only, chunked bodies decoded as they arrive so a streamed response's first token is
//! timed when it comes.

use std::time::Instant;

use anyhow::{bail, Context};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// `http://host:port/prefix`, split.
#[derive(Clone, Debug)]
pub(super) struct Target {
    pub(super) authority: String,
    pub(super) prefix: String,
}

pub(super) fn parse_url(url: &str) -> anyhow::Result<Target> {
    let Some(rest) = url.strip_prefix("http://") else {
        bail!("--url `{url}`: only plain http:// URLs are supported");
    };
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    if authority.is_empty() {
        bail!("--url `{url}`: no host");
    }
    let authority = if authority.contains(':') && !authority.ends_with(']') {
        authority.to_string()
    } else {
        format!("{authority}:80")
    };
    let prefix = path
        .trim_end_matches('/')
        .trim_end_matches("/v1")
        .to_string();
    Ok(Target { authority, prefix })
}

/// Incremental decoder of `Transfer-Encoding: chunked` bodies.
#[derive(Default)]
pub(super) struct Chunked {
    pending: Vec<u8>,
    remaining: usize,
    in_data: bool,
    pub(super) done: bool,
}

impl Chunked {
    /// Feeds raw bytes; appends the body bytes they complete to `out`.
    pub(super) fn feed(&mut self, raw: &[u8], out: &mut Vec<u8>) -> anyhow::Result<()> {
        self.pending.extend_from_slice(raw);
        let mut pos = 0;
        loop {
            if self.done {
                break;
            }
            if self.in_data {
                let take = self.remaining.min(self.pending.len() - pos);
                out.extend_from_slice(&self.pending[pos..pos + take]);
                pos += take;
                self.remaining -= take;
                if self.remaining > 0 {
                    break;
                }
                if self.pending.len() - pos < 2 {
                    break;
                }
                pos += 2;
                self.in_data = false;
                continue;
            }
            let Some(eol) = self.pending[pos..].windows(2).position(|w| w == b"\r\n") else {
                break;
            };
            let line = std::str::from_utf8(&self.pending[pos..pos + eol])?;
            let size = line.split(';').next().unwrap_or("").trim();
            let size = usize::from_str_radix(size, 16)
                .with_context(|| format!("bad chunk size `{size}`"))?;
            pos += eol + 2;
            if size == 0 {
                self.done = true;
            } else {
                self.remaining = size;
                self.in_data = true;
            }
        }
        self.pending.drain(..pos);
        Ok(())
    }
}

pub(super) struct Outcome {
    pub(super) status: u16,
    pub(super) error: Option<String>,
    pub(super) output_tokens: usize,
    pub(super) first_token: Option<Instant>,
}

/// Sends one completion request and reads the whole response, noting when the first token came.
pub(super) async fn send(
    target: &Target,
    auth: Option<&str>,
    body: &[u8],
    stream: bool,
) -> Outcome {
    let mut out = Outcome {
        status: 0,
        error: None,
        output_tokens: 0,
        first_token: None,
    };
    if let Err(e) = exchange(target, auth, body, stream, &mut out).await {
        out.error = Some(format!("{e:#}"));
    }
    out
}

async fn exchange(
    target: &Target,
    auth: Option<&str>,
    body: &[u8],
    stream: bool,
    out: &mut Outcome,
) -> anyhow::Result<()> {
    let mut conn = TcpStream::connect(&target.authority)
        .await
        .with_context(|| format!("connecting to {}", target.authority))?;
    conn.set_nodelay(true).ok();
    let mut head = format!(
        "POST {}/v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n",
        target.prefix,
        target.authority,
        body.len()
    );
    if let Some(key) = auth {
        head.push_str(&format!("Authorization: Bearer {key}\r\n"));
    }
    head.push_str("\r\n");
    conn.write_all(head.as_bytes()).await?;
    conn.write_all(body).await?;

    let mut raw = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    let header_end = loop {
        let n = conn.read(&mut buf).await?;
        if n == 0 {
            bail!("connection closed before the response head");
        }
        raw.extend_from_slice(&buf[..n]);
        if let Some(i) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&raw[..header_end]).to_string();
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("malformed status line")?;
    out.status = status;
    let chunked = head.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    let mut decoder = chunked.then(Chunked::default);
    let mut decoded = Vec::new();
    let mut sse = Sse::default();
    let mut feed = |bytes: &[u8], decoded: &mut Vec<u8>, out: &mut Outcome| -> anyhow::Result<()> {
        match decoder.as_mut() {
            Some(d) => d.feed(bytes, decoded)?,
            None => decoded.extend_from_slice(bytes),
        }
        if stream && status == 200 {
            sse.consume(decoded, out)?;
        }
        Ok(())
    };
    feed(&raw[header_end..], &mut decoded, out)?;
    loop {
        let n = conn.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        feed(&buf[..n], &mut decoded, out)?;
    }
    if status != 200 {
        let text = String::from_utf8_lossy(&decoded);
        let msg = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
            .unwrap_or_else(|| text.chars().take(200).collect());
        bail!("HTTP {status}: {msg}");
    }
    if stream {
        if !sse.done {
            bail!("stream ended without [DONE]");
        }
        if let Some(n) = sse.usage_tokens {
            out.output_tokens = n;
        }
    } else {
        let v: Value = serde_json::from_slice(&decoded).context("response is not JSON")?;
        out.output_tokens = v["usage"]["completion_tokens"]
            .as_u64()
            .context("response has no usage.completion_tokens")?
            as usize;
        out.first_token = Some(Instant::now());
    }
    Ok(())
}

/// Server-sent events of a streamed completion.
#[derive(Default)]
struct Sse {
    done: bool,
    usage_tokens: Option<usize>,
}

impl Sse {
    /// Handles every complete event in `buf` and removes it.
    fn consume(&mut self, buf: &mut Vec<u8>, out: &mut Outcome) -> anyhow::Result<()> {
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&event);
            for line in text.lines() {
                let Some(data) = line.strip_prefix("data:") else {
                    continue;
                };
                let data = data.trim();
                if data == "[DONE]" {
                    self.done = true;
                    continue;
                }
                let v: Value = serde_json::from_str(data).context("SSE event is not JSON")?;
                if let Some(e) = v.get("error") {
                    bail!("error event: {}", e["message"].as_str().unwrap_or("?"));
                }
                if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                    self.usage_tokens = Some(n as usize);
                }
                let mut tokens = 0;
                let mut text_seen = false;
                for c in v["choices"].as_array().into_iter().flatten() {
                    tokens += c["token_ids"].as_array().map_or(0, |a| a.len());
                    text_seen |= c["text"].as_str().is_some_and(|t| !t.is_empty());
                }
                if tokens > 0 || text_seen {
                    out.first_token.get_or_insert_with(Instant::now);
                }
                out.output_tokens += tokens;
            }
        }
        Ok(())
    }
}

/// GET `<url>/v1/models`: the first model's id.
pub(super) async fn first_model(target: &Target, auth: Option<&str>) -> anyhow::Result<String> {
    let mut conn = TcpStream::connect(&target.authority)
        .await
        .with_context(|| format!("connecting to {}", target.authority))?;
    let mut req = format!(
        "GET {}/v1/models HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n",
        target.prefix, target.authority
    );
    if let Some(key) = auth {
        req.push_str(&format!("Authorization: Bearer {key}\r\n"));
    }
    req.push_str("\r\n");
    conn.write_all(req.as_bytes()).await?;
    let mut raw = Vec::new();
    conn.read_to_end(&mut raw).await?;
    let i = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("malformed response")?;
    let head = String::from_utf8_lossy(&raw[..i]).to_string();
    let status = head.split_whitespace().nth(1).unwrap_or("?").to_string();
    let mut body = raw[i + 4..].to_vec();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut d = Chunked::default();
        let mut out = Vec::new();
        d.feed(&body, &mut out)?;
        body = out;
    }
    if status != "200" {
        bail!("HTTP {status}: {}", String::from_utf8_lossy(&body));
    }
    let v: Value = serde_json::from_slice(&body).context("/v1/models is not JSON")?;
    v["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .context("/v1/models lists no model")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_decoding_survives_any_split() {
        let raw = b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\n\r\n";
        for cut in 0..raw.len() {
            let mut d = Chunked::default();
            let mut out = Vec::new();
            d.feed(&raw[..cut], &mut out).unwrap();
            d.feed(&raw[cut..], &mut out).unwrap();
            assert_eq!(out, b"hello, world");
            assert!(d.done);
        }
    }

    #[test]
    fn urls_parse() {
        let t = parse_url("http://localhost:8000/v1/").unwrap();
        assert_eq!(
            (t.authority.as_str(), t.prefix.as_str()),
            ("localhost:8000", "")
        );
        assert_eq!(parse_url("http://h").unwrap().authority, "h:80");
        assert!(parse_url("https://h").is_err());
    }
}
