// Cross-entropy over a large vocabulary without an fp32 copy of the logits.
//
// `at::cross_entropy_loss` under autocast takes fp32 logits: a language model's [tokens, vocabulary]
// bf16 logits are cast to fp32, log-softmax writes another fp32 tensor, its backward a third, and
// the gradient is cast back; the token accuracy's argmax reads them once more. For GPT-2 124M at
// 8 x 1024 tokens on an H200 that is 4.5 ms of a 28 ms step (docs/gpu.md, "The fourth run").
// On CUDA, cross_entropy_sum reads the logits once in their own dtype (one block per row: an
// online max and sum of exponentials, and the argmax) and its backward reads them once more and
// writes the gradient in their dtype: 3 passes of 2 bytes per logit instead of about 15 of 4.
// Where the backward will follow (grad mode, logits that require a gradient; bf16 rows up to
// 65536 classes, float32 up to 32768), the forward writes the gradient itself from the row it
// holds, and the backward only scales it by the loss's gradient where that is not 1: 2 passes.
// Such a forward takes one backward (not two through one graph with retain_graph).
//
// The kernels are compiled at first use by NVRTC (the libnvrtc a CUDA LibTorch ships) for the
// device's own architecture: nothing is built with nvcc, and a CPU-only machine builds the same
// code. Where NVRTC or the driver cannot be used, or LOOM_FUSED_KERNELS turns it off (unset: every
// fused operation; 0: none; a list of cross_entropy, embedding, layer_norm, linear, mlp: those), the same call
// runs ATen's operators (cross_entropy_loss on fp32 logits, argmax): same results, slower.
// On CPU it always runs ATen's.
#pragma once

#include <loom/sdk/error.hpp>

#include <ATen/core/Tensor.h>

#include <string>

namespace loom::sdk::nn {

struct CrossEntropySums {
  at::Tensor loss_sum;  ///< sum over rows of -log softmax(logits)[target], float32, differentiable
  at::Tensor correct;   ///< rows whose first arg-max is the target, int64, not differentiable
};

/// logits [rows, classes] (float32, bfloat16 or float16), target [rows] int64. Rows whose target is
/// ignore_index add nothing to either sum and get a zero gradient. On the fused path a target
/// outside [0, classes) makes the loss NaN (the step is then skipped as non-finite) where ATen
/// would stop the process with a device-side assertion.
LOOM_SDK_API CrossEntropySums cross_entropy_sum(const at::Tensor& logits, const at::Tensor& target,
                                                int64_t ignore_index = -100);

/// Why cross_entropy_sum would not use the fused kernels for these logits ("" when it would):
/// "not a CUDA tensor", "LOOM_FUSED_KERNELS=0", "libnvrtc not found (...)", a compiler log. Compiles
/// and loads the kernels for the logits' device if they are not yet.
LOOM_SDK_API std::string fused_cross_entropy_unavailable(const at::Tensor& logits);

/// Why cross_entropy_sum on these logits, in a step that takes the gradient, would not write the
/// logits' gradient in its forward ("" when it would): fused_cross_entropy_unavailable's reasons,
/// fp16 logits, rows wider than the kernel holds or not of whole 16-byte vectors, or its check at
/// first use failing on this device (run now if it has not run).
LOOM_SDK_API std::string fused_cross_entropy_gradient_unavailable(const at::Tensor& logits);

/// The compiler of Loom's CUDA kernels (cross-entropy, LayerNorm): the libnvrtc file found, or
/// "unavailable: " and why (then those operations take ATen's path on CUDA). For `loom doctor`.
LOOM_SDK_API std::string fused_kernels_compiler();

/// Compiles the kernels with NVRTC for compute capability major.minor without loading them (no
/// GPU needed): "" when they compile, otherwise why not. For tests.
LOOM_SDK_API std::string compile_fused_kernels(int major, int minor);

}  // namespace loom::sdk::nn
