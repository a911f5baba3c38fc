// The training loop: steps until the end, the logging, evaluation and checkpoint cadence, the
// best checkpoint, the final test evaluation and the run's summary.
#include <loom/core/checkpoint.hpp>
#include <loom/core/device_memory.hpp>
#include <loom/core/estimator.hpp>
#include <loom/core/log.hpp>
#include <loom/core/metrics.hpp>
#include <loom/core/text.hpp>
#include <loom/core/trainer.hpp>
#include "trainer_internal.hpp"

#include <nlohmann/json.hpp>

#include <cstdio>

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace loom::core {

using namespace detail;

TrainSummary Trainer::train() {
  TrainSummary summary;
  summary.run_dir = run_dir_;
  const int64_t per_epoch = std::max<int64_t>(1, train_loader_->batches_per_epoch() / plan_.accumulation);
  const int64_t eval_every = options_.eval_every > 0 ? options_.eval_every : per_epoch;
  const int64_t checkpoint_every = options_.checkpoint_every > 0 ? options_.checkpoint_every : eval_every;
  std::optional<double> best = checkpoints_->best_value(options_.best_metric);
  Progress progress(total_steps_);
  const int64_t first_step = step_;
  memory_->reset_peak();
  double train_seconds = 0;
  double window_seconds = 0, window_loss = 0;
  int64_t window_steps = 0, window_samples = 0;
  std::map<std::string, double> window_metrics;
  std::optional<EvalResult> last_eval;

  auto checkpoint = [&] {
    progress.finish();
    const auto dir = save_checkpoint();
    log::debug("checkpoint ", dir.string());
  };

  while (step_ < total_steps_) {
    const auto start = Clock::now();
    const StepResult r = in_phase("training step " + std::to_string(step_ + 1), [&] { return step_with_recovery(); });
    const double dt = seconds_since(start);
    train_seconds += dt;
    window_seconds += dt;
    window_loss += r.loss;
    window_samples += r.samples;
    ++window_steps;
    for (const auto& [k, v] : r.metrics) window_metrics[k] += v;

    const double rate = window_samples / std::max(1e-9, window_seconds);
    const double eta = (total_steps_ - step_) * (train_seconds / std::max<int64_t>(1, step_ - first_step));
    if (step_ % options_.log_every == 0 || step_ == total_steps_) {
      const sdk::MemoryStats mem = memory_->stats();
      std::map<std::string, double> m{{"train/loss", window_loss / window_steps},
                                      {"train/lr", r.lr},
                                      {"train/samples_per_s", rate},
                                      {"train/grad_norm", r.grad_norm},
                                      {"train/epoch", static_cast<double>(train_loader_->position().epoch)},
                                      {"train/skipped_steps", static_cast<double>(skipped_steps_)},
                                      {"train/skipped_rate", static_cast<double>(skipped_steps_) / std::max<int64_t>(1, step_)},
                                      {"memory/allocated_bytes", static_cast<double>(mem.allocated)},
                                      {"memory/reserved_bytes", static_cast<double>(mem.reserved)},
                                      {"memory/peak_bytes", static_cast<double>(mem.peak)}};
      for (const auto& [k, v] : window_metrics) m["train/" + k] = v / window_steps;
      metrics_->write(step_, m);
      char fields[256];
      std::snprintf(fields, sizeof fields, "loss %.4f | lr %.2e | %.0f samples/s | ETA %s | mem %s (peak %s)",
                    window_loss / window_steps, r.lr, rate, format_duration(eta).c_str(),
                    format_bytes(mem.allocated).c_str(), format_bytes(mem.peak).c_str());
      progress.update(step_, fields);
      window_seconds = window_loss = 0;
      window_steps = window_samples = 0;
      window_metrics.clear();
    }

    const bool last = step_ == total_steps_;
    if (step_ % eval_every == 0 || last) {
      // Validation picks the best checkpoint; without a validation split, the test split does.
      const sdk::Split split = val_loader_ ? sdk::Split::kValidation : sdk::Split::kTest;
      if (eval_loader(split)) {
        const EvalResult e = in_phase("evaluation at step " + std::to_string(step_), [&] { return evaluate(split); });
        last_eval = e;
        progress.finish();
        report_evaluation(e);
        const auto& best_spec = metric_specs_.at(options_.best_metric);
        const std::optional<double> it = e.value(best_spec.name);
        if (it && (!best || sdk::improves(best_spec.direction, *it, *best))) {
          best = *it;
          in_phase("saving the best checkpoint at step " + std::to_string(step_), [&] {
            const json state = json::parse(state_json());
            checkpoints_->save_best(options_.best_metric, *it, step_, model_tensors(),
                                    {{"model", state["model"].dump()}, {"data", state["data"].dump()}});
          });
        }
      }
    }
    if (step_ % checkpoint_every == 0 || last)
      in_phase("saving the checkpoint of step " + std::to_string(step_), [&] { checkpoint(); });
  }
  progress.finish();
  // The test split, once, at the end (when validation chose the best checkpoint).
  if (val_loader_ && test_loader_ && step_ > first_step) {
    last_eval = in_phase("the final test evaluation", [&] { return evaluate(sdk::Split::kTest); });
    report_evaluation(*last_eval);
  }
  summary.steps = step_;
  summary.seconds = train_seconds;
  summary.samples_per_second = (step_ - first_step) * plan_.global() / std::max(1e-9, train_seconds);
  summary.final_eval = last_eval;
  summary.peak_memory = memory_->stats().peak;
  summary.peak_resident = peak_resident_bytes();
  if (fit_) predicted_peak_ = estimate(model_states(), *fit_, plan_.micro_batch).total();  // the final plan
  summary.predicted_peak = predicted_peak_;
  summary.oom_recoveries = oom_recoveries_;
  summary.recovery_seconds = recovery_seconds_;
  if (predicted_peak_ > 0 && summary.peak_memory > 0) {
    const double error = 100.0 * static_cast<double>(predicted_peak_ - summary.peak_memory) / static_cast<double>(summary.peak_memory);
    char line[160];
    std::snprintf(line, sizeof line, "memory estimate: predicted peak %s at micro-batch %lld, measured %s (error %+.1f %%)",
                  format_bytes(predicted_peak_).c_str(), static_cast<long long>(plan_.micro_batch),
                  format_bytes(summary.peak_memory).c_str(), error);
    log::info(line);
  }
  if (!options_.memory_snapshot.empty() && device_.is_cuda()) {
    write_memory_snapshot(device_, options_.memory_snapshot);
    log::info("memory snapshot written to ", options_.memory_snapshot, " (open it at https://pytorch.org/memory_viz)");
  }
  return summary;
}

}  // namespace loom::core
