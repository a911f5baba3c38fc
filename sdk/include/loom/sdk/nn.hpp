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
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <string>

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

/// gelu_tanh(x W1^T + b1) W2^T + b2, GPT-2's MLP. On CUDA under bf16 or fp16 autocast (while
/// autograd records) the GELU runs in cuBLASLt's epilogues, forward and backward (Note [GELU in
/// the product's epilogue], sdk/src/mlp.cpp), the parameters' gradients in float32 as linear's;
/// elsewhere, or where fused_mlp_unavailable says why not, linear(gelu(linear(x, W1, b1)), W2, b2).
/// LOOM_FUSED_KERNELS without "mlp" turns it off.
LOOM_SDK_API at::Tensor mlp_gelu_tanh(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& b1,
                                      const at::Tensor& w2, const at::Tensor& b2);

/// Why mlp_gelu_tanh would take the composition ("" when it takes cuBLASLt's epilogues); checks
/// them once per device at first use.
LOOM_SDK_API std::string fused_mlp_unavailable(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& b1,
                                               const at::Tensor& w2, const at::Tensor& b2);

/// weight[indices] as at::embedding (no padding index, no max_norm). On CUDA (while autograd
/// records) its backward adds the looked-up rows' gradients into the weight's float32 gradient
/// where it has one, instead of a dense [rows, width] gradient autograd then adds (Note [An
/// embedding's gradient into the buffer], sdk/src/linear.cpp); LOOM_FUSED_KERNELS without
/// "embedding" turns that off.
LOOM_SDK_API at::Tensor embedding(const at::Tensor& weight, const at::Tensor& indices);

/// A module's lookup (`nn::embedding(*wte, tokens)`); one with a padding index, max_norm, sparse
/// or frequency-scaled gradients is its own forward.
inline at::Tensor embedding(torch::nn::EmbeddingImpl& module, const at::Tensor& indices) {
  const auto& o = module.options;
  if (o.padding_idx() || o.max_norm() || o.sparse() || o.scale_grad_by_freq()) return module.forward(indices);
  return loom::sdk::nn::embedding(module.weight, indices);  // qualified: ADL would find at::embedding too
}

}  // namespace loom::sdk::nn
