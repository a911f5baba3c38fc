"""kill -9 while checkpoints are written and pruned: with a checkpoint every step and keep-last 1,
saving and pruning run all the time, and the run is killed at random moments, then resumed,
again and again. After every kill each step_* folder is complete (its three files) and loads;
the next start removes the half-written and half-deleted folders (.step_*.tmp, .step_*.deleting),
resumes from the newest step folder, and at the end metrics.jsonl holds every step once."""
import os
import random
import shutil
import signal
import subprocess
import sys
import time

from common import SMALL, loom, metrics, workdir

exe = sys.argv[1]
STEPS = 400
KILLS = 12
work = workdir()
args = [*SMALL, "--set", f"trainer.work_dir={work}", "--set", f"trainer.max_steps={STEPS}",
        "--set", "trainer.checkpoint_every=1", "--set", "trainer.keep_last=1", "--set", "trainer.eval_every=100000",
        "--set", "trainer.name=pruned"]
run = os.path.join(work, "pruned")
checkpoints = os.path.join(run, "checkpoints")
rng = random.Random(7)


def step_folders():
    return sorted(d for d in os.listdir(checkpoints) if d.startswith("step_"))


def newest_step():
    folders = step_folders()
    return int(folders[-1][5:]) if folders else 0


try:
    leftovers_seen = 0
    resume = []
    for kill in range(KILLS):
        before = newest_step() if os.path.isdir(checkpoints) else 0
        proc = subprocess.Popen([exe, "train", *args, *resume], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.time() + 120
        while time.time() < deadline and (not os.path.isdir(checkpoints) or newest_step() < before + 3):
            if proc.poll() is not None:
                raise SystemExit("the run ended before it could be killed:\n" + proc.stderr.read().decode())
            time.sleep(0.005)
        time.sleep(rng.uniform(0, 0.05))  # somewhere inside a save or a prune, or between them
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        folders = step_folders()
        assert folders, f"kill {kill}: no step folder left"
        for d in folders:
            files = sorted(os.listdir(os.path.join(checkpoints, d)))
            assert files == ["model.safetensors", "optimizer.safetensors", "state.json"], f"kill {kill}: {d} holds {files}"
        hidden = [d for d in os.listdir(checkpoints) if d.startswith(".step_")]
        leftovers_seen += bool(hidden)
        resume = ["--resume", "auto"]

    # The last start removes the leftovers, resumes from the newest step folder and finishes.
    newest = newest_step()
    out = loom(exe, "train", *args, "--resume", "auto")
    assert f"at step {newest}" in out.stderr, out.stderr
    assert not [d for d in os.listdir(checkpoints) if d.startswith(".")], os.listdir(checkpoints)
    assert step_folders() == [f"step_{STEPS:08d}"], step_folders()
    steps = [m["step"] for m in metrics(run) if "train/loss" in m]
    assert steps == list(range(1, STEPS + 1)), "metrics.jsonl must hold every step once"
    print(f"{KILLS} kills during saving and pruning: every step folder complete after each; "
          f"{leftovers_seen} kill(s) left a half-written or half-deleted .step_* folder, removed by the next start")
finally:
    shutil.rmtree(work, ignore_errors=True)
print("kill -9 during pruning test passed")
