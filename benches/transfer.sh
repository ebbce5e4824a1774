#!/usr/bin/env bash
# Page-transfer throughput on this machine, in one run and one table: our tcp and ucx backends
# (transfer/examples/transfer_bench.rs), then the anchors, Mooncake's TCP transfer engine and
# UCX's own ucx_perftest (transfer_anchors.sh), all moving 1,769,472-byte blocks (one K3 MLA
# parent plane) over loopback.
#
#   mkdir -p .anchors && cp <path>/transfer_anchors.sh .anchors/   # or TRANSFER_ANCHORS=<path>
#   benches/transfer.sh [seconds per row, default 4] [rounds, default 3]
#
# Needs libucx-dev, libclang-dev and pkg-config (scripts/test.sh installs them) and ucx-utils; the
# anchor script installs Mooncake into a venv under /tmp. Every round runs every row once, ours
# then the anchors, so that load from elsewhere hits all of them alike; the table gives each
# row's median over the rounds and its median ratio to the anchors of the same round.
#
# Our rows write as a prefill worker writes into a decode worker: 16 blocks per batch (one
# request's pages), each batch into destination pages the previous ones did not use (the bench
# cycles through 4 groups per lane), acknowledged only after the destination verified and
# recorded it. "2 processes" puts the destination in a child process, as the anchors do; "2 in
# flight" runs two such requests at once to the same peer.
set -euo pipefail
cd "$(dirname "$0")/.."

SECS=${1:-4}
ROUNDS=${2:-3}
BLOCK=1769472
ANCHORS=${TRANSFER_ANCHORS:-.anchors/transfer_anchors.sh}
[ -f "$ANCHORS" ] || { echo "anchor script not found at $ANCHORS (see the header)" >&2; exit 1; }
command -v ucx_perftest >/dev/null || { echo "ucx_perftest missing: apt-get install ucx-utils" >&2; exit 1; }

cargo build --release --locked -p tessera-transfer --features ucx --example transfer_bench
BENCH=target/release/examples/transfer_bench

# Rows: "label|transfer_bench flags".
ROWS=(
  "tessera tcp, checksums on, 2 processes|--backend tcp --processes 2"
  "tessera tcp, checksums on, 2 processes, 2 in flight|--backend tcp --processes 2 --inflight 2"
  "tessera tcp, checksums on, 1 process|--backend tcp"
  "tessera ucx, shared-memory regions, 2 processes|--backend ucx --processes 2"
  "tessera ucx, shared-memory regions, 2 processes, 2 in flight|--backend ucx --processes 2 --inflight 2"
  "tessera ucx, shared-memory regions, 1 process|--backend ucx"
  "tessera ucx, 2 processes, 1 block/batch|--backend ucx --processes 2 --batch 1"
  "tessera ucx, 2 processes, 1 block/batch, 4 in flight|--backend ucx --processes 2 --batch 1 --inflight 4"
  "tessera ucx, checksums on (both sides), 2 processes|--backend ucx-crc --processes 2"
  "tessera ucx, heap regions (UCX software RMA), 2 processes|--backend ucx --processes 2 --ucx-memory heap"
  "context: plain socket copy loop, 1 connection, no checksums, 2 processes|--backend raw-tcp"
)

# One backend's GB/s. UCX also logs to standard output: keep only the bench's own TSV line.
ours() {
  local out
  # shellcheck disable=SC2086
  out=$("$BENCH" --tsv --seconds "$SECS" --extent "$BLOCK" $1 2>/dev/null) ||
    echo "transfer_bench $1 failed" >&2
  awk -F'\t' 'NF == 2 && $1 ~ /^(tcp|ucx|raw)/ { v = $2 } END { print v }' <<<"$out"
}

# ucx_perftest put bandwidth for one message size, GB/s (10^9 B/s), as the anchor script runs it.
perftest() {
  local port=$((13441 + $3))
  (timeout 60 ucx_perftest -p $port >/dev/null 2>&1 &)
  sleep 1
  local mbs
  mbs=$(timeout 60 ucx_perftest 127.0.0.1 -p $port -t ucp_put_bw -s "$1" -n "$2" 2>/dev/null |
    awk '/^Final:/ { print $6 }')
  python3 -c "print(round(${mbs:-0} * 1048576 / 1e9, 2))"
}

results=$(mktemp)
trap 'rm -f "$results"' EXIT
for round in $(seq 1 "$ROUNDS"); do
  echo "== round $round of $ROUNDS ($SECS s per row)"
  for row in "${ROWS[@]}"; do
    v=$(ours "${row#*|}")
    printf '%s\t%s\t%s\n' "$round" "${row%%|*}" "$v" | tee -a "$results"
  done
  # In a process group of its own: the Mooncake target it starts outlives its wrapper script, so
  # the whole group goes once the anchors are measured.
  anchors_out=$(mktemp)
  setsid bash "$ANCHORS" "$BLOCK" >"$anchors_out" &
  anchors_pid=$!
  wait "$anchors_pid" || echo "the anchor script failed" >&2
  kill -- -"$anchors_pid" 2>/dev/null || true
  awk -v r="$round" '$1 == "mooncake_tcp" { print r "\tMOONCAKE\t" $2 }
    $1 == "ucx_perftest_put" { print r "\tPERFTEST\t" $2 }' "$anchors_out" | tee -a "$results"
  rm -f "$anchors_out"
  # Context: the same tool with one whole batch (16 blocks) as one message, i.e. the working set
  # of our rows rather than one cache-resident block.
  printf '%s\tPERFTEST_BATCH\t%s\n' "$round" "$(perftest $((16 * BLOCK)) 200 "$round")" | tee -a "$results"
done

echo
echo "Transfer, loopback, $(nproc) cores, $(date -u +%Y-%m-%d), UCX $(ucx_info -v | awk '/Version/ { print $3 }'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $ROUNDS rounds of $SECS s per row, load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo
python3 - "$results" <<'EOF'
import sys, statistics
rows, order = {}, []
for line in open(sys.argv[1]):
    r, label, v = line.rstrip("\n").split("\t")
    if label not in rows:
        rows[label] = {}
        order.append(label)
    try:
        rows[label][int(r)] = float(v)
    except ValueError:
        pass
def med(xs):
    return statistics.median(xs) if xs else None
def ratio(label, anchor):
    a, b = rows.get(label, {}), rows.get(anchor, {})
    xs = [a[r] / b[r] for r in a if r in b and b[r] > 0]
    return f"{med(xs):.2f}x" if xs else "-"
names = {
    "MOONCAKE": "Mooncake TCP transfer engine (write, batch 16, 2 threads)",
    "PERFTEST": "ucx_perftest ucp_put_bw, 1.77 MB messages (one buffer)",
    "PERFTEST_BATCH": "ucx_perftest ucp_put_bw, 28.3 MB messages (one batch)",
}
print(f"| {'what (1,769,472 B blocks)':<66} | GB/s, median | all rounds | / Mooncake | / perftest |")
print(f"|{'-' * 68}|-------------:|------------|-----------:|-----------:|")
for label in order:
    vals = [rows[label][r] for r in sorted(rows[label])]
    m = med(vals)
    print(f"| {names.get(label, label):<66} | {f'{m:.2f}' if m is not None else '-':>12} | "
          f"{' '.join(f'{v:.2f}' for v in vals):<10} | {ratio(label, 'MOONCAKE'):>10} | "
          f"{ratio(label, 'PERFTEST'):>10} |")
EOF
