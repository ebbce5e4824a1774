#!/usr/bin/env bash
# Whole-model forward on a CUDA GPU, end to end, in one call to the GPU machine:
#   1. cuda_model_check: every fixture's prompt logits and greedy tokens on the GPU against the
#      reference and the CPU engine, decode = prefill, batch = alone;
#   2. `tessera generate --device cuda` against `--device cpu`;
#   3. `tessera serve --device cuda` and `tessera up --device cuda` (router + prefill + decode
#      daemons) answering a greedy completion, compared with `tessera serve --device cpu`.
# Exits non-zero when any step fails.
#
# Build here with `cargo build --release --features cuda` and
# `cargo build --release -p tessera-engine --features cuda --example cuda_model_check`, then run
# with BIN and CHECK pointing at the (stripped) binaries.
set -u
BIN=${BIN:-target/release/tessera}
CHECK=${CHECK:-target/release/examples/cuda_model_check}
MODEL=${MODEL:-tests/fixtures/kl_mixed}
PORT=${PORT:-18431}
fail=0
# cuBLAS from the CUDA toolkit or a Python wheel, wherever the machine has it.
cublas=$(find /usr/local /usr/lib /opt -name 'libcublas.so.1*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH="${cublas:+$(dirname "$cublas"):}${LD_LIBRARY_PATH:-}"
note() { printf '\n== %s\n' "$*"; }

note "fixtures on the GPU"
"$CHECK" || fail=1

note "generate: cuda against cpu ($MODEL)"
for d in cpu cuda; do
    "$BIN" generate --model "$MODEL" --device "$d" --prompt-ids 5,17,42,99,3,250 \
        --max-new-tokens 16 --ignore-eos --json >"/tmp/gen-$d.json" || fail=1
    echo "$d: $(cat "/tmp/gen-$d.json")"
done
python3 - <<'EOF' || fail=1
import json
a, b = (json.load(open(f"/tmp/gen-{d}.json")) for d in ("cpu", "cuda"))
ka = a.get("token_ids", a.get("tokens"))
kb = b.get("token_ids", b.get("tokens"))
same = next((i for i, (x, y) in enumerate(zip(ka, kb)) if x != y), len(ka))
print(f"greedy tokens equal for {same}/{len(ka)} steps")
EOF

# Waits for an OpenAI server on $1, then prints the greedy completion of a fixed prompt.
complete() {
    local base=$1
    for _ in $(seq 1 120); do
        curl -sf "$base/models" >/dev/null 2>&1 && break
        sleep 0.5
    done
    local id
    id=$(curl -sf "$base/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])') || return 1
    curl -sf "$base/completions" -H 'content-type: application/json' \
        -d "{\"model\":\"$id\",\"prompt\":\"The quick brown fox\",\"max_tokens\":24,\"temperature\":0,\"ignore_eos\":true}" |
        python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)["choices"][0]["text"]))'
}

note "serve: embedded default model, cpu and cuda"
for d in cpu cuda; do
    "$BIN" serve --device "$d" --port "$PORT" >"/tmp/serve-$d.log" 2>&1 &
    pid=$!
    out=$(complete "http://127.0.0.1:$PORT/v1") || { fail=1; tail -20 "/tmp/serve-$d.log"; }
    echo "$d: $out"
    echo "$out" >"/tmp/serve-$d.txt"
    kill -TERM "$pid"; wait "$pid" 2>/dev/null
done
cmp -s /tmp/serve-cpu.txt /tmp/serve-cuda.txt && echo "serve: cuda text equals cpu text" ||
    echo "serve: cuda text differs from cpu text (bf16 near ties?)"

note "up: router + prefill + decode daemons on cuda"
"$BIN" up --device cuda --port "$PORT" >/tmp/up.log 2>&1 &
pid=$!
out=$(complete "http://127.0.0.1:$PORT/v1") || { fail=1; tail -30 /tmp/up.log; }
echo "up cuda: $out"
echo "$out" >/tmp/up-cuda.txt
kill -TERM "$pid"; wait "$pid" 2>/dev/null
cmp -s /tmp/serve-cuda.txt /tmp/up-cuda.txt && echo "up: cluster text equals single-process cuda text" ||
    { echo "up: cluster text differs from single-process cuda text"; fail=1; }

note "result: $([ $fail = 0 ] && echo PASS || echo FAIL)"
exit $fail
