// The trainable parameters of a run as the optimizer sees them: the model's parameter groups (or
// groups by weight decay), each parameter once however often the module registers it (tied
// weights), frozen groups turned off. The host owns their gradients: it creates, zeroes and clips
// them here; an optimizer plugin (sdk::Optimizer) only turns them into updates.
#pragma once

#include <loom/sdk/model.hpp>
#include <loom/sdk/optimizer.hpp>

#include <string>
#include <vector>

namespace loom::core {

class Parameters {
 public:
  Parameters() = default;

  /// The groups of `model` (after its setup, on its device): its parameter_groups(), and for the
  /// parameters those leave out, a "decay" and a "no_decay" group by Model::decays. A parameter
  /// registered under two names (tied weights) is one parameter, under its first name. Throws
  /// Error for a group that names a tensor that is not a parameter of the module, or for a
  /// parameter in two groups. Turns requires_grad off in frozen groups.
  static Parameters of(sdk::Model& model);

  /// The groups the optimizer updates (frozen and empty groups left out).
  const std::vector<sdk::ParameterGroup>& trainable() const { return trainable_; }
  /// Every distinct parameter of the module, frozen ones included.
  const std::vector<at::Tensor>& all() const { return all_; }

  /// Every trainable parameter's gradient, in a fixed order, each once: a view into one of the
  /// flat buffers (Note [Flat gradients]).
  std::vector<at::Tensor> gradients();
  /// The same gradients as a few flat buffers, one per (device, dtype): what the host does to
  /// every gradient (dividing, the norm, clipping, the reduction across ranks) is one operation
  /// per buffer instead of one per parameter.
  std::vector<at::Tensor> flat_gradients();
  /// Sets every gradient to zero (one fill per buffer).
  void zero_grad();
  /// The flat buffers cut into buckets of about `bytes` (at least one parameter each), each a
  /// contiguous slice of one buffer with the parameters whose gradients it holds; the last
  /// parameters first, as backward produces their gradients first.
  struct Bucket {
    at::Tensor slice;
    std::vector<at::Tensor> params;
  };
  std::vector<Bucket> buckets(int64_t bytes);
  /// Parameters (elements), all and trainable.
  int64_t count() const;
  int64_t trainable_count() const;

 private:
  void bind_gradients();

  std::vector<sdk::ParameterGroup> trainable_;
  std::vector<at::Tensor> all_;
  std::vector<at::Tensor> flats_;                              ///< one per (device, dtype)
  std::vector<std::pair<at::Tensor, at::Tensor>> slices_;      ///< (parameter, its view of a buffer)
};

/// Clips the gradients' global L2 norm to max_norm (no-op when max_norm <= 0); returns the norm
/// before clipping (a 0-dim tensor, on the gradients' device). Each gradient must appear once.
at::Tensor clip_grad_norm(const std::vector<at::Tensor>& gradients, double max_norm);

/// The global L2 norm of `gradients` (a 0-dim tensor on their device, no read).
at::Tensor gradient_norm(const std::vector<at::Tensor>& gradients);

/// What clip_grad_norm multiplies the gradients by: min(1, max_norm / (norm + 1e-6)).
at::Tensor clip_coefficient(const at::Tensor& norm, double max_norm);

}  // namespace loom::core
