// Optimizer, learning-rate schedule and gradient clipping. See optimizer.hpp.
#include <loom/core/error.hpp>
#include <loom/core/optimizer.hpp>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/_fused_sgd.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

#include <cmath>

namespace loom::core {

Optimizer::Optimizer(std::vector<ParameterGroup> groups, Options options)
    : groups_(std::move(groups)), options_(std::move(options)) {
  if (options_.kind != "adamw" && options_.kind != "sgd")
    throw Error("trainer.optimizer = '" + options_.kind + "': expected adamw or sgd");
  // Empty groups would make the fused kernels unhappy.
  std::erase_if(groups_, [](const ParameterGroup& g) { return g.params.empty(); });
}

void Optimizer::ensure_state() {
  if (initialized_) return;
  for (const auto& g : groups_) {
    std::vector<at::Tensor> m, v, b, s;
    for (const auto& p : g.params) {
      if (options_.kind == "adamw") {
        m.push_back(at::zeros_like(p, at::MemoryFormat::Preserve));
        v.push_back(at::zeros_like(p, at::MemoryFormat::Preserve));
        s.push_back(at::zeros({}, p.options().dtype(at::kFloat)));
      } else {
        b.push_back(at::zeros_like(p, at::MemoryFormat::Preserve));
      }
    }
    exp_avg_.push_back(std::move(m));
    exp_avg_sq_.push_back(std::move(v));
    momentum_buffer_.push_back(std::move(b));
    step_.push_back(std::move(s));
  }
  initialized_ = true;
}

std::vector<at::Tensor> Optimizer::gradients() {
  std::vector<at::Tensor> out;
  for (auto& g : groups_)
    for (auto& p : g.params) {
      if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
      out.push_back(p.grad());
    }
  return out;
}

void Optimizer::zero_grad() {
  for (auto& g : groups_)
    for (auto& p : g.params)
      if (p.grad().defined()) p.mutable_grad().zero_();
}

void Optimizer::step(double lr) {
  ensure_state();
  at::NoGradGuard no_grad;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    auto& g = groups_[gi];
    std::vector<at::Tensor> params, grads, m, v, s, b;
    for (size_t i = 0; i < g.params.size(); ++i) {
      if (!g.params[i].grad().defined()) continue;
      params.push_back(g.params[i]);
      grads.push_back(g.params[i].grad());
      if (options_.kind == "adamw") {
        m.push_back(exp_avg_[gi][i]);
        v.push_back(exp_avg_sq_[gi][i]);
        s.push_back(step_[gi][i]);
      } else {
        b.push_back(momentum_buffer_[gi][i]);
      }
    }
    if (params.empty()) continue;
    if (options_.kind == "adamw") {
      at::_foreach_add_(s, 1);
      at::_fused_adamw_(params, grads, m, v, /*max_exp_avg_sqs=*/{}, s, lr, options_.beta1, options_.beta2,
                        g.weight_decay, options_.eps, /*amsgrad=*/false, /*maximize=*/false);
    } else {
      // PyTorch's SGD: the first step sets the buffer to the gradient (is_first_step).
      at::_fused_sgd_(params, grads, b, g.weight_decay, options_.momentum, lr, /*dampening=*/0.0,
                      /*nesterov=*/false, /*maximize=*/false, /*is_first_step=*/steps_ == 0);
    }
  }
  ++steps_;
}

sdk::State Optimizer::state_dict() const {
  sdk::State state;
  state.text["kind"] = options_.kind;
  state.text["steps"] = std::to_string(steps_);
  if (!initialized_) return state;
  for (size_t gi = 0; gi < groups_.size(); ++gi)
    for (size_t i = 0; i < groups_[gi].params.size(); ++i) {
      const std::string& name = groups_[gi].names[i];
      if (options_.kind == "adamw") {
        state.tensors["exp_avg." + name] = exp_avg_[gi][i];
        state.tensors["exp_avg_sq." + name] = exp_avg_sq_[gi][i];
        state.tensors["step." + name] = step_[gi][i];
      } else {
        state.tensors["momentum_buffer." + name] = momentum_buffer_[gi][i];
      }
    }
  return state;
}

void Optimizer::load_state_dict(const sdk::State& state) {
  auto kind = state.text.find("kind");
  if (kind == state.text.end() || kind->second != options_.kind)
    throw Error("the checkpoint's optimizer is '" + (kind == state.text.end() ? std::string("?") : kind->second) +
                "', this run's is '" + options_.kind + "'; set trainer.optimizer to match");
  steps_ = std::stoll(state.text.at("steps"));
  initialized_ = false;
  exp_avg_.clear();
  exp_avg_sq_.clear();
  momentum_buffer_.clear();
  step_.clear();
  if (state.tensors.empty()) return;
  ensure_state();
  at::NoGradGuard no_grad;
  auto restore = [&](const std::string& key, at::Tensor& into) {
    auto it = state.tensors.find(key);
    if (it == state.tensors.end()) throw Error("the checkpoint's optimizer state has no '" + key + "'");
    if (it->second.sizes() != into.sizes())
      throw Error("the checkpoint's optimizer state '" + key + "' has shape " + c10::str(it->second.sizes()) +
                  ", the parameter has " + c10::str(into.sizes()));
    into.copy_(it->second);
  };
  for (size_t gi = 0; gi < groups_.size(); ++gi)
    for (size_t i = 0; i < groups_[gi].params.size(); ++i) {
      const std::string& name = groups_[gi].names[i];
      if (options_.kind == "adamw") {
        restore("exp_avg." + name, exp_avg_[gi][i]);
        restore("exp_avg_sq." + name, exp_avg_sq_[gi][i]);
        restore("step." + name, step_[gi][i]);
      } else {
        restore("momentum_buffer." + name, momentum_buffer_[gi][i]);
      }
    }
}

double learning_rate(double lr, int64_t step, int64_t total, bool cosine, double warmup_ratio, double min_lr_ratio) {
  if (!cosine || total <= 0) return lr;
  const int64_t warmup = static_cast<int64_t>(std::floor(warmup_ratio * static_cast<double>(total)));
  if (step < warmup) return lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  const double span = static_cast<double>(std::max<int64_t>(1, total - warmup));
  const double progress = std::min(1.0, static_cast<double>(step - warmup) / span);
  const double floor = lr * min_lr_ratio;
  return floor + (lr - floor) * 0.5 * (1.0 + std::cos(M_PI * progress));
}

at::Tensor clip_grad_norm(const std::vector<at::Tensor>& gradients, double max_norm) {
  if (gradients.empty()) return at::zeros({});
  const auto norms = at::_foreach_norm(gradients, 2);
  const at::Tensor total = at::stack(norms).norm();
  if (max_norm > 0) {
    const at::Tensor coef = at::clamp(total.add(1e-6).reciprocal().mul(max_norm), std::nullopt, 1.0);
    at::_foreach_mul_(gradients, coef);
  }
  return total;
}

}  // namespace loom::core
