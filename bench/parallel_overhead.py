"""What a parallel strategy costs on one device: `single` against `ddp` with a world of one (NCCL on
CUDA, Gloo on the CPU: the reduction runs, with no one to reduce with) and `data_parallel` over
that one device (replica bookkeeping with one replica); with two GPUs or more, both over two.
The default job's model on synthetic 28 x 28 images at global batch --batch.

    build/bin/loom must exist (scripts/build.sh).
    $(scripts/setup.sh --print-venv)/bin/python bench/parallel_overhead.py --device cuda [--steps 300] [--repeats 3]

Runs interleaved, --repeats times each; samples/s is the harmonic mean of the log windows after
the first, the table shows medians and the ratio to single measured in the same run.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from bench_common import cpu_name, rate, run

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def gpu_count():
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def gpu_name():
    r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return r.stdout.splitlines()[0].strip() if r.returncode == 0 and r.stdout.strip() else "unknown GPU"


def train(exe, a, work, name, extra, launch_ranks=0):
    shutil.rmtree(os.path.join(work, name), ignore_errors=True)
    args = ["train", "--set", f"trainer.work_dir={work}", "--set", f"trainer.name={name}",
            "--set", "data.name=synthetic", "--set", "data.image_size=28", "--set", f"data.train_size={a.train_size}",
            "--set", "data.test_size=256", "--set", f"trainer.batch_size={a.batch}", "--set", f"trainer.max_steps={a.steps}",
            "--set", f"trainer.log_every={a.window}", "--set", "trainer.eval_every=1000000",
            "--set", f"precision.name={a.precision}", "--set", "memory.estimate=false", *extra]
    if a.device == "cpu":
        args += ["--set", "trainer.threads=1"]
    cmd = [exe, "launch", "--nproc-per-node", str(launch_ranks), "--", *args] if launch_ranks else [exe, *args]
    run(cmd)
    with open(os.path.join(work, name, "metrics.jsonl")) as f:
        return rate([json.loads(l)["train/samples_per_s"] for l in f if "train/samples_per_s" in l])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loom", default=os.path.join(ROOT, "build", "bin", "loom"))
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--batch", type=int, default=128, help="global batch")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--window", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    a.train_size = max(4096, a.batch * a.steps)
    gpus = gpu_count() if a.device == "cuda" else 0
    if a.device == "cuda" and gpus == 0:
        sys.exit("--device cuda: no CUDA device visible to this Python's torch")
    one = "cuda:0" if a.device == "cuda" else "cpu"
    dev = ["--set", f"trainer.device={'auto' if a.device == 'cuda' else 'cpu'}"]
    configs = [("single", [*dev], 0),
               ("ddp, world 1", [*dev, "--set", "parallel.name=ddp"], 1),
               ("data_parallel, 1 device", ["--set", "parallel.name=data_parallel", "--set", f"parallel.devices={one}"], 0)]
    if gpus >= 2:
        configs += [("ddp, world 2", [*dev, "--set", "parallel.name=ddp"], 2),
                    ("data_parallel, 2 GPUs", ["--set", "parallel.name=data_parallel",
                                               "--set", "parallel.devices=cuda:0,cuda:1"], 0)]
    rates = {c[0]: [] for c in configs}
    work = tempfile.mkdtemp(prefix="loom-parallel-bench-")
    try:
        for r in range(a.repeats):
            for label, extra, ranks in configs:
                value = train(a.loom, a, work, label.split(",")[0] + str(len(rates[label])) + str(ranks), extra, ranks)
                rates[label].append(value)
                print(f"  repeat {r + 1}: {label}: {value:.0f} samples/s", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    machine = gpu_name() if a.device == "cuda" else f"{cpu_name()}, {os.cpu_count()} cores, one thread per process"
    print(f"\nMachine: {machine}; the default job's ViT on synthetic 28 x 28 images, {a.precision}, global batch "
          f"{a.batch}, {a.steps} steps, medians of {a.repeats} interleaved repeats.\n")
    print("| run | samples/s | against single | overhead per step (ms) |")
    print("| --- | --- | --- | --- |")
    for label, _, _ in configs:
        overhead = 1000 * (a.batch / med[label] - a.batch / med["single"])
        print(f"| {label} | {med[label]:.0f} | {med[label] / med['single']:.2f}x | {overhead:+.2f} |")


if __name__ == "__main__":
    main()
