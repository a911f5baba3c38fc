"""scripts/fused_gate.py: the GPU suite turns off, for its benchmarks, each fused operation whose GPU
test failed, crashed, timed out or did not run, and keeps the others on; the dry run's skipped
tests turn nothing off; a GPU test renamed without its table is an error, not a silent gate.

The logs here are written in ctest's own format (as `ctest --output-on-failure` prints results),
and the table's names are checked against the GPU tests' sources and the names LOOM_FUSED_KERNELS
accepts, so that the gate cannot drift from either."""
import os
import re
import subprocess
import sys
import tempfile

exe, source = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.join(source, "scripts"))
import fused_gate  # noqa: E402  (scripts/ on the path first)

GATE = os.path.join(source, "scripts", "fused_gate.py")
ALL = [t for tests in fused_gate.TESTS.values() for t in tests]


def expect(cond, what):
    if not cond:
        raise SystemExit(f"FAIL: {what}")


def ctest_log(outcomes):
    """A `ctest -L gpu` log with these {test: outcome} results, others before and after them."""
    lines = ["Test project /tmp/build"]
    names = ["PrecisionGpu.AutocastDtypesOnCuda"] + list(outcomes) + ["StepGpu.ACudaGraphTrainsAsTheEagerStepDoes"]
    for i, name in enumerate(names, 1):
        outcome = outcomes.get(name, "Passed")
        lines.append(f"      Start {200 + i}: {name}")
        mark = "   " if outcome == "Passed" else "***"
        lines.append(f"{i:2d}/{len(names)} Test #{200 + i}: {name} {'.' * max(3, 60 - len(name))}{mark}{outcome}"
                     f"   {0.4 + i:.2f} sec")
    lines.append("")
    lines.append(f"{100 * sum(o == 'Passed' for o in outcomes.values()) // max(1, len(outcomes))}% tests passed")
    return "\n".join(lines) + "\n"


def run_gate(text, tmp):
    path = os.path.join(tmp, "test-gpu.log")
    with open(path, "w") as f:
        f.write(text)
    r = subprocess.run([sys.executable, GATE, path], capture_output=True, text=True)
    return r.returncode, r.stdout.strip(), r.stderr


with tempfile.TemporaryDirectory() as tmp:
    # every operation's tests passed: nothing set, all on
    rc, value, err = run_gate(ctest_log({t: "Passed" for t in ALL}), tmp)
    expect(rc == 0 and value == "", f"all passed: rc {rc}, value '{value}', stderr {err}")

    # the dry run on a CPU: skipped tests turn nothing off
    rc, value, _ = run_gate(ctest_log({t: "Skipped" for t in ALL}), tmp)
    expect(rc == 0 and value == "", f"all skipped: rc {rc}, value '{value}'")

    # a failed product and a crashed embedding: those two off, the rest named
    outcomes = {t: "Passed" for t in ALL}
    outcomes["PrecisionGpu.LinearMatchesAten"] = "Failed"
    outcomes["PrecisionGpu.EmbeddingMatchesAten"] = "Exception: SegFault"
    rc, value, err = run_gate(ctest_log(outcomes), tmp)
    expect(rc == 0 and value == "cross_entropy,layer_norm,mlp", f"two failed: rc {rc}, value '{value}'")
    expect("linear off for the benchmarks: PrecisionGpu.LinearMatchesAten Failed" in err, f"says why: {err}")
    expect("embedding off for the benchmarks: PrecisionGpu.EmbeddingMatchesAten Exception: SegFault" in err,
           f"says why: {err}")

    # one of LayerNorm's two tests timed out: LayerNorm off, though its other test passed
    outcomes = {t: "Passed" for t in ALL}
    outcomes["PrecisionGpu.FusedAddLayerNormMatchesTheAddThenLayerNorm"] = "Timeout"
    rc, value, _ = run_gate(ctest_log(outcomes), tmp)
    expect(rc == 0 and value == "cross_entropy,embedding,linear,mlp", f"a timeout: rc {rc}, value '{value}'")

    # a test ctest could not start counts as failed
    outcomes = {t: "Passed" for t in ALL}
    outcomes["PrecisionGpu.MlpGeluMatchesTheComposition"] = "Not Run"
    rc, value, _ = run_gate(ctest_log(outcomes), tmp)
    expect(rc == 0 and value == "cross_entropy,embedding,layer_norm,linear", f"not run: rc {rc}, value '{value}'")

    # every one failed: 0, which LOOM_FUSED_KERNELS reads as none
    rc, value, _ = run_gate(ctest_log({t: "Failed" for t in ALL}), tmp)
    expect(rc == 0 and value == "0", f"all failed: rc {rc}, value '{value}'")

    # a test the table names is not in the log (the budget cut ctest before it, or it was renamed):
    # counted as failed, with exit 2 naming it, and the failures before it still count
    outcomes = {t: "Passed" for t in ALL if t != "PrecisionGpu.LinearMatchesAten"}
    outcomes["PrecisionGpu.EmbeddingMatchesAten"] = "Failed"
    rc, value, err = run_gate(ctest_log(outcomes), tmp)
    expect(rc == 2 and value == "cross_entropy,layer_norm,mlp" and "PrecisionGpu.LinearMatchesAten" in err,
           f"a missing test: rc {rc}, value '{value}', stderr {err}")

    # no log: one clear line
    r = subprocess.run([sys.executable, GATE, os.path.join(tmp, "none.log")], capture_output=True, text=True)
    expect(r.returncode == 1 and "cannot read ctest's log" in r.stderr, f"no log: {r.returncode} {r.stderr}")

# the table against the sources: each test exists, each operation is one LOOM_FUSED_KERNELS accepts
gpu_sources = ""
for name in os.listdir(os.path.join(source, "tests", "gpu")):
    if name.endswith(".cpp"):
        with open(os.path.join(source, "tests", "gpu", name)) as f:
            gpu_sources += f.read()
defined = {f"{a}.{b}" for a, b in re.findall(r"^TEST\((\w+), (\w+)\)", gpu_sources, re.M)}
for test in ALL:
    expect(test in defined, f"{test} (scripts/fused_gate.py) is not a test in tests/gpu/")
with open(os.path.join(source, "sdk", "src", "rtc.cpp")) as f:
    accepted = set(re.findall(r'name != "(\w+)"', f.read()))
expect(accepted == set(fused_gate.TESTS), f"LOOM_FUSED_KERNELS accepts {sorted(accepted)}, the gate knows "
       f"{sorted(fused_gate.TESTS)}")
print("ok: scripts/fused_gate.py")
