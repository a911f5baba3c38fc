"""GPT-2 training four ways, side by side: Loom eager, Loom with CUDA graphs (step.cuda_graph), and
the same model in plain Python PyTorch from the same wheel, eager and through torch.compile
(`pytorch_gpt2.py`); and, on request, Loom eager without its fused operations (loom_unfused:
LOOM_FUSED_KERNELS=0, ATen's cross-entropy, LayerNorm and linear), with the fused cross-entropy
only (loom_ce_only), without the fused linear (loom_no_linear), and without the fused LayerNorm and
the residual adds inside it (loom_no_layer_norm), which show what each gains. Tokens/s, peak memory, final loss and model
FLOPs utilization (MFU) against the card's dense bf16 peak.

    build/bin/loom with the gpt2_lm and synthetic_tokens plugins must exist; on the GPU machine:
    $(scripts/setup.sh --print-venv)/bin/python bench/compare_gpt2.py --device cuda --size gpt2 \\
        --vocab-size 50304 --seq-len 1024 --batch-size 8 --steps 60 --window 10

--accumulation N sums N micro-batches of --batch-size sequences per update on both sides
(Loom's trainer.gradient_accumulation_steps): the shape llm.c trains GPT-2 in (64 x 1024 tokens
per micro-batch, 524288 per update), where the optimizer's pass over the weights and the host's
work per step are spread over many more tokens than at 8 x 1024. The GPU suite runs both
(bench-gpt2-large: 32 x 1024 x 4; bench-gpt2: 8 x 1024).

Both sides train on synthetic tokens from a fixed random order-1 rule (the same rule, each side
its own generator), with AdamW (lr 6e-4, betas 0.9 / 0.95, weight decay 0.1 on the matrices and
embeddings), warm-up then cosine, clipping at 1.0, bf16 autocast on CUDA. Throughput is measured
over windows of --window steps after the first (warm-up, CUDA graph capture, compilation);
Loom's windows time the training steps only, so its final evaluation and checkpoint stay out.
Peak memory: peak allocated device memory on CUDA, the process's peak resident set on CPU.
Each variant runs --repeats times, interleaved; the table shows medians and, against PyTorch
eager, the median of the repeats' ratios.

MFU = tokens/s x model FLOPs per token / peak FLOP/s, with model FLOPs per token
6 N + 12 n_layer n_embd T (PaLM, appendix B; nanoGPT's estimate_mfu): N counts every parameter,
the embeddings included and the tied head once; the second term is the attention's scores and
weighted sum, forward and backward, over T = --seq-len positions. The peak is --peak-tflops, or
the dense bf16 peak of a card recognised by name. Beside it, MFU as llm.c counts it
(gpt2_estimate_mfu: 6 N + 6 n_layer n_embd T, the causal mask halving the attention's work):
about 7 % lower for GPT-2 124M at T = 1024, the convention of llm.c's 38 % on an H100.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile

from bench_common import GPT2_SIZES, RunFailed, add_gpt2_arguments, card_peak_tflops, cpu_name, rate, run
from bench_common import VARIANTS as COMMON_VARIANTS

VARIANTS = dict(COMMON_VARIANTS, loom_unfused="Loom eager, no fused operations",
                loom_ce_only="Loom eager, fused cross-entropy only", loom_no_linear="Loom eager, no fused linear",
                loom_no_layer_norm="Loom eager, no fused LayerNorm (nor residual add)",
                loom_no_mlp="Loom eager, GELU not in cuBLASLt's epilogues")
# LOOM_FUSED_KERNELS of each Loom variant (<loom/sdk/cross_entropy.hpp>, <loom/sdk/layer_norm.hpp>)
FUSED = {"loom": None, "loom_graph": None, "loom_unfused": "0", "loom_ce_only": "cross_entropy",
         "loom_no_linear": "cross_entropy,embedding,layer_norm,mlp", "loom_no_layer_norm": "cross_entropy,embedding,linear,mlp",
         "loom_no_mlp": "cross_entropy,embedding,layer_norm,linear"}
DEFAULT_VARIANTS = list(COMMON_VARIANTS)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# layers, heads, width, positions: as gpt2_lm's model.size (<loom/sdk/gpt2.hpp>).
SIZES = GPT2_SIZES


def parameters(size, vocab):
    """GPT-2's parameters: token and position embeddings, per block two LayerNorms, c_attn, attn.c_proj,
    c_fc and mlp.c_proj with their biases, the final LayerNorm; the tied head adds none."""
    layers, _, d, n_ctx = SIZES[size]
    return vocab * d + n_ctx * d + layers * (12 * d * d + 13 * d) + 2 * d


def peak_tflops(device_name):
    """Dense bf16 tensor-core TFLOPS of the cards whose peak is known here (bench_common.CARD_PEAKS,
    the table Loom's own log uses)."""
    return card_peak_tflops(device_name, "bf16_amp")


# Loom's words for a component its loaded plugins lack (core/src/plugin_registry.cpp, require()).
MISSING_PLUGIN = re.compile(r"no (?:model|dataset) '[\w.-]+' in the loaded plugins|"
                            r"(?:model|dataset) '[\w.-]+' is not available: its plugin was refused")


class PluginMissing(Exception):
    pass


def loom(exe, a, data_vocab, threads, work, precision, variant):
    name = "bench_" + variant
    cuda_graph = variant == "loom_graph"
    shutil.rmtree(os.path.join(work, name), ignore_errors=True)  # a repeat: Loom refuses to write over a run
    args = [exe, "train", "--set", f"trainer.work_dir={work}", "--set", f"trainer.name={name}",
            "--set", "model.name=gpt2_lm", "--set", f"model.size={a.size}", "--set", f"model.vocab_size={a.vocab_size}",
            "--set", "model.dropout=0.0",
            "--set", "data.name=synthetic_tokens", "--set", f"data.vocab_size={data_vocab}",
            "--set", f"data.seq_len={a.seq_len}", "--set", f"data.train_size={a.train_size}",
            "--set", "data.validation_fraction=0",  # all of train, as the Python side
            "--set", f"trainer.batch_size={a.batch_size * a.accumulation}",
            "--set", f"trainer.gradient_accumulation_steps={a.accumulation}", "--set", f"trainer.max_steps={a.steps}",
            "--set", f"trainer.log_every={a.window}", "--set", "trainer.use_scheduler=true",
            "--set", "trainer.lr=6e-4", "--set", "optimizer.beta2=0.95", "--set", "optimizer.weight_decay=0.1",
            "--set", f"trainer.threads={threads}", "--set", f"trainer.device={a.device}",
            "--set", f"precision.name={precision}"] + (["--set", "step.cuda_graph=true"] if cuda_graph else [])
    if a.peak_tflops:  # Loom's own log then divides by the same peak
        args += ["--set", f"trainer.peak_tflops={a.peak_tflops}"]
    try:
        _, _, rss = run(args, env=None if FUSED[variant] is None else {"LOOM_FUSED_KERNELS": FUSED[variant]})
    except RunFailed as e:
        missing = MISSING_PLUGIN.search(str(e))
        if missing:
            raise PluginMissing(f"{exe} reports {missing.group(0)}: build (or rebuild) the gpt2_lm and "
                                "synthetic_tokens plugins")
        raise
    with open(os.path.join(work, name, "metrics.jsonl")) as f:
        lines = [json.loads(l) for l in f]
    train = [l for l in lines if "train/loss_terms_per_s" in l]
    # gpt2_lm's loss averages over the batch's tokens: Loom logs their rate as loss terms per second
    # (train/samples_per_s counts sequences).
    peak = rss if a.device == "cpu" else max(l["memory/peak_bytes"] for l in train)
    # Loom's log reports its own MFU per window (Note [Model FLOPs in the log]), with the same count
    # of FLOPs and the same peak: shown beside the script's figure, which it should match.
    logged = [l["train/mfu"] for l in train[1:] if "train/mfu" in l]
    if logged:
        print(f"    ({VARIANTS[variant]}: Loom's own log says MFU {100 * statistics.median(logged):.1f} %, the median "
              "of its windows after the first)", flush=True)
    return rate([l["train/loss_terms_per_s"] for l in train]), peak, train[-1]["train/loss"], None


def pytorch(a, data_vocab, threads, precision, compiled=False):
    out, _, _ = run([sys.executable, os.path.join(HERE, "pytorch_gpt2.py"), "--size", a.size,
                     "--vocab-size", str(a.vocab_size), "--data-vocab-size", str(data_vocab),
                     "--seq-len", str(a.seq_len), "--batch-size", str(a.batch_size), "--accumulation", str(a.accumulation),
                     "--steps", str(a.steps),
                     "--window", str(a.window), "--train-size", str(a.train_size), "--threads", str(threads),
                     "--precision", precision, "--device", a.device] + (["--compile"] if compiled else []))
    result = json.loads(out.strip().splitlines()[-1])
    if result["parameters"] != parameters(a.size, a.vocab_size):
        raise RunFailed(f"pytorch_gpt2.py has {result['parameters']} parameters, the MFU counts "
                        f"{parameters(a.size, a.vocab_size)}")
    return result["tokens_per_s"], result["peak_memory"], result["final_loss"], result["first_step_s"]


# The torch Loom's LibTorch comes from, and the card; asked in a child, not imported (bench_common).
INFO = """
import json, sys, torch
print(json.dumps({"torch": torch.__version__,
                  "device": torch.cuda.get_device_name(sys.argv[1]) if sys.argv[1].startswith("cuda") else None}))
"""


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loom", default=os.path.join(ROOT, "build", "bin", "loom"))
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="comma-separated, from " + ", ".join(VARIANTS)
                   + " (default: " + ",".join(DEFAULT_VARIANTS) + ")")
    p.add_argument("--repeats", type=int, default=3, help="runs of each variant, interleaved; medians are reported")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    add_gpt2_arguments(p)
    p.add_argument("--train-size", type=int, default=0, help="sequences of training data (0: --batch-size x "
                   "--accumulation x --steps, at least 512: one epoch covers the run, so Loom evaluates only at the end)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads of each side")
    p.add_argument("--peak-tflops", type=float, help="the card's dense bf16 peak in TFLOPS, for the MFU "
                   "(default: recognised from the card's name: H100 SXM and H200 989.4, H100 PCIe 756.5, "
                   "H100 and H200 NVL 835.5, A100 312; on CPU no MFU unless given)")
    a = p.parse_args()
    variants = a.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)} (valid: {', '.join(VARIANTS)})")
    if a.steps < 2 * a.window:
        p.error(f"--steps {a.steps}: at least two windows of {a.window} (the first is left out)")
    cuda = a.device.startswith("cuda")
    precision = a.precision if a.precision != "auto" else ("bf16_amp" if cuda else "fp32")
    data_vocab = a.data_vocab_size or min(50257, a.vocab_size)
    if a.accumulation < 1:
        p.error(f"--accumulation {a.accumulation}: at least 1")
    a.train_size = a.train_size or max(512, a.batch_size * a.accumulation * a.steps)
    layers, heads, d, n_ctx = SIZES[a.size]
    info = json.loads(run([sys.executable, "-c", INFO, a.device])[0].strip().splitlines()[-1])
    peak = a.peak_tflops or (peak_tflops(info["device"]) if cuda else None)  # a CPU's: only when given
    if cuda and peak is None:
        p.error(f"the dense bf16 peak of '{info['device']}' is not known here: give it with --peak-tflops")
    skipped = {}  # variant -> why it is left out
    if "loom_graph" in variants and not cuda:
        skipped["loom_graph"] = "step.cuda_graph captures CUDA graphs, and Loom refuses it on a CPU device"
    for v in FUSED:
        if v in variants and v not in skipped and not os.path.exists(a.loom):
            skipped[v] = f"no Loom binary at {a.loom} (./loom builds it)"

    n = parameters(a.size, a.vocab_size)
    flops = 6 * n + 12 * layers * d * a.seq_len
    flops_llmc = 6 * n + 6 * layers * d * a.seq_len  # llm.c's count (performance-anchors: its 38 % on an H100)
    device = info["device"] if cuda else f"{cpu_name()}, {os.cpu_count()} cores"
    setup = (f"Device: {device}; torch {info['torch']}; {a.threads} CPU threads each. GPT-2 {a.size} ({layers} layers, "
             f"{heads} heads, width {d}, {n_ctx} positions), vocabulary {a.vocab_size} (data {data_vocab}); "
             f"{a.batch_size} x {a.seq_len} tokens per micro-batch, "
             + (f"{a.accumulation} micro-batches ({a.batch_size * a.accumulation * a.seq_len} tokens) per step"
                if a.accumulation > 1 else "one per step") + f", {precision}; {a.steps} steps, throughput over steps "
             f"{a.window + 1}..{a.steps}."
             + (f" LOOM_FUSED_KERNELS={os.environ['LOOM_FUSED_KERNELS']} for Loom's variants without their own "
                "(scripts/fused_gate.py: a fused operation whose GPU test failed is off)."
                if "LOOM_FUSED_KERNELS" in os.environ else ""))
    formula = (f"Model FLOPs per token = 6 N + 12 n_layer n_embd T = 6 x {n:,} + 12 x {layers} x {d} x {a.seq_len} "
               f"= {flops / 1e6:.1f} MFLOP (N: all parameters, embeddings included, the tied head once). "
               + (f"MFU = tokens/s x FLOPs per token / {peak:g} TFLOPS ("
                  + ("--peak-tflops" if a.peak_tflops else f"the dense bf16 peak, recognised from '{device}'") + "); "
                  + f"llm.c's MFU counts 6 N + 6 n_layer n_embd T = {flops_llmc / 1e6:.1f} MFLOP per token."
                  if peak else "MFU: none on CPU without --peak-tflops."))
    print(setup)
    print(formula, flush=True)
    for v, why in skipped.items():
        print(f"{v} skipped: {why}", flush=True)

    work = tempfile.mkdtemp(prefix="loom-bench-gpt2-")
    runs = {v: [] for v in variants}  # (tokens/s, peak memory, final loss) per repeat
    failed = {}
    eager = []  # PyTorch eager's tokens/s per repeat, None where it failed
    try:
        for repeat in range(a.repeats):  # interleaved, so a noisy neighbour hits all variants alike
            eager_rate = None
            fields = []
            for v in variants:
                if v in skipped or v in failed:  # not run again: it would fail the same way
                    continue
                try:
                    if v.startswith("loom"):
                        result = loom(a.loom, a, data_vocab, a.threads, work, precision, v)
                    else:
                        result = pytorch(a, data_vocab, a.threads, precision, compiled=v == "pytorch_compile")
                except PluginMissing as e:
                    skipped[v] = str(e)
                    print(f"  {v} skipped: {e}", flush=True)
                    continue
                except RunFailed as e:
                    failed[v] = str(e)
                    print(f"  {v}: FAILED\n{e}", flush=True)
                    continue
                tokens, memory, loss, first = result
                runs[v].append((repeat, tokens, memory, loss))
                if v == "pytorch":
                    eager_rate = tokens
                compiled = f" (first step, compilation included, {first:.1f} s)" if v == "pytorch_compile" else ""
                fields.append(f"{VARIANTS[v]} {tokens:.0f}{compiled}")
                # each figure as soon as it is measured: a run cut short (a lent GPU's budget) keeps it
                mfu = (f", MFU {100 * tokens * flops / (peak * 1e12):.1f} % "
                       f"(llm.c's count {100 * tokens * flops_llmc / (peak * 1e12):.1f} %)" if peak else "")
                print(f"    {VARIANTS[v]}: {tokens:.0f} tokens/s{mfu}, peak {memory / 2**20:.0f} MiB{compiled}", flush=True)
            eager.append(eager_rate)
            print(f"  repeat {repeat + 1}: tokens/s " + ", ".join(fields), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    mem = "peak allocated" if cuda else "peak RSS"
    lines = [setup, "", formula, "",
             f"| variant | tokens/s | / PyTorch eager | {mem} | final loss | MFU | MFU, llm.c's count |",
             "|" + " --- |" * 7]
    for v in variants:
        if v in skipped or v in failed:  # a partial set of repeats would not be comparable
            why = "skipped (see below)" if v in skipped else "failed (see above)"
            lines.append(f"| {VARIANTS[v]} | {why} | - | - | - | - | - |")
            continue
        tokens = statistics.median(r[1] for r in runs[v])
        memory = statistics.median(r[2] for r in runs[v])
        ratios = [r[1] / eager[r[0]] for r in runs[v] if eager[r[0]]]
        ratio = f"**{statistics.median(ratios):.2f}x**" if ratios else "-"
        mfu = f"{100 * tokens * flops / (peak * 1e12):.1f} %" if peak else "-"
        mfu_llmc = f"{100 * tokens * flops_llmc / (peak * 1e12):.1f} %" if peak else "-"
        lines.append(f"| {VARIANTS[v]} | {tokens:.0f} | {ratio} | {memory / 2**20:.0f} MiB | {runs[v][0][3]:.3f} | "
                     f"{mfu} | {mfu_llmc} |")
    lines += ["", f"Medians of {a.repeats} interleaved repeats; / PyTorch eager: the median of the repeats' ratios "
              "to the PyTorch eager run of the same repeat; final loss: the last window's mean, first repeat."]
    lines += [f"{VARIANTS[v]} skipped: {why}." for v, why in skipped.items() if v in variants]
    print()
    print("\n".join(lines))
    if failed:
        sys.exit("failed: " + ", ".join(failed))


if __name__ == "__main__":
    main()
