// The run's callbacks: building them from trainer.callbacks, calling their hooks (an error names
// the callback and the hook), the weights files they may ask for, and what the loop reports to
// them (the logged values of a window of steps, a step's report, an evaluation, the run's end).
// What they see of the run: run_context.hpp.
#include <loom/core/crash_report.hpp>
#include <loom/core/checkpoint.hpp>
#include <loom/core/device_memory.hpp>
#include <loom/core/files.hpp>
#include <loom/core/log.hpp>
#include <loom/core/text.hpp>
#include "json_limits.hpp"
#include "run_context.hpp"
#include "trainer_internal.hpp"

#include <loom/sdk/files.hpp>
#include <loom/sdk/helpers.hpp>
#include <nlohmann/json.hpp>
#include "saved_state.hpp"

#include <algorithm>
#include <set>

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace loom::core {

using namespace detail;

// (declared in saved_state.hpp)
void load_callback_states(const std::vector<std::pair<std::string, std::shared_ptr<sdk::Callback>>>& callbacks,
                          const json& saved, const sdk::TensorMap& extra, const fs::path& dir,
                          std::map<std::string, sdk::TextMap>& unselected_text, sdk::TensorMap& unselected_tensors) {
  const auto state_of = [&](const std::string& name) {
    sdk::State state;
    for (const auto& [k, v] : saved[name].items()) {
      if (!v.is_string())
        throw Error((dir / "state.json").string() + ": the state of callback '" + name + "' is damaged (key '" + k +
                    "' is not text)");
      state.text[k] = v.get<std::string>();
    }
    const std::string prefix = "callback." + name + ".";
    for (const auto& [k, t] : extra)
      if (k.rfind(prefix, 0) == 0) state.tensors[k.substr(prefix.size())] = t;
    return state;
  };
  unselected_text.clear();
  unselected_tensors.clear();
  if (!saved.is_object())
    throw Error((dir / "state.json").string() + ": the callbacks' states are damaged (not an object)");
  for (const auto& [name, value] : saved.items()) {
    const bool selected = std::any_of(callbacks.begin(), callbacks.end(), [&](const auto& c) { return c.first == name; });
    if (selected) continue;
    if (!value.is_object())
      throw Error((dir / "state.json").string() + ": the state of callback '" + name + "' is damaged (not an object)");
    sdk::State state = state_of(name);
    unselected_text[name] = std::move(state.text);
    for (auto& [k, t] : state.tensors) unselected_tensors["callback." + name + "." + k] = t;
    log::debug("callback '", name, "' is not selected in this run: its state in ", dir.string(),
               " is kept in this run's checkpoints");
  }
  for (const auto& [name, callback] : callbacks) {
    if (!saved.contains(name)) {
      log::info("callback '", name, "' has no state in ", dir.string(), "; it starts fresh");
      continue;
    }
    const sdk::State state = state_of(name);
    sdk::Callback& target = *callback;  // clang 14 cannot capture a structured binding
    in_phase("restoring the state of callback '" + name + "' from " + dir.string(), [&] { target.load_state_dict(state); });
  }
}

void Trainer::build_callbacks() {
  callbacks_.clear();
  std::vector<std::string> readers;
  callbacks_read_gradients_ = false;
  for (const auto& name : sdk::parse_list(value_of(config_, "trainer.callbacks"))) {
    const auto& info = registry_.require(LOOM_KIND_CALLBACK, name);
    auto callback = registry_.create<sdk::Callback>(name, component_values(config_, info));
    // A 1.0 callback may read any step's values; a 1.1 one says whether it does.
    if (!callback.implements(1) || callback->reads_every_step()) readers.push_back(name);
    if (!callback.implements(2) || callback->reads_gradients()) callbacks_read_gradients_ = true;  // 1.2
    callbacks_.emplace_back(name, std::move(callback));
  }
  read_every_step_ = !readers.empty();
  step_readers_ = join(readers, ", ");
  context_ = std::make_unique<Context>(*this);
}

void Trainer::notify(const char* hook, const std::function<void(sdk::Callback&, sdk::RunContext&)>& call) {
  const char* outer = hook_;  // (a save's on_checkpoint_saved inside on_step_end)
  const std::string* outer_callback = callback_;
  hook_ = hook;
  try {
    for (auto& [name, callback] : callbacks_) {
      callback_ = &name;
      // (the progress line is what the log says at info: --log-level warn, error or off quiet it too)
      if (name == "progress" && !log::enabled(LOOM_LOG_INFO)) continue;
      sdk::Callback& target = *callback;  // clang 14 cannot capture a structured binding
      const std::string phase = "callback '" + name + "' (" + hook + ")";
      const CrashContext running(("running " + phase).c_str());  // (a crash or an exit() in it names it)
      in_phase(phase, [&] { call(target, *context_); });
    }
  } catch (...) {
    hook_ = outer;
    callback_ = outer_callback;
    throw;
  }
  hook_ = outer;
  callback_ = outer_callback;
}

fs::path Trainer::save_checkpoint_for_callback() {
  const std::string refused = save_refused_in(hook_ != nullptr ? hook_ : "");
  if (!refused.empty()) throw Error(refused);
  try {
    return save_checkpoint();
  } catch (const RunFolderGone&) {  // (nothing more is written at its path)
    throw;
  } catch (const std::exception& e) {
    if (parallel_->rank() == 0 && wrote_summary_) say_checkpoint_unsaved_in_summary(e.what());
    throw;
  }
}

sdk::Split Trainer::selection_split() const { return val_loader_ ? sdk::Split::kValidation : sdk::Split::kTest; }

fs::path Trainer::save_weights(const std::string& file_name, const sdk::TextMap& metadata) {
  CheckpointStore::check_weights_name(file_name);  // (on every rank: they stop together)
  // (a callback's save_weights("best_accuracy.safetensors") replaced the run's best weights with
  // its step's, their metric and value gone from the metadata, in silence)
  if (file_name.starts_with("best_") && (callback_ == nullptr || *callback_ != "best"))
    throw Error("save_weights(" + printable(file_name, 200) + ")" + (callback_ != nullptr ? " of callback '" + *callback_ + "'" : std::string()) +
                ": names starting with best_ are the best callback's (the run's best weights, which loom eval and "
                "trainer.init_from take by name); choose another name");
  check_weights_before_saving(file_name);
  for (const auto& [key, value] : metadata)  // (the file's header is JSON: UTF-8 only)
    if (invalid_utf8(key) || invalid_utf8(value))
      throw Error("save_weights(" + printable(file_name, 200) + "): metadata '" + printable(key, 80) + "' is not UTF-8 text; "
                  "a weights file's metadata is JSON, which holds UTF-8 only");
  if (parallel_->rank() != 0) return run_dir_ / "checkpoints" / file_name;  // rank 0 writes (save_checkpoint)
  const json state = detail::parse_json<json>(state_json());
  sdk::TextMap all = metadata;
  all.emplace("step", std::to_string(step_));  // (a resume from an earlier step sets a later one's file aside)
  all["model"] = state["model"].dump();
  all["data"] = state["data"].dump();
  all["precision"] = precision_name_;  // (loom eval evaluates in it, on a device of the type it trained on)
  all["device"] = state["device"].get<std::string>();
  return checkpoints_->save_weights(file_name, model_tensors(), all);
}

bool Trainer::evaluate_and_report(sdk::Split split) {
  if (eval_loader(split) == nullptr) return false;
  const std::string what = split == sdk::Split::kValidation ? "validation" : "test";
  EvalResult e;
  try {
    e = in_phase(what + " evaluation at step " + std::to_string(step_), [&] { return evaluate(split); });
  } catch (const EvaluationStopped& stopped) {
    log::warn(what, " ", stopped.what(), " at step ", step_, ": no figures from it",
              split == selection_split()                      ? " (a resume runs it first)"
              : step_ >= total_steps_ && writes_checkpoints() ? " (a resume runs it)"
                                                              : "");
    if (split == selection_split()) evaluation_cut_at_ = step_;
    if (stop_reason_.empty()) stop_reason_ = signal_name(stopped.signal) + " received";
    // (the run's end reached, its verdict cut: summary.json says so, or a script saw no summary at all)
    if (split == selection_split() && step_ >= total_steps_ && parallel_->rank() == 0) write_run_summary();
    return false;
  } catch (const StoppedBySignal&) {
    throw;  // (a stop during set-up work: the caller ends the run)
  } catch (const std::exception&) {
    // The step trained and updated on every rank; only its evaluation failed (another rank gone
    // in it, a model's error, memory): rank 0 keeps the step, its evaluation pending as a stop's
    // would be, where the steps since the last checkpoint were lost with it. The error stops the
    // run after. (Not a step already saved: the pending evaluation a resume runs again.)
    std::error_code ec;
    if (split == selection_split() && parallel_->rank() == 0 && writes_checkpoints() &&
        !fs::exists(run_dir_ / "checkpoints" / step_dir_name(step_), ec)) {
      evaluation_cut_at_ = step_;
      // (pruning none: an evaluation that fails again at each resume must not cost the older steps)
      const int64_t keep_last = options_.keep_last;
      options_.keep_last = 0;
      try {
        const fs::path dir = save_checkpoint();
        options_.keep_last = keep_last;
        log::warn(what, " evaluation at step ", step_, " failed (below); the step's checkpoint is saved, its evaluation "
                  "pending (a resume runs it first; the older checkpoints are kept, none pruned): ", dir.string());
      } catch (const RunFolderGone&) {
        throw;  // (where the run went, and how to go on, is the message that matters)
      } catch (const std::exception& e) {
        options_.keep_last = keep_last;
        log::warn(what, " evaluation at step ", step_, " failed, and the step's checkpoint could not be saved: ", e.what());
      }
    }
    throw;
  }
  e.step = step_;
  last_eval_ = e;
  std::string line = what + " step " + std::to_string(step_) + ": " + format_metric("loss", e.loss);
  for (const auto& [k, v] : e.metrics) line += ", " + format_metric(k, v);
  log::info(line, " (", sdk::format_duration(e.seconds), ")");
  const std::string prefix = split == sdk::Split::kValidation ? "val/" : "test/";
  std::map<std::string, double> values{{prefix + "loss", e.loss}};
  for (const auto& [k, v] : e.metrics) values[prefix + k] = v;
  notify("on_log", [&](sdk::Callback& c, sdk::RunContext& run) { c.on_log(run, step_, values); });
  notify("on_evaluation_end", [&](sdk::Callback& c, sdk::RunContext& run) { c.on_evaluation_end(run, e); });
  // The run's verdict, written after each evaluation at its end (validation, then test over it:
  // a run killed between the two keeps the first) or at an early stop a callback just asked for.
  if ((step_ >= total_steps_ || !stop_reason_.empty()) && parallel_->rank() == 0) write_run_summary();
  return true;
}

std::map<std::string, double> Trainer::step_values(const StepResult& last) const {
  const sdk::MemoryStats mem = memory_->stats();
  std::map<std::string, double> values{{"train/lr", last.lr},
          {"train/grad_norm", last.grad_norm},
          {"train/epoch", static_cast<double>(train_loader_->position().epoch)},
          {"train/skipped_steps", static_cast<double>(skipped_steps_)},
          {"train/skipped_rate", static_cast<double>(skipped_steps_) / static_cast<double>(std::max<int64_t>(1, step_))},
          {"memory/allocated_bytes", static_cast<double>(mem.allocated)},
          {"memory/reserved_bytes", static_cast<double>(mem.reserved)},
          {"memory/peak_bytes", static_cast<double>(mem.peak)}};
  // data_parallel on GPUs: each device's own (memory/cuda_1/peak_bytes, ...), for the progress line.
  for (const auto& device_memory : replica_memory_) {
    const sdk::MemoryStats stats = device_memory->stats();
    std::string name = device_memory->device().str();
    std::replace(name.begin(), name.end(), ':', '_');
    values["memory/" + name + "/allocated_bytes"] = static_cast<double>(stats.allocated);
    values["memory/" + name + "/peak_bytes"] = static_cast<double>(stats.peak);
  }
  return values;
}

sdk::StepReport Trainer::step_report(const StepResult& r, double seconds) const {
  sdk::StepReport report;
  report.step = r.step;
  report.total_steps = total_steps_;
  report.epoch = train_loader_->position().epoch;
  report.loss = r.loss;
  report.metrics = r.metrics;
  finish_metrics(report.metrics);
  report.lr = r.lr;
  report.grad_norm = r.grad_norm;
  report.skipped = r.skipped;
  report.samples = r.read ? r.samples : 0;
  report.seconds = seconds;
  report.plan = plan_;
  report.memory = memory_->stats();
  return report;
}

TrainSummary Trainer::finish_run(int64_t first_step, double train_seconds) {
  TrainSummary summary;
  summary.run_dir = run_dir_;
  summary.wrote_summary = wrote_summary_;
  summary.steps = step_;
  summary.seconds = train_seconds;
  summary.samples_per_second = static_cast<double>((step_ - first_step) * plan_.global()) / std::max(1e-9, train_seconds);
  summary.final_eval = last_eval_;
  const int64_t plan_peak = memory_->stats().peak;  // since the last re-plan, if any
  summary.peak_memory = std::max(plan_peak, peak_before_replan_);
  summary.peak_resident = peak_resident_bytes();
  if (fit_) predicted_peak_ = estimate(model_states(), *fit_, plan_.micro_batch).peak();  // the final plan
  summary.predicted_peak = predicted_peak_;
  summary.oom_recoveries = oom_recoveries_;
  summary.recovery_seconds = recovery_seconds_;
  // A stop asked for at the last step is no early stop (said: a resume with more steps meets it).
  if (step_ >= total_steps_ && stop_signal() == 0 && !stop_reason_.empty()) {
    log::info("stop asked at the last step (", step_, "), which ends nothing early: ", stop_reason_);
    stop_reason_.clear();
  }
  summary.stop_reason = stop_reason_;
  summary.signal = stop_signal();
  if (!stop_reason_.empty()) log::info("stopped   early at step ", step_, " of ", total_steps_, ": ", stop_reason_);

  sdk::RunReport report;
  report.first_step = first_step;
  report.steps = step_;
  report.seconds = train_seconds;
  report.samples_per_second = summary.samples_per_second;
  report.plan = plan_;
  // (the final plan's: what its estimate is checked against; none where this process trained no
  // step: a resume at the end measured its set-up, "error +341.0 %"; the docs probe)
  report.peak_memory = step_ > first_step ? plan_peak : -1;
  report.predicted_peak = summary.predicted_peak;
  report.oom_recoveries = oom_recoveries_;
  report.stop_reason = stop_reason_;
  notify("on_run_end", [&](sdk::Callback& c, sdk::RunContext& run) { c.on_run_end(run, report); });
  if (!options_.memory_snapshot.empty() && device_.is_cuda()) {
    write_memory_snapshot(device_, options_.memory_snapshot);
    log::info("memory snapshot written to ", options_.memory_snapshot, " (open it at https://pytorch.org/memory_viz)");
  }
  return summary;
}

namespace {
std::optional<json> summary_at(const fs::path& run_dir, int64_t step);
}  // namespace

void Trainer::write_run_summary() {
  check_run_folder();  // (a summary.json alone at a moved run's old path)
  // The verdict of a run at its end, in its folder: a later `--resume auto` of it (a requeued
  // job) reads it, so that a diverged run fails each time it is asked, not only once. JSON has no
  // NaN: a figure that is not finite is written "nan", "inf" or "-inf".
  const auto number = [](double v) { return std::isfinite(v) ? json(v) : json(std::isnan(v) ? "nan" : v > 0 ? "inf" : "-inf"); };
  json summary{{"step", step_}, {"total_steps", total_steps_}, {"skipped_steps", skipped_steps_}};
  if (step_ < total_steps_) summary["stopped_early"] = stop_reason_;
  // (a callback's stop at the last step ends nothing early, but a resume with more steps meets it)
  else if (!stop_reason_.empty() && stop_signal() == 0) summary["stop_asked_at_last_step"] = stop_reason_;
  if (!last_eval_ || last_eval_->step != step_) {  // a stop in the final evaluation: no verdict yet
    const std::string why = stop_reason_.empty() ? signal_name(stop_signal()) + " received" : stop_reason_;
    const bool saves = writes_checkpoints();
    summary["final_evaluation"] =
        "not run: the run was stopped (" + why + ") before it finished; " +
        // (written before that checkpoint: a save that fails is said on stderr, and the resume trains to the step again)
        (saves ? "the checkpoint of step " + std::to_string(step_) + " holds it pending, and a resume of the run runs it first " +
                     "(where that checkpoint could not be written, as the run's last lines then say, the resume takes the " +
                     "one before it and trains to step " + std::to_string(step_) + " again)"
               : std::string("the run writes no checkpoint (trainer.callbacks has no 'checkpoint'), so no resume can run it"));
    summary["diverged"] = nullptr;  // (not known)
  } else {
    json evaluation = json::object();
    const std::string prefix = last_eval_->split == sdk::Split::kValidation ? "val/" : "test/";
    evaluation[prefix + "loss"] = number(last_eval_->loss);
    for (const auto& [k, v] : last_eval_->metrics) evaluation[prefix + k] = number(v);
    summary["final_evaluation"] = evaluation;
    // (the validation's verdict, before the test's: a stop or a failure during the test leaves this one,
    // and a script that reads final_evaluation must see that the test's figures never came)
    // (at the run's end a resume runs it; after an early stop, which a resume repeats, only loom eval)
    if (last_eval_->split == sdk::Split::kValidation && selection_split() == sdk::Split::kValidation && test_loader_)
      summary["test_evaluation"] =
          step_ >= total_steps_ && writes_checkpoints()
              ? "not run: the run ended before it finished; a resume of the run (--resume auto) runs it and records its "
                "figures here (loom eval " + run_dir_.string() + " shows them only)"
              : "not run: the run ended before it finished; loom eval runs it on weights the run saved (" +
                    run_dir_.string() + ", its step folders or its best file, where it has either)";
    summary["diverged"] = !std::isfinite(last_eval_->loss);
  }
  try {
    write_file_atomic(run_dir_ / "summary.json", summary.dump(2, ' ', false, json::error_handler_t::replace) + "\n");
    wrote_summary_ = true;
  } catch (const std::exception& e) {  // (the checkpoints are written; the verdict is a convenience)
    // One of this step left there (its validation's, the test's write failing: a full disk) stays:
    // its test evaluation pending is what a resume runs and records. An older step's contradicted
    // how the run ended: removed, said, and not listed among the run's files.
    const fs::path file = run_dir_ / "summary.json";
    const std::string there = sdk::what_is_at(file);
    bool this_step = false;
    try {
      this_step = there.empty() && summary_at(run_dir_, step_).has_value();
    } catch (const std::exception&) {  // (not one Loom can read: removed as well)
    }
    std::error_code ec;
    const bool removed = there.empty() && !this_step && fs::remove(file, ec);  // (a regular file)
    wrote_summary_ = wrote_summary_ && this_step;
    std::string why = e.what();  // (less write_file_atomic's "(... is unchanged)", where it is not)
    if (const std::string kept = " (" + file.string() + " is unchanged)"; removed && why.find(kept) != std::string::npos)
      why.erase(why.find(kept), kept.size());
    static std::set<std::string> said;  // (once per run: the validation's and the test's evaluations both write it)
    if (said.insert(run_dir_.string()).second || removed)
      log::warn("could not write ", file.string(), " (", why, "): ",
                removed    ? "the older one there is removed, as it no longer says how the run stands; "
                : this_step ? "the older one of this step stays, with what it says is still to run (a resume of the "
                              "run, --resume auto, runs that and records it); "
                            : "",
                "the run's figures are in its log, metrics.jsonl and checkpoints (`loom eval ", run_dir_.string(),
                "` gives them again)",
                there.empty() || there == "no such file" ? "" : "; move what is at that path (" + there + ") out of the run "
                                                                "folder for later runs to write it");
  }
}

namespace {

// The summary.json a run wrote at `step`, or nothing where there is none or it is another step's
// (another length's run, an older step). Throws where the file is not one Loom can read.
std::optional<json> summary_at(const fs::path& run_dir, int64_t step) {
  const fs::path file = run_dir / "summary.json";
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(file, ec))) return std::nullopt;
  json summary = detail::parse_json<json>(read_file(file, int64_t{1} << 20));
  if (summary.at("step").get<int64_t>() != step) return std::nullopt;
  return summary;
}

}  // namespace

