//! `tessera up`: router, prefill and decode daemons as separate processes on loopback. Greedy
//! outputs through the cluster equal the single-process engine and the `transformers`
//! references, plain and streamed, with 1+1 and 2+2 workers; SIGTERM stops everything.

mod common;
#[path = "common/server.rs"]
mod server;

use common::*;
use serde_json::{json, Value};
use server::{sse_events, Server};

fn ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).unwrap()
}

fn greedy(s: &Server, prompt: &[u32], n: usize, stream: bool) -> Vec<u32> {
    let body = json!({"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": true,
        "return_token_ids": true, "stream": stream});
    if stream {
        let (st, text) = s.request("POST", "/v1/completions", Some(&body.to_string()));
        assert_eq!(st, 200, "{text}");
        sse_events(&text)
            .iter()
            .filter_map(|e| e["choices"].get(0).and_then(|c| c.get("token_ids")))
            .flat_map(ids)
            .collect()
    } else {
        let (st, r) = s.post_json("/v1/completions", &body);
        assert_eq!(st, 200, "{r}");
        ids(&r["choices"][0]["token_ids"])
    }
}

fn check_cluster(prefill: &str, decode: &str) {
    let dir = fixtures_dir().join("kl_mixed");
    let refs = reference(&dir).prompts;
    let s = Server::launch(
        &dir,
        &[
            "up",
            "--port",
            "0",
            "--prefill",
            prefill,
            "--decode",
            decode,
        ],
    );
    for stream in [false, true] {
        for p in &refs {
            let got = greedy(&s, &p.prompt_ids, p.greedy_ids.len(), stream);
            assert_eq!(got.len(), p.greedy_ids.len());
            assert_greedy_matches(
                &got,
                &p.greedy_ids,
                &p.greedy_margins,
                &format!("{} stream={stream}", p.name),
            );
        }
    }
    // Concurrent requests through the cluster equal sequential ones.
    let jobs: Vec<usize> = (0..6).map(|i| i % refs.len()).collect();
    let seq: Vec<Vec<u32>> = jobs
        .iter()
        .map(|&j| greedy(&s, &refs[j].prompt_ids, 8, false))
        .collect();
    let conc: Vec<Vec<u32>> = std::thread::scope(|sc| {
        let hs: Vec<_> = jobs
            .iter()
            .map(|&j| {
                let (s, p) = (&s, &refs[j]);
                sc.spawn(move || greedy(s, &p.prompt_ids, 8, true))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(conc, seq);
    let took = s.terminate();
    assert!(took.as_secs() <= 12, "tessera up took {took:?} to stop");
}

#[test]
fn one_prefill_one_decode() {
    check_cluster("1", "1");
}

#[test]
fn two_prefill_two_decode() {
    check_cluster("2", "2");
}
