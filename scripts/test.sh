#!/usr/bin/env bash
# Loom's test command: set-up, build, then every test through ctest. Prints ctest's summary and
# exits with the tests' status. Extra arguments go to ctest (e.g. -L plugins, -R PluginLoader).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/env.sh"

bash "$here/build.sh"
cd "$LOOM_BUILD_DIR"
set +e
ctest --output-on-failure --timeout 900 -j "$(nproc)" "$@" 2>&1 | tee "$LOOM_BUILD_DIR/ctest.log" \
  | grep -E -v '^ *[0-9]+/[0-9]+ Test +#[0-9]+: .* Passed|^ +Start +[0-9]+: '
status=${PIPESTATUS[0]}
exit "$status"
