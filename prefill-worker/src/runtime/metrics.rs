//! Prometheus text for `/metrics`: metric families, and an engine worker's pool and load figures.

use tessera_proto::v1;

/// One metric family with a single sample: (name, Prometheus type, help, value).
pub type Family<'a> = (&'a str, &'a str, &'a str, f64);

/// Help of `tessera_draining`, which every role exports.
pub const DRAINING_HELP: &str =
    "1 from SIGTERM on: the worker finishes what it has and accepts nothing new.";

/// A gauge [`Family`].
pub fn gauge<'a>(name: &'a str, help: &'a str, value: f64) -> Family<'a> {
    (name, "gauge", help, value)
}

/// A counter [`Family`].
pub fn counter<'a>(name: &'a str, help: &'a str, value: u64) -> Family<'a> {
    (name, "counter", help, value as f64)
}

/// Appends one metric family to Prometheus text: its `# HELP` and `# TYPE` lines, then one
/// sample per `(labels, value)` (`labels` without braces).
pub fn write_family(
    out: &mut String,
    name: &str,
    kind: &str,
    help: &str,
    samples: impl IntoIterator<Item = (String, f64)>,
) {
    use std::fmt::Write;
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    for (labels, value) in samples {
        let _ = writeln!(out, "{name}{{{labels}}} {value}");
    }
}

/// Appends `families`, each sample labelled `role="<role>"`.
pub fn write_role_families(out: &mut String, role: &str, families: &[Family<'_>]) {
    for &(name, kind, help, value) in families {
        write_family(out, name, kind, help, [(format!("role=\"{role}\""), value)]);
    }
}

/// `/metrics` of an engine worker: [`render_metrics`] of its `stats`, or why they are missing.
pub fn engine_metrics(
    role: &str,
    stats: anyhow::Result<(v1::PoolStats, v1::LoadStats)>,
    extra: &[Family<'_>],
) -> String {
    match stats {
        Ok((pool, load)) => render_metrics(role, &pool, &load, extra),
        Err(e) => format!("# error: {e}\n"),
    }
}

/// Prometheus text for the figures of [`worker_stats`] plus the worker's own `extra` families.
pub fn render_metrics(
    role: &str,
    pool: &v1::PoolStats,
    load: &v1::LoadStats,
    extra: &[Family<'_>],
) -> String {
    let ratio = match pool.total_parents {
        0 => 0.0,
        n => pool.request_parents as f64 / n as f64,
    };
    let mut s = String::new();
    write_role_families(
        &mut s,
        role,
        &[
            gauge(
                "tessera_queue_depth",
                "Requests waiting for admission to the running batch.",
                load.waiting.into(),
            ),
            gauge(
                "tessera_running_batch",
                "Requests in the running batch.",
                load.running.into(),
            ),
            gauge(
                "tessera_queued_prompt_tokens",
                "Prompt tokens waiting or being prefilled: whole prompts of waiting requests, \
                 the rest of those being prefilled.",
                load.queued_prompt_tokens as f64,
            ),
            gauge(
                "tessera_inflight_requests",
                "Requests admitted and not finished (on decode, open reservations too): what a \
                 drain waits for.",
                load.inflight.into(),
            ),
            gauge(
                "tessera_reservations",
                "Page reservations waiting for their transfer and decode (decode).",
                load.reservations.into(),
            ),
            counter(
                "tessera_preemptions_total",
                "Requests preempted (pages freed, recomputed later) because the pool was full.",
                load.preemptions,
            ),
            counter(
                "tessera_prefix_lookups_total",
                "Prefix-cache lookups.",
                load.prefix_lookups,
            ),
            counter(
                "tessera_prefix_hits_total",
                "Prefix-cache lookups that hit.",
                load.prefix_hits,
            ),
            counter(
                "tessera_prefix_hit_tokens_total",
                "Prompt tokens served from the prefix cache.",
                load.prefix_hit_tokens,
            ),
            gauge(
                "tessera_draining",
                DRAINING_HELP,
                u8::from(load.draining).into(),
            ),
            gauge(
                "tessera_pool_arena_bytes",
                "Bytes of the KV page pool.",
                pool.arena_bytes as f64,
            ),
            gauge(
                "tessera_pool_used_bytes",
                "Bytes of the parents bound to a cache group, prefix-cache pages included.",
                pool.used_bytes as f64,
            ),
            gauge(
                "tessera_pool_cached_pages",
                "Pages only the prefix cache holds (evicted on demand).",
                pool.cached_pages as f64,
            ),
            gauge(
                "tessera_pool_parents",
                "Parents of the page pool (each holds pages of one cache group at a time).",
                pool.total_parents.into(),
            ),
            gauge(
                "tessera_pool_free_parents",
                "Parents bound to no cache group.",
                pool.free_parents.into(),
            ),
            gauge(
                "tessera_pool_request_parents",
                "Parents holding a page of a request, reservation or handoff: what stays bound \
                 however much of the prefix cache is evicted.",
                pool.request_parents.into(),
            ),
            gauge(
                "tessera_pool_request_use_ratio",
                "tessera_pool_request_parents / tessera_pool_parents: the page pool's use \
                 without reclaimable prefix-cache pages, 0 to 1.",
                ratio,
            ),
        ],
    );
    let live = pool.groups.iter().map(|g| {
        let fam = if g.kind == v1::CacheGroupKind::Mla as i32 {
            "mla"
        } else {
            "kda"
        };
        let labels = format!("role=\"{role}\",group=\"{}\",family=\"{fam}\"", g.group);
        (labels, g.live_pages as f64)
    });
    write_family(
        &mut s,
        "tessera_pool_live_pages",
        "gauge",
        "Live pages per cache group (requests, reservations, handoffs and the prefix cache).",
        live,
    );
    write_role_families(&mut s, role, extra);
    s
}
