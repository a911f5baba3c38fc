"""Helpers of the integration tests: run the loom CLI on a small, fast configuration."""
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile

SKIP = 77  # ctest's SKIP_RETURN_CODE for these tests

SMALL = [
    "--set", "model.name=lightweight_transformer", "--set", "model.flavour=debug",
    "--set", "model.dropout=0.1",
    "--set", "data.name=synthetic", "--set", "data.train_size=2048", "--set", "data.test_size=256",
    "--set", "trainer.batch_size=32", "--set", "trainer.seed=11", "--set", "trainer.device=cpu",
    "--set", "trainer.log_every=1", "--set", "precision.name=fp32",
]


def require(*modules):
    for name in modules:
        try:
            __import__(name)
        except ImportError:
            print(f"SKIP: Python module {name} is not installed here (scripts/setup.sh puts it in the venv)")
            sys.exit(SKIP)


def loom(exe, *args, check=True, **kwargs):
    result = subprocess.run([exe, *args], capture_output=True, text=True, **kwargs)
    if check and result.returncode != 0:
        print(result.stdout, result.stderr, sep="\n")
        raise SystemExit(f"loom {' '.join(args)} failed with {result.returncode}")
    return result


def metrics(run_dir, partial=False):
    """The rows of a run's metrics.jsonl. partial=True, for a run still writing it (or one cut by a
    SIGKILL): a last line without its newline yet is left out, as Loom's resume drops it. Else
    every line must be whole."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = f.readlines()
    if lines and not lines[-1].endswith("\n"):
        assert partial, f"{run_dir}/metrics.jsonl ends with a line cut short: {lines[-1]!r}"
        lines.pop()
    return [json.loads(line) for line in lines]


def workdir():
    """A scratch folder under the system's temporary folder, removed when the test's process
    exits, whether it passed or failed (LOOM_KEEP_TEST_WORK=1 keeps it to look at)."""
    path = tempfile.mkdtemp(prefix="loom-it-")
    if os.environ.get("LOOM_KEEP_TEST_WORK") != "1":
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    else:
        print(f"LOOM_KEEP_TEST_WORK=1: {path} is kept", file=sys.stderr)
    return path


def losses(run_dir):
    """Step -> the logged training loss of a run."""
    return {m["step"]: m["train/loss"] for m in metrics(run_dir) if "train/loss" in m}


def close(a, b, what, rel=1e-5):
    """Two {key: value} maps with the same keys and values within `rel` of b's."""
    assert sorted(a) == sorted(b), f"{what}: keys {sorted(a)} != {sorted(b)}"
    for k in a:
        assert abs(a[k] - b[k]) <= rel * max(abs(b[k]), 1e-8), f"{what}, {k}: {a[k]} != {b[k]}"

