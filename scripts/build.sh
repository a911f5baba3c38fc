#!/usr/bin/env bash
# Set-up (when needed) and an incremental build of Loom in $LOOM_BUILD_DIR (default ./build),
# with the `dev` preset's settings. Progress goes to stderr; quiet when there is nothing to do.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/env.sh"

bash "$here/setup.sh"
export LOOM_PYTHON="$LOOM_VENV/bin/python"
if [ ! -f "$LOOM_BUILD_DIR/build.ninja" ]; then
  echo "[build] configuring $LOOM_BUILD_DIR (first build: several minutes on 2 cores)" >&2
  cmake --preset dev -B "$LOOM_BUILD_DIR" >"$LOOM_CACHE/configure.log" 2>&1 || {
    cat "$LOOM_CACHE/configure.log" >&2
    exit 1
  }
fi
# Ninja prints one line per step; keep the last lines of a failure, and nothing on a no-op.
log="$LOOM_BUILD_DIR/build.log"
if ! cmake --build "$LOOM_BUILD_DIR" "$@" >"$log" 2>&1; then
  grep -v '^\[' "$log" | tail -n 60 >&2
  echo "[build] failed; the full log is $log" >&2
  exit 1
fi
if ! grep -q "no work to do" "$log"; then
  echo "[build] $(grep -c '^\[' "$log") build steps done" >&2
fi
