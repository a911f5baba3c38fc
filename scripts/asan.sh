#!/usr/bin/env bash
# The sanitizer suite: the `asan` preset (Debug, AddressSanitizer and UBSan) built in build-asan,
# then every test under it, with LeakSanitizer suppressions for LibTorch's one-time allocations
# only (tests/sanitizers/lsan.supp; the test preset sets the options). Extra arguments go to
# ctest (e.g. -L trainer). Too slow for CI's time limit on 2 cores, so it is run by hand.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/env.sh"
bash "$here/setup.sh"
export LOOM_PYTHON="$LOOM_VENV/bin/python"
cd "$LOOM_ROOT"
[ -f build-asan/build.ninja ] || cmake --preset asan >"$LOOM_CACHE/configure-asan.log"
cmake --build --preset asan
ctest --preset asan --timeout 1800 -j "$(nproc)" "$@"
