#!/usr/bin/env bash
# Names the frames of a Loom crash report (core/src/crash_report.cpp): reads a log, and for each
# frame written as MODULE(+0xOFFSET) or "MODULE (+0xOFFSET)" prints the function (and the line,
# where the build has debug information), through addr2line.
#   scripts/symbolize-crash.sh LOG
set -uo pipefail
log="${1:?usage: scripts/symbolize-crash.sh LOG}"
command -v addr2line >/dev/null || { echo "symbolize-crash: addr2line not found (binutils)" >&2; exit 1; }
grep -oE '(/[^ ()]+)( in |)?\(\+0x[0-9a-f]+\)|in /[^ ]+ \(\+0x[0-9a-f]+\)' "$log" |
  sed -E 's/^in //; s/ \(\+/(+/' |
  while IFS= read -r frame; do
    module="${frame%%(+*}"
    offset="${frame##*(+}"
    offset="${offset%)}"
    [ -f "$module" ] || { echo "$frame: (module not here)"; continue; }
    printf '%s(+%s): %s\n' "$(basename "$module")" "$offset" \
      "$(addr2line -f -C -p -e "$module" "$offset" 2>/dev/null)"
  done
