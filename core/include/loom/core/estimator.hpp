// The memory estimator: per device, what a run's memory is made of.
//
//   parameters, gradients, optimizer states   from parameter counts, dtypes and the optimizer
//                                             (frozen parameters have no gradient or state)
//   activations                               measured: two probes of small micro-batches on
//   workspace                                 the real device (or the CPU under the budget
//                                             allocator) fit peak = fixed + per_sample * b; the
//                                             fixed part beyond the model states is workspace
//
// and the peak it predicts for any micro-batch, the largest micro-batch under a target, and, at
// the end of a run, its error against the measured peak.
#pragma once

#include <cstdint>
#include <algorithm>
#include <functional>
#include <map>
#include <string>

namespace loom::core {

struct ModelStates {
  int64_t parameters = 0;        ///< bytes of all parameters
  int64_t gradients = 0;         ///< bytes of the gradients of trainable parameters
  int64_t optimizer_states = 0;  ///< AdamW: two moments and a step per trainable parameter; SGD: momentum
  int64_t trainable = 0, frozen = 0;  ///< parameter counts
  /// What the model holds besides its parameters, by what it is (Model::held_memory, 2.1): a
  /// recommender's "cached embeddings".
  std::map<std::string, int64_t> held;
  int64_t held_total() const {
    int64_t n = 0;
    for (const auto& [what, bytes] : held) n += bytes;
    return n;
  }
  /// The step on the device's table of the schedule's learning rate per step (trainer.device_step):
  /// 8 bytes a step on CPU, 4 on CUDA; 8 MB for a run of a million steps.
  int64_t rate_table = 0;
  int64_t total() const { return parameters + held_total() + gradients + optimizer_states + rate_table; }
};

struct ActivationFit {
  int64_t probe_small = 0, probe_large = 0;  ///< micro-batches probed
  int64_t peak_small = 0, peak_large = 0;    ///< their measured peaks
  double per_sample = 0;                     ///< activation bytes per sample
  double fixed = 0;                          ///< peak at batch 0: model states + workspace
  /// The same line for an evaluation forward (no gradients) at the same probes: a model whose
  /// evaluation does more than its training step (a recommender ranks the whole catalogue) peaks
  /// there. has_eval false: not probed.
  bool has_eval = false;
  double eval_per_sample = 0, eval_fixed = 0;
  /// The evaluation measured at one micro-batch, the run's own (0: not measured), which `estimate`
  /// gives there instead of the line's: an evaluation need not be a line in the batch (the
  /// recommender scores the catalogue in chunks of a fixed size: it grows, then levels off; the
  /// line through a quarter and half of the batch put it 80 % above the run's measured peak).
  int64_t eval_at = 0, eval_peak_at = 0;
};

struct MemoryEstimate {
  int64_t devices = 1;
  int64_t micro_batch = 0;  ///< per device
  ModelStates states;
  int64_t activations = 0;
  int64_t workspace = 0;
  int64_t total() const { return states.total() + activations + workspace; }
  int64_t evaluation = -1;  ///< an evaluation forward's peak at the micro-batch; -1: not probed
  /// The run's peak: the training step's, or an evaluation's where that is larger.
  int64_t peak() const { return std::max(total(), evaluation); }
};

/// Fits activations from two probes (probe(b) returns the peak bytes of a forward and backward
/// at micro-batch b, model states included).
/// `eval_probe`, if given, is probed at the same sizes for the evaluation line.
ActivationFit fit_activations(const std::function<int64_t(int64_t)>& probe, int64_t small, int64_t large,
                              const std::function<int64_t(int64_t)>& eval_probe = nullptr);

/// The estimate for a micro-batch per device.
MemoryEstimate estimate(const ModelStates& states, const ActivationFit& fit, int64_t micro_batch, int64_t devices = 1);

/// The largest micro-batch whose estimate fits under `target` bytes, its evaluation's peak too
/// where probed (the run's peak: MemoryEstimate::peak), or 0 when none does.
int64_t largest_micro_batch(const ModelStates& states, const ActivationFit& fit, int64_t target);

/// The per-device table, as seed 002 lays it out.
std::string format_estimate(const MemoryEstimate& e, const std::string& device);

}  // namespace loom::core
