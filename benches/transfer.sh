#!/usr/bin/env bash
# Page-transfer throughput on this machine, in one run and one table: our tcp and ucx backends
# (transfer/examples/transfer_bench.rs), then the anchors, Mooncake's TCP transfer engine and
# UCX's own ucx_perftest (transfer_anchors.sh), all moving 1,769,472-byte blocks (one K3 MLA
# parent plane) over loopback.
#
#   mkdir -p .anchors && cp <path>/transfer_anchors.sh .anchors/   # or TRANSFER_ANCHORS=<path>
#   benches/transfer.sh [seconds per row, default 4]
#
# Needs libucx-dev, libclang-dev and pkg-config (scripts/test.sh installs them) and ucx-utils; the
# anchor script installs Mooncake into a venv under /tmp. Our rows: 16 blocks per batch, each
# batch acknowledged after the destination verified and recorded it; "2 processes" puts the
# destination in a child process, as the anchors do.
set -euo pipefail
cd "$(dirname "$0")/.."

SECS=${1:-4}
BLOCK=1769472
ANCHORS=${TRANSFER_ANCHORS:-.anchors/transfer_anchors.sh}
[ -f "$ANCHORS" ] || { echo "anchor script not found at $ANCHORS (see the header)" >&2; exit 1; }
command -v ucx_perftest >/dev/null || { echo "ucx_perftest missing: apt-get install ucx-utils" >&2; exit 1; }

cargo build --release --locked -p tessera-transfer --features ucx --example transfer_bench
BENCH=target/release/examples/transfer_bench

# One backend's GB/s. UCX also logs to standard output: keep only the bench's own TSV line.
ours() {
  local out
  out=$("$BENCH" --tsv --seconds "$SECS" --extent "$BLOCK" "$@" 2>/dev/null) ||
    echo "transfer_bench $* failed" >&2
  awk -F'\t' 'NF == 2 && $1 ~ /^(tcp|ucx)/ { v = $2 } END { print v }' <<<"$out"
}

# ucx_perftest put bandwidth for one message size, GB/s (10^9 B/s), as the anchor script runs it.
perftest() {
  local port=13441
  (timeout 60 ucx_perftest -p $port >/dev/null 2>&1 &)
  sleep 1
  local mbs
  mbs=$(timeout 60 ucx_perftest 127.0.0.1 -p $port -t ucp_put_bw -s "$1" -n "$2" 2>/dev/null |
    awk '/^Final:/ { print $6 }')
  python3 -c "print(round(${mbs:-0} * 1048576 / 1e9, 2))"
}

echo "== our backends ($SECS s each)"
tcp1=$(ours --backend tcp)
tcp2=$(ours --backend tcp --processes 2)
ucx2=$(ours --backend ucx --processes 2)
ucx1=$(ours --backend ucx)
ucx2one=$(ours --backend ucx --processes 2 --batch 1)
ucxcrc2=$(ours --backend ucx-crc --processes 2)
ucxheap2=$(ours --backend ucx --processes 2 --ucx-memory heap)
echo "== anchors ($ANCHORS)"
# In a process group of its own: the Mooncake target it starts outlives its wrapper script, so
# the whole group goes once the anchors are measured.
anchors_out=$(mktemp)
setsid bash "$ANCHORS" "$BLOCK" >"$anchors_out" &
anchors_pid=$!
wait "$anchors_pid" || echo "the anchor script failed" >&2
kill -- -"$anchors_pid" 2>/dev/null || true
anchors=$(cat "$anchors_out")
rm -f "$anchors_out"
echo "$anchors"
mooncake=$(awk '$1 == "mooncake_tcp" { print $2 }' <<<"$anchors")
ucxperf=$(awk '$1 == "ucx_perftest_put" { print $2 }' <<<"$anchors")
# Context: the same tool with one whole batch (16 blocks) as one message, i.e. the working set of
# our rows rather than one cache-resident block.
ucxperf_batch=$(perftest $((16 * BLOCK)) 200)

ratio() { python3 -c "a, b = '$1', '$2'; print(f'{float(a) / float(b):.2f}x' if a and b and float(b) > 0 else '-')"; }

echo
echo "Transfer, loopback, $(nproc) cores, $(date -u +%Y-%m-%d), UCX $(ucx_info -v | awk '/Version/ { print $3 }'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
echo
printf '| %-62s | %6s | %8s | %8s |\n' "what (1,769,472 B blocks)" "GB/s" "/Mooncake" "/perftest"
printf '|%s|%s|%s|%s|\n' "$(printf -- '-%.0s' {1..64})" "--------" "----------" "----------"
row() { printf '| %-62s | %6s | %8s | %8s |\n' "$1" "${2:--}" "$(ratio "$2" "$mooncake")" "$(ratio "$2" "$ucxperf")"; }
row "tessera tcp, checksums on, 1 process, 16 blocks/batch" "$tcp1"
row "tessera tcp, checksums on, 2 processes, 16 blocks/batch" "$tcp2"
row "tessera ucx, UCX shared-memory regions, 2 processes" "$ucx2"
row "tessera ucx, UCX shared-memory regions, 1 process" "$ucx1"
row "tessera ucx, 2 processes, 1 block/batch (perftest's footprint)" "$ucx2one"
row "tessera ucx, checksums on, 2 processes" "$ucxcrc2"
row "tessera ucx, heap regions (UCX software RMA), 2 processes" "$ucxheap2"
row "Mooncake TCP transfer engine (write, batch 16, 2 threads)" "$mooncake"
row "ucx_perftest ucp_put_bw, 1.77 MB messages (one buffer)" "$ucxperf"
row "ucx_perftest ucp_put_bw, 28.3 MB messages (one batch)" "$ucxperf_batch"
