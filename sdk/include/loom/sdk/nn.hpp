// Layers as Python PyTorch runs them. LibTorch's C++ frontend has kernels of its own for some
// modules: `torch::nn::Linear::forward` (torch/nn/functional/linear.h) multiplies and then adds the
// bias in place whenever the input is not 2-D, where Python's nn.Linear calls at::linear, which
// folds a contiguous N-D input to 2-D and adds the bias in the matrix multiply's epilogue
// (addmm). Under bf16 autocast the in-place add also mixes dtypes (a bf16 product, an fp32 bias)
// and takes ATen's slowest elementwise path: on an H200 it cost GPT-2 124M 3.1 ms of its 31 ms
// step (four adds per block; docs/gpu.md, "The fourth run"). Models call these instead of the
// modules' forward.
#pragma once

#include <loom/sdk/error.hpp>

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/linear.h>

namespace loom::sdk::nn {

/// x W^T + b as at::linear (addmm with the bias in the epilogue), as Python's nn.Linear; `bias`
/// may be undefined (none). On CUDA (while autograd records) its backward writes the weight's and the bias's gradients in float32
/// straight from cuBLAS, without bf16 copies to cast, and the bias's as a product (Note [A linear
/// layer's gradients in float32], sdk/src/linear.cpp); LOOM_FUSED_KERNELS without "linear" turns
/// that off (<loom/sdk/cross_entropy.hpp>).
LOOM_SDK_API at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

inline at::Tensor linear(const torch::nn::Linear& layer, const at::Tensor& x) {
  return linear(x, layer->weight, layer->bias);
}

}  // namespace loom::sdk::nn
