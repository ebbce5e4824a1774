//! Serves the HTTP front over the deterministic fake backend, with the tiny Kimi-style
//! tokenizer, for trying OpenAI clients against it:
//!
//! ```text
//! cargo run -p tessera-router --example fake_server -- --port 8000
//! python tests/openai_client/check_openai.py --base-url http://127.0.0.1:8000/v1
//! ```
//!
//! Every request gets the same scripted text back (cycled up to `max_tokens`).

use std::sync::Arc;
use std::time::Duration;

use tessera_router::fake::{FakeBackend, FakeConfig};
use tessera_router::{FrontOptions, HttpFront};
use tessera_tokenizer::{ChatTemplate, Tokenizer};

const SCRIPT: &str = "The old lighthouse stood at the end of the harbor road, and every evening \
                      the keeper climbed its one hundred and twelve steps to light the lamp. ";

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let host = arg("--host").unwrap_or_else(|| "127.0.0.1".into());
    let port: u16 = arg("--port").map_or(Ok(8000), |p| p.parse())?;
    let vocab = 1024;
    let dir = tempfile::tempdir()?;
    tessera_tokenizer::write_tiny_tokenizer(dir.path(), vocab)?;
    let tokenizer = Tokenizer::from_dir(dir.path())?;
    let template = ChatTemplate::from_dir(dir.path())?;
    let backend = Arc::new(FakeBackend::new(FakeConfig {
        script: tokenizer.encode(SCRIPT, false)?,
        cached_tokens: 4,
        token_delay: Duration::from_millis(2),
        ..FakeConfig::default()
    }));
    let eos = tessera_tokenizer::tiny_special_ids(vocab).stop_ids();
    let front = HttpFront::new(backend, tokenizer, template, eos, FrontOptions::default());
    let listener = tokio::net::TcpListener::bind((host.as_str(), port)).await?;
    println!("listening on http://{}", listener.local_addr()?);
    front.serve(listener, std::future::pending()).await?;
    Ok(())
}
