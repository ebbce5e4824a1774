#!/usr/bin/env bash
# Tessera's whole test suite. Installs what the tests need when it is missing, then runs
# formatting, lint and every test. Works on a fresh Debian machine with only Rust installed.
#
#   scripts/test.sh            # everything
#   TESSERA_TEST_FILTER=kda scripts/test.sh   # only tests whose name contains `kda`
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '\n== %s\n' "$*"; }

# --- system packages (Debian) ------------------------------------------------------------
# Each entry: a command or file that proves the package is there, then the package.
DEB_NEEDS=(
  "python3:python3"
  "etcd:etcd-server"
)
missing=()
for entry in "${DEB_NEEDS[@]}"; do
  probe=${entry%%:*}; pkg=${entry##*:}
  command -v "$probe" >/dev/null 2>&1 || [ -e "$probe" ] || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

# --- Python packages (a venv under target/, so the system stays untouched) -----------------
PY_VENV="$PWD/target/py-venv"
PY_PACKAGES=(openai==2.*)
if ! "$PY_VENV/bin/python" -c "import openai" >/dev/null 2>&1; then
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

say "lint"
cargo clippy --workspace --all-targets --locked -- -D warnings

say "tests"
filter=${TESSERA_TEST_FILTER:-}
# Tests that write the embedded default model use a private cache, never the user's.
export TESSERA_CACHE_DIR="${TESSERA_CACHE_DIR:-$PWD/target/test-cache}"
cargo test --workspace --locked -- ${filter:+"$filter"}

if [ -z "$filter" ]; then
  say "the official openai client against tessera serve"
  cargo build --locked --bin tessera
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
