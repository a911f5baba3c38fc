// Mixed precision building blocks for precision plugins: an autocast scope, a finiteness check
// of gradients, and a gradient scaler (LibTorch has none: pytorch/pytorch#44710).
//
// GradScaler follows torch.amp.GradScaler: the loss is multiplied by the scale before
// backward; once per optimizer step the gradients are divided by it (one fused kernel that also
// detects inf/NaN, at::_amp_foreach_non_finite_check_and_unscale_); a step with non-finite
// gradients is skipped; then the scale is updated (at::_amp_update_scale_): halved after an
// overflow, doubled after `growth_interval` finite steps in a row. A static scale never changes.
#pragma once

#include <loom/sdk/compat.hpp>
#include <loom/sdk/error.hpp>
#include <loom/sdk/types.hpp>

#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/_amp_update_scale.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

namespace loom::sdk {

/// Autocast to `dtype` on `device_type` for the lifetime of the guard; restores the previous
/// state (and clears the cast cache when the outermost guard ends), as Python's torch.autocast.
/// Thread-local: create it on the thread that runs forward, and run backward outside it.
class AutocastGuard {
 public:
  AutocastGuard(c10::DeviceType device_type, at::ScalarType dtype)
      : device_type_(device_type),
        previous_enabled_(at::autocast::is_autocast_enabled(device_type)),
        previous_dtype_(at::autocast::get_autocast_dtype(device_type)),
        previous_cache_(at::autocast::is_autocast_cache_enabled()) {
    at::autocast::set_autocast_enabled(device_type, true);
    at::autocast::set_autocast_dtype(device_type, dtype);
    at::autocast::increment_nesting();
  }
  ~AutocastGuard() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(device_type_, previous_enabled_);
    at::autocast::set_autocast_dtype(device_type_, previous_dtype_);
    at::autocast::set_autocast_cache_enabled(previous_cache_);
  }
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  c10::DeviceType device_type_;
  bool previous_enabled_;
  at::ScalarType previous_dtype_;
  bool previous_cache_;
};

/// Gradients grouped by device, in order of first appearance (the fused kernels take one
/// device at a time).
inline std::vector<std::pair<c10::Device, std::vector<at::Tensor>>> by_device(const std::vector<at::Tensor>& tensors) {
  std::vector<std::pair<c10::Device, std::vector<at::Tensor>>> out;
  for (const auto& t : tensors) {
    if (!t.defined()) continue;
    auto it = std::find_if(out.begin(), out.end(), [&](const auto& g) { return g.first == t.device(); });
    if (it == out.end()) out.emplace_back(t.device(), std::vector<at::Tensor>{t});
    else it->second.push_back(t);
  }
  return out;
}

/// Multiplies the gradients by `inverse_scale` in place (skipped when it is 1) and returns a
/// float tensor per device that is 1 where some gradient holds an inf or a NaN.
inline std::vector<at::Tensor> unscale_and_check(const std::vector<at::Tensor>& gradients, double inverse_scale) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> found;
  for (auto& [device, grads] : by_device(gradients)) {
    auto options = at::TensorOptions().dtype(at::kFloat).device(device);
    at::Tensor found_inf = at::zeros({1}, options);
    const at::Tensor inverse = at::full({1}, inverse_scale, options);
    at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inverse);
    found.push_back(found_inf);
  }
  return found;
}

/// Whether every gradient is finite (one synchronization).
inline bool all_finite(const std::vector<at::Tensor>& gradients) {
  double found = 0;
  for (const auto& f : unscale_and_check(gradients, 1.0)) found += f.item<double>();
  return found == 0;
}

class GradScaler {
 public:
  struct Options {
    bool dynamic = true;
    double init_scale = 65536.0;     ///< 2^16, as PyTorch
    double growth_factor = 2.0;
    double backoff_factor = 0.5;
    int64_t growth_interval = 2000;
  };

  explicit GradScaler(Options options) : options_(options) {
    if (options_.init_scale <= 0) throw Error("loss scale must be positive, got " + std::to_string(options_.init_scale));
    if (options_.growth_factor <= 1 || options_.backoff_factor <= 0 || options_.backoff_factor >= 1 ||
        options_.growth_interval < 1)
      throw Error("loss scaler: growth_factor must be > 1, backoff_factor in (0, 1), growth_interval >= 1");
    scale_ = at::full({1}, options_.init_scale, at::TensorOptions().dtype(at::kFloat));
    growth_tracker_ = at::zeros({1}, at::TensorOptions().dtype(at::kInt));
  }

