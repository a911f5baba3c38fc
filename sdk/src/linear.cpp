// loom::sdk::nn::linear on CUDA: see Note [A linear layer's gradients in float32] below.
#include <loom/sdk/nn.hpp>

#include "gradients.hpp"
#include "rtc.hpp"

#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/embedding_dense_backward.h>
#include <ATen/ops/_index_put_impl.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/ones.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>

namespace loom::sdk::nn {

// Note [A linear layer's gradients in float32]
// Under bf16 autocast, ATen's linear casts the float32 weight and bias to bf16, and its backward
// writes their gradients in bf16: the weight's as a product, the bias's as a sum over the rows
// (ATen's reduction, 1.06 ms per step for GPT-2 124M's 48 biases on an H200), each then cast to
// float32 by the cast's backward (0.54 ms) before autograd adds it into the parameter's gradient.
// Here the backward asks cuBLAS for float32 results of the bf16 products directly (mm with
// out_dtype), and takes the bias's gradient as a product too, ones[1, rows] x dy, instead of
// ATen's reduction. The forward is ATen's (addmm, the bias in the epilogue). The
// results are those of ATen's linear up to rounding: the gradients are rounded once, to float32,
// instead of to bf16 first. Not twice differentiable (no model in the tree needs it).
// Where the parameter already has a float32 gradient (Loom's trainer keeps every gradient as a
// view of a flat buffer, zeroed before a step), the product adds into it in cuBLAS's epilogue
// (addmm, beta 1) and the backward hands autograd no gradient for it: autograd's accumulation,
// an add over the whole weight (0.7 of GPT-2's 1.0 ms per step of them), is not needed. Its
// accumulator still runs, with nothing to add, so hooks after accumulation (ddp's bucket
// readiness, core/src/gradient_sync.cpp) fire as before; a hook on the tensor's gradient itself
// would see none (Loom registers none). A weight used twice works the same (GPT-2's head, tied to
// the token embedding: the head's product and nn::embedding's backward both add into it).

// a x b as the gradient of `parameter` (Note [A linear layer's gradients in float32]): added into
// its float32 gradient in cuBLAS's epilogue where it has one, else returned in `result`.
void product_gradient(const at::Tensor& a, const at::Tensor& b, const at::Tensor& parameter, at::Tensor& result) {
  // A LibTorch whose addmm with out_dtype refuses a float32 `self` beside bf16 products (older
  // releases check that self's dtype is the products') throws before it writes anything: then
  // this process returns the gradients instead, as below.
  static std::atomic<bool> adds_into_gradients{true};
  at::Tensor into = parameter.grad();
  if (adds_into_gradients.load() && !at::GradMode::is_enabled() && into.defined() && into.scalar_type() == at::kFloat &&
      into.is_contiguous() && into.device() == a.device() && into.numel() == a.size(0) * b.size(1)) {
    at::Tensor view = into.view({a.size(0), b.size(1)});
    try {
      if (a.scalar_type() == at::kFloat) at::addmm_out(view, view, a, b);
      else at::addmm_out(view, view, a, b, at::kFloat);
      return;
    } catch (const c10::Error&) {
      adds_into_gradients = false;
    }
  }
  // float32 out of a bf16 or fp16 product; the same dtype out of a float32 one
  const at::ScalarType want = parameter.scalar_type();
  const at::ScalarType out = want == at::kFloat ? at::kFloat : a.scalar_type();
  result = (a.scalar_type() == out ? at::mm(a, b) : at::mm(a, b, out)).reshape(parameter.sizes()).to(want);
}

namespace {

// The forward and backward shared by Linear and LinearNoBias (`bias` undefined: none).
at::Tensor linear_forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                          const at::Tensor& bias) {
  const c10::DeviceType device = x.device().type();
  const at::ScalarType dtype =
      at::autocast::is_autocast_enabled(device) ? at::autocast::get_autocast_dtype(device) : x.scalar_type();
  const at::Tensor xc = x.to(dtype), wc = weight.to(dtype);
  const at::Tensor y = at::linear(xc, wc, bias.defined() ? bias.to(dtype) : at::Tensor());
  if (bias.defined()) ctx->save_for_backward({xc, wc, weight, bias});
  else ctx->save_for_backward({xc, wc, weight});
  ctx->saved_data["x_dtype"] = x.scalar_type();
  return y;
}

torch::autograd::variable_list linear_backward(torch::autograd::AutogradContext* ctx,
                                               const torch::autograd::variable_list& grads) {
  const auto saved = ctx->get_saved_variables();
  const bool has_bias = saved.size() == 4;
  const at::Tensor &xc = saved[0], &wc = saved[1];
  const int64_t in = wc.size(1), out = wc.size(0);
  const at::Tensor dy = grads[0].to(wc.scalar_type()).reshape({-1, out});
  const at::Tensor x2 = xc.reshape({-1, in});
  at::Tensor dx, dw, db;
  if (ctx->needs_input_grad(0))
    dx = at::mm(dy, wc).reshape(xc.sizes()).to(ctx->saved_data["x_dtype"].toScalarType());
  if (ctx->needs_input_grad(1)) product_gradient(dy.t(), x2, saved[2], dw);
  if (!has_bias) return {dx, dw};
  if (ctx->needs_input_grad(2)) product_gradient(at::ones({1, dy.size(0)}, dy.options()), dy, saved[3], db);
  return {dx, dw, db};
}

class Linear : public torch::autograd::Function<Linear> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias) {
    return linear_forward(ctx, x, weight, bias);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return linear_backward(ctx, grads);
  }
};

