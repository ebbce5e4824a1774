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
  "pkg-config:pkg-config"
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
