"""Model FLOPs in the training log (Note [Model FLOPs in the log], Model 2.2): what gpt2_lm and
the lightweight transformer declare per loss term, read back from a real run's metrics.jsonl
(train/tflops x 1e12 / loss terms per second), against an independent count: PyTorch's
FlopCounterMode over one forward of the same model written in plain PyTorch (bench/pytorch_gpt2.py,
bench/pytorch_vit.py). The declared figure is three times the forward's products; GPT-2's also
counts 6 FLOPs per token for each parameter that enters no product (position embeddings,
LayerNorms, biases), as PaLM and nanoGPT count. Then train/mfu is train/tflops over
trainer.peak_tflops, the progress line shows both, and a CPU run without a peak reports TFLOP/s
and no MFU. Needs the venv's torch (skipped without it)."""
import os
import sys

from common import SKIP, loom, metrics, workdir

exe, source = sys.argv[1], sys.argv[2]
try:
    import torch
    from torch.utils.flop_counter import FlopCounterMode
except ImportError:
    print("SKIP: torch is not importable here (scripts/setup.sh puts it in the venv)")
    sys.exit(SKIP)
sys.path.insert(0, os.path.join(source, "bench"))
import pytorch_gpt2  # noqa: E402  (bench/ on the path first)
import pytorch_vit  # noqa: E402

PEAK = 0.002  # TFLOP/s: any positive figure; train/mfu must be train/tflops over it


def expect(cond, what, result=None):
    if not cond:
        detail = f"\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}" if result is not None else ""
        raise SystemExit(f"FAIL: {what}{detail}")


def forward_flops(model, *inputs):
    model.eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(*inputs)
    return counter.get_total_flops()


def train(name, settings, peak=True):
    """Runs loom train; returns (the last log line's values, the process result)."""
    work = workdir()
    args = ["train", "--set", f"trainer.work_dir={work}", "--set", f"trainer.name={name}", "--set", "trainer.device=cpu",
            "--set", "trainer.max_steps=4", "--set", "trainer.log_every=2", "--set", "precision.name=fp32",
            "--set", "trainer.callbacks=progress,jsonl"] + settings
    if peak:
        args += ["--set", f"trainer.peak_tflops={PEAK}"]
    result = loom(exe, *args)
    logged = [m for m in metrics(os.path.join(work, name)) if "train/loss" in m]
    expect(logged, f"{name}: no training lines in metrics.jsonl", result)
    return logged[-1], result


def declared(values, terms_key):
    expect(values.get("train/tflops", 0) > 0, f"train/tflops in the log: {values}")
    return values["train/tflops"] * 1e12 / values[terms_key]


def close(a, b, what, rel=1e-9):
    expect(abs(a - b) <= rel * abs(b), f"{what}: {a} != {b} (relative difference {abs(a - b) / abs(b):.3g})")
    print(f"{what}: {a:.6g}, as expected")


# ---- GPT-2 (debug size): per token ---------------------------------------------------------------
VOCAB, SEQ = 256, 32
values, result = train("gpt2", ["--set", "model.name=gpt2_lm", "--set", "model.size=debug",
                                "--set", f"model.vocab_size={VOCAB}", "--set", "data.name=synthetic_tokens",
                                "--set", f"data.vocab_size={VOCAB}", "--set", f"data.seq_len={SEQ}",
                                "--set", "data.train_size=64", "--set", "data.test_size=8",
                                "--set", "data.validation_fraction=0", "--set", "trainer.batch_size=4"])
layers, heads, d, n_ctx = pytorch_gpt2.SIZES["debug"]
twin = pytorch_gpt2.Gpt2(VOCAB, n_ctx, layers, heads, d)
idx = torch.zeros(2, SEQ, dtype=torch.long)
per_token = forward_flops(twin, idx, idx) / idx.numel()
no_product = sum(p.numel() for name, p in twin.named_parameters()
                 if name.startswith("wpe") or ".ln_" in name or name.startswith("ln_") or name.endswith(".bias"))
close(declared(values, "train/loss_terms_per_s"), 3 * per_token + 6 * no_product, "gpt2_lm, per token")
close(values["train/mfu"], values["train/tflops"] / PEAK, "gpt2_lm, train/mfu x peak")
expect("TFLOP/s, MFU " in result.stderr, "the progress line shows TFLOP/s and MFU", result)
expect(f"MFU against {PEAK:g} TFLOP/s (trainer.peak_tflops)" in result.stderr,
       "the start-up report names the peak and where it comes from", result)

# ---- the lightweight transformer (stem, patches, 2 blocks): per sample -------------------------
vit = ["--set", "model.name=lightweight_transformer", "--set", "model.flavour=standard", "--set", "model.num_layers=2",
       "--set", "model.d_model=32", "--set", "model.num_heads=2", "--set", "model.mlp_ratio=2",
       "--set", "model.patch_size=7", "--set", "model.stem_channels=4", "--set", "data.name=synthetic",
       "--set", "data.image_size=28", "--set", "data.classes=4", "--set", "data.train_size=128",
       "--set", "data.test_size=16", "--set", "trainer.batch_size=16"]
values, result = train("vit", vit)
twin = pytorch_vit.Vit(layers=2, d=32, heads=2, mlp_ratio=2, dropout=0.0, patch=7, stem_channels=4, side=28,
                       channels=1, classes=4)
per_sample = forward_flops(twin, torch.zeros(3, 1, 28, 28)) / 3
close(declared(values, "train/samples_per_s"), 3 * per_sample, "lightweight_transformer, per sample")

# ---- no peak on a CPU: TFLOP/s, no MFU -----------------------------------------------------------
values, result = train("vit_no_peak", vit, peak=False)
expect("train/tflops" in values and "train/mfu" not in values, f"without a peak: TFLOP/s and no MFU: {values}")
expect("no peak known for cpu (give trainer.peak_tflops for an MFU)" in result.stderr,
       "the start-up report says why there is no MFU", result)

# ---- an absurd peak is refused by the option's range, naming the key ----------------------------
bad = loom(exe, "train", "--set", "trainer.peak_tflops=-5", "--set", "trainer.device=cpu", check=False)
expect(bad.returncode != 0 and "trainer.peak_tflops" in bad.stderr, "a negative peak is refused, naming the key", bad)
print("ok")
