#!/usr/bin/env python3
"""Which of Loom's fused operations the GPU suite's benchmarks may use, from `ctest -L gpu`'s log.

    python3 scripts/fused_gate.py LOG

scripts/gpu-suite.sh runs the GPU tests before the benchmarks. A fused operation whose GPU test
failed, crashed or timed out must not carry the benchmarks' figures: a wrong kernel would measure
a wrong model, and one that faults on the device (an illegal address is sticky: the process
cannot go on) would lose every Loom figure of a lent machine's run. So the suite turns off, for
the benchmarks only, each operation with such a test, and the rest still run fused.

Prints one line, LOOM_FUSED_KERNELS's value for the benchmarks: empty where every operation's
tests passed or skipped (no GPU: the dry run), else the operations whose tests passed, comma-
separated, or 0 for none. Then, on standard error, which tests turned what off. A test the log
lacks counts as failed (the budget cut ctest before it, perhaps in a hung kernel's test), and the
script exits 2 after printing the value (or the test was renamed: this table must follow it).
"""
import re
import sys

# Each fused operation (LOOM_FUSED_KERNELS's names, sdk/src/rtc.cpp) and the GPU tests that check
# it against ATen (tests/gpu/precision_gpu_test.cpp).
TESTS = {
    "cross_entropy": ["PrecisionGpu.FusedCrossEntropyMatchesAten"],
    "embedding": ["PrecisionGpu.EmbeddingMatchesAten"],
    "layer_norm": ["PrecisionGpu.FusedLayerNormMatchesAten", "PrecisionGpu.FusedAddLayerNormMatchesTheAddThenLayerNorm"],
    "linear": ["PrecisionGpu.LinearMatchesAten"],
    "mlp": ["PrecisionGpu.MlpGeluMatchesTheComposition"],
}

# ctest's result line: " 4/19 Test #221: PrecisionGpu.FusedCrossEntropyMatchesAten ....***Failed  3.2 sec"
RESULT = re.compile(r"^\s*\d+/\d+ Test +#\d+: (\S+) \.*\s*(\*\*\*)?(.*?)\s+[\d.]+ sec\s*$")


def outcomes(text):
    """{test name: ctest's outcome ("Passed", "Skipped", "Failed", "Exception: SegFault", "Timeout", "Not Run", ...)}."""
    found = {}
    for line in text.splitlines():
        m = RESULT.match(line)
        if m:
            found[m.group(1)] = m.group(3).strip()
    return found


def gate(text):
    """(LOOM_FUSED_KERNELS's value or "" for all, [(operation, test, outcome) turned off], [missing tests])."""
    found = outcomes(text)
    missing = [t for tests in TESTS.values() for t in tests if t not in found]
    off = [(op, t, found.get(t, "not in the log")) for op, tests in TESTS.items() for t in tests
           if found.get(t) not in ("Passed", "Skipped")]
    bad = {op for op, _, _ in off}
    if not bad:
        return "", off, missing
    kept = [op for op in TESTS if op not in bad]
    return ",".join(kept) if kept else "0", off, missing


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    try:
        with open(sys.argv[1], errors="replace") as f:
            text = f.read()
    except OSError as e:
        sys.exit(f"fused_gate: cannot read ctest's log {sys.argv[1]}: {e.strerror}")
    value, off, missing = gate(text)
    for op, test, outcome in off:
        print(f"fused_gate: {op} off for the benchmarks: {test} {outcome}", file=sys.stderr)
    print(value)
    if missing:
        print("fused_gate: the log has no result for " + ", ".join(missing) +
              " (renamed? scripts/fused_gate.py's table must name the GPU tests)", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
