// Internal to libloom_sdk: a parameter's gradient from a matrix product, shared by nn::linear
// (linear.cpp) and nn::mlp_gelu_tanh (mlp.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace loom::sdk::nn {

/// a x b as the gradient of `parameter` (Note [A linear layer's gradients in float32]): added into
/// its float32 gradient in cuBLAS's epilogue where it has one (`result` left undefined), else
/// returned in `result` in the parameter's dtype and shape.
void product_gradient(const at::Tensor& a, const at::Tensor& b, const at::Tensor& parameter, at::Tensor& result);

}  // namespace loom::sdk::nn
