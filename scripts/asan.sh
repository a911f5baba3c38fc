#!/usr/bin/env bash
# The sanitizer suite: the `asan` preset (Debug, AddressSanitizer and UBSan) built in build-asan,
# then every test under it, with LeakSanitizer suppressions for LibTorch's one-time allocations
# only (tests/sanitizers/lsan.supp; the test preset sets the options). The test preset leaves out
# two labels that run no Loom code under the sanitizers: compat (compiles the sources against
# torch 2.11's headers) and package (builds a plugin out of tree with the installed SDK). Extra
# arguments go to ctest (e.g. -L trainer). Too slow for CI's time limit on 2 cores (a cold
# Debug+ASan build of LibTorch units takes about 40 minutes there), so it is run by hand.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/env.sh"
bash "$here/setup.sh"
export LOOM_PYTHON="$LOOM_VENV/bin/python"
cd "$LOOM_ROOT"
[ -f build-asan/build.ninja ] || cmake --preset asan >"$LOOM_CACHE/configure-asan.log"
cmake --build --preset asan
ctest --preset asan --timeout 1800 -j "$(nproc)" "$@"
