// Loom's own callbacks (the defaults of trainer.callbacks, and early_stopping): what a run writes
// and when it saves, as plugins on the callback seam. Each class is one component of the
// `standard` plugin (standard.cpp lists them).
#pragma once

#include "event_file.hpp"

#include <loom/sdk/callback.hpp>
#include <loom/sdk/options.hpp>

#include <fstream>
#include <memory>
#include <optional>

namespace loom::callbacks {

using sdk::RunContext;

/// The live progress line on the terminal: step, loss, learning rate, throughput, ETA, memory.
/// Redrawn in place on a terminal; plain lines, at most one every 5 s, otherwise.
class Progress final : public sdk::Callback {
 public:
  bool reads_every_step() const override { return false; }  // no step's loss, metrics or norm
  bool reads_gradients() const override { return false; }
  explicit Progress(const sdk::Options&) {}
  void on_run_begin(RunContext& run) override;
  void on_step_end(RunContext& run, const sdk::StepReport& report) override;
  void on_log(RunContext& run, int64_t step, const std::map<std::string, double>& values) override;
  void on_evaluation_end(RunContext& run, const sdk::EvalReport& report) override;
  void on_run_end(RunContext& run, const sdk::RunReport& report) override;
  std::string describe() const override { return "progress: the live line on the terminal"; }

 private:
  void finish();
  bool tty_ = false;
  bool live_ = false;
  double last_plain_ = -1e9;
  double train_seconds_ = 0;
  int64_t steps_timed_ = 0;
};

/// metrics.jsonl in the run folder: one JSON object per on_log ({"step": .., "train/loss": ..}).
/// On resume, lines of steps after the checkpoint (written by the interrupted run) are dropped.
class Jsonl final : public sdk::Callback {
 public:
  bool reads_every_step() const override { return false; }  // no step's loss, metrics or norm
  bool reads_gradients() const override { return false; }
  explicit Jsonl(const sdk::Options&) {}
  void on_run_begin(RunContext& run) override;
  void on_log(RunContext& run, int64_t step, const std::map<std::string, double>& values) override;
  std::string describe() const override { return "jsonl: metrics.jsonl"; }

 private:
  std::filesystem::path path_;
  std::ofstream out_;
};

/// TensorBoard event files in <run>/tensorboard; on resume, a purge marker drops later events.
class TensorBoard final : public sdk::Callback {
 public:
  bool reads_every_step() const override { return false; }  // no step's loss, metrics or norm
  bool reads_gradients() const override { return false; }
  explicit TensorBoard(const sdk::Options&) {}
  void on_run_begin(RunContext& run) override;
  void on_log(RunContext& run, int64_t step, const std::map<std::string, double>& values) override;
  std::string describe() const override { return "tensorboard: event files in tensorboard/"; }

 private:
  // The file is made at the first value logged: a resume refused at its first step, or stopped
  // before it, left an event file of no values in the run's folder.
  std::unique_ptr<EventFileWriter> writer_;
  std::filesystem::path dir_;    ///< where the file goes (empty: not the main rank)
  int64_t purge_from_ = -1;      ///< the resumed timeline's first step: events from it on are cut
};

/// Saves a checkpoint every trainer.checkpoint_every steps (0: after each evaluation), at the last
/// step, and where the run stops early.
class Checkpoint final : public sdk::Callback {
 public:
  bool reads_every_step() const override { return false; }  // no step's loss, metrics or norm
  bool reads_gradients() const override { return false; }
  explicit Checkpoint(const sdk::Options&) {}
  void on_step_end(RunContext& run, const sdk::StepReport& report) override;
  void on_run_end(RunContext& run, const sdk::RunReport& report) override;
  std::string describe() const override { return "checkpoint: step folders in checkpoints/"; }

 private:
  int64_t saved_at_ = -1;
};

/// Keeps best_<metric>.safetensors: the weights of the evaluation with the best value of
/// trainer.best_metric, in the direction the metric declares. Its best value is in each
/// checkpoint, so a resumed run compares against the value of its own past.
class Best final : public sdk::Callback {
 public:
  bool reads_every_step() const override { return false; }  // no step's loss, metrics or norm
  bool reads_gradients() const override { return false; }
  explicit Best(const sdk::Options&) {}
  void on_run_begin(RunContext& run) override;
  void on_evaluation_end(RunContext& run, const sdk::EvalReport& report) override;
  void on_checkpoint_loaded(RunContext& run, const std::filesystem::path& dir) override;
  sdk::State state_dict() const override;
  void load_state_dict(const sdk::State& state) override;
  std::string describe() const override { return "best: best_<metric>.safetensors"; }

 private:
  std::optional<double> best_;
  int64_t step_ = 0;
  std::string metric_;  ///< what best_ measures (empty: a checkpoint from before it was saved)

  /// With no best of `metric` known, the run folder's best_<metric>.safetensors, written by an
  /// earlier session of this run, is its best so far: its metadata's value becomes best_.
  void adopt_best_file(RunContext& run, const std::string& metric, const sdk::MetricSpec& spec, int64_t step);
  bool looked_for_file_ = false;  ///< adopt_best_file ran in this process (once is enough)
};

/// The end-of-run memory line: the estimator's predicted peak against the measured one.
class MemorySummary final : public sdk::Callback {
 public:
  bool reads_every_step() const override { return false; }  // no step's loss, metrics or norm
  bool reads_gradients() const override { return false; }
  explicit MemorySummary(const sdk::Options&) {}
  void on_run_end(RunContext& run, const sdk::RunReport& report) override;
  std::string describe() const override { return "memory_summary: predicted against measured peak"; }
};

/// Stops the run when a metric of the selection split (validation when there is one) has not
/// improved by more than min_delta for `patience` evaluations in a row.
class EarlyStopping final : public sdk::Callback {
 public:
  bool reads_every_step() const override { return false; }  // no step's loss, metrics or norm
  bool reads_gradients() const override { return false; }
  static constexpr loom_option_spec kOptions[] = {
      sdk::option_string("metric", "auto", "metric to watch (\"loss\" or one the model declares); auto: trainer.best_metric"),
      sdk::option_int("patience", "3", "evaluations without improvement before the run stops", "1..1000000"),
      sdk::option_float("min_delta", "0", "an improvement smaller than this does not count", "0.."),
      sdk::option_enum("direction", "auto", "min|max|auto", "which way is better; auto: as the metric declares"),
  };
  explicit EarlyStopping(const sdk::Options& options);
  void on_run_begin(RunContext& run) override;
  void on_checkpoint_loaded(RunContext& run, const std::filesystem::path& dir) override;
  void on_evaluation_end(RunContext& run, const sdk::EvalReport& report) override;
  sdk::State state_dict() const override;
  void load_state_dict(const sdk::State& state) override;
  std::string describe() const override;

 private:
  std::string metric_, direction_option_;
  int64_t patience_;
  double min_delta_;
  sdk::Direction direction_ = sdk::Direction::kMinimize;
  std::optional<double> best_;
  int64_t best_step_ = 0;
  int64_t bad_evaluations_ = 0;
  std::string stopped_;  ///< the reason, once it asked to stop
  std::string saved_metric_, saved_direction_;  ///< what the checkpoint's count was of (empty: older)
};

}  // namespace loom::callbacks
