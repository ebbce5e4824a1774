//! Chaos: `tessera up` with 2 prefill and 2 decode daemons serves 200 streamed greedy requests,
//! 12 at a time, while one prefill and one decode daemon are killed with SIGKILL mid-run. Every
//! request completes with the single-process engine's tokens — streams that were on the killed
//! decode worker migrate, with no token missing or repeated — and afterwards the survivors'
//! page pools hold no request pages. `up` starts the killed daemons again at their addresses
//! (new incarnations); the router takes them back and they serve exactly too. Finally the router
//! itself is killed: it holds no state, `up` starts it again at its port, and it serves exactly.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::cluster::{complete_streamed, jobs, prompts, wait_until, Job};
use crate::common::*;
use crate::server::{self, http_request, metric_sum, Server};

const REQUESTS: usize = 200;
const CLIENTS: usize = 12;
/// Tokens per request: long enough that many streams are mid-flight when the kill lands.
const MAX_TOKENS: usize = 48;
/// Requests completed before the kill (which then waits for streams decoding on the victim).
const KILL_AFTER: usize = 40;

/// A worker as `tessera up` announced it.
struct Announced {
    grpc: String,
    pid: i32,
    metrics: String,
}

/// Parses `tessera up: <role> ready, gRPC at <addr> (pid <pid>, metrics at <addr>)`.
fn announced(s: &Server, role: &str) -> Announced {
    let prefix = format!("tessera up: {role} ready, gRPC at ");
    let rest = s
        .banner
        .iter()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {role} in {:?}", s.banner));
    let words: Vec<&str> = rest
        .split(|c: char| c.is_whitespace() || c == '(' || c == ')' || c == ',')
        .filter(|w| !w.is_empty())
        .collect();
    // [addr, "pid", pid, "metrics", "at", addr]
    Announced {
        grpc: words[0].to_string(),
        pid: words[2].parse().unwrap(),
        metrics: words[5].to_string(),
    }
}

/// The pid of the child of `parent` whose command line has the argument `arg`.
fn child_running(parent: u32, arg: &str) -> Option<i32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
        // `pid (comm) state ppid …`: the fields after the last ')'.
        let ppid: u32 = stat
            .rsplit(')')
            .next()?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()?;
        let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
        let has_arg = cmdline.split(|&b| b == 0).any(|a| a == arg.as_bytes());
        (ppid == parent && has_arg).then_some(pid)
    })
}

/// Pages and requests a worker holds for requests (its prefix cache aside).
fn held(w: &Announced) -> Option<[f64; 3]> {
    let (status, text) = server::try_http_request(&w.metrics, "GET", "/metrics", None).ok()?;
    (status == 200).then(|| {
        [
            metric_sum(&text, "tessera_pool_request_parents"),
            metric_sum(&text, "tessera_reservations"),
            metric_sum(&text, "tessera_inflight_requests"),
        ]
    })
}

/// Runs `n` streamed requests (`clients` at a time) over `jobs`; calls `at(done)` from the
/// calling thread while they run. Returns the failures.
fn run_load(
    router: &str,
    jobs: &[Job],
    n: usize,
    clients: usize,
    mut at: impl FnMut(usize),
) -> Vec<String> {
    let next = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let failures = Arc::new(Mutex::new(Vec::new()));
    std::thread::scope(|sc| {
        for _ in 0..clients {
            let (next, done, failures) = (next.clone(), done.clone(), failures.clone());
            sc.spawn(move || loop {
                let i = next.fetch_add(1, Ordering::AcqRel);
                if i >= n {
                    return;
                }
                let j = &jobs[i % jobs.len()];
                match complete_streamed(router, &j.prompt, j.max_tokens) {
                    Ok((ids, text)) if ids == j.ids && text == j.text => {}
                    r => failures
                        .lock()
                        .unwrap()
                        .push(format!("request {i}: got {r:?}, want {:?}", j.ids)),
                }
                done.fetch_add(1, Ordering::AcqRel);
            });
        }
        while done.load(Ordering::Acquire) < n {
            at(done.load(Ordering::Acquire));
            std::thread::sleep(Duration::from_millis(5));
        }
    });
    let f = failures.lock().unwrap().clone();
    f
}

