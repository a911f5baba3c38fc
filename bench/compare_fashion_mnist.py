"""Loom against the same model in plain Python PyTorch (same wheel, same thread count), side by
side: training samples/s, GFLOP/s and their share of this machine's sgemm peak (on a GPU: of the
card's dense data-sheet peak at each precision, the model FLOPs utilization), and peak resident
memory at micro-batch 8 and 128.

    build/bin/loom must exist (./loom builds it); run with the venv's Python:
    $(scripts/setup.sh --print-venv)/bin/python bench/compare_fashion_mnist.py [--steps 400]
    ... --default-job --write-readme    # also the default job, and the table into bench/README.md

Three sides: Loom; the model as a PyTorch user writes it (`pytorch_vit.py`: SDPA, Conv2d
patches); and the same Python loop computing the model with the kernels Loom's plugin picks on
CPU (`--kernels loom`), which shows how much of the difference is Loom's runtime and how much its
kernel choice. FLOPs per sample are the model's training FLOPs as torch.utils.flop_counter counts
them (forward + backward, the PyTorch-as-written model); the sgemm peak is the best of 2048^3
float32 matrix products at the same thread count, measured before and after the runs (the table's
shares are against the best of them) and, for the default job, just before and after each run
(each run's share is also given against the mean of those two: on a shared machine whose speed
drifts by a third from one run to the next, a run and a peak measured twenty minutes apart do not compare).

Both train the lightweight transformer (3x3 conv stem of 16 channels, patch 7, d_model 96,
3 layers, 4 heads) on
Fashion-MNIST with AdamW, warm-up + cosine, clipping at 1.0. Throughput is measured over windows
of steps after the first (warm-up) window, training steps only; peak memory is the process's
maximum resident set (wait4). Each side runs --repeats times, interleaved; the table shows
medians and the Loom / PyTorch ratios.

--variants adds two more ways to run the same job, each timed like the others and set against
PyTorch eager in a second table: `loom_graph`, Loom with `step.cuda_graph=true` (CUDA only: Loom
refuses it on a CPU device, so on --device cpu it is skipped with a note), and
`pytorch_compile`, `pytorch_vit.py --compile` (torch.compile in default mode from the same wheel;
the compilation falls in the first window, which the throughput leaves out). `loom` and
`pytorch` are the two sides above and always run; a variant that fails is reported and the rest
of the configuration still runs.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

from bench_common import VARIANTS, RunFailed, card_peak_tflops, cpu_name, rate, run

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def loom(exe, batch, steps, window, threads, work, precision, device, data, cuda_graph=False):
    name = f"bench_b{batch}_{precision}" + ("_graph" if cuda_graph else "")
    shutil.rmtree(os.path.join(work, name), ignore_errors=True)  # a repeat: Loom refuses to write over a run
    args = [exe, "train", "--set", f"trainer.work_dir={work}", "--set", f"trainer.name={name}",
            "--set", f"data.path={data}", "--set", "data.validation_fraction=0",  # all of train, as the Python side
            "--set", "model.patch_size=7", "--set", "model.d_model=96", "--set", "model.num_layers=3",
            "--set", "model.num_heads=4", "--set", "model.dropout=0.0", "--set", "model.stem_channels=16",
            "--set", f"trainer.batch_size={batch}", "--set", f"trainer.max_steps={steps}",
            "--set", f"trainer.log_every={window}", "--set", "trainer.use_scheduler=true",
            "--set", "trainer.lr=2e-3", "--set", f"trainer.threads={threads}", "--set", f"trainer.device={device}",
            "--set", f"precision.name={precision}"] + (["--set", "step.cuda_graph=true"] if cuda_graph else [])
    _, _, rss = run(args)
    with open(os.path.join(work, name, "metrics.jsonl")) as f:
        lines = [json.loads(l) for l in f]
    train = [l for l in lines if "train/samples_per_s" in l]
    peak = rss if device == "cpu" else max(l["memory/peak_bytes"] for l in train)
    return rate([l["train/samples_per_s"] for l in train]), train[-1]["train/loss"], peak


def pytorch(batch, steps, window, threads, precision, device, data, kernels="pytorch", compiled=False):
    out, _, rss = run([sys.executable, os.path.join(HERE, "pytorch_vit.py"), "--batch-size", str(batch),
                       "--data", data, "--kernels", kernels,
                       "--steps", str(steps), "--window", str(window), "--threads", str(threads),
                       "--precision", precision, "--device", device] + (["--compile"] if compiled else []))
    result = json.loads(out.strip().splitlines()[-1])
    peak = rss if device == "cpu" else result["device_peak"]
    return rate(result["windows"]), result["final_loss"], peak, result


SGEMM = """
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
n = 2048
a, b = torch.randn(n, n), torch.randn(n, n)
for _ in range(3):
    a @ b
