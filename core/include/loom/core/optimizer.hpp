// The optimizer (AdamW or SGD with momentum) and the learning-rate schedule.
//
// Loom keeps its own small optimizer instead of torch::optim so that (1) the update runs as one
// fused kernel per parameter group (at::_fused_adamw_ / at::_fused_sgd_, on CPU and CUDA) rather
// than a dozen ops per parameter, which is where small models lose time, and (2) its state is
// plain named tensors that go straight into a safetensors checkpoint.
#pragma once

#include <loom/sdk/types.hpp>

#include <string>
#include <vector>

namespace loom::core {

struct ParameterGroup {
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  double weight_decay = 0.0;
};

class Optimizer {
 public:
  struct Options {
    std::string kind = "adamw";  ///< adamw | sgd
    double lr = 1e-3;
    double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  ///< adamw
    double momentum = 0.9;                          ///< sgd
  };

  Optimizer(std::vector<ParameterGroup> groups, Options options);

  /// One update with learning rate `lr` from the parameters' .grad(). Parameters without a
  /// gradient are left alone.
  void step(double lr);

  /// Sets every gradient to zero (keeps the buffers).
  void zero_grad();

  /// Allocates the optimizer state now rather than at the first step (so memory planning sees
  /// the steady state). Idempotent.
  void materialize() { ensure_state(); }

  /// Every parameter's gradient, in a fixed order (created as zeros where missing).
  std::vector<at::Tensor> gradients();
  const std::vector<ParameterGroup>& groups() const { return groups_; }
  int64_t steps_taken() const { return steps_; }

  /// State as named tensors ("exp_avg.<param>", ...) plus the step count; and its restore, which
  /// checks every name and shape.
  sdk::State state_dict() const;
  void load_state_dict(const sdk::State& state);

 private:
  void ensure_state();

  std::vector<ParameterGroup> groups_;
  Options options_;
  int64_t steps_ = 0;
  // Per group, per parameter.
  std::vector<std::vector<at::Tensor>> exp_avg_, exp_avg_sq_, momentum_buffer_, step_;
  bool initialized_ = false;
};

/// The learning rate at step `step` (0-based) of `total`: constant, or linear warm-up over
/// warmup_ratio x total steps then cosine decay to min_lr_ratio x lr.
double learning_rate(double lr, int64_t step, int64_t total, bool cosine, double warmup_ratio, double min_lr_ratio);

/// Clips the gradients' global L2 norm to max_norm (no-op when max_norm <= 0); returns the norm
/// before clipping (a 0-dim tensor, on the gradients' device).
at::Tensor clip_grad_norm(const std::vector<at::Tensor>& gradients, double max_norm);

}  // namespace loom::core
