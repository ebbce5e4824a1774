#!/usr/bin/env bash
# Checks and times Tessera's CUDA kernels on a GPU machine, with FLA's Triton KDA kernels (the
# anchor) timed in the same run, and prints one table with the ratios.
#
# Prepare on a build machine (the GPU machine needs no Rust toolchain and no network):
#   cargo build --release -p tessera-kernels --features cuda --example cuda_check_bench \
#     --example cuda_ops_check --example cuda_model_ops_check
#   pip download --no-deps fla-core==0.6.0 -d .whl          # FLA, the anchor (git-ignored)
#   mkdir -p .anchors && cp <path>/fla_kda_bench.py .anchors/ # FLA's timing harness
# Then, on the GPU machine, from the repository root:
#   scripts/gpu-bench.sh [--quick]
# Logs go to $OUT (or /tmp/gpu-bench): ours.log, ops.log, model.log, fla.log, table.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=${OUT:-/tmp/gpu-bench}
mkdir -p "$LOGS"
BIN=${BIN:-target/release/examples/cuda_check_bench}
export TESSERA_CACHE_DIR=${TESSERA_CACHE_DIR:-/tmp/tessera-cache}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader

echo "== tessera kernels: checks and timings"
"$BIN" "$@" 2>&1 | tee "$LOGS/ours.log"
ours_rc=${PIPESTATUS[0]}

# Row-wise ops and the cuBLAS linear layer (cuda_ops_check), when built.
OPS_BIN=${OPS_BIN:-target/release/examples/cuda_ops_check}
if [ -x "$OPS_BIN" ]; then
  echo "== tessera row ops and linear: checks and timings"
  cublas=$(find /usr/local /usr/lib /opt -name 'libcublas.so.1*' 2>/dev/null | head -1)
  LD_LIBRARY_PATH="${cublas:+$(dirname "$cublas"):}${LD_LIBRARY_PATH:-}" "$OPS_BIN" "$@" 2>&1 | tee "$LOGS/ops.log"
  ops_rc=${PIPESTATUS[0]}
  [ "$ours_rc" -eq 0 ] && ours_rc=$ops_rc
fi

# Model kernels: sampling, KDA short conv, MLA absorbed decode, MoE decode (cuda_model_ops_check).
MODEL_BIN=${MODEL_BIN:-target/release/examples/cuda_model_ops_check}
if [ -x "$MODEL_BIN" ]; then
  echo "== tessera model kernels: checks and timings"
  "$MODEL_BIN" "$@" 2>&1 | tee "$LOGS/model.log"
  model_rc=${PIPESTATUS[0]}
  [ "$ours_rc" -eq 0 ] && ours_rc=$model_rc
else
  : > "$LOGS/model.log"
fi

if ls .whl/fla_core-*.whl >/dev/null 2>&1 && [ -f .anchors/fla_kda_bench.py ]; then
  echo "== anchor: FLA chunk_kda / fused_recurrent_kda"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
  PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 .anchors/fla_kda_bench.py 2>&1 | tee "$LOGS/fla.log"
else
  echo "(no FLA wheel or harness: anchor skipped)" | tee "$LOGS/fla.log"
fi

python3 - "$LOGS/ours.log" "$LOGS/fla.log" "$LOGS/model.log" <<'EOF' | tee "$LOGS/table.txt"
import re, sys
ours = open(sys.argv[1]).read()
fla = open(sys.argv[2]).read()
anchor = {}
for m in re.finditer(r"chunk_kda B=(\d+) T=(\d+) H=(\d+) K=(\d+): ([\d.]+) us", fla):
    anchor[("prefill", int(m[1]), int(m[2]))] = float(m[5])
for m in re.finditer(r"fused_recurrent_kda decode B=(\d+): ([\d.]+) us", fla):
    anchor[("decode", int(m[1]), 1)] = float(m[2])
print(f"{'kernel':<28}{'shape':<18}{'ours us':>10}{'floor us':>10}{'% floor':>9}{'FLA us':>10}{'FLA/ours':>10}  stages")
for m in re.finditer(r"time kda_(prefill|decode)(\S*) B=(\d+)(?: T=(\d+))? .*?us=([\d.]+) floor_us=([\d.]+)", ours):
    kind, variant, b, t = m[1], m[2], int(m[3]), int(m[4] or 1)
    us, floor = float(m[5]), float(m[6])
    a = anchor.get((kind, b, t))
    ratio = f"{a / us:.2f}x" if a else "-"
    line = ours[m.start():ours.find("\n", m.start())]
    st = re.search(r"prep_us=([\d.]+) scan_us=([\d.]+)", line)
    stages = f"  prep {st[1]} + scan {st[2]}" if st else ""
    print(f"{'kda_' + kind + variant:<28}{f'B={b} T={t}':<18}{us:>10.1f}{floor:>10.1f}{100 * floor / us:>8.0f}%{(a or 0):>10.1f}{ratio:>10}{stages}")

model = open(sys.argv[3]).read()
rows = re.findall(r"^time (\S+) (\S+) us=([\d.]+) floor_us=([\d.]+) GBps=(\d+)(.*)$", model, re.M)
if rows:
    print()
    print(f"{'kernel':<24}{'shape':<42}{'us':>10}{'floor us':>10}{'GB/s':>7}{'% floor':>9}  notes")
    us_of = {}
    for name, shape, us, floor, gbps, rest in rows:
        us, floor = float(us), float(floor)
        us_of[(name, shape)] = us
        notes = " ".join(f for f in rest.split() if not f.startswith("pct_floor"))
        print(f"{name:<24}{shape:<42}{us:>10.1f}{floor:>10.1f}{gbps:>7}{100 * floor / us:>8.0f}%  {notes}")
    for (name, shape), us in us_of.items():
        if name.endswith("_mxfp4") and (name[:-6] + "_bf16", shape) in us_of:
            bf = us_of[(name[:-6] + "_bf16", shape)]
            print(f"{name[:-6] + ' mxfp4/bf16':<24}{shape:<42}{bf / us:>9.2f}x speed-up")
fails = re.findall(r"^check (\S+) .* FAIL$", model, re.M)
if fails:
    status = "FAILED: " + " ".join(fails)
elif "all checks passed" in model:
    status = "all passed"
else:
    status = "incomplete (see model.log)"
print(f"\nmodel kernel checks: {status}")
EOF
exit $ours_rc
