// The memory estimator. See estimator.hpp.
#include <loom/core/error.hpp>
#include <loom/core/estimator.hpp>
#include <loom/core/text.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace loom::core {

ActivationFit fit_activations(const std::function<int64_t(int64_t)>& probe, int64_t small, int64_t large,
                              const std::function<int64_t(int64_t)>& eval_probe) {
  if (small < 1 || large <= small) throw Error("estimator: probe sizes must satisfy 1 <= small < large");
  ActivationFit f;
  f.probe_small = small;
  f.probe_large = large;
  f.peak_small = probe(small);
  f.peak_large = probe(large);
  f.per_sample = std::max(0.0, static_cast<double>(f.peak_large - f.peak_small) / static_cast<double>(large - small));
  f.fixed = static_cast<double>(f.peak_small) - f.per_sample * static_cast<double>(small);
  if (eval_probe) {
    const int64_t a = eval_probe(small), b = eval_probe(large);
    f.has_eval = true;
    f.eval_per_sample = std::max(0.0, static_cast<double>(b - a) / static_cast<double>(large - small));
    f.eval_fixed = static_cast<double>(a) - f.eval_per_sample * static_cast<double>(small);
  }
  return f;
}

MemoryEstimate estimate(const ModelStates& states, const ActivationFit& fit, int64_t micro_batch, int64_t devices) {
  MemoryEstimate e;
  e.devices = devices;
  e.micro_batch = micro_batch;
  e.states = states;
  // The prediction is the measured line, fixed + per_sample * b; the breakdown splits it into the
  // model states (counted), workspace (what the line's fixed part holds beyond them) and
  // activations (the rest).
  // The probes run before the table of learning rates exists (the first step makes it): the line
  // holds the other states, and the table comes on top of it (subtracted from the line, it took
  // the activations of a run of 100000 steps to 0 B, and the estimate 35 % under the peak).
  const int64_t probed_states = states.total() - states.rate_table;
  const int64_t total = states.rate_table + std::max<int64_t>(probed_states, static_cast<int64_t>(std::llround(
                                                                                 fit.fixed + fit.per_sample * static_cast<double>(micro_batch))));
  e.workspace = std::max<int64_t>(0, static_cast<int64_t>(std::llround(fit.fixed)) - probed_states);
  e.activations = total - states.total() - e.workspace;
  if (fit.has_eval)
    e.evaluation = states.rate_table + (fit.eval_at > 0 && fit.eval_at == micro_batch
                                            ? fit.eval_peak_at
                                            : static_cast<int64_t>(std::llround(fit.eval_fixed + fit.eval_per_sample *
                                                                                                 static_cast<double>(micro_batch))));
  return e;
}

int64_t largest_micro_batch(const ModelStates& states, const ActivationFit& fit, int64_t target) {
  if (states.total() >= target) return 0;
  const double room = static_cast<double>(target - states.rate_table) - fit.fixed;  // (the table: on top, as above)
  if (room <= 0) return 0;
  int64_t largest = fit.per_sample <= 0 ? INT64_MAX : static_cast<int64_t>(std::floor(room / fit.per_sample));
  // An evaluation that peaks above the step (a recommender ranks the whole catalogue) bounds it too:
  // a batch whose evaluation does not fit ends the run at its first evaluation.
  if (fit.has_eval) {
    const double eval_room = static_cast<double>(target - states.rate_table) - fit.eval_fixed;
    if (eval_room <= 0) return 0;
    if (fit.eval_per_sample > 0)
      largest = std::min(largest, static_cast<int64_t>(std::floor(eval_room / fit.eval_per_sample)));
  }
  return largest;
}

std::string format_estimate(const MemoryEstimate& e, const std::string& device) {
  std::ostringstream out;
  char line[160];
  auto row = [&](const char* what, int64_t bytes, const std::string& note) {
    std::snprintf(line, sizeof line, "  %-18s %12s   %s\n", what, format_bytes(bytes).c_str(), note.c_str());
    out << line;
  };
  out << "per device (" << e.devices << " device" << (e.devices > 1 ? "s, each" : "") << " on " << device
      << "), micro-batch " << e.micro_batch << ":\n";
  row("parameters", e.states.parameters,
      std::to_string(e.states.trainable + e.states.frozen) + " parameters (" + std::to_string(e.states.frozen) + " frozen)");
  for (const auto& [what, bytes] : e.states.held) row(what.c_str(), bytes, "held by the model (Model::held_memory)");
  std::snprintf(line, sizeof line, "  %-18s %12lld   %s\n", "batch per device", static_cast<long long>(e.micro_batch),
                "samples in one forward");
  out << line;
  row("activations", e.activations, "measured per sample, times the micro-batch");
  row("gradients", e.states.gradients, "trainable parameters only");
  row("optimizer states", e.states.optimizer_states, "from the optimizer and the parameters' dtypes");
  if (e.states.rate_table > 0) row("learning rates", e.states.rate_table, "the schedule's rate per step, on the device");
  row("workspace", e.workspace, "what the probes held beyond model states and activations");
  out << "  " << std::string(60, '-') << "\n";
  row("total", e.total(), "the training step's peak");
  if (e.evaluation >= 0)
    row("evaluation", e.evaluation,
        e.evaluation > e.total() ? "an evaluation's peak, above the step's: the run's peak" : "an evaluation's peak (below the step's)");
  return out.str();
}

}  // namespace loom::core
