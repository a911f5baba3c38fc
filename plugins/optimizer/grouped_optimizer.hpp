// Shared by the in-tree optimizers: parameter groups, per-parameter state tensors in named slots
// ("exp_avg", "exp_avg_sq", "step"), their state_dict round trip, and one fused update call per
// group. A concrete optimizer says which slots it keeps, how to make one, and how to update a
// group; see adamw/ and sgd/.
#pragma once

#include <loom/sdk/sdk.hpp>

#include <ATen/core/grad_mode.h>

#include <cmath>
#include <string>
#include <vector>

namespace loom::plugins {

class GroupedOptimizer : public sdk::Optimizer {
 public:
  GroupedOptimizer(std::string kind, std::vector<std::string> slots, double weight_decay)
      : kind_(std::move(kind)), slots_(std::move(slots)), weight_decay_(weight_decay) {}

  void setup(const std::vector<sdk::ParameterGroup>& groups) override {
    for (const auto& g : groups)
      if (!g.params.empty() && !g.frozen) groups_.push_back({g, g.weight_decay.value_or(weight_decay_), {}});
  }

  void materialize() override {
    if (materialized_) return;
    for (auto& g : groups_) {
      g.state.assign(slots_.size(), {});
      for (size_t s = 0; s < slots_.size(); ++s)
        for (const auto& p : g.spec.params) g.state[s].push_back(make_state(s, p));
    }
    materialized_ = true;
  }

  void step(double lr) override {
    for_each_group([&](Group& g, std::vector<at::Tensor>& params, std::vector<at::Tensor>& grads,
                       std::vector<std::vector<at::Tensor>>& state) {
      update(params, grads, state, lr * g.spec.lr_scale, g.weight_decay);
    });
    ++steps_;
    ++host_taken_;
  }

  // Optimizer 1.1: the fused kernels take the learning rate as a tensor and skip themselves where
  // found_inf is set; the updates taken are counted on the device too (read only for a
  // checkpoint), so that a CUDA graph's replays of this call count (step.cuda_graph).
  void step_on_device(const at::Tensor& lr, const at::Tensor& found_non_finite) override {
    queue(lr, found_non_finite, at::Tensor());
  }

  // Optimizer 1.2: the same, the kernels dividing each gradient by `divisor` as they read it
  // (their grad_scale) instead of the host scaling every gradient beforehand.
  void step_on_device_dividing(const at::Tensor& lr, const at::Tensor& found_non_finite, const at::Tensor& divisor,
                               const std::vector<at::Tensor>&) override {
    queue(lr, found_non_finite, divisor.reshape({1}).to(at::kFloat));
  }

  sdk::State state_dict() const override {
    sdk::State out;
    out.text["kind"] = kind_;
    out.text["steps"] = std::to_string(steps_taken());
    if (!materialized_) return out;
    for (const auto& g : groups_)
      for (size_t s = 0; s < slots_.size(); ++s)
        for (size_t i = 0; i < g.spec.params.size(); ++i) out.tensors[slots_[s] + "." + g.spec.names[i]] = g.state[s][i];
    return out;
  }

  void load_state_dict(const sdk::State& state) override {
    auto kind = state.text.find("kind");
    if (kind == state.text.end() || kind->second != kind_)
      throw sdk::Error("the checkpoint's optimizer is '" + (kind == state.text.end() ? std::string("?") : kind->second) +
                       "', this run's is '" + kind_ + "'; set trainer.optimizer to match");
    auto steps = state.text.find("steps");
    const auto parsed = steps == state.text.end() ? std::nullopt : sdk::parse_int(steps->second);
    if (!parsed || *parsed < 0) throw sdk::Error("the checkpoint's optimizer state has no valid step count");
    steps_ = host_taken_ = *parsed;
    taken_on_device_ = at::Tensor();
    materialized_ = false;
    if (state.tensors.empty()) return;  // saved before the first step
    materialize();
    at::NoGradGuard no_grad;
    for (auto& g : groups_)
      for (size_t s = 0; s < slots_.size(); ++s)
        for (size_t i = 0; i < g.spec.params.size(); ++i) {
          const std::string key = slots_[s] + "." + g.spec.names[i];
          auto it = state.tensors.find(key);
          if (it == state.tensors.end()) throw sdk::Error("the checkpoint's optimizer state has no '" + key + "'");
          if (it->second.sizes() != g.state[s][i].sizes())
            throw sdk::Error("the checkpoint's optimizer state '" + key + "' has shape " + c10::str(it->second.sizes()) +
                             ", this run's has " + c10::str(g.state[s][i].sizes()));
          g.state[s][i].copy_(it->second);
        }
  }

