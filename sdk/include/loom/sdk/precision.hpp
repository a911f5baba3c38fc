// Tier-1 interface of a precision strategy: the numeric format of forward, backward and step
// (autocast, loss scaling, TF32 switches).
#pragma once

#include <loom/sdk/abi.h>
#include <loom/sdk/amp.hpp>
#include <loom/sdk/types.hpp>

#include <limits>
#include <memory>
#include <vector>

namespace loom::sdk {

/// An RAII scope: whatever it set up is undone when it is destroyed.
class LOOM_SDK_API Guard {
 public:
  virtual ~Guard();  // defined in libloom_sdk: its type info has one home
};

/// How a training step is computed numerically. The host calls, per optimizer step:
///   for each micro-batch: { auto g = forward_guard(); out = model.forward(...); }
///                         backward(scale_loss(loss))
///   finite = unscale_gradients(grads)   // once, after the last micro-batch, before clipping
///   if (finite) optimizer.step();       // else the step is skipped and the LR does not move
///   update(!finite)
/// or, where the precision and the optimizer both implement interface 1.1 (Note [The step on the
/// device] in core/src/trainer_step.cpp), without the host waiting for the device:
///   unscale_gradients_on_device(grads)  // in place, no check
///   found = the gradients' norm is not finite (a tensor on the device)
///   optimizer.step_on_device(lr, found) // the fused kernel skips itself where found
///   update_on_device(found)
/// With `step.cuda_graph` these on-device calls, and forward_guard() and scale_loss(), are
/// captured into a CUDA graph and replayed (see Optimizer::step_on_device): device work only,
/// no reads, no host state that changes per step.
class LOOM_SDK_API PrecisionStrategy {
 public:
  using Interface = PrecisionStrategy;
  static constexpr uint32_t kKind = LOOM_KIND_PRECISION;
  static constexpr uint32_t kInterfaceMajor = 1;
  static constexpr uint32_t kInterfaceMinor = 1;  // 1.1: unscale_gradients_on_device, update_on_device

  virtual ~PrecisionStrategy();  // defined in libloom_sdk

  /// Prepares for training on `device` (process-wide switches such as TF32). Called once, on
  /// the main thread, before the model is built. Throws Error when the device cannot compute in
  /// this precision, saying which precision would work.
  virtual void setup(const c10::Device& device) = 0;

  /// The scope forward runs in (autocast); backward runs outside it. Thread-local state: call
  /// on the thread that runs forward.
  virtual std::unique_ptr<Guard> forward_guard() = 0;

  /// The loss to call backward on: `loss` times the current loss scale (or `loss` itself).
  virtual at::Tensor scale_loss(const at::Tensor& loss) { return loss; }

  /// Divides the gradients by the loss scale in place and returns whether all are finite; the
  /// host skips the optimizer step when they are not. Called once per optimizer step, after
  /// gradient synchronization and before clipping. The default (no scaling) only checks.
  virtual bool unscale_gradients(const std::vector<at::Tensor>& gradients) { return all_finite(gradients); }

  /// Updates the loss scale after a step that was taken (`found_non_finite` false) or skipped.
  virtual void update(bool found_non_finite) { (void)found_non_finite; }

  /// 1.1: divides the gradients by the loss scale in place without reading anything back to the
  /// host (the host derives "non-finite" from the gradients' norm). The default calls
  /// unscale_gradients(), so that a strategy that overrides only that stays right, at the cost of
  /// the host's wait; a strategy without a loss scale overrides this with nothing.
  virtual void unscale_gradients_on_device(const std::vector<at::Tensor>& gradients) {
    // Its "not finite" reaches the host as the gradients' norm: one NaN makes the step skipped.
    if (!unscale_gradients(gradients))
      for (const auto& g : gradients)
        if (g.defined() && g.numel() > 0) {
          g.fill_(std::numeric_limits<double>::quiet_NaN());
          break;
        }
  }

  /// 1.1: update() with the decision on the device: `found_non_finite` is a float tensor of one
  /// element on the gradients' device, 1 after a skipped step, 0 after a taken one. The default
  /// reads it and calls update() (right, with a wait); override it to keep the step wait-free.
  virtual void update_on_device(const at::Tensor& found_non_finite) { update(found_non_finite.item<double>() != 0); }

  /// What this precision does (autocast dtype, TF32 switches, scaler policy and parameters):
  /// printed at start-up and stored in every checkpoint; resuming under a different manifest
  /// is refused unless the user allows it.
  virtual TextMap manifest() const = 0;

  /// Checkpointable state (loss scale, growth tracker, skip count) and its restore.
  virtual State state_dict() const { return {}; }
  virtual void load_state_dict(const State& state) { (void)state; }
};

}  // namespace loom::sdk
