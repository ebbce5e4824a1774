#!/usr/bin/env bash
# Runs the cargo-fuzz targets of fuzz/ (libFuzzer), each for a given time; fails when any of
# them crashes, panics, leaks, runs out of memory or hangs on one input.
#
#   scripts/fuzz.sh                       # every target, 60 s each, AddressSanitizer
#   scripts/fuzz.sh 600 http_request      # one target for 10 minutes
#   TESSERA_FUZZ_SANITIZER=none TESSERA_FUZZ_PROFILE=dev scripts/fuzz.sh 5    # CI's quick smoke
#
# Targets:
#   http_request        request bodies through the OpenAI HTTP front (/v1/completions and
#                       /v1/chat/completions) over the fake backend
#   proto_messages      prost decoding of the worker, router and etcd gRPC messages, and the TCP
#                       page-transfer wire frames
#   safetensors_header  a hostile model.safetensors opened and read by the engine's loader
#   model_config        a hostile config.json parsed by the engine and planned into the KV page pool
#   chat_template       arbitrary chat messages and template variables through the chat templates
#                       and the tokenizer
#   image_decode        a hostile image file decoded, checked against the size limits,
#                       preprocessed and encoded by the tiny kimi_k25 fixture's vision tower
#
# Seeds are committed in fuzz/corpus/<target>/ and never written to; what a run learns goes to
# fuzz/target/corpus/<target>/ (git-ignored), so later runs start from it. A crashing input is
# written to fuzz/artifacts/<target>/; reproduce it with
#   RUSTC_BOOTSTRAP=1 cargo fuzz run --fuzz-dir fuzz <target> fuzz/artifacts/<target>/<file>
# and minimize it with `cargo fuzz tmin`.
#
# Needs cargo-fuzz (installed here when missing). cargo-fuzz asks for nightly-only rustc flags:
# RUSTC_BOOTSTRAP=1 lets the stable toolchain accept them.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-60}
shift || true
all_targets=(http_request proto_messages safetensors_header model_config chat_template image_decode)
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=("${all_targets[@]}")
sanitizer=${TESSERA_FUZZ_SANITIZER:-address}
profile=${TESSERA_FUZZ_PROFILE:-release}

case "$seconds" in
  '' | *[!0-9]*) echo "usage: scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]" >&2; exit 2 ;;
esac
for t in "${targets[@]}"; do
  [ -f "fuzz/fuzz_targets/$t.rs" ] || {
    echo "unknown fuzz target '$t' (have: ${all_targets[*]})" >&2
    exit 2
  }
done

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "== installing cargo-fuzz"
  cargo install cargo-fuzz --locked
fi

export RUSTC_BOOTSTRAP=1
build_args=(--fuzz-dir fuzz --sanitizer "$sanitizer")
case "$profile" in
  release) ;;
  dev) build_args+=(--dev) ;;
  *) echo "TESSERA_FUZZ_PROFILE must be release or dev, got '$profile'" >&2; exit 2 ;;
esac

echo "== building the fuzz targets (sanitizer: $sanitizer, profile: $profile)"
cargo fuzz build "${build_args[@]}"

failed=()
for t in "${targets[@]}"; do
  echo "== fuzzing $t for ${seconds}s"
  work="$PWD/fuzz/target/corpus/$t"
  mkdir -p "$work"
  flags=(-max_total_time="$seconds" -timeout=20 -rss_limit_mb=4096 -print_final_stats=1)
  [ -f "fuzz/dict/$t.dict" ] && flags+=(-dict="$PWD/fuzz/dict/$t.dict")
  if ! cargo fuzz run "${build_args[@]}" "$t" "$work" "$PWD/fuzz/corpus/$t" -- "${flags[@]}"; then
    failed+=("$t")
  fi
done

if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzzing found crashes in: ${failed[*]} (inputs under fuzz/artifacts/)" >&2
  exit 1
fi
echo "== fuzzing: ${#targets[@]} target(s), ${seconds}s each, no crash"
