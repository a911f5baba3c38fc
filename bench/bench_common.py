"""What the side-by-side benchmarks (compare_fashion_mnist.py, compare_gpt2.py) share: running a
side in a child process with its peak resident memory, the steady throughput of a run's windows,
the variants' names and the CPU's name. Standard library only: a script that imports torch
itself would lend its resident set to every child it starts (see compare_fashion_mnist.sgemm_peak).
"""
import os
import platform
import subprocess
import tempfile


class RunFailed(Exception):
    pass


def run(cmd, env=None):
    """Runs cmd (with env added to this process's environment); returns (stdout, stderr, peak RSS in bytes)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=dict(os.environ, **env) if env else None)
        _, status, usage = os.wait4(proc.pid, 0)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
        if os.waitstatus_to_exitcode(status) != 0:
            tail = "\n".join((stdout + "\n" + stderr).strip().splitlines()[-40:])
            raise RunFailed(f"{' '.join(cmd)} failed (exit {os.waitstatus_to_exitcode(status)}):\n{tail}")
        return stdout, stderr, usage.ru_maxrss * 1024


# --variants: the name on the command line and in the variants table.
VARIANTS = {"loom": "Loom eager", "loom_graph": "Loom with CUDA graphs", "pytorch": "PyTorch eager",
            "pytorch_compile": "PyTorch torch.compile"}


def rate(windows):
    """Throughput over the windows after the first (equal windows: harmonic mean). The first
    holds the warm-up: allocator growth, a CUDA graph's capture, torch.compile's compilation."""
    w = windows[1:] or windows
    return len(w) / sum(1.0 / r for r in w)


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "cpu"


# Dense peaks in TFLOP/s from NVIDIA's data sheets (the sparse figures halved), per precision: the
# 16-bit tensor cores under bf16/fp16 autocast, TF32's, plain FP32. The table Loom's own log uses
# (core/src/throughput.cpp, Note [Model FLOPs in the log]). (name part, part it must not have,
# one of these parts or None) -> (16-bit, tf32, fp32). The SXM H100 names its HBM3.
CARD_PEAKS = [
    ("H100", None, ("HBM3", "SXM"), (989.4, 494.7, 66.9)),
    ("H100", None, ("PCIe",), (756.5, 378.0, 51.2)),
    ("H100", None, ("NVL",), (835.5, 417.5, 60.0)),
    ("H200", "NVL", None, (989.4, 494.7, 66.9)),
    ("H200", None, ("NVL",), (835.5, 417.5, 60.0)),
    ("A100", None, None, (312.0, 156.0, 19.5)),
]


def card_peak_tflops(device_name, precision="bf16_amp"):
    """The card's dense peak for a Loom precision (fp32, tf32, fp16_amp, bf16_amp) in TFLOP/s, or
    None for a card not in CARD_PEAKS."""
    for part, exclude, one_of, peaks in CARD_PEAKS:
        if part not in device_name or (exclude and exclude in device_name):
            continue
        if one_of and not any(o in device_name for o in one_of):
            continue
        return peaks[0] if precision in ("bf16_amp", "fp16_amp") else peaks[1] if precision == "tf32" else peaks[2]
    return None


# GPT-2 sizes (layers, heads, width, positions), as Loom's gpt2_lm has them.
GPT2_SIZES = {"gpt2": (12, 12, 768, 1024), "gpt2-medium": (24, 16, 1024, 1024), "debug": (2, 2, 64, 256)}


def add_gpt2_arguments(p):
    """The GPT-2 benchmark's model and data shape, the same for Loom's side and PyTorch's."""
    p.add_argument("--size", choices=list(GPT2_SIZES), default="gpt2")
    p.add_argument("--vocab-size", type=int, default=50304, help="the model's token embeddings (%(default)s: "
                   "GPT-2's 50257 padded to a multiple of 64)")
    p.add_argument("--data-vocab-size", type=int, default=0, help="tokens the data uses (0: the smaller of 50257 "
                   "and --vocab-size)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch (one forward and backward)")
    p.add_argument("--accumulation", type=int, default=1, help="micro-batches whose gradients one update sums "
                   "(tokens per step: batch size x accumulation x sequence length)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--precision", choices=["auto", "bf16_amp", "fp32"], default="auto",
                   help="auto: bf16_amp on CUDA, fp32 on CPU")
