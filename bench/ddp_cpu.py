"""parallel = ddp on the CPU: one process against two (one thread each, Gloo over loopback), the
default job's model on synthetic 28 x 28 images at global batch --batch, and how much of the
gradients' all-reduce the buckets hide behind backward.

    build/bin/loom must exist (scripts/build.sh).
    $(scripts/setup.sh --print-venv)/bin/python bench/ddp_cpu.py [--steps 300] [--repeats 3]

Runs, interleaved, --repeats times each (samples/s: the harmonic mean of the log windows after
the first; the table shows medians):
  single          one process, global batch B;
  single B/2      one process at B/2: the compute one rank of two does per step;
  ddp after       two processes, B/2 each, the gradients summed after backward (parallel.bucket_mb=0);
  ddp one bucket  two processes, the default 25 MiB buckets (this model: one bucket, started when
                  backward ends);
  ddp buckets     two processes, --bucket-mb buckets, started while backward runs.
A rank's step is its compute (single B/2's step) plus what communication it waits for; the share
of the all-reduce hidden is 1 - (ddp buckets' step - single B/2's step) / (ddp after's step -
single B/2's step). Two processes on two cores compete for memory bandwidth too, so the compute
per rank is not quite single B/2's; the figure is an estimate, stated as such.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

from bench_common import cpu_name, rate, run

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def loom(exe, a, work, name, batch, ranks, bucket_mb=None):
    shutil.rmtree(os.path.join(work, name), ignore_errors=True)
    args = ["train", "--set", f"trainer.work_dir={work}", "--set", f"trainer.name={name}",
            "--set", "data.name=synthetic", "--set", "data.image_size=28", "--set", f"data.train_size={a.train_size}",
            "--set", "data.test_size=256", "--set", f"trainer.batch_size={batch}", "--set", f"trainer.max_steps={a.steps}",
            "--set", f"trainer.log_every={a.window}", "--set", "trainer.threads=1", "--set", "trainer.device=cpu",
            "--set", "trainer.eval_every=1000000", "--set", "precision.name=fp32", "--set", "memory.estimate=false"]
    if ranks > 1:
        args += ["--set", "parallel.name=ddp", "--set", f"parallel.bucket_mb={bucket_mb}"]
        cmd = [exe, "launch", "--nproc-per-node", str(ranks), "--", *args]
    else:
        cmd = [exe, *args]
    _, err, _ = run(cmd)
    with open(os.path.join(work, name, "metrics.jsonl")) as f:
        train = [json.loads(l) for l in f if "train/samples_per_s" in l]
    note = next((l.split("parallel  ", 1)[1].strip() for l in err.splitlines() if "started during backward" in l), "")
    return rate([l["train/samples_per_s"] for l in train]), note


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loom", default=os.path.join(ROOT, "build", "bin", "loom"))
    p.add_argument("--batch", type=int, default=128, help="global batch")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--window", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=0.25, help="the overlapped runs' bucket size")
    a = p.parse_args()
    a.train_size = max(4096, a.batch * a.steps)
    configs = [("single", a.batch, 1, None), (f"single {a.batch // 2}", a.batch // 2, 1, None),
               ("ddp after", a.batch, 2, 0), ("ddp one bucket", a.batch, 2, 25),
               ("ddp buckets", a.batch, 2, a.bucket_mb)]
    rates = {c[0]: [] for c in configs}
    notes = {}
    work = tempfile.mkdtemp(prefix="loom-ddp-bench-")
    try:
        for r in range(a.repeats):
            for label, batch, ranks, bucket in configs:
                value, note = loom(a.loom, a, work, label.replace(" ", "_"), batch, ranks, bucket)
                rates[label].append(value)
                notes[label] = note
                print(f"  repeat {r + 1}: {label}: {value:.0f} samples/s", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    # Per-step seconds of one rank: its share of the global batch over the job's rate.
    step = {k: (a.batch / med[k]) for k in med}
    half = f"single {a.batch // 2}"
    compute = (a.batch // 2) / med[half]
    exposed_after = step["ddp after"] - compute
    exposed_buckets = step["ddp buckets"] - compute
    hidden = 1 - exposed_buckets / exposed_after if exposed_after > 0 else float("nan")
    print(f"\nMachine: {cpu_name()}, {os.cpu_count()} cores; one thread per process; the default job's ViT on "
          f"synthetic 28 x 28 images, global batch {a.batch}, {a.steps} steps, medians of {a.repeats} interleaved "
          f"repeats.\n")
    print("| run | processes | samples/s | against single | step (ms) | note |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, batch, ranks, bucket in configs:
        print(f"| {label} | {ranks} | {med[label]:.0f} | {med[label] / med['single']:.2f}x | "
              f"{1000 * (batch / med[label] if ranks == 1 else step[label]):.1f} | {notes.get(label, '')} |")
    print(f"\nA rank's compute (single at {a.batch // 2}): {1000 * compute:.1f} ms per step; communication waited for: "
          f"{1000 * exposed_after:.1f} ms after backward, {1000 * exposed_buckets:.1f} ms with {a.bucket_mb} MiB buckets: "
          f"about {100 * hidden:.0f} % of the all-reduce hidden behind backward (an estimate: see the docstring).")


if __name__ == "__main__":
    main()
