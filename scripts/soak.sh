#!/usr/bin/env bash
# Soak: `tessera up` (2 prefill + 2 decode workers, the embedded tiny model) under a steady
# streamed load from `tessera bench` for a long time, sampling every worker's memory and page
# pool once a minute. Passes when no request failed, every pool is back at baseline at the end,
# and no process grew by more than SOAK_RSS_GROWTH_PCT (5) between the first sample after warm-up
# and the last.
#
#   scripts/soak.sh [SECONDS] [OUT_DIR]        # default 1800 s, target/soak
#   SOAK_RATE=8 SOAK_MAX_TOKENS=64 scripts/soak.sh 600
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${1:-1800}
OUT=${2:-target/soak}
RATE=${SOAK_RATE:-6}
MAX_TOKENS=${SOAK_MAX_TOKENS:-48:16}
PROMPT_TOKENS=${SOAK_PROMPT_TOKENS:-96:48}
GROWTH_PCT=${SOAK_RSS_GROWTH_PCT:-5}
PORT=${SOAK_PORT:-18431}
mkdir -p "$OUT"

cargo build --release --locked --bin tessera
BIN=target/release/tessera

"$BIN" up --port "$PORT" --prefill 2 --decode 2 >"$OUT/up.log" 2>&1 &
UP=$!
trap 'kill $UP 2>/dev/null || true; wait $UP 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do grep -q "router at http://" "$OUT/up.log" && break; sleep 0.2; done
grep -q "router at http://" "$OUT/up.log" || { cat "$OUT/up.log"; echo "soak: tessera up did not start"; exit 1; }
URL="http://127.0.0.1:$PORT"
# Each worker's pid and metrics address, from `up`'s banner.
mapfile -t WORKERS < <(sed -n 's/^tessera up: \([a-z]*-[0-9]*\) ready, gRPC at [^ ]* (pid \([0-9]*\), metrics at \([^)]*\)).*/\1 \2 \3/p' "$OUT/up.log")
[ ${#WORKERS[@]} -eq 4 ] || { cat "$OUT/up.log"; echo "soak: expected 4 workers"; exit 1; }

metric() { # metric ADDR NAME → the sum of its samples
  curl -sf "http://$1/metrics" | awk -v n="$2" '$1 == n || index($1, n "{") == 1 { s += $NF } END { print s + 0 }'
}

sample() { # one line per worker: t role rss_kib request_parents inflight
  local t=$1
  for w in "${WORKERS[@]}"; do
    set -- $w
    local rss; rss=$(awk '/VmRSS/ { print $2 }' "/proc/$2/status" 2>/dev/null || echo 0)
    echo "$t $1 $rss $(metric "$3" tessera_pool_request_parents) $(metric "$3" tessera_inflight_requests)"
  done
}

: >"$OUT/samples.txt"
(
  t=0
  while kill -0 $UP 2>/dev/null; do
    sample $t >>"$OUT/samples.txt"
    sleep 60; t=$((t + 60))
  done
) &
SAMPLER=$!

bench_rc=0
"$BIN" bench --url "$URL" --stream --request-rate "$RATE" --duration "$DURATION" \
  --prompt-tokens "$PROMPT_TOKENS" --max-tokens "$MAX_TOKENS" --timeout 120 \
  --progress-interval 60 --json-out "$OUT/bench.json" --plot-out "$OUT/bench.png" \
  2> >(tee "$OUT/bench.log" >&2) || bench_rc=$?
kill $SAMPLER 2>/dev/null || true

# Back at baseline within 30 s of the last answer.
baseline=0
for _ in $(seq 1 30); do
  busy=0
  for w in "${WORKERS[@]}"; do
    set -- $w
    n=$(( $(metric "$3" tessera_pool_request_parents | cut -d. -f1) + $(metric "$3" tessera_inflight_requests | cut -d. -f1) ))
    busy=$((busy + n))
  done
  [ $busy -eq 0 ] && { baseline=1; break; }
  sleep 1
done
sample end >>"$OUT/samples.txt"

python3 - "$OUT" "$GROWTH_PCT" "$baseline" <<'PY'
import json, sys, collections
out, growth, baseline = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "1"
summary = json.load(open(f"{out}/bench.json"))["summary"]
rss = collections.defaultdict(list)
for line in open(f"{out}/samples.txt"):
    t, role, kib, *_ = line.split()
    rss[role].append((t, int(kib)))
ok = True
print(f"requests {summary['successes']} ok, {summary['errors']} errors in {summary['duration_s']:.0f} s; "
      f"TTFT p50 {summary['ttft_ms']['p50']:.1f} ms p99 {summary['ttft_ms']['p99']:.1f} ms; "
      f"TPOT p50 {summary['tpot_ms']['p50']:.2f} ms p99 {summary['tpot_ms']['p99']:.2f} ms")
if summary["errors"]:
    ok = False
for role, s in sorted(rss.items()):
    # The first sample after warm-up (t ≥ 120 s) against the last.
    warm = next((k for t, k in s if t != "end" and int(t) >= 120), s[0][1])
    last = s[-1][1]
    pct = 100.0 * (last - warm) / max(warm, 1)
    flag = "" if pct <= growth else f"  > {growth}%"
    ok &= pct <= growth
    print(f"{role:10s} rss {warm/1024:7.1f} MiB after warm-up → {last/1024:7.1f} MiB at the end ({pct:+.1f}%){flag}")
print("pools back at baseline" if baseline else "pools NOT back at baseline")
ok &= baseline
print("soak: PASS" if ok else "soak: FAIL")
sys.exit(0 if ok else 1)
PY