// A layer without bias (GPT-2's head, tied to the token embedding): a function of its own, as
// LibTorch's custom functions take no undefined input.
class LinearNoBias : public torch::autograd::Function<LinearNoBias> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight) {
    return linear_forward(ctx, x, weight, at::Tensor());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return linear_backward(ctx, grads);
  }
};

// Note [An embedding's gradient into the buffer]
// at::embedding's backward builds a dense [rows, width] gradient (zeros, then the looked-up rows'
// gradients summed in, sorted, so deterministically), which autograd then adds into the
// parameter's gradient: for GPT-2's token embedding, 50304 x 768 floats, a fill and an add over
// 154 MB every step for the 8192 rows a batch touched. Where the parameter already has a float32
// gradient of its shape (the trainer's flat buffers), the backward here adds the rows' gradients
// into it (index_put_ with accumulate, which CUDA sorts too, so deterministically) and hands
// autograd none, as the linear layer above does; the tied head's product adds into the same
// gradient.
class Embedding : public torch::autograd::Function<Embedding> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& weight, const at::Tensor& indices) {
    ctx->save_for_backward({weight, indices});
    return at::embedding(weight, indices);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &weight = saved[0], &indices = saved[1];
    if (!ctx->needs_input_grad(0)) return {at::Tensor(), at::Tensor()};
    const at::Tensor rows = grads[0].reshape({-1, weight.size(1)});
    const at::Tensor flat = indices.reshape({-1});
    at::Tensor into = weight.grad();
    if (!at::GradMode::is_enabled() && into.defined() && into.scalar_type() == at::kFloat && into.is_contiguous() &&
        into.device() == rows.device() && into.sizes() == weight.sizes()) {
      // unsafe: no range check of the indices, which the forward's lookup made; the check reads
      // their minimum and maximum to the host (two waits per step, and no CUDA graph capture)
      at::_index_put_impl_(into, c10::List<std::optional<at::Tensor>>({flat}), rows.to(at::kFloat), /*accumulate=*/true,
                           /*unsafe=*/true);
      return {at::Tensor(), at::Tensor()};
    }
    return {at::embedding_dense_backward(rows, flat, weight.size(0), /*padding_idx=*/-1, /*scale_grad_by_freq=*/false),
            at::Tensor()};
  }
};

}  // namespace

at::Tensor embedding(const at::Tensor& weight, const at::Tensor& indices) {
  if (weight.is_cuda() && weight.dim() == 2 && weight.requires_grad() && at::GradMode::is_enabled() &&
      rtc::disabled_by_environment("embedding").empty())
    return Embedding::apply(weight, indices);
  return at::embedding(weight, indices);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  if (x.is_cuda() && x.dim() >= 2 && weight.dim() == 2 && rtc::disabled_by_environment("linear").empty() &&
      (x.requires_grad() || weight.requires_grad() || (bias.defined() && bias.requires_grad())))
    return bias.defined() ? Linear::apply(x, weight, bias) : LinearNoBias::apply(x, weight);
  return at::linear(x, weight, bias);
}

}  // namespace loom::sdk::nn
