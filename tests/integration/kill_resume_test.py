"""A run killed with SIGKILL in the middle of training resumes from its last checkpoint
(`--resume auto`) and loses nothing else: its losses after the checkpoint are those of a run
that never stopped, and metrics.jsonl has every step exactly once."""
import os
import shutil
import signal
import subprocess
import sys
import time

from common import SMALL, loom, metrics, workdir

exe = sys.argv[1]
STEPS = 300
work = workdir()
args = [*SMALL, "--set", f"trainer.work_dir={work}", "--set", f"trainer.max_steps={STEPS}",
        "--set", "trainer.checkpoint_every=20", "--set", "trainer.eval_every=100"]
try:
    loom(exe, "train", *args, "--set", "trainer.name=straight")
    straight = {m["step"]: m["train/loss"] for m in metrics(os.path.join(work, "straight")) if "train/loss" in m}
    assert sorted(straight) == list(range(1, STEPS + 1))

    run = os.path.join(work, "killed")
    proc = subprocess.Popen([exe, "train", *args, "--set", "trainer.name=killed"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoints = os.path.join(run, "checkpoints")
    deadline = time.time() + 300
    while time.time() < deadline:
        done = [d for d in os.listdir(checkpoints)] if os.path.isdir(checkpoints) else []
        if any(d.startswith("step_") and int(d[5:]) >= 60 for d in done):
            break
        if proc.poll() is not None:
            raise SystemExit("the run ended before it could be killed; make it longer")
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    kept = sorted(d for d in os.listdir(checkpoints) if d.startswith("step_"))
    last = int(kept[-1][5:])
    assert last < STEPS, f"the run finished before the kill ({kept})"
    written = [m["step"] for m in metrics(run, partial=True) if "train/loss" in m]  # (a SIGKILL may cut its last line)
    print(f"killed at about step {max(written)}; newest checkpoint step {last}")

    out = loom(exe, "train", *args, "--set", "trainer.name=killed", "--resume", "auto")
    assert f"at step {last}" in out.stderr, out.stderr
    resumed = [m for m in metrics(run) if "train/loss" in m]
    steps = [m["step"] for m in resumed]
    assert steps == list(range(1, STEPS + 1)), "metrics.jsonl must hold every step once"
    for m in resumed:
        s = m["step"]
        assert m["train/loss"] == straight[s], f"step {s}: {m['train/loss']} != {straight[s]}"
    print(f"resumed from step {last}; steps 1..{STEPS} identical to the run that never stopped")
finally:
    shutil.rmtree(work, ignore_errors=True)
print("kill -9 test passed")
