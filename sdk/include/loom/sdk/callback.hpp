// Tier-1 interface of callbacks: code that runs at fixed points of a training run without being
// part of the loop. The host's writers (progress line, metrics.jsonl, TensorBoard), checkpoint
// cadence, best-checkpoint tracking, the end-of-run memory summary and early stopping are
// callbacks; a run selects them, in order, with trainer.callbacks.
//
// Order of the hooks in one run (Lightning's names):
//   on_run_begin
//   per step:  on_step_begin -> on_after_backward -> on_before_optimizer_step (not for a skipped
//              update on the host path; with trainer.device_step the skip is decided on the
//              device and the hook runs before every update, whose gradients then may hold inf
//              or NaN) -> [on_log every trainer.log_every steps] -> [evaluation: on_log of its
//              values, on_evaluation_end] -> on_step_end (which sees whether the step evaluated)
//   after the last step: [the test evaluation: on_log, on_evaluation_end] -> on_run_end
//   on_checkpoint_saved after any checkpoint is written; on_checkpoint_loaded after a resume
// A step that runs out of memory unwinds and replays: on_after_backward may then be called again
// for the same step (on_before_optimizer_step is not: it comes after the step's commit point).
// Callbacks are called in the order trainer.callbacks lists them, on the main thread.
//
// The host implements RunContext: what a callback may ask of the run (its folder, the step, the
// metric specs) and do to it (save a checkpoint or the weights, ask it to stop). Checkpoint IO
// stays in the host; a callback decides when.
#pragma once

#include <loom/sdk/abi.h>
#include <loom/sdk/types.hpp>

#include <cmath>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace loom::sdk {

/// One optimizer step, as it ended.
///
/// loss, metrics, lr, grad_norm, skipped and samples live on the device until the host reads
/// them (with trainer.device_step, the default), and each read makes the host wait for the
/// device. They are read on every step when some callback of the run reads every step
/// (Callback::reads_every_step, true unless a callback says otherwise), else only on log steps
/// (trainer.log_every, the last step): between those, loss, lr and grad_norm are NaN, metrics
/// empty, skipped false and samples 0. on_log always gets the window's means.
struct StepReport {
  int64_t step = 0;            ///< the step just taken, 1-based
  int64_t total_steps = 0;
  int64_t epoch = 0;           ///< the training data's pass the step read from (0-based)
  double loss = 0;             ///< mean over the global batch (NaN where not read, above)
  std::map<std::string, double> metrics;  ///< the model's metrics over the global batch
  double lr = 0;
  double grad_norm = 0;        ///< before clipping; NaN for a skipped update (its norm was not finite)
  bool skipped = false;        ///< non-finite gradients: no update
  int64_t samples = 0;
  double seconds = 0;          ///< this step's wall time (replays after running out of memory included)
  BatchPlan plan;              ///< the plan the step ran with
  MemoryStats memory;          ///< device memory after the step
  bool evaluated = false;      ///< an evaluation ran after this step (on_step_end only)
  bool last = false;           ///< no step follows: the end, or a callback asked to stop (on_step_end only)
};

/// One evaluation over a whole split.
struct EvalReport {
  Split split = Split::kValidation;
  int64_t step = 0;            ///< the optimizer steps taken before it
  double loss = 0;
  std::map<std::string, double> metrics;  ///< sum / count per metric; NaN where a count was 0
  int64_t samples = 0;
  double seconds = 0;
  /// The value of "loss" or a metric, if measured and finite.
  std::optional<double> value(const std::string& name) const {
    if (name == "loss") return std::isfinite(loss) ? std::optional<double>(loss) : std::nullopt;
    auto it = metrics.find(name);
    return it != metrics.end() && std::isfinite(it->second) ? std::optional<double>(it->second) : std::nullopt;
  }
};

/// The run, as it ended.
struct RunReport {
  int64_t first_step = 0;         ///< where this process started (the resumed step, else 0)
  int64_t steps = 0;              ///< the step it ended at
  double seconds = 0;             ///< training time, evaluations excluded
  double samples_per_second = 0;
  BatchPlan plan;                 ///< the final plan
  int64_t peak_memory = -1;       ///< bytes allocated on the device at the peak (CPU: Loom's allocator), of the
                                  ///< final plan (after an out-of-memory re-plan, since it)
  int64_t predicted_peak = -1;    ///< the estimator's prediction for the final plan; -1 if it did not run
  int64_t oom_recoveries = 0;
  std::string stop_reason;        ///< why it stopped before the end (a callback's request), else empty
};

/// The run, as callbacks see it. Implemented by the host; valid during a hook.
class LOOM_SDK_API RunContext {
 public:
  virtual ~RunContext();  // defined in libloom_sdk: its type info has one home

