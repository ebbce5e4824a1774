//! `tessera up`: router, prefill and decode daemons as separate processes on loopback. Greedy
//! outputs through the cluster equal the single-process engine and the `transformers`
//! references, plain and streamed, with 1+1 and 2+2 workers; SIGTERM stops everything. The
//! workers refuse gRPC calls without the cluster secret `up` generated for its children. The
//! router gets `up`'s API-key and limit flags.

use serde_json::{json, Value};

use crate::common::*;
use crate::server::{sse_events, KeyFile, Server};

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
    let _cluster = crate::cluster_beside_others();
    check_cluster("1", "1");
}

#[test]
fn two_prefill_two_decode() {
    let _cluster = crate::cluster_beside_others();
    check_cluster("2", "2");
}

#[test]
fn workers_refuse_calls_without_the_secret_up_gave_its_children() {
    let _cluster = crate::cluster_beside_others();
    use tessera_prefill::runtime::{ClusterToken, DEV_SECRET};
    use tessera_proto::tonic::{transport::Channel, Code};
    use tessera_proto::v1::prefill_worker_client::PrefillWorkerClient;
    use tessera_proto::v1::{self, decode_worker_client::DecodeWorkerClient};

    let dir = fixtures_dir().join("kl_mixed");
    let s = Server::launch(&dir, &["up", "--port", "0"]);
    let grpc = |role: &str| {
        let prefix = format!("tessera up: {role} ready, gRPC at ");
        s.banner
            .iter()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("no {role} in {:?}", s.banner))
            .to_string()
    };
    let (decode, prefill) = (grpc("decode-0"), grpc("prefill-0"));
    assert!(
        !s.banner.iter().any(|l| l.contains("encoder")),
        "no encoder for a text-only model: {:?}",
        s.banner
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let channel = |addr: &str| {
            Channel::from_shared(format!("http://{addr}"))
                .unwrap()
                .connect_lazy()
        };
        // Without a secret, and with the default one: `up` generated its own.
        let dev = ClusterToken::new(DEV_SECRET).unwrap();
        let refusals = [
            DecodeWorkerClient::new(channel(&decode))
                .stats(v1::StatsRequest {})
                .await
                .map(drop),
            DecodeWorkerClient::with_interceptor(channel(&decode), dev.clone())
                .stats(v1::StatsRequest {})
                .await
                .map(drop),
            PrefillWorkerClient::new(channel(&prefill))
                .stats(v1::StatsRequest {})
                .await
                .map(drop),
            PrefillWorkerClient::with_interceptor(channel(&prefill), dev)
                .stats(v1::StatsRequest {})
                .await
                .map(drop),
        ];
        for (i, r) in refusals.into_iter().enumerate() {
            assert_eq!(r.unwrap_err().code(), Code::Unauthenticated, "call {i}");
        }
    });
    // Closes the connections, which the workers' graceful stop would otherwise wait for.
    drop(rt);
    // The router was given the same secret: requests go through.
    let refs = reference(&dir).prompts;
    let p = &refs[0];
    let got = greedy(&s, &p.prompt_ids, p.greedy_ids.len(), false);
    assert_greedy_matches(&got, &p.greedy_ids, &p.greedy_margins, &p.name);
    s.terminate();
}

#[test]
fn up_hands_api_keys_and_limits_to_the_router() {
    let _cluster = crate::cluster_beside_others();
    let dir = fixtures_dir().join("kl_mixed");
    let keys = KeyFile::new("sk-cluster\n");
    let s = Server::launch(
        &dir,
        &[
            "up",
            "--port",
            "0",
            "--api-key-file",
            &keys.path,
            "--max-prompt-tokens",
            "8",
        ],
    );
    let p = &reference(&dir).prompts[0];
    let post = |key, prompt: &[u32]| {
        let body = json!({"prompt": prompt, "max_tokens": p.greedy_ids.len(), "temperature": 0,
            "ignore_eos": true, "return_token_ids": true});
        let (st, _, text) = s.request_as(key, "POST", "/v1/completions", Some(&body.to_string()));
        (st, serde_json::from_str::<Value>(&text).unwrap())
    };
    let (st, v) = post(None, &p.prompt_ids);
    assert_eq!(st, 401, "{v}");
    assert_eq!(v["error"]["code"], "missing_api_key");
    let key = Some("sk-cluster");
    let (st, v) = post(key, &[5; 9]);
    assert_eq!(st, 400, "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("at most 8 tokens"));
    let (st, v) = post(key, &p.prompt_ids);
    assert_eq!(st, 200, "{v}");
    let got = ids(&v["choices"][0]["token_ids"]);
    assert_greedy_matches(&got, &p.greedy_ids, &p.greedy_margins, &p.name);
    assert_eq!(s.request("GET", "/health", None).0, 200);
}
