"""The lightweight transformer on Fashion-MNIST in plain Python PyTorch: the same model, data,
loss normalization, optimizer, clipping and schedule as `loom train`, written as a PyTorch user
would (torch.nn modules, torch.optim.AdamW with its defaults). Used by compare_fashion_mnist.py;
prints one JSON line with the throughput of each window of steps. With --compile the model runs
through torch.compile (default mode; the optimizer stays eager): the compilation happens in the
first step, which falls in the first window, and its time goes to stderr.

    python pytorch_vit.py --batch-size 8 --steps 300 --window 50 --threads 2
"""
import argparse
import gzip
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FMNIST = "/usr/share/datasets/fashion-mnist"


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    magic, count = int.from_bytes(data[0:4], "big"), int.from_bytes(data[4:8], "big")
    if magic == 0x803:
        return torch.from_numpy(np.frombuffer(data, np.uint8, offset=16).reshape(count, 1, 28, 28).copy())
    return torch.from_numpy(np.frombuffer(data, np.uint8, offset=8).astype(np.int64))


KERNELS = {"attention": "sdpa", "patch_embedding": "conv"}  # --kernels loom: Loom's CPU choices


class Attention(nn.Module):
    def __init__(self, d, heads, dropout):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        p = self.dropout if self.training else 0.0
        if KERNELS["attention"] == "math":  # as Loom's lightweight_transformer on CPU
            q, k, v = (t.transpose(1, 2) for t in self.qkv(x).view(b, n, 3, self.heads, d // self.heads).unbind(2))
            weights = F.dropout(torch.matmul(q * (d // self.heads) ** -0.5, k.transpose(-2, -1)).softmax(-1), p)
            out = torch.matmul(weights, v)
        else:
            q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    def __init__(self, d, heads, hidden, dropout):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(d), Attention(d, heads, dropout)
        self.norm2, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, hidden), nn.Linear(hidden, d)
        self.dropout = dropout

    def forward(self, x):
        x = x + F.dropout(self.attn(self.norm1(x)), self.dropout, self.training)
        h = F.gelu(self.fc1(self.norm2(x)))
        return x + F.dropout(self.fc2(F.dropout(h, self.dropout, self.training)), self.dropout, self.training)


class Vit(nn.Module):
    def __init__(self, layers, d, heads, mlp_ratio, dropout, patch, stem_channels, side=28, channels=1, classes=10):
        super().__init__()
        self.stem = nn.Conv2d(channels, stem_channels, 3, padding=1) if stem_channels else None
        self.patch_embed = nn.Conv2d(stem_channels or channels, d, patch, stride=patch)
        self.pos_embed = nn.Parameter(torch.zeros(1, (side // patch) ** 2, d))
        nn.init.normal_(self.pos_embed, 0.0, 0.02)
        self.blocks = nn.ModuleList(Block(d, heads, round(mlp_ratio * d), dropout) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, classes)
        self.dropout = dropout

    def forward(self, x):
        if self.stem is not None:
            x = F.gelu(self.stem(x))
        if KERNELS["patch_embedding"] == "matmul":  # as Loom's lightweight_transformer on CPU
            b, c, side, _ = x.shape
            p, g = self.patch_embed.kernel_size[0], side // self.patch_embed.kernel_size[0]
            patches = x.reshape(b, c, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(b, g * g, c * p * p)
            x = F.linear(patches, self.patch_embed.weight.view(self.patch_embed.out_channels, -1), self.patch_embed.bias)
        else:
            x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = F.dropout(x + self.pos_embed, self.dropout, self.training)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--window", type=int, default=50)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--d-model", type=int, default=96)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--mlp-ratio", type=float, default=2.0)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--patch", type=int, default=7)
    p.add_argument("--stem-channels", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "fp16_amp", "bf16_amp"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--data", default=FMNIST, help="folder of the Fashion-MNIST IDX files (default %(default)s)")
    p.add_argument("--profile", metavar="TRACE", help="profile the last --profile-steps steps with torch.profiler: "
                   "a Chrome trace to TRACE and the top operators by self time to stderr")
    p.add_argument("--profile-steps", type=int, default=20)
    p.add_argument("--kernels", choices=["pytorch", "loom"], default="pytorch",
                   help="pytorch: the model as a PyTorch user writes it (SDPA, Conv2d patches); loom: the same "
                   "model computed with the kernels Loom's plugin picks on CPU (attention as batched matmuls, "
                   "patches as one matmul)")
    p.add_argument("--compile", action="store_true", help="wrap the model in torch.compile (default mode); the "
                   "optimizer, clipping and loss stay eager")
    p.add_argument("--flops", action="store_true", help="print the training FLOPs per sample (forward + backward, "
                   "torch.utils.flop_counter) as JSON and exit")
    a = p.parse_args()
    if a.kernels == "loom":
        KERNELS.update(attention="math", patch_embedding="matmul")
    device = torch.device(a.device)
    # The same settings as Loom's precision plugins.
    tf32 = a.precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    autocast_dtype = {"fp16_amp": torch.float16, "bf16_amp": torch.bfloat16}.get(a.precision)
    scaler = torch.amp.GradScaler(device.type, enabled=a.precision == "fp16_amp")
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    images = read_idx(os.path.join(a.data, "train-images-idx3-ubyte.gz"))
    labels = read_idx(os.path.join(a.data, "train-labels-idx1-ubyte.gz"))
    if device.type == "cuda":
        images, labels = images.pin_memory(), labels.pin_memory()
    model = Vit(a.layers, a.d_model, a.heads, a.mlp_ratio, a.dropout, a.patch, a.stem_channels).to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "pos_embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "pos_embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=a.lr)
    warmup = int(0.05 * a.steps)

    def lr_at(step):  # linear warm-up then cosine, as loom's trainer.use_scheduler
        if step < warmup:
            return a.lr * (step + 1) / warmup
        return a.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, a.steps - warmup))))

    model.train()
    if a.flops:
        from torch.utils.flop_counter import FlopCounterMode
        x = torch.zeros(a.batch_size, 1, 28, 28, device=device)
        with FlopCounterMode(display=False) as counter:
            F.cross_entropy(model(x), torch.zeros(a.batch_size, dtype=torch.long, device=device),
                            reduction="sum").backward()
        print(json.dumps({"flops_per_sample": counter.get_total_flops() / a.batch_size}))
        return
    if a.compile:
        model = torch.compile(model)
    g = torch.Generator().manual_seed(a.seed)
    order = torch.randperm(len(images), generator=g)
    mean, std = 0.2860, 0.3530
    windows, losses = [], []
    profiler = None
    t0 = time.perf_counter()
    for step in range(a.steps):
        if a.profile and step == a.steps - a.profile_steps:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] +
                                              ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []))
            profiler.__enter__()
        start = (step * a.batch_size) % (len(images) - a.batch_size)
        idx = order[start:start + a.batch_size]
        x = (images[idx].to(device, non_blocking=True).float() / 255.0 - mean) / std
        y = labels[idx].to(device, non_blocking=True)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=False)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = model(x)
        loss_sum = F.cross_entropy(logits.float(), y, reduction="sum")
        scaler.scale(loss_sum / len(y)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        losses.append(loss_sum.item() / len(y))
        if step == 0:  # item() has waited for the device: the whole step (with --compile, the compilation too)
            first_step = time.perf_counter() - t0
            if a.compile:
                print(f"torch.compile: first step (compilation included) {first_step:.1f} s", file=sys.stderr,
                      flush=True)
        if (step + 1) % a.window == 0:
            t1 = time.perf_counter()
            windows.append(a.window * a.batch_size / (t1 - t0))
            t0 = t1
    if profiler is not None:
        profiler.__exit__(None, None, None)
        profiler.export_chrome_trace(a.profile)
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=30), file=sys.stderr)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    print(json.dumps({"windows": windows, "final_loss": sum(losses[-a.window:]) / a.window,
                      "threads": torch.get_num_threads(), "torch": torch.__version__, "device_peak": peak,
                      "first_step_s": first_step}))


if __name__ == "__main__":
    main()
