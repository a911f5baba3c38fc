"""GPT-2 trained in plain Python PyTorch, as a user writes it after nanoGPT: the model of Loom's
gpt2_lm plugin (the same modules, initialisation, tied head and loss), AdamW (fused on CUDA) with
GPT-2's betas and weight decay on the matrices and embeddings, warm-up then cosine as Loom's
trainer.use_scheduler, clipping at 1.0, bf16 autocast. Used by compare_gpt2.py; prints the tokens/s
of each window of steps and, last, one JSON line (tokens/s over the windows after the first, peak
memory, final loss, the first step's seconds). With --compile the model, loss included, runs
through torch.compile (default mode; the optimizer stays eager): the compilation falls in the
first step, the first window, which the tokens/s leave out.

    python pytorch_gpt2.py --device cuda --size gpt2 --vocab-size 50304 --seq-len 1024 --batch-size 8

With --accumulation N each step sums the gradients of N micro-batches of --batch-size sequences
(each micro-batch's loss divided by N) before clipping and the update, as Loom's
trainer.gradient_accumulation_steps does.
"""
import argparse
import json
import math
import resource
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from bench_common import GPT2_SIZES, add_gpt2_arguments, rate

# layers, heads, width, positions: as gpt2_lm's model.size (<loom/sdk/gpt2.hpp>).
SIZES = GPT2_SIZES


def synthetic_tokens(count, seq_len, vocab, noise, seed):
    """`count` sequences from a fixed random order-1 rule: the next token is perm[current] with
    probability 1 - noise, else uniform. Returns (input, target), [count, seq_len] each, the
    target the input shifted by one. Loom's synthetic_tokens dataset follows the same rule with
    its own generator, so the tokens differ; what a throughput comparison needs is the same shapes
    and a loss that falls alike, not the same numbers."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab, generator=g)
    tokens = torch.empty(count, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (count,), generator=g)
    for t in range(seq_len):
        follow = torch.rand(count, generator=g) >= noise
        tokens[:, t + 1] = torch.where(follow, perm[tokens[:, t]], torch.randint(vocab, (count,), generator=g))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class CausalSelfAttention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (p.view(b, t, self.heads, d // self.heads).transpose(1, 2) for p in self.c_attn(x).split(d, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class Mlp(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d), CausalSelfAttention(d, heads)
        self.ln_2, self.mlp = nn.LayerNorm(d), Mlp(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Gpt2(nn.Module):
    """Token ids [B, T] and targets [B, T] -> the mean next-token loss. Dropout is left out: the
    benchmark's Loom runs use model.dropout = 0, where it does nothing."""

    def __init__(self, vocab, n_ctx, layers, heads, d):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(n_ctx, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        residual = 0.02 / math.sqrt(2 * layers)
        for name, p in self.named_parameters():
            if "ln_" in name:
                continue  # LayerNorm: ones and zeros already
            if name.endswith(".bias"):
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, 0.0, residual if name.endswith("c_proj.weight") else 0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # the head tied to the embedding
        # The sum over the tokens divided by their count, as Loom normalizes a loss sum.
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum") / targets.numel()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_gpt2_arguments(p)
    p.add_argument("--train-size", type=int, default=512, help="sequences of training data (reshuffled each epoch)")
    p.add_argument("--noise", type=float, default=0.1, help="share of tokens drawn uniformly instead of by the rule")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--compile", action="store_true", help="wrap the model (loss included) in torch.compile "
                   "(default mode); the optimizer and clipping stay eager")
    a = p.parse_args()
    device = torch.device(a.device)
    precision = a.precision if a.precision != "auto" else ("bf16_amp" if device.type == "cuda" else "fp32")
    data_vocab = a.data_vocab_size or min(50257, a.vocab_size)
    if data_vocab > a.vocab_size:
        p.error(f"--data-vocab-size {data_vocab} is larger than --vocab-size {a.vocab_size}")
    layers, heads, d, n_ctx = SIZES[a.size]
    if a.seq_len > n_ctx:
        p.error(f"--seq-len {a.seq_len} is longer than {a.size}'s {n_ctx} positions")
    if a.steps < a.window:
        p.error(f"--steps {a.steps} is shorter than one --window of {a.window}")
    if a.accumulation < 1:
        p.error(f"--accumulation {a.accumulation}: at least 1")
    if a.train_size < a.batch_size * a.accumulation:
        p.error(f"--train-size {a.train_size} is smaller than one step's {a.batch_size} x {a.accumulation} sequences")
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    inputs, targets = synthetic_tokens(a.train_size, a.seq_len, data_vocab, a.noise, a.seed)
    inputs, targets = inputs.to(device), targets.to(device)  # a few MB: on the device once
    model = Gpt2(a.vocab_size, n_ctx, layers, heads, d).to(device)
    parameters = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices and embeddings, as gpt2_lm's decays()
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    warmup = int(0.05 * a.steps)

    def lr_at(step):  # linear warm-up then cosine to 0, as Loom's warmup_cosine
        if step < warmup:
            return a.lr * (step + 1) / warmup
        return a.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, a.steps - warmup))))

    model.train()
    if a.compile:
        model = torch.compile(model)
    g = torch.Generator().manual_seed(a.seed)
    order, position = torch.randperm(a.train_size, generator=g).to(device), 0
    tokens_per_step = a.batch_size * a.accumulation * a.seq_len
    windows = []
    window_loss = torch.zeros((), device=device)  # summed on the device: the host reads it once a window
    t0 = time.perf_counter()
    for step in range(a.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        for _ in range(a.accumulation):  # each micro-batch's mean loss / accumulation: the step's mean
            if position + a.batch_size > a.train_size:  # a new epoch; the incomplete last batch is dropped
                order, position = torch.randperm(a.train_size, generator=g).to(device), 0
            idx = order[position:position + a.batch_size]
            position += a.batch_size
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16_amp"):
                loss = model(inputs[idx], targets[idx]) / a.accumulation
            loss.backward()
            window_loss += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 0:  # item() waits for the device: the whole step (with --compile, the compilation too)
            window_loss.item()
            first_step = time.perf_counter() - t0
            if a.compile:
                print(f"torch.compile: first step (compilation included) {first_step:.1f} s", file=sys.stderr,
                      flush=True)
        if (step + 1) % a.window == 0:
            final_loss = window_loss.item() / a.window
            t1 = time.perf_counter()
            windows.append(a.window * tokens_per_step / (t1 - t0))
            print(f"step {step + 1}: {windows[-1]:.0f} tokens/s, loss {final_loss:.4f}", flush=True)
            window_loss.zero_()
            t0 = t1
    if device.type == "cuda":
        peak, memory = torch.cuda.max_memory_allocated(device), "peak allocated"
    else:
        peak, memory = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak RSS"
    print(json.dumps({"tokens_per_s": rate(windows), "windows": windows, "peak_memory": peak, "memory": memory,
                      "final_loss": final_loss, "first_step_s": first_step, "parameters": parameters,
                      "precision": precision, "torch": torch.__version__, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
