"""The lightweight transformer's kernel choices on CPU, timed forward + backward at its shapes:
scaled_dot_product_attention against Q K^T, softmax, times V as three batched products, over
sequence lengths; the patch embedding as a strided Conv2d against one matrix product over the
patches (the same weights); with the 3x3 stem before it, the stem as a convolution whose output
is cut into patches against the stem computed in patch order (Note [Stem and patches in patch
order]), timed interleaved. Medians of repeated timings, same wheel as Loom.

    $(scripts/setup.sh --print-venv)/bin/python bench/attention_kernels.py [--threads 2]
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def timed(fn, repeats=20):
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def attention(batch, heads, tokens, head_dim):
    q, k, v = (torch.randn(batch, heads, tokens, head_dim, requires_grad=True) for _ in range(3))

    def sdpa():
        out = F.scaled_dot_product_attention(q, k, v)
        out.backward(torch.ones_like(out))

    def math():
        weights = torch.matmul(q * head_dim ** -0.5, k.transpose(-2, -1)).softmax(-1)
        out = torch.matmul(weights, v)
        out.backward(torch.ones_like(out))

    return timed(sdpa), timed(math)


def patch_embedding(batch, channels, side, patch, d_model):
    x = torch.randn(batch, channels, side, side, requires_grad=True)
    conv = torch.nn.Conv2d(channels, d_model, patch, stride=patch)
    g = side // patch

    def as_conv():
        conv(x).flatten(2).transpose(1, 2).sum().backward()

    def as_matmul():
        patches = x.reshape(batch, channels, g, patch, g, patch).permute(0, 2, 4, 1, 3, 5).reshape(batch, g * g, -1)
        F.linear(patches, conv.weight.view(d_model, -1), conv.bias).sum().backward()

    return timed(as_conv), timed(as_matmul)


def stem_and_patches(batch, channels, side, patch, stem, d_model, rounds=15):
    """Stem (3x3, `stem` channels, GELU) and patch embedding, forward and backward, the input
    without a gradient: the two ways, interleaved in `rounds` rounds of 10 steps."""
    x = torch.randn(batch, channels, side, side)
    sw, sb = torch.randn(stem, channels, 3, 3, requires_grad=True), torch.randn(stem, requires_grad=True)
    pw, pb = torch.randn(d_model, stem, patch, patch, requires_grad=True), torch.randn(d_model, requires_grad=True)
    g, padded = side // patch, side + 2
    index = torch.arange(channels * padded * padded).view(channels, padded, padded)
    index = index.unfold(1, 3, 1).unfold(2, 3, 1).reshape(channels, g, patch, g, patch, 3, 3)
    index = index.permute(1, 3, 2, 4, 0, 5, 6).reshape(-1)  # (gy, gx, py, px, C, ky, kx)
    grad = torch.randn(batch, g * g, d_model)

    def as_conv():
        y = F.gelu(F.conv2d(x, sw, sb, padding=1))
        patches = y.reshape(batch, stem, g, patch, g, patch).permute(0, 2, 4, 1, 3, 5).reshape(batch, g * g, -1)
        F.linear(patches, pw.view(d_model, -1), pb).backward(grad)

    def in_patch_order():
        rows = F.pad(x, (1, 1, 1, 1)).reshape(batch, -1).index_select(1, index).view(batch, -1, channels * 9)
        y = F.gelu(torch.baddbmm(sb.expand(batch, rows.size(1), stem), rows,
                                 sw.view(stem, -1).t().expand(batch, channels * 9, stem)))
        F.linear(y.view(batch, g * g, -1), pw.permute(0, 2, 3, 1).reshape(d_model, -1), pb).backward(grad)

    times = {as_conv: [], in_patch_order: []}
    for fn in times:
        timed(fn, repeats=3)
    for _ in range(rounds):
        for fn in times:
            times[fn].append(timed(fn, repeats=10))
    return statistics.median(times[as_conv]), statistics.median(times[in_patch_order])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; forward + backward, median ms")
    print(f"{'attention (batch, heads, tokens, head dim)':>44} | {'SDPA':>8} | {'math':>8}")
    for shape in [(128, 4, 16, 24), (8, 4, 16, 24), (64, 4, 50, 24), (32, 4, 100, 32), (32, 4, 128, 32),
                  (16, 4, 197, 64), (8, 4, 256, 64)]:
        sdpa, math = attention(*shape)
        print(f"{str(shape):>44} | {sdpa:8.2f} | {math:8.2f}")
    print(f"\n{'patch embedding (batch, C, side, patch, d)':>44} | {'conv':>8} | {'matmul':>8}")
    for shape in [(128, 16, 28, 7, 96), (8, 16, 28, 7, 96), (32, 3, 224, 16, 192)]:
        conv, mm = patch_embedding(*shape)
        print(f"{str(shape):>44} | {conv:8.2f} | {mm:8.2f}")
    print(f"\n{'stem + patches (batch, C, side, patch, S, d)':>44} | {'conv':>8} | {'in order':>8}")
    for shape in [(128, 1, 28, 7, 16, 96), (8, 1, 28, 7, 16, 96)]:
        conv, ordered = stem_and_patches(*shape)
        print(f"{str(shape):>44} | {conv:8.2f} | {ordered:8.2f}")


if __name__ == "__main__":
    main()
