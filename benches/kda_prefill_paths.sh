#!/usr/bin/env bash
# Whole-model prefill on a CUDA GPU with the KDA layers on the chunked kernels (`kda.cu`, the
# default outside the exact mode) against the token recurrence (`TESSERA_KDA_PREFILL=recurrent`),
# on the `medium` random Kimi Linear model: prefill time per prompt length and batch (each shape
# run twice, the second warm), then a profiled prefill per path (`TESSERA_CUDA_PROFILE=1`: every
# part of the forward bracketed by synchronisations) that splits out the KDA recurrence's time.
#
# Build here with `cargo build --release --features cuda` and
# `cargo build --release -p tessera-engine --features cuda --example decode_bench`, then run with
# BIN and BENCH pointing at the (stripped) binaries. PROMPTS and BATCH override the shapes.
set -eu
BIN=${BIN:-target/release/tessera}
BENCH=${BENCH:-target/release/examples/decode_bench}
MODEL=${MODEL:-/tmp/medium}
PROMPTS=${PROMPTS:-"64 512 4096"}
cublas=$(find /usr/local /usr/lib /opt -name 'libcublas.so.1*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH="${cublas:+$(dirname "$cublas"):}${LD_LIBRARY_PATH:-}"
[ -f "$MODEL/config.json" ] || "$BIN" init-model --arch kimi_linear --preset medium --out "$MODEL"
for prompt in $PROMPTS; do
    for path in chunked recurrent; do
        echo "== KDA prefill $path, prompt $prompt"
        TESSERA_KDA_PREFILL=$path "$BENCH" "$MODEL" cuda "${BATCH:-1,1,8}" "$prompt" 8 serving |
            grep -E '^batch'
        TESSERA_KDA_PREFILL=$path TESSERA_CUDA_PROFILE=1 "$BENCH" "$MODEL" cuda 1 "$prompt" 1 serving |
            sed -n '/^prefill forward profile/,/^forward profile/p' | grep -v '^forward profile'
    done
done
