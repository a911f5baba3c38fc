#!/usr/bin/env bash
# Fuzzes every parser of untrusted input for a bounded time (fuzz/README.md):
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]     (default: 60 s, every target)
#
# builds the `fuzz` preset (clang 14 with libFuzzer, AddressSanitizer and UBSan) in build-fuzz,
# then runs each target from its seed corpus (fuzz/corpus/<target>, copied to
# $LOOM_CACHE/fuzz-corpus/<target>, where what the fuzzer learns accumulates across runs). An
# input that crashes, trips a sanitizer, leaks, takes over 10 s or needs over 2 GiB is saved as
# build-fuzz/findings/<target>/crash-* (or timeout-*, oom-*) and the script fails. Prints one
# line per target: executions, corpus size, findings.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/env.sh"
seconds="${1:-60}"
shift || true
case "$seconds" in ''|*[!0-9]*) echo "fuzz: '$seconds' is not a number of seconds" >&2; exit 2 ;; esac
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(config safetensors state_json idx descriptor note)

command -v clang++-14 >/dev/null || { echo "fuzz: clang++-14 not found; scripts/setup.sh installs it" >&2; exit 1; }
bash "$here/setup.sh" >/dev/null
export LOOM_PYTHON="$LOOM_VENV/bin/python"
cd "$LOOM_ROOT"
[ -f build-fuzz/build.ninja ] || cmake --preset fuzz >"$LOOM_CACHE/configure-fuzz.log" || {
  echo "fuzz: configuring failed; see $LOOM_CACHE/configure-fuzz.log" >&2; exit 1; }
cmake --build --preset fuzz >"$LOOM_CACHE/build-fuzz.log" 2>&1 || {
  tail -n 30 "$LOOM_CACHE/build-fuzz.log" >&2; echo "fuzz: the build failed" >&2; exit 1; }

export ASAN_OPTIONS="detect_leaks=1:detect_odr_violation=0:allocator_may_return_null=1"
export LSAN_OPTIONS="suppressions=$LOOM_ROOT/tests/sanitizers/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
failed=0
printf '%-12s %12s %10s %8s  %s\n' target executions "exec/s" corpus findings
for t in "${targets[@]}"; do
  exe="build-fuzz/bin/${t}_fuzz"
  [ -x "$exe" ] || { echo "fuzz: no target '$t' (built: $(ls build-fuzz/fuzz | grep _fuzz$ | sed 's/_fuzz$//' | tr '\n' ' '))" >&2; exit 2; }
  corpus="$LOOM_CACHE/fuzz-corpus/$t"
  findings="build-fuzz/findings/$t"
  mkdir -p "$corpus" "$findings"
  cp -n fuzz/corpus/"$t"/* "$corpus"/ 2>/dev/null || true
  log="build-fuzz/findings/$t.log"
  "$exe" "$corpus" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$findings/" >"$log" 2>&1
  rc=$?
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)
  size=$(ls "$corpus" | wc -l)
  found=$(ls "$findings" 2>/dev/null | tr '\n' ' ')
  printf '%-12s %12s %10s %8s  %s\n' "$t" "${runs:-?}" "${rate:-?}" "$size" "${found:-none}"
  if [ $rc -ne 0 ] || [ -n "$found" ]; then
    failed=1
    grep -m 1 -E "ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|runtime error|==ERROR" "$log" | sed 's/^/    /'
    echo "    full log: $log; reproduce: $exe $findings/<file>"
  fi
done
exit $failed
