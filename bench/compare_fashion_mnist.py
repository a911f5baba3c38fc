"""Loom against the same model in plain Python PyTorch (same wheel, same thread count), side by
side: training samples/s and peak resident memory at micro-batch 8 and 128.

    build/bin/loom must exist (./loom builds it); run with the venv's Python:
    $(scripts/setup.sh --print-venv)/bin/python bench/compare_fashion_mnist.py [--steps 400]

Both train the lightweight transformer (3x3 conv stem of 16 channels, patch 7, d_model 96,
3 layers, 4 heads) on
Fashion-MNIST with AdamW, warm-up + cosine, clipping at 1.0. Throughput is measured over windows
of steps after the first (warm-up) window, training steps only; peak memory is the process's
maximum resident set (wait4). Each side runs --repeats times, interleaved; the table shows
medians and the Loom / PyTorch ratios.
"""
import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class RunFailed(Exception):
    pass


def run(cmd):
    """Runs cmd; returns (stdout, stderr, peak RSS in bytes)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
        if os.waitstatus_to_exitcode(status) != 0:
            tail = "\n".join((stdout + "\n" + stderr).strip().splitlines()[-40:])
            raise RunFailed(f"{' '.join(cmd)} failed (exit {os.waitstatus_to_exitcode(status)}):\n{tail}")
        return stdout, stderr, usage.ru_maxrss * 1024


def rate(windows):
    """Samples/s over the windows after the first (equal windows: harmonic mean)."""
    w = windows[1:] or windows
    return len(w) / sum(1.0 / r for r in w)


def loom(exe, batch, steps, window, threads, work, precision, device, data):
    name = f"bench_b{batch}_{precision}"
    shutil.rmtree(os.path.join(work, name), ignore_errors=True)  # a repeat: Loom refuses to write over a run
    args = [exe, "train", "--set", f"trainer.work_dir={work}", "--set", f"trainer.name={name}",
            "--set", f"data.path={data}", "--set", "data.validation_fraction=0",  # all of train, as the Python side
            "--set", "model.patch_size=7", "--set", "model.d_model=96", "--set", "model.num_layers=3",
            "--set", "model.num_heads=4", "--set", "model.dropout=0.0", "--set", "model.stem_channels=16",
            "--set", f"trainer.batch_size={batch}", "--set", f"trainer.max_steps={steps}",
            "--set", f"trainer.log_every={window}", "--set", "trainer.use_scheduler=true",
            "--set", "trainer.lr=2e-3", "--set", f"trainer.threads={threads}", "--set", f"trainer.device={device}",
            "--set", f"precision.name={precision}"]
    _, _, rss = run(args)
    with open(os.path.join(work, name, "metrics.jsonl")) as f:
        lines = [json.loads(l) for l in f]
    train = [l for l in lines if "train/samples_per_s" in l]
    peak = rss if device == "cpu" else max(l["memory/peak_bytes"] for l in train)
    return rate([l["train/samples_per_s"] for l in train]), train[-1]["train/loss"], peak


def pytorch(batch, steps, window, threads, precision, device, data):
    out, _, rss = run([sys.executable, os.path.join(HERE, "pytorch_vit.py"), "--batch-size", str(batch),
                       "--data", data,
                       "--steps", str(steps), "--window", str(window), "--threads", str(threads),
                       "--precision", precision, "--device", device])
    result = json.loads(out.strip().splitlines()[-1])
    peak = rss if device == "cpu" else result["device_peak"]
    return rate(result["windows"]), result["final_loss"], peak, result


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loom", default=os.path.join(ROOT, "build", "bin", "loom"))
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--window", type=int, default=50)
    p.add_argument("--batches", default="8,128")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--repeats", type=int, default=3, help="runs of each side, interleaved; medians are reported")
    p.add_argument("--precisions", default="fp32", help="comma-separated: fp32, tf32, fp16_amp, bf16_amp")
    p.add_argument("--device", default="cpu", help="cpu or cuda (memory: peak resident set on CPU, peak "
                   "allocated device memory on CUDA)")
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist",
                   help="folder of the Fashion-MNIST IDX files, for both sides (default %(default)s)")
    a = p.parse_args()
    import torch  # the same wheel Loom's LibTorch comes from

    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"machine: {cpu}, {os.cpu_count()} cores; torch {torch.__version__}; {a.threads} threads each; "
          f"{a.steps} steps, throughput over steps {a.window + 1}..{a.steps}")
    work = tempfile.mkdtemp(prefix="loom-bench-")
    rows = []
    failed = []  # a configuration that failed is reported and the others still run
    try:
        for precision in a.precisions.split(","):
            for batch in [int(b) for b in a.batches.split(",")]:
                runs = []
                try:
                    for _ in range(a.repeats):  # interleaved, so a noisy neighbour hits both sides alike
                        l_rate, l_loss, l_mem = loom(a.loom, batch, a.steps, a.window, a.threads, work, precision,
                                                      a.device, a.data)
                        p_rate, p_loss, p_mem, _ = pytorch(batch, a.steps, a.window, a.threads, precision, a.device,
                                                           a.data)
                        runs.append((l_rate, p_rate, l_mem, p_mem, l_loss, p_loss))
                        print(f"  {precision} batch {batch}: Loom {l_rate:.0f} samples/s, "
                              f"PyTorch {p_rate:.0f} samples/s", flush=True)
                except RunFailed as e:
                    print(f"  {precision} batch {batch}: FAILED\n{e}", flush=True)
                    failed.append(f"{precision} batch {batch}")
                    continue
                med = [statistics.median(r[i] for r in runs) for i in range(4)]
                rows.append((precision, batch, *med, runs[0][4], runs[0][5]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    mem = "peak RSS" if a.device == "cpu" else "peak alloc"
    print(f"{'precision':>9} | {'micro-batch':>11} | {'Loom samples/s':>14} | {'PyTorch samples/s':>17} | "
          f"{'Loom/PyTorch':>12} | {'Loom ' + mem:>15} | {'PyTorch ' + mem:>18} | {'mem ratio':>9} | "
          f"final loss Loom / PyTorch")
    for precision, batch, lr_, pr, lm, pm, ll, pl in rows:
        print(f"{precision:>9} | {batch:>11} | {lr_:>14.0f} | {pr:>17.0f} | {lr_ / pr:>11.2f}x | "
              f"{lm / 2**20:>11.0f} MiB | {pm / 2**20:>14.0f} MiB | {lm / pm:>8.2f}x | {ll:.3f} / {pl:.3f}")
    if failed:
        sys.exit("failed: " + ", ".join(failed))


if __name__ == "__main__":
    main()
