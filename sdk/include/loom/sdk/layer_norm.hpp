// LayerNorm whose output comes in the dtype the next matrix product takes.
//
// Under autocast, at::layer_norm runs in float32 and returns float32: the linear layer after it
// casts that to bf16 (a pass that reads 4 and writes 2 bytes per value), and in backward the cast's
// gradient goes the other way. GPT-2 has two such LayerNorms per block. On CUDA, layer_norm reads
// x as it is (the float32 residual stream), normalizes in float32, and writes the output in
// autocast's dtype while autocast is on (otherwise in x's dtype); its backward takes the gradient
// in that dtype. Loom's kernels (one warp per row; compiled at run time, Note [Kernels compiled at
// run time] in sdk/src/rtc.cpp). Elsewhere (CPU, widths not a multiple of 4 or above 2048,
// weights not float32, LOOM_FUSED_KERNELS without layer_norm, no NVRTC) it is at::layer_norm, whose output under
// autocast is float32: the product after it casts as before.
#pragma once

#include <loom/sdk/error.hpp>

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/normalization.h>

#include <string>
#include <utility>

namespace loom::sdk::nn {

/// LayerNorm over the last dimension of x with float32 weight and bias ([width]) and eps.
LOOM_SDK_API at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps);

inline at::Tensor layer_norm(const torch::nn::LayerNorm& module, const at::Tensor& x) {
  return layer_norm(x, module->weight, module->bias, module->options.eps());
}

/// {x + branch, LayerNorm of that sum}: the residual add and the LayerNorm after it in one pass on
/// CUDA, backward included (Note [The residual add in the LayerNorm], sdk/src/layer_norm.cpp),
/// where layer_norm takes Loom's kernels, x is the residual stream (float32, or the branch's
/// dtype) and the branch comes in the LayerNorm's output dtype (a product's output under
/// autocast). Elsewhere x + branch, then layer_norm: the same values. An undefined branch is
/// none: {x, layer_norm(x)}.
LOOM_SDK_API std::pair<at::Tensor, at::Tensor> add_layer_norm(const at::Tensor& x, const at::Tensor& branch,
                                                              const at::Tensor& weight, const at::Tensor& bias,
                                                              double eps);

inline std::pair<at::Tensor, at::Tensor> add_layer_norm(const torch::nn::LayerNorm& module, const at::Tensor& x,
                                                        const at::Tensor& branch) {
  return add_layer_norm(x, branch, module->weight, module->bias, module->options.eps());
}

/// Why add_layer_norm would take the unfused path ("" when it takes Loom's kernels).
LOOM_SDK_API std::string fused_add_layer_norm_unavailable(const at::Tensor& x, const at::Tensor& branch,
                                                          const at::Tensor& weight, const at::Tensor& bias);

/// Why layer_norm would take ATen's path for x ("" when it would take Loom's kernels); compiles and
/// loads them for x's device if they are not yet.
LOOM_SDK_API std::string fused_layer_norm_unavailable(const at::Tensor& x, const at::Tensor& weight,
                                                      const at::Tensor& bias);

/// Compiles the kernels with NVRTC for compute capability major.minor without loading them: ""
/// when they compile, otherwise why not.
LOOM_SDK_API std::string compile_layer_norm_kernels(int major, int minor);

}  // namespace loom::sdk::nn