 protected:
  /// A new state tensor of slot `slot` for parameter `p` (zeros, like it).
  virtual at::Tensor make_state(size_t slot, const at::Tensor& p) const = 0;
  /// Updates one group's parameters that have gradients; `state[s]` holds slot s's tensors in
  /// the parameters' order. `steps_taken()` updates came before this one.
  virtual void update(std::vector<at::Tensor>& params, std::vector<at::Tensor>& grads,
                      std::vector<std::vector<at::Tensor>>& state, double lr, double weight_decay) = 0;
  /// The same with `lr` a 0-dim tensor and `found_inf` (one float element) on the parameters'
  /// device: where found_inf is nonzero, nothing may change (state included). Where `divisor`
  /// (one float element) is defined, each gradient is to be divided by it first (grad_scale).
  virtual void update_on_device(std::vector<at::Tensor>& params, std::vector<at::Tensor>& grads,
                                std::vector<std::vector<at::Tensor>>& state, const at::Tensor& lr,
                                double weight_decay, const at::Tensor& found_inf, const at::Tensor& divisor) = 0;
  /// Updates taken so far (skipped ones not counted; reads the device's count).
  int64_t steps_taken() const {
    return host_taken_ + (taken_on_device_.defined() ? std::llround(taken_on_device_.item<double>()) : 0);
  }
  /// Calls to step() and step_on_device() the host made so far, skipped or not (no read from the
  /// device; a CUDA graph's replays are not calls: only its capture is).
  int64_t steps_called() const { return steps_; }
  double weight_decay() const { return weight_decay_; }

 private:
  struct Group {
    sdk::ParameterGroup spec;
    double weight_decay;
    std::vector<std::vector<at::Tensor>> state;  // [slot][parameter]
  };

  void queue(const at::Tensor& lr, const at::Tensor& found_non_finite, const at::Tensor& divisor) {
    at::NoGradGuard no_grad;
    const at::Tensor found = found_non_finite.reshape({1}).to(at::kFloat);
    for_each_group([&](Group& g, std::vector<at::Tensor>& params, std::vector<at::Tensor>& grads,
                       std::vector<std::vector<at::Tensor>>& state) {
      update_on_device(params, grads, state, g.spec.lr_scale == 1.0 ? lr : lr * g.spec.lr_scale, g.weight_decay, found,
                       divisor);
    });
    ++steps_;
    if (taken_on_device_.defined()) taken_on_device_.sub_(found).add_(1);
    else taken_on_device_ = found.to(at::kDouble).neg_().add_(1);  // double: exact past 2^24 steps
  }

  // Calls fn(group, params, grads, state) for each group's parameters that have a gradient.
  template <typename Fn>
  void for_each_group(Fn&& fn) {
    materialize();
    at::NoGradGuard no_grad;
    for (auto& g : groups_) {
      std::vector<at::Tensor> params, grads;
      std::vector<std::vector<at::Tensor>> state(slots_.size());
      for (size_t i = 0; i < g.spec.params.size(); ++i) {
        const at::Tensor& p = g.spec.params[i];
        if (!p.grad().defined()) continue;
        params.push_back(p);
        grads.push_back(p.grad());
        for (size_t s = 0; s < slots_.size(); ++s) state[s].push_back(g.state[s][i]);
      }
      if (!params.empty()) fn(g, params, grads, state);
    }
  }
  std::string kind_;
  std::vector<std::string> slots_;
  double weight_decay_;
  std::vector<Group> groups_;
  int64_t steps_ = 0;       // calls made by the host
  int64_t host_taken_ = 0;  // updates step() took, and those of a loaded checkpoint
  at::Tensor taken_on_device_;  // updates step_on_device took (undefined: no call yet)
  bool materialized_ = false;
};

}  // namespace loom::plugins
