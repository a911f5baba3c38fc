"""ddp over NCCL and data_parallel on the GPUs this machine has, against single on one GPU: the same
global batch gives the same losses (fp32, TF32 off) over 20 steps. With one GPU: ddp with a world
of one (NCCL still reduces) and data_parallel over that GPU; with two or more, each over two GPUs
too, and data_parallel's progress line shows each device's memory. Skipped without a GPU."""
import os
import shutil
import sys

from common import SKIP, SMALL, close, loom, losses, workdir

exe = sys.argv[1]
try:
    import torch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
except ImportError:
    gpus = 0
if gpus == 0:
    print("SKIP: no CUDA device")
    sys.exit(SKIP)

GPU = [a if a != "trainer.device=cpu" else "trainer.device=auto" for a in SMALL]
BASE = [*GPU, "--set", "model.dropout=0", "--set", "precision.name=fp32", "--set", "trainer.max_steps=20"]


work = workdir()
try:
    args = [*BASE, "--set", f"trainer.work_dir={work}"]
    loom(exe, "train", *args, "--set", "trainer.name=single")
    single = losses(os.path.join(work, "single"))

    r = loom(exe, "launch", "--nproc-per-node", "1", "--", "train", *args, "--set", "parallel.name=ddp",
             "--set", "parallel.backend=nccl", "--set", "trainer.name=ddp1")
    close(losses(os.path.join(work, "ddp1")), single, "ddp over NCCL, world 1")
    print("ddp over NCCL with one rank = single")

    r = loom(exe, "train", *args, "--set", "parallel.name=data_parallel", "--set", "parallel.devices=cuda:0",
             "--set", "trainer.name=dp1")
    close(losses(os.path.join(work, "dp1")), single, "data_parallel on one GPU")
    print("data_parallel on one GPU = single")

    if gpus >= 2:
        r = loom(exe, "launch", "--nproc-per-node", "2", "--", "train", *args, "--set", "parallel.name=ddp",
                 "--set", "trainer.name=ddp2")
        assert "NCCL" in r.stderr or "nccl" in r.stderr, r.stderr[-2000:]
        close(losses(os.path.join(work, "ddp2")), single, "ddp over NCCL, world 2")
        r = loom(exe, "train", *args, "--set", "parallel.name=data_parallel", "--set", "parallel.devices=cuda:0,cuda:1",
                 "--set", "trainer.name=dp2")
        assert "cuda:1 " in r.stderr and "(peak" in r.stderr, r.stderr[-2000:]
        close(losses(os.path.join(work, "dp2")), single, "data_parallel on two GPUs")
        print("ddp over NCCL and data_parallel on two GPUs = single; per-device memory in the progress line")
    else:
        print("one GPU here: the two-GPU cases were not run")
finally:
    shutil.rmtree(work, ignore_errors=True)
print("parallel GPU test passed")
