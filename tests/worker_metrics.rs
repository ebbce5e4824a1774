//! The autoscaling signals of the worker daemons (deploy/README.md, the chart's HPAs), scraped
//! from their `/metrics` while a router sends them a steady load: prefill's
//! `tessera_queued_prompt_tokens` counts the prompt tokens waiting or being prefilled, decode's
//! `tessera_pool_request_parents` / `tessera_pool_request_use_ratio` the pool that requests hold.
//! Both rise under load and fall back to 0 once it stops, while the prefix cache still holds
//! pages (so the ratio really leaves reclaimable cache out). Every family carries `# HELP` and
//! `# TYPE`.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use crate::cluster::{jobs, prompts, spawn_router, start_worker, wait_until, Daemon, Load};
use crate::common::fixtures_dir;
use crate::server::{self, metric_sum};

/// Every sample's family has `# HELP` and `# TYPE` lines before its first sample.
fn assert_exposition(who: &str, text: &str) {
    let (mut help, mut typed) = (HashSet::new(), HashSet::new());
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            help.insert(rest.split(' ').next().unwrap().to_string());
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut it = rest.split(' ');
            let name = it.next().unwrap().to_string();
            let kind = it.next().unwrap();
            assert!(kind == "gauge" || kind == "counter", "{who}: {line}");
            assert!(
                !name.ends_with("_total") || kind == "counter",
                "{who}: {name} is a {kind}"
            );
            typed.insert(name);
        } else if !line.is_empty() {
            let name = line.split(['{', ' ']).next().unwrap();
            assert!(
                help.contains(name) && typed.contains(name),
                "{who}: {name} has no # HELP or # TYPE before its sample"
            );
            let value = line.rsplit(' ').next().unwrap();
            assert!(value.parse::<f64>().is_ok(), "{who}: {line}");
        }
    }
}

/// The largest value each of `names` showed in `w`'s `/metrics`, scraped every 5 ms for a
/// second and then until `enough` holds for the peaks (at most 20 s).
fn peaks<const N: usize>(
    w: &Daemon,
    names: [&str; N],
    enough: impl Fn(&[f64; N]) -> bool,
) -> [f64; N] {
    let t0 = Instant::now();
    let mut peak = [0f64; N];
    loop {
        let text = w.metrics_text();
        for (p, name) in peak.iter_mut().zip(names) {
            *p = p.max(metric_sum(&text, name));
        }
        let t = t0.elapsed();
        if (t >= Duration::from_secs(1) && enough(&peak)) || t >= Duration::from_secs(20) {
            return peak;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn queued_prompt_tokens_and_request_pool_use_rise_under_load_and_fall_after() {
    let _cluster = crate::cluster_alone();
    let fixture = fixtures_dir().join("kl_mixed");
    let model = server::with_tokenizer(&fixture);
    // Prefill is the bottleneck: one request at a time in steps of 16 tokens, so the others
    // wait (and hold their reservations on decode) meanwhile.
    let prefill_flags = ["--max-batch-tokens", "16", "--max-running", "1"];
    let mut p0 = start_worker("prefill", "p0", model.path(), &prefill_flags);
    let mut d0 = start_worker("decode", "d0", model.path(), &["--kv-memory", "2M"]);
    p0.ready();
    d0.ready();
    for (w, role) in [(&p0, "prefill"), (&d0, "decode")] {
        let text = w.metrics_text();
        assert_exposition(role, &text);
        assert_eq!(metric_sum(&text, "tessera_queued_prompt_tokens"), 0.0);
        assert_eq!(metric_sum(&text, "tessera_pool_request_parents"), 0.0);
        assert_eq!(metric_sum(&text, "tessera_pool_request_use_ratio"), 0.0);
        assert!(metric_sum(&text, "tessera_pool_parents") > 0.0, "{role}");
        assert_eq!(
            metric_sum(&text, "tessera_pool_free_parents"),
            metric_sum(&text, "tessera_pool_parents"),
            "{role}: an idle pool has every parent free"
        );
    }
    let router = spawn_router(
        model.path(),
        &["--prefill", p0.field("grpc"), "--decode", d0.field("grpc")],
    );
    let http = router.field("http").to_string();

    let lens = [180, 150, 210, 120];
    let prompts = prompts(&fixture, &lens, 4);
    let jobs = jobs(&fixture, &http, &prompts, 8);
    let load = Load::start(&http, &jobs, 4);
    load.wait_for_more(4, Duration::from_secs(30));

    let shortest = *lens.iter().min().unwrap() as f64;
    let [queued, waiting] = peaks(
        &p0,
        ["tessera_queued_prompt_tokens", "tessera_queue_depth"],
        |p| p[0] >= shortest,
    );
    let [req_parents, ratio, parents] = peaks(
        &d0,
        [
            "tessera_pool_request_parents",
            "tessera_pool_request_use_ratio",
            "tessera_pool_parents",
        ],
        |p| p[0] >= 1.0,
    );
    eprintln!(
        "prefill under load: queued prompt tokens up to {queued} ({waiting} requests waiting)"
    );
    eprintln!(
        "decode under load: request parents up to {req_parents} of {parents} (ratio {ratio})"
    );
    // Tokens, not requests: a waiting request counts its whole prompt, and there are never
    // more than four prompts (one per client) to count.
    assert!(waiting >= 1.0, "no request waited on prefill under load");
    assert!(
        queued >= shortest,
        "queued prompt tokens peaked at {queued} under load, below any whole prompt"
    );
    assert!(queued <= 4.0 * *lens.iter().max().unwrap() as f64);
    assert!(
        req_parents >= 1.0,
        "requests held no pool parents on decode under load"
    );
    assert!(ratio > 0.0 && ratio <= req_parents / parents + 1e-9);

    let (ok, failures) = load.stop();
    assert!(
        failures.is_empty(),
        "requests failed:\n{}",
        failures.join("\n")
    );
    eprintln!("{ok} requests answered correctly");

    // Idle again: nothing queued, no request holds pages, but the prefix cache keeps some.
    for (w, role) in [(&p0, "prefill"), (&d0, "decode")] {
        wait_until(&format!("{role} idle"), Duration::from_secs(10), || {
            let t = w.metrics_text();
            metric_sum(&t, "tessera_queued_prompt_tokens") == 0.0
                && metric_sum(&t, "tessera_pool_request_parents") == 0.0
                && metric_sum(&t, "tessera_inflight_requests") == 0.0
        });
        let text = w.metrics_text();
        assert_exposition(role, &text);
        assert_eq!(metric_sum(&text, "tessera_pool_request_use_ratio"), 0.0);
        assert!(
            metric_sum(&text, "tessera_pool_cached_pages") > 0.0
                && metric_sum(&text, "tessera_pool_used_bytes") > 0.0,
            "{role}: the prefix cache should still hold pages (so the request ratio is not \
             simply the pool's use)"
        );
        assert!(
            metric_sum(&text, "tessera_pool_free_parents")
                < metric_sum(&text, "tessera_pool_parents"),
            "{role}: cached pages keep some parents bound"
        );
    }
    drop(router);
}
