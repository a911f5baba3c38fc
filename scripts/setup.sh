#!/usr/bin/env bash
# Installs everything Loom needs to build, test and run, and nothing by hand.
#
#   - Debian packages (compilers and build tools, Boost, spdlog, GoogleTest, nlohmann-json,
#     zlib, the Fashion-MNIST dataset, Python venv support, clang with libFuzzer for
#     scripts/fuzz.sh), through apt-get;
#   - the pinned PyTorch wheel (LibTorch for the build, Python PyTorch for the side-by-side
#     benchmarks) and the Python readers the tests use, into a venv cached outside the
#     checkout: $LOOM_CACHE (default ~/.cache/loom), so clones and CI runs share it;
#   - the headers of the GPU machine's torch release (2.11), for the check that Loom still
#     compiles against it (scripts/torch_compat.py; the wheel is downloaded, its headers kept,
#     nothing installed).
#
# Idempotent: a second run on the same machine compares a stamp and returns at once; --check
# looks at every package again. Prints the venv's path as its last line with --print-venv.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=scripts/env.sh
source "$here/env.sh"

log() { printf '[setup] %s\n' "$*" >&2; }

apt_packages=(
  build-essential cmake ninja-build ccache git pkg-config binutils
  libboost-dev libboost-program-options-dev
  libspdlog-dev libfmt-dev
  libgtest-dev libgmock-dev
  nlohmann-json3-dev zlib1g-dev
  libelf-dev                             # the fingerprint note of a plugin file, read before loading it
  libpcre2-dev                           # the GPT-2 tokenizer's pre-tokenizer (Unicode classes \p{L}, \p{N})
  libgloo-dev                            # Gloo's headers, which torch's ProcessGroupGloo.hpp includes (the ddp strategy on CPU; the wheel ships the code)
  dataset-fashion-mnist
  python3 python3-venv python3-pip
  clang-14 libclang-rt-14-dev            # the fuzz targets (scripts/fuzz.sh): libFuzzer
)

install_debian_packages() {
  local missing=()
  for p in "${apt_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing Debian packages: ${missing[*]}"
  local sudo=()
  [ "$(id -u)" -ne 0 ] && sudo=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  if ! "${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}"; then
    "${sudo[@]}" apt-get update
    "${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}"
  fi
}

install_venv() {
  local req="$here/requirements.txt"
  local want
  want="$(sha256sum "$req" | cut -c1-16)"
  if [ -f "$LOOM_VENV/.loom-requirements" ] && [ "$(cat "$LOOM_VENV/.loom-requirements")" = "$want" ] \
     && "$LOOM_VENV/bin/python" -c 'import torch' 2>/dev/null; then
    return 0
  fi
  log "creating the Python venv $LOOM_VENV (torch and the test readers; a few minutes once)"
  mkdir -p "$LOOM_CACHE"
  # The stamp is written last, so an interrupted install is redone from scratch next time.
  rm -rf "$LOOM_VENV"
  "$LOOM_PYTHON" -m venv "$LOOM_VENV"
  "$LOOM_VENV/bin/python" -m pip install -q --upgrade pip
  "$LOOM_VENV/bin/python" -m pip install -q --cache-dir "$LOOM_CACHE/pip" -r "$req"
  echo "$want" > "$LOOM_VENV/.loom-requirements"
}

# Fast path: nothing changed since the last complete run on this machine.
stamp="$LOOM_CACHE/setup.stamp"
want_stamp="$(cat "$here/setup.sh" "$here/requirements.txt" | sha256sum | cut -c1-16) $LOOM_VENV"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want_stamp" ] && [ -x "$LOOM_VENV/bin/python" ] \
   && [ "${1:-}" != "--check" ]; then
  [ "${1:-}" = "--print-venv" ] && echo "$LOOM_VENV"
  exit 0
fi

install_debian_packages
install_venv
"$LOOM_VENV/bin/python" "$here/torch_compat.py" --fetch --python "$LOOM_VENV/bin/python"
mkdir -p "$CCACHE_DIR"
echo "$want_stamp" > "$stamp"
if [ "${1:-}" = "--print-venv" ]; then
  echo "$LOOM_VENV"
fi
