// The callbacks that act on the run: checkpoint cadence, the best checkpoint, early stopping, and
// the end-of-run memory summary.
#include "standard.hpp"

#include <loom/sdk/files.hpp>
#include <loom/sdk/helpers.hpp>
#include <loom/sdk/log.hpp>
#include <loom/sdk/safetensors.hpp>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>

namespace loom::callbacks {

namespace {

std::string exact(double v) {
  char buffer[32];
  const auto [end, error] = std::to_chars(buffer, buffer + sizeof buffer, v);
  return error == std::errc() ? std::string(buffer, end) : std::to_string(v);
}

// `what` and `whose` name the text and what holds it when it is damaged: a checkpoint's callback
// state, or a best file's metadata.
std::optional<double> read_double(const sdk::TextMap& text, const std::string& key, const char* what = "callback state",
                                  const char* whose = "the checkpoint") {
  auto it = text.find(key);
  if (it == text.end()) return std::nullopt;
  double v = 0;
  const auto [end, error] = std::from_chars(it->second.data(), it->second.data() + it->second.size(), v);
  // (from_chars reads "nan" and "inf": a best of NaN would never be beaten, so neither is a value)
  if (error != std::errc() || end != it->second.data() + it->second.size() || !std::isfinite(v))
    throw sdk::Error(std::string(what) + " '" + key + "' = '" + it->second + "' is not a finite number; " + whose + " is damaged");
  return v;
}

int64_t read_int(const sdk::TextMap& text, const std::string& key, const char* what = "callback state",
                 const char* whose = "the checkpoint") {
  const auto v = read_double(text, key, what, whose);
  if (v && !(*v >= 0 && *v <= 9e15 && *v == std::floor(*v)))  // a step or a count
    throw sdk::Error(std::string(what) + " '" + key + "' = '" + text.at(key) + "' is not a count; " + whose + " is damaged");
  return v ? static_cast<int64_t>(*v) : 0;
}

const sdk::MetricSpec& spec_of(RunContext& run, const std::string& metric, const char* who) {
  auto it = run.metrics().find(metric);
  if (it != run.metrics().end()) return it->second;
  std::string names;
  for (const auto& [name, spec] : run.metrics()) names += (names.empty() ? "" : ", ") + name;
  throw sdk::Error(std::string(who) + ": '" + metric + "' is not a metric of this run's model, which reports " + names);
}

}  // namespace

// ---- checkpoint ----------------------------------------------------------------------------

void Checkpoint::on_step_end(RunContext& run, const sdk::StepReport& report) {
  const int64_t every = run.checkpoint_every();
  const bool due = every > 0 ? report.step % every == 0 : report.evaluated;
  if (!(due || report.last)) return;
  const auto dir = run.save_checkpoint();
  saved_at_ = report.step;
  sdk::log::debug("checkpoint ", dir.string());
}

void Checkpoint::on_run_end(RunContext& run, const sdk::RunReport& report) {
  // A run asked to stop by a callback later in the list than this one ends after on_step_end.
  if (report.steps > report.first_step && saved_at_ != report.steps) {
    run.save_checkpoint();
    saved_at_ = report.steps;
  }
}

// ---- best ----------------------------------------------------------------------------------

// A FIFO or a folder at the best file's path was found at the first evaluation, which ended the
// run without a checkpoint of the steps trained since the last one (probe): checked before them.
// (what the writer would refuse, write_file_durably: a symbolic link it replaces, a copied run's, passes)
void Best::on_run_begin(RunContext& run) {
  if (!run.is_main()) return;
  const auto path = run.run_dir() / "checkpoints" / ("best_" + run.best_metric() + ".safetensors");
  std::error_code ec;
  const auto status = std::filesystem::symlink_status(path, ec);
  if (!ec && std::filesystem::exists(status) && !std::filesystem::is_regular_file(status) &&
      !std::filesystem::is_symlink(status))
    throw sdk::Error(path.string() + " is " + sdk::what_is_at(path) + ", not the run's best weights; move it out of the "
                     "run folder, and Loom writes the file there");
}

void Best::on_evaluation_end(RunContext& run, const sdk::EvalReport& report) {
  if (report.split != run.selection_split()) return;
  const std::string metric = run.best_metric();
  const sdk::MetricSpec& spec = spec_of(run, metric, "best");
  if (metric_ != metric) {
    // A resume with another trainer.best_metric: the checkpoint's best is of another metric (its
    // file, best_<that metric>.safetensors, stays), so this one starts without a best.
    if (!metric_.empty() && best_)
      sdk::log::info("best: the checkpoint's best is of ", metric_, "; trainer.best_metric is now ", metric,
                     ": its best so far is that of best_", metric, ".safetensors where this run wrote one, else this evaluation's");
    if (!metric_.empty()) best_.reset();
    metric_ = metric;
  }
  if (!best_) adopt_best_file(run, metric, spec, report.step);
  const std::optional<double> value = report.value(metric);
  // (NaN, a diverged model's, is no best: as the first it would be beaten by nothing after it)
  // (nor is an evaluation whose loss is not finite: some of its outputs overflowed, whatever its accuracy says)
  if (!value || !std::isfinite(*value) || !std::isfinite(report.loss) ||
      (best_ && !sdk::improves(spec.direction, *value, *best_)))
    return;
  best_ = *value;
  step_ = report.step;
  run.save_weights("best_" + metric + ".safetensors",
                   {{"metric", metric}, {"value", exact(*value)}, {"step", std::to_string(report.step)},
                    {"direction", sdk::direction_name(spec.direction)}});
}

// A session of this run that did not select this callback (trainer.callbacks without best), or
// measured another trainer.best_metric, left a checkpoint without this metric's best; its file was
// then overwritten by the next evaluation, however much worse (probe): the best weights were lost.
// The file is this run's: a resume sets aside the best files of steps after its checkpoint
// (run_folder.cpp), so one still here was written at or before it. A file that does not say what
// it holds (another metric or direction, a step after this one, metadata not Loom's) is replaced, as
// before, with a warning that says so.
void Best::adopt_best_file(RunContext& run, const std::string& metric, const sdk::MetricSpec& spec, int64_t step) {
  if (looked_for_file_) return;
  looked_for_file_ = true;
  const auto path = run.run_dir() / "checkpoints" / ("best_" + metric + ".safetensors");
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return;
  std::string why;
  try {
    sdk::TextMap metadata;
    sdk::map_safetensors(path, &metadata);  // (mapped: the header's pages only are read)
    const auto field = [&](const char* key) {
      auto it = metadata.find(key);
      return it == metadata.end() ? std::string() : it->second;
    };
    const std::optional<double> value = metadata.count("value") ? read_double(metadata, "value", "metadata", "the file") : std::nullopt;
    const int64_t written_at = metadata.count("step") ? read_int(metadata, "step", "metadata", "the file") : -1;
    if (field("metric") != metric)
      why = "it holds the best of '" + field("metric") + "', not of " + metric;
    else if (field("direction") != sdk::direction_name(spec.direction))
      why = "its direction is '" + field("direction") + "', " + metric + "'s is " + sdk::direction_name(spec.direction);
    else if (!value)
      why = "its metadata has no value";
    else if (written_at < 0 || written_at > step)
      why = "it was written at step " + field("step") + ", not before this evaluation's (" + std::to_string(step) + ")";
    else {
      best_ = *value;
      step_ = written_at;
      sdk::log::info("best: ", path.filename().string(), " (", run.format_metric(metric, *value), " at step ", written_at,
                     ") is this run's best so far, which the checkpoint did not carry; only a better evaluation replaces it");
      return;
    }
  } catch (const std::exception& e) {
    why = e.what();
  }
  sdk::log::warn("best: ", path.string(), " is not this run's best of ", metric, " (", why,
                 "): the run's next best evaluation replaces it");
}

namespace {

/// Whether the checkpoint `dir` (<run>/checkpoints/step_*) is another run's (--resume-from into a
/// new name); nothing where either path cannot be resolved (neither is then changed).
std::optional<bool> another_runs(RunContext& run, const std::filesystem::path& dir) {
  std::error_code run_ec, dir_ec;
  const auto run_dir = std::filesystem::weakly_canonical(run.run_dir(), run_ec);
  const auto from = std::filesystem::weakly_canonical(dir, dir_ec).parent_path().parent_path();
  if (run_ec || dir_ec) return std::nullopt;
  return from != run_dir;
}

}  // namespace

void Best::on_checkpoint_loaded(RunContext& run, const std::filesystem::path& dir) {
  // A checkpoint of another run (--resume-from into a new name) brings its best value, not its
  // weights: beating it would be the only way to a best file, and the run could end without one.
  if (!best_ || metric_.empty()) return;
  const std::optional<bool> another = another_runs(run, dir);
  if (!another) return;
  if (*another) {
    sdk::log::info("best: ", dir.string(), " is another run's checkpoint, whose best ", metric_, " (",
                   run.format_metric(metric_, *best_), " at step ", step_, ") is not this run's: its best starts afresh");
    best_.reset();
    return;
  }
  // This run, resumed at an older step: a best file of a later step went aside with that timeline,
  // and a run that never beat the checkpoint's best ended with none (its step folder pruned, the
  // best weights were nowhere). The best of the checkpoint's own step is the weights just loaded:
  // written again now. One of an earlier step went with the later best: the best starts afresh.
  const std::string file = "best_" + metric_ + ".safetensors";
  std::error_code ec;
  // (another trainer.best_metric now: its best starts with the first evaluation, in on_evaluation_end)
  if (metric_ != run.best_metric() || std::filesystem::exists(run.run_dir() / "checkpoints" / file, ec)) return;
  if (step_ == run.step()) {
    const sdk::MetricSpec& spec = spec_of(run, metric_, "best");
    run.save_weights(file, {{"metric", metric_}, {"value", exact(*best_)}, {"step", std::to_string(step_)},
                            {"direction", sdk::direction_name(spec.direction)}});
    sdk::log::info("best: ", file, " written again from the weights of step ", step_, ", the resumed timeline's best (",
                   run.format_metric(metric_, *best_), ")");
    return;
  }
  char step_dir[32];
  std::snprintf(step_dir, sizeof step_dir, "step_%08lld", static_cast<long long>(step_));
  const auto kept = run.run_dir() / "checkpoints" / step_dir;
  sdk::log::warn("best: the resumed timeline's best ", metric_, " (", run.format_metric(metric_, *best_), " at step ", step_,
                 ") has no ", file, " in checkpoints/ (a later step's went aside with its timeline, or it was removed)",
                 std::filesystem::is_directory(kept, ec) ? "; its weights are in " + kept.string() + " (loom eval it)"
                                                          : std::string("; its weights are gone (pruned)"),
                 ": the best file starts afresh with the next evaluation");
  best_.reset();
}

sdk::State Best::state_dict() const {
  sdk::State s;
  if (best_) s.text = {{"value", exact(*best_)}, {"step", std::to_string(step_)}, {"metric", metric_}};
  return s;
}

void Best::load_state_dict(const sdk::State& state) {
  best_ = read_double(state.text, "value");
  step_ = read_int(state.text, "step");
  const auto it = state.text.find("metric");
  metric_ = it == state.text.end() ? "" : it->second;
}

// ---- memory_summary ------------------------------------------------------------------------

void MemorySummary::on_run_end(RunContext& run, const sdk::RunReport& report) {
  if (!run.is_main() || report.predicted_peak <= 0 || report.peak_memory <= 0) return;
  const double error = 100.0 * static_cast<double>(report.predicted_peak - report.peak_memory) /
                       static_cast<double>(report.peak_memory);
  char line[200];
  std::snprintf(line, sizeof line, "memory estimate: predicted peak %s at micro-batch %lld, measured %s (error %+.1f %%)",
                sdk::format_bytes(report.predicted_peak).c_str(), static_cast<long long>(report.plan.micro_batch),
                sdk::format_bytes(report.peak_memory).c_str(), error);
  sdk::log::info(line);
}

// ---- early_stopping ------------------------------------------------------------------------

EarlyStopping::EarlyStopping(const sdk::Options& options)
    : metric_(options.get_string("metric")),
      direction_option_(options.get_string("direction")),
      patience_(options.get_int("patience")),
      min_delta_(options.get_float("min_delta")) {
  if (patience_ < 1) throw sdk::Error("callback.early_stopping.patience = " + std::to_string(patience_) + " must be at least 1");
  if (min_delta_ < 0) throw sdk::Error("callback.early_stopping.min_delta must be >= 0 (it is how much better counts)");
}

void EarlyStopping::on_run_begin(RunContext& run) {
  if (metric_ == "auto") metric_ = run.best_metric();
  const sdk::MetricSpec& spec = spec_of(run, metric_, "callback.early_stopping.metric");
  direction_ = direction_option_ == "auto" ? spec.direction
               : direction_option_ == "max" ? sdk::Direction::kMaximize
                                            : sdk::Direction::kMinimize;
  sdk::log::info(describe(), " on the ", sdk::split_name(run.selection_split()), " split");
  const std::string direction = sdk::direction_name(direction_);
  if ((!saved_metric_.empty() && saved_metric_ != metric_) || (!saved_direction_.empty() && saved_direction_ != direction)) {
    // The checkpoint counted evaluations of another metric (or the other way round): its best and
    // its count say nothing of this one, so both start afresh, and a stop they made is lifted.
    sdk::log::warn("early_stopping: the checkpoint watched ", saved_metric_, " (", saved_direction_, "), this run watches ",
                   metric_, " (", direction, "): its best and its count of evaluations without improvement start afresh");
    best_.reset();
    best_step_ = 0;
    bad_evaluations_ = 0;
    stopped_.clear();
  }
  saved_metric_ = metric_;
  saved_direction_ = direction;
  if (stopped_.empty()) return;
  if (bad_evaluations_ < patience_) {
    // Resumed with a higher patience: the user asks for more evaluations than the stop allowed.
    sdk::log::info("early_stopping: the checkpoint's run had stopped (", stopped_, "); with patience ", patience_,
                   " it goes on (", bad_evaluations_, bad_evaluations_ == 1 ? " evaluation" : " evaluations",
                   " without improvement so far)");
    stopped_.clear();
    return;
  }
  // A run that already stopped early stays stopped when resumed, and says how to go on.
  run.request_stop(stopped_ + "; resumed with patience " + std::to_string(patience_) +
                   ": to train on, resume with callback.early_stopping.patience above " + std::to_string(bad_evaluations_) +
                   " or without the early_stopping callback");
}

void EarlyStopping::on_checkpoint_loaded(RunContext& run, const std::filesystem::path& dir) {
  // Another run's checkpoint (--resume-from into a new name): its count, its best and its stop are
  // that run's, as `best` says of its best (README); kept, the new run stopped at its first
  // evaluation, naming the other run's best step, or at once, training nothing.
  if (another_runs(run, dir) != std::optional<bool>(true) || (!best_ && bad_evaluations_ == 0 && stopped_.empty())) return;
  sdk::log::info("early_stopping: ", dir.string(), " is another run's checkpoint: its count of evaluations without improvement (",
                 bad_evaluations_, ")", best_ ? ", its best" : "", stopped_.empty() ? "" : " and its stop",
                 " are not this run's: they start afresh");
  best_.reset();
  best_step_ = 0;
  bad_evaluations_ = 0;
  stopped_.clear();
  saved_metric_.clear();  // (on_run_begin would say "start afresh" again where the metric differs)
  saved_direction_.clear();
}

void EarlyStopping::on_evaluation_end(RunContext& run, const sdk::EvalReport& report) {
  if (report.split != run.selection_split()) return;
  const std::optional<double> value = report.value(metric_);
  if (value && std::isfinite(*value) && (!best_ || sdk::improves(direction_, *value, *best_, min_delta_))) {
    best_ = *value;
    best_step_ = report.step;
    bad_evaluations_ = 0;
    return;
  }
  ++bad_evaluations_;
  if (bad_evaluations_ < patience_) return;
  stopped_ = "early_stopping: " + std::string(sdk::split_name(report.split)) + " " + metric_ + " has not improved" +
             (min_delta_ > 0 ? " by more than " + exact(min_delta_) : std::string()) + " for " +
             std::to_string(bad_evaluations_) + (bad_evaluations_ == 1 ? " evaluation" : " evaluations") +
             (best_ ? " (best " + run.format_metric(metric_, *best_) + " at step " + std::to_string(best_step_) + ")"
                    : std::string(" (never measured)"));
  run.request_stop(stopped_);
}

sdk::State EarlyStopping::state_dict() const {
  sdk::State s;
  s.text = {{"bad_evaluations", std::to_string(bad_evaluations_)}, {"best_step", std::to_string(best_step_)}};
  if (best_) s.text["best"] = exact(*best_);
  if (!stopped_.empty()) s.text["stopped"] = stopped_;
  s.text["metric"] = saved_metric_.empty() ? metric_ : saved_metric_;
  s.text["direction"] = saved_direction_;
  return s;
}

void EarlyStopping::load_state_dict(const sdk::State& state) {
  best_ = read_double(state.text, "best");
  best_step_ = read_int(state.text, "best_step");
  bad_evaluations_ = read_int(state.text, "bad_evaluations");
  const auto text = [&](const char* key) {
    const auto it = state.text.find(key);
    return it == state.text.end() ? std::string() : it->second;
  };
  stopped_ = text("stopped");
  saved_metric_ = text("metric");
  saved_direction_ = text("direction");
}

std::string EarlyStopping::describe() const {
  return "early stopping on " + metric_ + " (" + sdk::direction_name(direction_) +
         "), patience " + std::to_string(patience_) + (patience_ == 1 ? " evaluation" : " evaluations") +
         ", min_delta " + exact(min_delta_);
}

}  // namespace loom::callbacks