#[test]
fn killing_a_prefill_and_a_decode_worker_mid_run_loses_no_request() {
    let _cluster = crate::cluster_alone();
    let dir = fixtures_dir().join("kl_mixed");
    let s = Server::launch(
        &dir,
        &["up", "--port", "0", "--prefill", "2", "--decode", "2"],
    );
    let workers: Vec<Announced> = ["prefill-0", "prefill-1", "decode-0", "decode-1"]
        .iter()
        .map(|r| announced(&s, r))
        .collect();
    let (survivors, victims) = ([&workers[0], &workers[2]], [&workers[1], &workers[3]]);
    let prompts = prompts(&dir, &[3, 17, 40, 90, 150], 10);
    let jobs = jobs(&dir, &s.addr, &prompts, MAX_TOKENS);

    let decoding = |w: &Announced| {
        server::try_http_request(&w.metrics, "GET", "/metrics", None)
            .map_or(0.0, |(_, m)| metric_sum(&m, "tessera_running_batch"))
    };
    let mut killed = None;
    let failures = run_load(&s.addr, &jobs, REQUESTS, CLIENTS, |done| {
        // Once the load is steady, kill both victims while the decode one has streams running.
        if done >= KILL_AFTER && killed.is_none() && decoding(victims[1]) >= 1.0 {
            for v in victims {
                // SAFETY: kill(2) on a pid `tessera up` reported for its own child.
                assert_eq!(unsafe { libc::kill(v.pid, libc::SIGKILL) }, 0);
            }
            killed = Some(Instant::now());
        }
    });
    assert!(killed.is_some(), "the load finished before the kill");
    assert!(
        failures.is_empty(),
        "{} of {REQUESTS} requests failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    let router = http_request(&s.addr, "GET", "/metrics", None).1;
    let migrated = metric_sum(&router, "tessera_router_migrations_total");
    let retried = metric_sum(&router, "tessera_router_retries_total");
    eprintln!("after the kill: {migrated} requests migrated, {retried} retried");
    assert!(
        migrated >= 1.0,
        "no stream was on the killed decode worker: the test proved nothing\n{router}"
    );

    // The survivors hold nothing for requests once the load is over.
    wait_until(
        "the survivors' pools at baseline",
        Duration::from_secs(20),
        || survivors.iter().all(|w| held(w) == Some([0.0; 3])),
    );
    // `up` restarted the victims at their addresses; the router routes to them again, and the
    // whole cluster still answers exactly.
    wait_until(
        "the restarted workers healthy",
        Duration::from_secs(60),
        || {
            let m = http_request(&s.addr, "GET", "/metrics", None).1;
            metric_sum(&m, "tessera_router_worker_healthy") == 4.0
                && victims.iter().all(|v| held(v).is_some())
        },
    );
    let failures = run_load(&s.addr, &jobs, 40, 4, |_| {});
    assert!(
        failures.is_empty(),
        "after the restart:\n{}",
        failures.join("\n")
    );
    for w in &workers {
        let w: &Announced = w;
        wait_until(
            &format!("{} at baseline", w.grpc),
            Duration::from_secs(20),
            || held(w) == Some([0.0; 3]),
        );
    }
    // The router dies: started again at its port, it finds its workers and serves exactly.
    let router_pid = child_running(s.pid(), "router").expect("tessera up runs a router");
    // SAFETY: kill(2) on the pid `tessera up` reported for its router.
    assert_eq!(unsafe { libc::kill(router_pid, libc::SIGKILL) }, 0);
    wait_until("the router back", Duration::from_secs(60), || {
        server::try_http_request(&s.addr, "GET", "/health", None).is_ok_and(|(st, _)| st == 200)
    });
    let failures = run_load(&s.addr, &jobs, 20, 4, |_| {});
    assert!(
        failures.is_empty(),
        "after the router restarted:\n{}",
        failures.join("\n")
    );
    let took = s.terminate();
    assert!(took.as_secs() <= 15, "tessera up took {took:?} to stop");
}
