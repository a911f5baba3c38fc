// Tier-1 interfaces of the optimizer and the learning-rate schedule, and the parameter groups a
// model may give the optimizer.
//
// The host owns the parameters' gradients: it sums them over micro-batches and ranks, divides
// them by the global count, unscales and clips them, and zeroes them. An optimizer only turns
// gradients into an update, and keeps its own state. A schedule only says which share of the
// peak learning rate (trainer.lr) a step uses.
#pragma once

#include <loom/sdk/abi.h>
#include <loom/sdk/types.hpp>

#include <optional>
#include <string>
#include <vector>

namespace loom::sdk {

/// Parameters that share optimizer settings. A model may return its own (Model::
/// parameter_groups: another learning rate for a pretrained encoder, no weight decay for
/// embeddings, a frozen part); otherwise the host makes two, with and without weight decay,
/// from Model::decays.
///
/// Each parameter is in one group at most. A parameter that the module registers twice (tied
/// input and output embeddings) is one parameter: the host hands it to the optimizer once, clips
/// and counts it once.
struct ParameterGroup {
  std::string name;                    ///< "decay", "no_decay", "encoder": for messages and reports
  std::vector<std::string> names;      ///< the parameters' names (keys of module().named_parameters())
  std::vector<at::Tensor> params;      ///< the parameters, in the same order as `names`
  double lr_scale = 1.0;               ///< this group's learning rate is the step's x lr_scale
  std::optional<double> weight_decay;  ///< unset: the optimizer's configured weight decay
  bool frozen = false;                 ///< no gradient, no optimizer state (the host turns
                                       ///< requires_grad off and does not pass the group on)
};

class LOOM_SDK_API Optimizer {
 public:
  using Interface = Optimizer;
  static constexpr uint32_t kKind = LOOM_KIND_OPTIMIZER;
  static constexpr uint32_t kInterfaceMajor = 1;
  static constexpr uint32_t kInterfaceMinor = 2;  // 1.1: step_on_device; 1.2: step_on_device_dividing

  virtual ~Optimizer();  // defined in libloom_sdk: its type info has one home

  /// The groups it updates, each trainable parameter once, already on the device. Called once,
  /// on the main thread, before any other method. The tensors stay valid for the optimizer's life.
  virtual void setup(const std::vector<ParameterGroup>& groups) = 0;

  /// Allocates the state now rather than at the first step, so memory planning measures the
  /// steady state. Idempotent.
  virtual void materialize() = 0;

  /// One update from the parameters' gradients (final: averaged, unscaled, clipped) with learning
  /// rate `lr` (a group's is lr x lr_scale). A parameter without a gradient is left alone.
  virtual void step(double lr) = 0;

  /// 1.1: step() with the learning rate and the decision to skip on the device, so that the host
  /// queues the update without waiting for the device: `lr` is a 0-dim floating tensor on the
  /// parameters' device (a group's rate is lr x lr_scale); where `found_non_finite` (a float
  /// tensor of one element, same device) is nonzero, nothing changes: no update, no step counted
  /// (the fused kernels' found_inf). The default reads both to the host and calls step(): right,
  /// but it waits for the device.
  /// With `step.cuda_graph`, the trainer captures the whole step, this call included, into a
  /// CUDA graph and replays it: the call runs on the host once per capture, its device work once
  /// per step. So it queues device work only: no read of a tensor, no host-side count that
  /// changes per call (keep such counts in device tensors, as the in-tree optimizers do), the
  /// same state tensors from call to call. A read makes the capture fail, which the trainer
  /// reports.
  virtual void step_on_device(const at::Tensor& lr, const at::Tensor& found_non_finite) {
    if (found_non_finite.item<double>() == 0) step(lr.item<double>());
  }

  /// The bytes of state it keeps for `parameter` (for the memory estimate).
  virtual int64_t state_bytes(const at::Tensor& parameter) const = 0;

  /// Its state, named by parameter ("exp_avg.<parameter name>", ...), and its restore, which
  /// throws Error naming a missing or misshapen tensor.
  virtual State state_dict() const = 0;
  virtual void load_state_dict(const State& state) = 0;

  /// One line for the start-up report ("adamw: betas 0.9/0.999, eps 1e-08, weight decay 0.05").
  virtual std::string describe() const { return {}; }

  /// 1.2: step_on_device() on gradients that are still to be divided by `divisor` (a float
  /// tensor of one element on the parameters' device): the global count (under a loss scale,
  /// the count over the power of two the loss went into backward divided by) times the inverse of
  /// the clipping factor, which the host no longer applies itself, so that the update reads the
  /// gradients once (the fused kernels' grad_scale) instead of after two passes that scale them.
  /// The host calls this instead of step_on_device() only when no callback reads the gradients
  /// (Callback::reads_gradients). `gradients` are those of the trainable parameters (the host's
  /// flat buffers, which the parameters' gradients are views of). The default divides them in
  /// place and calls step_on_device(). Same rules as step_on_device() for CUDA graphs.
  virtual void step_on_device_dividing(const at::Tensor& lr, const at::Tensor& found_non_finite,
                                       const at::Tensor& divisor, const std::vector<at::Tensor>& gradients);
};

class LOOM_SDK_API Schedule {
 public:
  using Interface = Schedule;
  static constexpr uint32_t kKind = LOOM_KIND_SCHEDULE;
  static constexpr uint32_t kInterfaceMajor = 1;
  static constexpr uint32_t kInterfaceMinor = 0;

  virtual ~Schedule();  // defined in libloom_sdk

  /// The share of the peak learning rate for the update at `step` (updates taken before it, so
  /// the first is 0; steps skipped for non-finite gradients do not count) of `total`: `step` is
  /// in 0 ... total - 1. Called on the main thread once per step and for reports (the step on the
  /// device asks every step's at the start); finite and >= 0, else the host stops the run.
  virtual double factor(int64_t step, int64_t total) const = 0;

  /// State, for schedules that keep any (the host saves the step itself).
  virtual State state_dict() const { return {}; }
  virtual void load_state_dict(const State& state) { (void)state; }

  /// One line for the start-up report ("warm-up 5 % then cosine to 0").
  virtual std::string describe() const { return {}; }
};

}  // namespace loom::sdk