  /// Moves the scale to the device of the loss (once).
  at::Tensor scale(const at::Tensor& loss) {
    if (scale_.device() != loss.device()) {
      scale_ = scale_.to(loss.device());
      growth_tracker_ = growth_tracker_.to(loss.device());
    }
    return loss * scale_.squeeze();
  }

  /// Divides the gradients by the scale, in place; returns whether all are finite.
  bool unscale(const std::vector<at::Tensor>& gradients) {
    const double inverse = 1.0 / current_scale();
    double found = 0;
    for (const auto& f : unscale_and_check(gradients, inverse)) found += f.to(at::kCPU).item<double>();
    found_inf_ = found > 0;
    return !found_inf_;
  }

  /// Divides the gradients by the scale, in place, on their device: the inverse is computed
  /// there, nothing is read back (PrecisionStrategy 1.1).
  void unscale_on_device(const std::vector<at::Tensor>& gradients) {
    at::NoGradGuard no_grad;
    for (auto& [device, grads] : by_device(gradients)) {
      if (scale_.device() != device) {
        scale_ = scale_.to(device);
        growth_tracker_ = growth_tracker_.to(device);
      }
      at::Tensor ignored = at::zeros({1}, scale_.options());  // the host finds non-finite from the norm
      at::_amp_foreach_non_finite_check_and_unscale_(grads, ignored, scale_.reciprocal());
    }
  }

  /// After the step (taken or skipped): halves the scale after an overflow, grows it after
  /// growth_interval finite steps. A static scale stays as it is.
  void update(bool found_non_finite) {
    if (!options_.dynamic) return;
    update_on_device(at::full({1}, found_non_finite ? 1.0 : 0.0, scale_.options()));
  }

  /// update() with `found_non_finite` (one float element, 1 = skipped) on the scale's device.
  void update_on_device(const at::Tensor& found_non_finite) {
    if (!options_.dynamic) return;
    at::Tensor found = found_non_finite.to(scale_.device(), at::kFloat).reshape({1});
    at::_amp_update_scale_(scale_, growth_tracker_, found, options_.growth_factor, options_.backoff_factor,
                           options_.growth_interval);
  }

  double current_scale() const { return scale_.to(at::kCPU).item<double>(); }
  int64_t growth_tracker() const { return growth_tracker_.to(at::kCPU).item<int64_t>(); }
  const Options& options() const { return options_; }

  /// "dynamic (init 65536, x2 after 2000 finite steps, x0.5 on overflow)" or "static 512".
  std::string describe() const {
    char buffer[160];
    if (options_.dynamic)
      std::snprintf(buffer, sizeof buffer, "dynamic (init %g, x%g after %lld finite steps, x%g on overflow)",
                    options_.init_scale, options_.growth_factor, static_cast<long long>(options_.growth_interval),
                    options_.backoff_factor);
    else
      std::snprintf(buffer, sizeof buffer, "static %g", options_.init_scale);
    return buffer;
  }

  State state_dict() const {
    State s;
    s.tensors["scale"] = scale_.to(at::kCPU);
    s.tensors["growth_tracker"] = growth_tracker_.to(at::kCPU);
    s.text["scaler"] = describe();
    return s;
  }

  void load_state_dict(const State& s) {
    auto scale = s.tensors.find("scale"), tracker = s.tensors.find("growth_tracker");
    if (scale == s.tensors.end() || tracker == s.tensors.end())
      throw Error("the checkpoint has no loss-scaler state (scale, growth_tracker)");
    if (!options_.dynamic) return;  // a static scale is configuration, not state
    scale_ = scale->second.to(scale_.device(), at::kFloat).reshape({1}).clone();
    growth_tracker_ = tracker->second.to(growth_tracker_.device(), at::kInt).reshape({1}).clone();
  }

 private:
  Options options_;
  at::Tensor scale_, growth_tracker_;
  bool found_inf_ = false;
};

}  // namespace loom::sdk
