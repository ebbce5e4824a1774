//! `tessera bench` against a `tessera serve` child: counts, output lengths, latency ordering and
//! a clean failure against a port where nothing listens.

use std::process::Command;

use serde_json::Value;

use crate::common::*;
use crate::server::Server;

fn bench(url: &str, extra: &[&str], json_out: &std::path::Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
        .env("TESSERA_LOG", "error")
        .args(["bench", "--url", url, "--json-out"])
        .arg(json_out)
        .args(extra)
        .output()
        .expect("tessera bench runs")
}

fn check_stats(s: &Value, name: &str) {
    let st = &s[name];
    let (p50, p90, p99) = (
        st["p50"].as_f64().unwrap(),
        st["p90"].as_f64().unwrap(),
        st["p99"].as_f64().unwrap(),
    );
    assert!(
        0.0 <= p50 && p50 <= p90 && p90 <= p99 && p99 <= st["max"].as_f64().unwrap(),
        "{name}: {st}"
    );
    assert!(st["mean"].as_f64().unwrap() >= 0.0, "{name}: {st}");
}

#[test]
fn bench_measures_a_served_model() {
    let dir = fixtures().into_iter().next().unwrap();
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let vocab = cfg["vocab_size"].as_u64().unwrap().to_string();
    let s = Server::start(&dir, &[]);
    let url = format!("http://{}", s.addr);
    let tmp = tempfile::tempdir().unwrap();
    for stream in [false, true] {
        let out_path = tmp.path().join(format!("bench-{stream}.json"));
        let mut args = vec![
            "--requests",
            "12",
            "--concurrency",
            "3",
            "--prompt-tokens",
            "16",
            "--max-tokens",
            "8",
            "--seed",
            "7",
            "--vocab",
            &vocab,
        ];
        let plot_path = tmp.path().join(format!("bench-{stream}.png"));
        let plot_arg = plot_path.to_str().unwrap().to_string();
        if stream {
            args.push("--stream");
            args.extend(["--plot-out", &plot_arg]);
        }
        let out = bench(&url, &args, &out_path);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "stream={stream}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains("TTFT ms") && stdout.contains("E2E ms"),
            "{stdout}"
        );
        let doc: Value =
            serde_json::from_str(&std::fs::read_to_string(&out_path).unwrap()).unwrap();
        let sum = &doc["summary"];
        assert_eq!(sum["requests"], 12, "{sum}");
        assert_eq!(sum["successes"], 12, "{sum}");
        assert_eq!(sum["errors"], 0, "{sum}");
        assert_eq!(sum["stream"], stream);
        assert!(sum["request_throughput"].as_f64().unwrap() > 0.0, "{sum}");
        assert!(
            sum["output_token_throughput"].as_f64().unwrap() > 0.0,
            "{sum}"
        );
        assert_eq!(sum["total_output_tokens"], 12 * 8);
        for name in ["ttft_ms", "tpot_ms", "e2e_ms"] {
            check_stats(sum, name);
        }
        assert_eq!(sum["e2e_ms"]["count"], 12);
        assert_eq!(sum["tpot_ms"]["count"], if stream { 12 } else { 0 });
        let reqs = doc["requests"].as_array().unwrap();
        assert_eq!(reqs.len(), 12);
        for r in reqs {
            assert_eq!(r["ok"], true, "{r}");
            assert_eq!(r["status"], 200, "{r}");
            assert_eq!(r["prompt_tokens"], 16, "{r}");
            assert_eq!(r["output_tokens"], 8, "{r}");
            let (ttft, e2e) = (
                r["ttft_ms"].as_f64().unwrap(),
                r["e2e_ms"].as_f64().unwrap(),
            );
            assert!(0.0 < ttft && ttft <= e2e, "{r}");
            if stream {
                assert!(r["tpot_ms"].as_f64().unwrap() >= 0.0, "{r}");
            } else {
                assert!(r["tpot_ms"].is_null(), "{r}");
            }
        }
        if stream {
            let png = std::fs::read(&plot_path).unwrap();
            assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
            assert_eq!(&png[12..16], b"IHDR");
            let dim = |at: usize| u32::from_be_bytes(png[at..at + 4].try_into().unwrap());
            assert_eq!((dim(16), dim(20)), (800, 500));
            assert_eq!(&png[png.len() - 8..png.len() - 4], b"IEND");
        }
    }
    s.terminate();
}

#[test]
fn bench_against_a_dead_port_fails_cleanly() {
    // A port that was free a moment ago: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let tmp = tempfile::tempdir().unwrap();
    let url = format!("http://127.0.0.1:{port}");
    for extra in [&[][..], &["--model", "m", "--requests", "3"][..]] {
        let out = bench(&url, extra, &tmp.path().join("dead.json"));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains("error:"), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(stderr.contains(&format!("127.0.0.1:{port}")), "{stderr}");
    }
    // With the model named, requests are made: each fails and the JSON counts them.
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("dead.json")).unwrap())
            .unwrap();
    assert_eq!(doc["summary"]["errors"], 3);
    assert_eq!(doc["summary"]["errors_by_status"]["no_response"], 3);
}