best = 0.0
for _ in range(10):
    start = time.perf_counter()
    a @ b
    best = max(best, 2 * n ** 3 / (time.perf_counter() - start) / 1e9)
print(best)
"""


def sgemm_peak(threads):
    """GFLOP/s of the best of ten 2048^3 float32 products at `threads` threads. In a child
    process, as everything that imports torch: a child forked from a parent that holds torch
    would report the parent's resident set as its own peak (Linux keeps the larger of the two
    across exec)."""
    out, _, _ = run([sys.executable, "-c", SGEMM, str(threads)])
    return float(out.strip().splitlines()[-1])


def flops_per_sample(data):
    out, _, _ = run([sys.executable, os.path.join(HERE, "pytorch_vit.py"), "--flops", "--batch-size", "16",
                     "--data", data])
    return json.loads(out.strip().splitlines()[-1])["flops_per_sample"]


def default_job(exe, threads, work):
    """`loom train` with the default configuration, as a user runs it: training samples/s and
    the test accuracy from its last lines."""
    shutil.rmtree(os.path.join(work, "default_job"), ignore_errors=True)  # a repeat: Loom refuses to write over a run
    args = [exe, "train", "--set", f"trainer.work_dir={work}", "--set", "trainer.name=default_job",
            "--set", f"trainer.threads={threads}"]
    out, err, rss = run(args)
    text = out + err
    import re
    rate = re.search(r"of training, (\d+) samples/s", text)
    acc = re.search(r"accuracy ([\d.]+) %", text.split("done", 1)[-1])
    if not rate or not acc:
        raise RunFailed("the default job's summary lines were not found:\n" + text[-2000:])
    return float(rate.group(1)), float(acc.group(1)), rss


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
    p.add_argument("--default-job", action="store_true",
                   help="also run the default job (`loom train`, 7 epochs, --default-job-repeats times, after "
                   "the comparison; medians): samples/s, share of the sgemm peak, test accuracy")
    p.add_argument("--default-job-repeats", type=int, default=3)
    p.add_argument("--variants", default="loom,pytorch",
                   help="comma-separated, from " + ", ".join(VARIANTS) + "; loom and pytorch are the two sides "
                   "and must be in the list; any other adds a row per configuration to a second table "
                   "(default %(default)s: that table is left out)")
    p.add_argument("--write-readme", action="store_true",
                   help="write the table into bench/README.md between its generated-table markers")
    a = p.parse_args()
    variants = a.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)} (valid: {', '.join(VARIANTS)})")
    if "loom" not in variants or "pytorch" not in variants:
        p.error(f"--variants {a.variants}: loom and pytorch must be in the list (the two sides of the "
                "comparison; the other variants are set against pytorch)")
    skipped = []  # notes on the variants left out, printed now and under the variants table
    if "loom_graph" in variants and a.device == "cpu":
        variants.remove("loom_graph")
        skipped.append("loom_graph skipped: step.cuda_graph captures CUDA graphs, and Loom refuses it on a "
                       "CPU device")
    extras = [v for v in variants if v not in ("loom", "pytorch")]
    # The same wheel Loom's LibTorch comes from; asked in a child, not imported (see sgemm_peak).
    torch_version = run([sys.executable, "-c", "import torch; print(torch.__version__)"])[0].strip().splitlines()[-1]

    card = None  # on CUDA: the card's name, whose dense peak per precision is the MFU's (bench_common.CARD_PEAKS)
    if a.device.startswith("cuda"):
        card = run([sys.executable, "-c", f"import torch; print(torch.cuda.get_device_name('{a.device}'))"])[0]
        card = card.strip().splitlines()[-1]
    machine = (f"{card + '; ' if card else ''}{cpu_name()}, {os.cpu_count()} cores; torch {torch_version}; "
               f"{a.threads} threads each; {a.steps} steps, throughput over steps {a.window + 1}..{a.steps}")
    print("machine:", machine)
    peak = sgemm_peak(a.threads) if a.device == "cpu" else None
    flops = flops_per_sample(a.data)
    print(f"model: {flops / 1e6:.2f} MFLOP per training sample"
          + (f"; sgemm peak {peak:.0f} GFLOP/s" if peak else ""), flush=True)
    for note in skipped:
        print(note, flush=True)
    work = tempfile.mkdtemp(prefix="loom-bench-")
    rows = []
    variant_rows = []  # (precision, batch, variant, (samples/s, / PyTorch eager, memory, loss) or None: failed)
    failed = []  # a configuration that failed is reported and the others still run
    job = None
    try:
        for precision in a.precisions.split(","):
            for batch in [int(b) for b in a.batches.split(",")]:
                runs = []
                extra_runs = {v: [] for v in extras}  # (samples/s, / PyTorch eager, memory, loss) per repeat
                extra_failed = set()  # not run again in the next repeats: it would fail the same way
                try:
                    for _ in range(a.repeats):  # interleaved, so a noisy neighbour hits all sides alike
                        l_rate, l_loss, l_mem = loom(a.loom, batch, a.steps, a.window, a.threads, work, precision,
                                                      a.device, a.data)
                        p_rate, p_loss, p_mem, _ = pytorch(batch, a.steps, a.window, a.threads, precision, a.device,
                                                           a.data)
                        # Loom's plugin picks other kernels than PyTorch's defaults on CPU only.
                        k_rate = pytorch(batch, a.steps, a.window, a.threads, precision, a.device, a.data,
                                         kernels="loom")[0] if a.device == "cpu" else float("nan")
                        runs.append((l_rate, p_rate, k_rate, l_mem, p_mem, l_loss, p_loss))
                        fields = ""
                        for v in extras:
                            if v in extra_failed:
                                continue
                            try:
                                if v == "loom_graph":
                                    v_rate, v_loss, v_mem = loom(a.loom, batch, a.steps, a.window, a.threads, work,
                                                                 precision, a.device, a.data, cuda_graph=True)
                                    first = ""
                                else:
                                    v_rate, v_loss, v_mem, result = pytorch(batch, a.steps, a.window, a.threads,
                                                                            precision, a.device, a.data,
                                                                            compiled=True)
                                    first = f" (first step, compilation included, {result['first_step_s']:.1f} s)"
                            except RunFailed as e:
                                print(f"  {precision} batch {batch}, {v}: FAILED\n{e}", flush=True)
                                failed.append(f"{v} {precision} batch {batch}")
                                extra_failed.add(v)
                                fields += f", {VARIANTS[v]} FAILED"
                                continue
                            extra_runs[v].append((v_rate, v_rate / p_rate, v_mem, v_loss))
                            fields += f", {VARIANTS[v]} {v_rate:.0f}{first}"
                        print(f"  {precision} batch {batch}: Loom {l_rate:.0f} samples/s, PyTorch {p_rate:.0f}, "
                              f"PyTorch with Loom's kernels {k_rate:.0f}{fields}", flush=True)
                except RunFailed as e:
                    print(f"  {precision} batch {batch}: FAILED\n{e}", flush=True)
                    failed.append(f"{precision} batch {batch}")
                    continue
                med = [statistics.median(r[i] for r in runs) for i in range(5)]
                # The ratio of each interleaved pair: a noisy neighbour slows both runs of a pair
                # alike, so the median of the pairs' ratios is steadier than the ratio of medians.
                ratio = statistics.median(r[0] / r[1] for r in runs)
                rows.append((precision, batch, *med, ratio, runs[0][5], runs[0][6]))
                if extras:
                    for v in variants:
                        if v == "loom":
                            r = (med[0], ratio, med[3], runs[0][5])
                        elif v == "pytorch":
                            r = (med[1], 1.0, med[4], runs[0][6])
                        elif v in extra_failed:  # a partial set of repeats would not be comparable
                            r = None
                        else:
                            r = (*(statistics.median(x[i] for x in extra_runs[v]) for i in range(3)),
                                 extra_runs[v][0][3])
                        variant_rows.append((precision, batch, v, r))
        if a.default_job:
            try:
                jobs, beside = [], []  # beside: each run's share of the peak measured just before and after it
                for _ in range(a.default_job_repeats):
                    before = sgemm_peak(a.threads)
                    jobs.append(default_job(a.loom, a.threads, work))
                    after = sgemm_peak(a.threads)
                    peak = max(peak, before, after)
                    beside.append(100 * jobs[-1][0] * flops / 1e9 / ((before + after) / 2))
                    print(f"  default job: {jobs[-1][0]:.0f} samples/s, test accuracy {jobs[-1][1]:.2f} %; sgemm peak "
                          f"{before:.0f} before, {after:.0f} after: {beside[-1]:.0f} % of their mean", flush=True)
                job = tuple(statistics.median(j[i] for j in jobs) for i in range(3))
            except RunFailed as e:
                print(f"  default job: FAILED\n{e}", flush=True)
                failed.append("default job")
        if a.device == "cpu":
            peak = max(peak, sgemm_peak(a.threads))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def share(rate, precision=None):
        """GFLOP/s and their share of the peak: this CPU's sgemm peak, or on CUDA the card's dense
        data-sheet peak at the row's precision (the model FLOPs utilization)."""
        top = peak
        if card is not None and precision is not None:
            top = (card_peak_tflops(card, precision) or 0) * 1e3 or None
        if not top:
            return f"{rate * flops / 1e9:.0f} (-)"
        return f"{rate * flops / 1e9:.0f} ({100 * rate * flops / 1e9 / top:.{1 if card else 0}f} %)"

    mem = "peak RSS" if a.device == "cpu" else "peak alloc"
    card_peaks = ""
    if card is not None:
        known = {p: card_peak_tflops(card, p) for p in a.precisions.split(",")}
        card_peaks = ("; the share of peak is the MFU against the card's dense data-sheet peak: " + ", ".join(
            f"{p} {t:g} TFLOP/s" for p, t in known.items() if t) if any(known.values())
            else f"; no data-sheet peak known for {card}")
    lines = [f"Machine: {machine}. Model: {flops / 1e6:.2f} MFLOP per training sample"
             + (f"; sgemm peak {peak:.0f} GFLOP/s (2048^3, {a.threads} threads)" if peak else "") + card_peaks + ".",
             "",
             f"| precision | micro-batch | Loom samples/s | PyTorch samples/s | Loom / PyTorch (pairs) | "
             f"PyTorch with Loom's kernels | Loom GFLOP/s (of peak) | PyTorch GFLOP/s (of peak) | "
             f"Loom {mem} | PyTorch {mem} | memory ratio | final loss Loom / PyTorch |",
             "|" + " --- |" * 12]
    for precision, batch, lr_, pr, kr, lm, pm, ratio, ll, pl in rows:
        lines.append(f"| {precision} | {batch} | {lr_:.0f} | {pr:.0f} | **{ratio:.2f}x** | {kr:.0f}".replace("nan", "-") + " | "
                     f"{share(lr_, precision)} | {share(pr, precision)} | {lm / 2**20:.0f} MiB | {pm / 2**20:.0f} MiB | {lm / pm:.2f}x | "
                     f"{ll:.3f} / {pl:.3f} |")
    if job:
        rate, acc, rss = job
        lines += ["", f"Default job (`loom train`, configs/fashion_mnist.ini, {a.threads} threads; medians of "
                  f"{a.default_job_repeats} runs): {rate:.0f} "
                  f"training samples/s, {share(rate)} GFLOP/s of the sgemm peak, test accuracy {acc:.2f} %, "
                  f"peak RSS {rss / 2**20:.0f} MiB. Each run against the sgemm peak measured just before and "
                  f"after it (the shared machine's speed drifts): "
                  + ", ".join(f"{b:.0f} %" for b in beside) + f" (median {statistics.median(beside):.0f} %)."]
    lines += ["", f"Medians of {a.repeats} interleaved repeats (Loom / PyTorch: the median of the {a.repeats} "
              "interleaved pairs' ratios, which a noisy neighbour affects least); "
              "`bench/compare_fashion_mnist.py --default-job --write-readme` regenerates this table."]
    if extras:
        lines += ["", "| precision | micro-batch | variant | samples/s | / PyTorch eager (pairs) | "
                  f"GFLOP/s (of peak) | {mem} | memory / PyTorch eager | final loss |", "|" + " --- |" * 9]
        eager_mem = {(r[0], r[1]): r[6] for r in rows}
        for precision, batch, v, r in variant_rows:
            if r is None:
                lines.append(f"| {precision} | {batch} | {VARIANTS[v]} | failed (see above) | - | - | - | - | - |")
                continue
            v_rate, v_ratio, v_mem, v_loss = r
            lines.append(f"| {precision} | {batch} | {VARIANTS[v]} | {v_rate:.0f} | **{v_ratio:.2f}x** | "
                         f"{share(v_rate, precision)} | {v_mem / 2**20:.0f} MiB | {v_mem / eager_mem[precision, batch]:.2f}x | "
                         f"{v_loss:.3f} |")
        lines += ["", f"Variants {', '.join(variants)}, each run in every interleaved repeat; / PyTorch eager: the "
                  "median of the repeats' ratios to the PyTorch eager run of the same repeat."]
    for note in skipped:
        lines += ["", note + "."]
    table = "\n".join(lines)
    print()
    print(table)
    if a.write_readme:
        readme = os.path.join(HERE, "README.md")
        text = open(readme).read()
        begin, end = "<!-- generated: compare_fashion_mnist.py -->", "<!-- end generated -->"
        if begin not in text or end not in text:
            sys.exit(f"{readme} has no {begin} ... {end} markers to write the table between")
        head, rest = text.split(begin, 1)
        text = head + begin + "\n" + table + "\n" + end + rest.split(end, 1)[1]
        with open(readme, "w") as f:
            f.write(text)
        print(f"\nwritten to {readme}")
    if failed:
        sys.exit("failed: " + ", ".join(failed))


if __name__ == "__main__":
    main()