  /// The run folder (<work_dir>/<name>).
  virtual std::filesystem::path run_dir() const = 0;
  /// Whether this process writes the run's files (rank 0; always true on one device).
  virtual bool is_main() const = 0;
  virtual int64_t step() const = 0;
  virtual int64_t total_steps() const = 0;
  /// Optimizer steps in one pass over the training data. An epoch's end is a multiple of it from
  /// step 0 only in a run that kept its batch: a resume at another batch goes on from where its
  /// checkpoint stood, so its epochs (and with trainer.eval_every = 0 its evaluations) end off
  /// those multiples. A cadence of evaluations is on_evaluation_end's, not step % eval_every().
  virtual int64_t steps_per_epoch() const = 0;
  /// The step this process resumed at, or -1 for a fresh run.
  virtual int64_t resumed_at() const = 0;
  /// The metrics of the run's model, "loss" included, with their directions.
  virtual const std::map<std::string, MetricSpec>& metrics() const = 0;
  /// "accuracy 88.89 %", "RMSE 0.8123": a metric as its spec says to show it.
  virtual std::string format_metric(const std::string& name, double value) const = 0;
  /// The run's cadence and choices: trainer.eval_every resolved (steps between evaluations),
  /// trainer.checkpoint_every resolved (0: at each evaluation), trainer.best_metric resolved
  /// (auto: the model's first metric), trainer.keep_last.
  virtual int64_t eval_every() const = 0;
  virtual int64_t checkpoint_every() const = 0;
  virtual std::string best_metric() const = 0;
  /// The split that evaluations during training use (validation when the run has one).
  virtual Split selection_split() const = 0;

  /// Writes a checkpoint of the current step (model, optimizer, schedule, precision, RNG, data
  /// position, every callback's state) and returns its folder. Only steps counted from
  /// on_step_end on; keeps trainer.keep_last of them.
  virtual std::filesystem::path save_checkpoint() = 0;
  /// Writes the model's weights to <run>/checkpoints/<file_name> (a plain name ending in
  /// .safetensors), atomically, with the model's and data's configuration and `metadata`
  /// in its metadata, so `loom eval --checkpoint` can load it. Names starting with "best_" are
  /// the `best` callback's (the run's best weights, which eval and init_from take by name).
  virtual std::filesystem::path save_weights(const std::string& file_name, const TextMap& metadata) = 0;
  /// Asks the run to stop after the current step (it still saves and reports). The first
  /// reason is kept.
  virtual void request_stop(const std::string& reason) = 0;
  virtual bool stop_requested() const = 0;
};

class LOOM_SDK_API Callback {
 public:
  using Interface = Callback;
  static constexpr uint32_t kKind = LOOM_KIND_CALLBACK;
  static constexpr uint32_t kInterfaceMajor = 1;
  static constexpr uint32_t kInterfaceMinor = 2;  // 1.1: reads_every_step; 1.2: reads_gradients

  virtual ~Callback();  // defined in libloom_sdk

  /// 1.1: whether on_step_end reads the step's loss, metrics, grad_norm, skipped or samples on
  /// every step (see StepReport). Return false if it does not: the host then reads them from the
  /// device on log steps only, and steps in between do not wait for the device. The default, and
  /// every callback built against 1.0, reads every step.
  virtual bool reads_every_step() const { return true; }

  virtual void on_run_begin(RunContext& run) { (void)run; }
  /// `step` is the step about to run, 1-based.
  virtual void on_step_begin(RunContext& run, int64_t step) { (void)run, (void)step; }
  /// The gradients summed over micro-batches and ranks and divided by the global count, before
  /// unscaling and clipping (a loss-scaled strategy's are still scaled). Read them; changing
  /// them changes the update.
  virtual void on_after_backward(RunContext& run, const std::vector<at::Tensor>& gradients) { (void)run, (void)gradients; }
  /// The final gradients (unscaled, clipped), just before the optimizer uses them (or, with
  /// trainer.device_step, skips them on the device: StepReport::skipped says which, later).
  virtual void on_before_optimizer_step(RunContext& run, const std::vector<at::Tensor>& gradients) {
    (void)run, (void)gradients;
  }
  /// Values to record at `step`: the training window's means ("train/loss", "train/lr",
  /// "train/samples_per_s", "memory/peak_bytes", ...) every trainer.log_every steps, and each
  /// evaluation's ("val/accuracy", "test/loss", ...). NaN where a value was not measured.
  virtual void on_log(RunContext& run, int64_t step, const std::map<std::string, double>& values) {
    (void)run, (void)step, (void)values;
  }
  virtual void on_evaluation_end(RunContext& run, const EvalReport& report) { (void)run, (void)report; }
  virtual void on_step_end(RunContext& run, const StepReport& report) { (void)run, (void)report; }
  virtual void on_checkpoint_saved(RunContext& run, const std::filesystem::path& dir) { (void)run, (void)dir; }
  /// After a resume restored every component, this callback's state included.
  virtual void on_checkpoint_loaded(RunContext& run, const std::filesystem::path& dir) { (void)run, (void)dir; }
  virtual void on_run_end(RunContext& run, const RunReport& report) { (void)run, (void)report; }

  /// Its state, saved in every checkpoint (under callback.<name>.) and restored on resume.
  virtual State state_dict() const { return {}; }
  virtual void load_state_dict(const State& state) { (void)state; }

  /// One line for the start-up report ("early stopping on val accuracy: patience 3").
  virtual std::string describe() const { return {}; }

  /// 1.2: whether on_after_backward or on_before_optimizer_step reads or changes the gradients.
  /// Return false if neither does: when no callback does, the host hands the division by the
  /// global count and the clipping factor to the optimizer's update (Optimizer::
  /// step_on_device_dividing), which reads the gradients once instead of three times, and the
  /// gradients the two hooks are given are then the summed ones, not yet divided or clipped.
  /// The default, and every callback built against 1.0 or 1.1, reads them. (At the end: a
  /// method added in a minor is appended, docs/abi.md, "Tier 1".)
  virtual bool reads_gradients() const { return true; }
};

}  // namespace loom::sdk