// The summary of this step was written before its checkpoint (the evaluation comes first), which
// then failed (a full disk): the run exits 1, its newest checkpoint an earlier step's, while its
// summary.json alone read as a finished run's. It says so (a resume sets it aside, writing its own).
void Trainer::say_checkpoint_unsaved_in_summary(const std::string& why) {
  const fs::path file = run_dir_ / "summary.json";
  try {
    std::optional<json> summary = summary_at(run_dir_, step_);
    if (!summary) return;
    (*summary)["final_checkpoint"] =
        "not written: " + why + "; the run stopped with this error, its newest checkpoint is an earlier step's, and a " +
        "resume of the run (--resume auto) trains from that one and writes this file anew";
    write_file_atomic(file, summary->dump(2, ' ', false, json::error_handler_t::replace) + "\n");
    log::warn(file.string(), " says that the checkpoint of step ", step_, " was not written (final_checkpoint)");
  } catch (const std::exception& e) {  // (the save's error stops the run, and is said; this one is said too)
    log::warn(file.string(), " says the run ended at step ", step_, ", whose checkpoint was not written, and could not be ",
              "changed to say so (", e.what(), "): the command's exit status and its error are what stands");
  }
}

std::optional<double> Trainer::recorded_final_loss() const {
  try {
    const std::optional<json> summary = summary_at(run_dir_, step_);
    if (!summary) return std::nullopt;
    const json& evaluation = summary->at("final_evaluation");  // (one evaluation: test/*, or val/* where the test's did not run)
    if (evaluation.is_string()) return std::nullopt;  // ("not run: ...": stopped during it)
    const json& loss = evaluation.contains("test/loss") ? evaluation.at("test/loss") : evaluation.at("val/loss");
    if (loss.is_string()) {
      const std::string text = loss.get<std::string>();
      if (text != "nan" && text != "inf" && text != "-inf") throw Error("a loss of '" + text + "'");
      return std::stod(text);
    }
    return loss.get<double>();
  } catch (const std::exception& e) {  // (written by Loom: damaged, or edited by hand)
    log::warn((run_dir_ / "summary.json").string(), " is not a run summary Loom can read (", e.what(), "), so whether the run ",
              "diverged is not checked; `loom eval ", run_dir_.string(), "` shows its figures, and removing the file drops this warning");
    return std::nullopt;
  }
}

bool Trainer::writes_checkpoints() const {
  return std::any_of(callbacks_.begin(), callbacks_.end(), [](const auto& c) { return c.first == "checkpoint"; });
}

bool Trainer::test_evaluation_left_pending() const {
  if (step_ < total_steps_ || !test_loader_ || selection_split() != sdk::Split::kValidation || !writes_checkpoints())
    return false;
  try {  // ("not run": the validation's verdict was written, then the test's evaluation was cut short)
    const std::optional<json> summary = summary_at(run_dir_, step_);
    return summary && summary->contains("test_evaluation") && summary->at("test_evaluation").is_string() &&
           summary->at("final_evaluation").contains("val/loss");
  } catch (const std::exception&) {  // (recorded_final_loss says what is wrong with it)
    return false;
  }
}

void Trainer::note_pending_test() {
  test_pending_ = false;
  if (resumed_at_ < 0 || step_ < total_steps_ || evaluation_pending_) return;  // (a pending validation runs the test after it)
  // (rank 0's summary decides: it alone writes one, and every rank evaluates)
  test_pending_ = any_rank(parallel_->rank() == 0 && test_evaluation_left_pending());
}

}  // namespace loom::core
