"""parallel = data_parallel on two CPU replicas (parallel.devices = cpu,cpu): one process trains as
`single` does with the same global batch (losses, weights, the test evaluation), with gradient
accumulation too; a run stopped with data_parallel resumes with single where the run that never
stopped is; wrong device lists are refused with one clear error."""
import os
import re
import shutil
import signal
import subprocess
import sys
import time

from common import SMALL, close, loom, losses, metrics, workdir

exe = sys.argv[1]
BASE = [*SMALL, "--set", "model.dropout=0", "--set", "trainer.threads=1"]
DP = ["--set", "parallel.name=data_parallel", "--set", "parallel.devices=cpu,cpu"]


def test_values(run):
    return {k: v for m in metrics(run) for k, v in m.items() if k.startswith("test/")}


def weights(run):
    from safetensors.numpy import load_file
    step = sorted(d for d in os.listdir(os.path.join(run, "checkpoints")) if d.startswith("step_"))[-1]
    return load_file(os.path.join(run, "checkpoints", step, "model.safetensors"))


def refused(what, *args, says):
    r = loom(exe, "train", *args, check=False, timeout=120)
    assert r.returncode != 0 and says in r.stderr, f"{what}: {r.returncode}\n{r.stderr[-2000:]}"
    assert "Traceback" not in r.stderr and "terminate called" not in r.stderr, r.stderr[-2000:]
    print(f"refused: {what}")


work = workdir()
try:
    args = [*BASE, "--set", f"trainer.work_dir={work}", "--set", "trainer.max_steps=20"]

    # 1. Two replicas of 16 samples each = one model on 32: losses, test metrics, weights.
    loom(exe, "train", *args, "--set", "trainer.name=single")
    r = loom(exe, "train", *args, *DP, "--set", "trainer.name=dp")
    assert "batch 32 = 16 x 1 x 2" in r.stderr, r.stderr[-3000:]
    assert "cpu, cpu" in r.stderr, r.stderr[-3000:]
    # Both replicas' activations share the CPU's one budget: the estimate counts them both (it
    # counted one, 37 % under, and a plan that auto_batch found to fit ran out of memory at step 1).
    error = re.search(r"memory estimate: predicted peak .* \(error (-?[0-9.]+) %\)", r.stderr)
    assert error and abs(float(error.group(1))) < 10, r.stderr[-3000:]
    single = losses(os.path.join(work, "single"))
    close(losses(os.path.join(work, "dp")), single, "data_parallel x 2 against single")
    close(test_values(os.path.join(work, "dp")), test_values(os.path.join(work, "single")), "test metrics")
    # As in integration.ddp: within 1e-5 of single's, except where single differs from itself as
    # much (a parameter whose true gradient is zero moves by rounding noise under AdamW).
    loom(exe, "train", *args, "--set", "trainer.name=single_2t", "--set", "trainer.threads=2")
    ws, wd, wt = (weights(os.path.join(work, n)) for n in ("single", "dp", "single_2t"))
    assert sorted(ws) == sorted(wd)
    for k in ws:
        diff, noise = float(abs(ws[k] - wd[k]).max()), float(abs(ws[k] - wt[k]).max())
        assert diff <= max(1e-5, 4 * noise), f"{k}: data_parallel differs from single by {diff} (noise {noise})"
    print("data_parallel on cpu,cpu = single over 20 steps: losses, test metrics, weights")

    # 2. With accumulation: 32 = 8 x 2 x 2 against single's 16 x 2.
    acc = [*args, "--gradient-accumulation-steps", "2"]
    loom(exe, "train", *acc, "--set", "trainer.name=single_acc")
    r = loom(exe, "train", *acc, *DP, "--set", "trainer.name=dp_acc")
    assert "batch 32 = 8 x 2 x 2" in r.stderr, r.stderr[-3000:]
    close(losses(os.path.join(work, "dp_acc")), losses(os.path.join(work, "single_acc")), "with accumulation")
    print("data_parallel with accumulation 2 = single with accumulation 2")

    # 3. Three replicas: 48 = 16 x 1 x 3; each micro-batch of 48 is cut 16/16/16. The test split
    # of 49 ends with a batch of one sample, which only the first replica gets.
    three = [*BASE, "--set", f"trainer.work_dir={work}", "--set", "trainer.max_steps=10", "--set", "trainer.batch_size=48",
             "--set", "data.test_size=49"]
    loom(exe, "train", *three, "--set", "trainer.name=single_48")
    loom(exe, "train", *three, *DP[:2], "--set", "parallel.devices=cpu,cpu,cpu", "--set", "trainer.name=dp3")
    close(losses(os.path.join(work, "dp3")), losses(os.path.join(work, "single_48")), "three replicas")
    close(test_values(os.path.join(work, "dp3")), test_values(os.path.join(work, "single_48")), "three replicas, test")
    print("data_parallel on three CPU replicas = single (the test split's last batch of one sample included)")

    # 4. Stopped (SIGINT: a checkpoint) with data_parallel, resumed with single: the data position
    # and the rest go on as in the run that never stopped.
    long = [*BASE, "--set", f"trainer.work_dir={work}", "--set", "trainer.max_steps=120"]
    loom(exe, "train", *long, "--set", "trainer.name=straight")
    p = subprocess.Popen([exe, "train", *long, *DP, "--set", "trainer.name=switched"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    jsonl = os.path.join(work, "switched", "metrics.jsonl")
    deadline = time.time() + 120
    while not (os.path.exists(jsonl) and sum(1 for _ in open(jsonl)) >= 10):
        assert time.time() < deadline and p.poll() is None, "the data_parallel run did not train"
        time.sleep(0.02)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, (p.returncode, err[-2000:])
    last = max(int(d[5:]) for d in os.listdir(os.path.join(work, "switched", "checkpoints")) if d.startswith("step_"))
    assert last < 120, last
    loom(exe, "train", *long, "--set", "trainer.name=switched", "--resume", "auto")
    resumed = losses(os.path.join(work, "switched"))
    straight = losses(os.path.join(work, "straight"))
    close({s: v for s, v in resumed.items() if s > last}, {s: v for s, v in straight.items() if s > last},
          "data_parallel stopped, single resumed")
    print(f"data_parallel stopped after step {last}, resumed with single: steps {last + 1}..120 as the run that never stopped")

    # 5. Device lists that cannot work: one error each, naming the key.
    refused("auto without GPUs", *args, "--set", "parallel.name=data_parallel", "--set", "trainer.name=e1",
            says="parallel.devices = cpu,cpu")
    refused("a device type mixed", *args, *DP[:2], "--set", "parallel.devices=cpu,cuda:0", "--set", "trainer.name=e2",
            says="parallel.devices")
    refused("not a device", *args, *DP[:2], "--set", "parallel.devices=cpu,gpu7", "--set", "trainer.name=e3",
            says="parallel.devices = 'gpu7' is not a device")
    refused("a global batch the devices do not divide", *args, *DP[:2], "--set", "parallel.devices=cpu,cpu,cpu",
            "--set", "trainer.name=e4", says="world size 3")
finally:
    shutil.rmtree(work, ignore_errors=True)
print("data_parallel test passed")
