# Sourced by Loom's scripts: where the cache, the venv and the build live.
# LOOM_CACHE moves the cache (default ~/.cache/loom); LOOM_BUILD_DIR the build tree.
LOOM_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOOM_CACHE="${LOOM_CACHE:-$HOME/.cache/loom}"
LOOM_PYTHON="${LOOM_PYTHON:-python3}"
_loom_torch="$(sed -n 's/^torch==//p' "$LOOM_ROOT/scripts/requirements.txt")"
_loom_py="$("$LOOM_PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
LOOM_VENV="${LOOM_VENV:-$LOOM_CACHE/venv-torch$_loom_torch-py$_loom_py}"
LOOM_BUILD_DIR="${LOOM_BUILD_DIR:-$LOOM_ROOT/build}"
export CCACHE_DIR="${CCACHE_DIR:-$LOOM_CACHE/ccache}"
# (LOOM_PYTHON is not exported: it names the interpreter the venv is made with; exported as plain
# python3, a shell that sourced this found no LibTorch for an out-of-tree plugin, whose CMake
# takes LOOM_PYTHON before LOOM_VENV and the SDK's own LibTorch; a user's export of it stays)
export LOOM_ROOT LOOM_CACHE LOOM_VENV LOOM_BUILD_DIR
unset _loom_torch _loom_py
# Clones in different folders share the compiler cache: paths under the checkout are hashed
# relative to it.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$LOOM_ROOT}"
export CCACHE_NOHASHDIR=1
