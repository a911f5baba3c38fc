// `loom train`: build the run from its configuration and train it; `loom eval`: evaluate a
// checkpoint on the test split.
#include "cli.hpp"

#include <loom/core/checkpoint.hpp>
#include <loom/core/error.hpp>
#include <loom/core/files.hpp>
#include <loom/core/log.hpp>
#include <loom/core/text.hpp>
#include <loom/core/trainer.hpp>

#include <loom/sdk/files.hpp>
#include <loom/sdk/helpers.hpp>
#include <loom/sdk/launch.hpp>
#include <loom/sdk/options.hpp>
#include <torch/cuda.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <optional>
#include <sys/stat.h>
#include <unistd.h>

namespace fs = std::filesystem;

namespace loom::cli {

namespace {

std::string eval_line(const core::Trainer& trainer, const core::EvalResult& e) {
  std::string line;
  for (const auto& [k, v] : e.metrics) line += trainer.format_metric(k, v) + ", ";
  return line + trainer.format_metric("loss", e.loss) + " on " + std::to_string(e.samples) +
         (e.split == sdk::Split::kValidation ? " validation samples" : " test samples");
}

/// The command that continues run `name`: the user's own arguments (its configuration and
/// files), less the ones that chose the run or where it started (--resume, --resume-from,
/// trainer.name, trainer.resume, trainer.resume_from), with --resume auto and the name.
std::string continue_command(const Invocation& invocation, const core::Trainer& trainer, const std::string& name) {
  std::string out = "loom train";
  const auto& a = invocation.command_line;
  auto sets_run = [](std::string assignment) {  // chooses the run, or where it starts
    const std::string key(sdk::trim(assignment.substr(0, assignment.find('='))));
    return key == "trainer.name" || key == "trainer.resume" || key == "trainer.resume_from";
  };
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] == "--resume" || a[i] == "--resume-from" || (a[i] == "--set" && i + 1 < a.size() && sets_run(a[i + 1]))) {
      ++i;
      continue;
    }
    if (a[i].rfind("--resume=", 0) == 0 || a[i].rfind("--resume-from=", 0) == 0 ||
        (a[i].rfind("--set=", 0) == 0 && sets_run(a[i].substr(6))))
      continue;
    out.append(" ").append(core::shell_word(a[i]));  // (appending: GCC 12's -Wrestrict misreads " " + string&&)
  }
  // A resume_from of a -c file would start the run again from there: cleared.
  if (!trainer.options().resume_from.empty()) out.append(" --set trainer.resume_from=");
  return out.append(" --resume auto --set trainer.name=").append(core::shell_word(name));
}

/// How to continue run `name`: the command, or under a launcher the launch to repeat.
std::string continue_hint(const Invocation& invocation, const core::Trainer& trainer, const std::string& name) {
  // (processes, not devices: data_parallel's devices in one process continue with the command)
  const auto environment = [] {
    try {
      return sdk::launch_environment();
    } catch (const std::exception&) {
      return std::optional<sdk::LaunchEnvironment>();
    }
  }();
  if (environment && environment->world_size > 1)
    return "the same launch (any number of ranks that divides the global batch) with --resume auto --set trainer.name=" +
           core::shell_word(name);
  return continue_command(invocation, trainer, name);
}

/// A run none of whose steps updated the weights (each had non-finite gradients): what to check.
std::string never_updated(const core::Trainer& trainer, const core::Resolved& resolved) {
  const std::string its = trainer.session_steps() < trainer.step()
                              ? "the " + std::to_string(trainer.session_steps()) + " steps since resuming"
                              : "the run's " + std::to_string(trainer.session_steps()) + " steps";
  return "every one of " + its + " had non-finite gradients, so no step updated the weights: the loss or its gradients "
         "were not finite from the start, which no learning rate causes. Check the data for NaN or infinite values, the model's forward (a log of 0, a division by 0)" +
         // (a weight of 1e36 in a pretrained file passes the load's NaN check and overflows every forward)
         [&] {
           const auto pretrained = resolved.find("model." + resolved.at("model.name").value + ".pretrained");
           const auto init = resolved.find("trainer.init_from");
           return (pretrained != resolved.end() && !pretrained->second.value.empty()
                       ? ", the weights model.pretrained = " + pretrained->second.value + " loads (a value far out of range)"
                       : std::string()) +
                  (init != resolved.end() && !init->second.value.empty() && trainer.session_steps() == trainer.step()
                       ? ", the weights of trainer.init_from = " + init->second.value
                       : std::string());
         }() +
         (trainer.session_steps() < trainer.step() ? ", the weights of the checkpoint it resumed from" : std::string()) +
         " and the precision strategy" +
         (resolved.at("precision.name").value == "fp16_amp" ? std::string(", or train in bf16_amp or fp32: a forward in "
                                                                          "float16 may overflow")
                                                           : std::string());
}

/// What a run whose final evaluation's loss is `loss` (not finite) did, and what to change.
std::string diverged(double loss, const core::Trainer& trainer, const core::Resolved& resolved) {
  const int64_t skipped = trainer.skipped_steps();
  const std::string value = std::isnan(loss) ? "nan" : loss > 0 ? "inf" : "-inf";
  if (skipped > 0 && skipped >= trainer.step())  // no update ever: no learning rate made this
    return "the final evaluation's loss is " + value + ", and " + never_updated(trainer, resolved);
  // Weights that went non-finite were written by an update whose gradients were finite: a rate
  // too high, or an optimizer (or a callback) that writes NaN.
  const std::string bad = trainer.nonfinite_weights();
  return "the run diverged: its final evaluation's loss is " + value +
         (skipped > 0 ? " (" + std::to_string(skipped) + " of its steps had non-finite gradients and were skipped)" : "") +
         ". Lower trainer.lr, or clip the gradients (trainer.clip_grad_norm)" +
         (resolved.at("precision.name").value == "fp16_amp" ? ", or train in bf16_amp or fp32 rather than fp16_amp" : "") +
         (bad.empty() ? std::string()
                      : ". Its " + bad + ", written by an update or a forward (a step with non-finite gradients "
                        "updates nothing): if a lower rate does not help, look at optimizer '" +
                        resolved.at("trainer.optimizer").value + "' and the callbacks that change weights");
}

}  // namespace

int cmd_train(const Invocation& invocation) {
  if (!invocation.args.empty())
    throw Error("loom train takes no positional arguments (got '" + invocation.args[0] +
                "'); configuration files go after -c" + switch_value_hint(invocation, invocation.args[0]));
  core::PluginRegistry registry;
  scan_plugins(registry, invocation.options);
  // A rank `loom launch` started: the launcher checked this configuration and said its warnings
  // (each rank would repeat them, before its lines carry its rank).
  std::optional<core::log::Quiet> said_by_launcher;
  said_by_launcher.emplace(std::getenv("LOOM_LAUNCH_CHECKED") != nullptr);
  // --resume too; a resume continues the run with the settings it was given, where this command leaves them out
  const core::Config config = core::with_run_settings(config_from(invocation.options), registry);
  const core::Resolved resolved = core::resolve_run(config, registry);
  said_by_launcher.reset();
  core::Trainer trainer(resolved, registry);
  const auto callbacks = sdk::parse_list(resolved.at("trainer.callbacks").value);
  const bool checkpoints = std::find(callbacks.begin(), callbacks.end(), "checkpoint") != callbacks.end();
  const std::string unsaved = "the run writes no checkpoint (trainer.callbacks has no 'checkpoint')";
  core::install_stop_signals(checkpoints ? core::OnStop::kCheckpoint : core::OnStop::kNoCheckpoint);
  for (const char* key : {"trainer.checkpoint_every", "trainer.keep_last"})
    if (!checkpoints && resolved.at(key).origin.source != "default")
      core::log::warn(key, " = ", resolved.at(key).value, " is set, but ", unsaved, ": it has no effect");
  // (a callback of the user's may save weights its own way; under a launcher, said by rank 0 alone)
  const bool own_only = std::all_of(callbacks.begin(), callbacks.end(), [](const std::string& c) {
    return c == "progress" || c == "jsonl" || c == "tensorboard" || c == "memory_summary" || c == "early_stopping";
  });
  const char* rank = std::getenv("RANK");
  if (own_only && (rank == nullptr || std::string(rank) == "0"))
    core::log::warn("trainer.callbacks = '", resolved.at("trainer.callbacks").value, "' (",
                    resolved.at("trainer.callbacks").origin.describe(), ") has neither checkpoint nor best: the run saves "
                    "no weights, and its model is gone when it ends; add them to keep it");
  try {
    trainer.setup();
  } catch (const core::StoppedBySignal& stopped) {  // before the run folder was opened
    core::log::warn(stopped.what(), "; nothing was written");
    core::log::flush();
    return 128 + stopped.signal;
  } catch (const std::exception&) {  // (after the folder was made: a misfit trainer.init_from, say) it goes again
    trainer.discard_if_nothing_trained();
    throw;
  }
  // A second Ctrl-C ends the process at once: where the run stands, and how to go on.
  if (checkpoints) {
    core::note_stop_at_once("\nloom: stopped at once (what was in progress is not saved); the checkpoints written before "
                            "stand in " + (trainer.run_dir() / "checkpoints").string() + "; continue from the newest with: " +
                                continue_hint(invocation, trainer, trainer.run_dir().filename().string()) + "\n",
                            "\nloom: stopped at once, before the run's first checkpoint: nothing of it can be continued\n");
    if (!core::CheckpointStore::list_run(trainer.run_dir()).empty()) core::note_checkpoint_written();
  }
  if (trainer.step() >= trainer.total_steps() && !trainer.evaluation_pending() && !trainer.test_evaluation_pending()) {  // resumed at its end: a requeued job that finished
    // A run that diverged fails each time it is asked, or a requeued job would report it done.
    if (const auto loss = trainer.recorded_final_loss(); loss && !std::isfinite(*loss)) {
      core::log::error("run ", trainer.run_dir().filename().string(), " is trained to its step ", trainer.step(),
                       " and its summary.json says ", diverged(*loss, trainer, resolved),
                       "; then train again: a new run (another trainer.name), or --resume-from one of its earlier checkpoints");
      core::log::flush();
      return 1;
    }
    core::log::info("run ", trainer.run_dir().filename().string(), " is complete: its checkpoint is at step ",
                    trainer.step(), trainer.step() > trainer.total_steps() ? ", past this command's " : " of ",
                    trainer.total_steps(), "; nothing to train. Raise trainer.max_steps to train further; evaluate it "
                    "with: loom eval ", trainer.run_dir().string());
    return 0;
  }
  core::TrainSummary s;
  try {
    s = trainer.train();
  } catch (const core::RunFolderGone& e) {  // (its message says where the checkpoints are and how to go on)
    core::log::error(message_of(e));
    core::log::flush();
    return 1;
  } catch (const std::exception& e) {
    // A failure mid-run (a full disk, a lost device): the checkpoints written before it stand, and
    // the user is told which one a resume takes up and the command that does it.
    const auto saved = core::CheckpointStore::list_run(trainer.run_dir());
    if (saved.empty()) {
      core::log::error(message_of(e));
      // Rank 0 writes the checkpoints: another rank that failed while rank 0 wrote the first said
      // "no checkpoint ... so it cannot be continued" beside rank 0's "intact" (a probe).
      bool other_rank = false;
      try {
        const auto launched = sdk::launch_environment();
        other_rank = launched && launched->rank != 0;
      } catch (const std::exception&) {  // (variables a launcher set wrong were refused at the start)
      }
      if (other_rank) {
        core::log::flush();
        return 1;
      }
      // (steps trained, none saved: nothing to continue from; a rank but the first of a run that
      // trained nothing discards nothing, and says nothing)
      if (!trainer.discard_if_nothing_trained() && trainer.step() > 0) {
        const fs::path folder = trainer.run_dir() / "checkpoints";
        const std::string what = sdk::what_is_at(folder);
        const std::string is = what.empty() ? "a file" : what == "no such file" ? "gone" : what;
        core::log::warn(!checkpoints ? "the run writes no checkpoint (trainer.callbacks has no 'checkpoint'), so it cannot be "
                                       "continued; its figures so far are in its log"
                                     : "no checkpoint of the run is in " + folder.string() +
                                           (is == "a folder" ? std::string() : " (it is " + is + " now)") +
                                           ", so it cannot be continued from where it stopped" +
                                           (is == "a folder" ? std::string() : "; where its checkpoints were moved away, put them back"));
      }
      core::log::flush();
      return 1;
    }
    core::log::error(message_of(e));
    if (core::step_of(saved.back()) >= trainer.total_steps()) {  // (in the final evaluation, say)
      core::log::warn("the training is complete: its last checkpoint ", saved.back().string(), " is written; ",
                      trainer.test_evaluation_left_pending() || trainer.evaluation_pending()
                          ? std::string("once the cause is fixed, a resume runs ") +
                                (trainer.evaluation_pending() ? "the evaluation that failed (and what follows it)"
                                                              : "its test evaluation alone") + ": " +
                                continue_hint(invocation, trainer, trainer.run_dir().filename().string())
                          : "evaluate it with: loom eval " + trainer.run_dir().string());
      core::log::flush();
      return 1;
    }
    // (a stop signal came first, whose line promised a checkpoint: said that it was not written, as
    // where a rank was killed and rank 0 could not agree on the stop with it; probe M)
    core::log::warn(core::stop_signal_received() != 0 && core::step_of(saved.back()) < trainer.step()
                        ? "no checkpoint of the stop was written (step " + std::to_string(trainer.step()) + " was the last trained); "
                        : std::string(),
                    "the run's checkpoints up to ", saved.back().string(), " are intact; once the cause is fixed, continue with: ",
                    continue_hint(invocation, trainer, trainer.run_dir().filename().string()));
    core::log::flush();
    return 1;
  }
  // A folder this command made for a run that a callback stopped before its first step (a run
  // --resume-from started, whose early stop the checkpoint held): the same command found "a run" there.
  if (trainer.discard_if_nothing_trained()) return 0;
  char rate[64];
  std::snprintf(rate, sizeof rate, "%.0f samples/s", s.samples_per_second);
  // (a resume a callback stopped before its first step: "done 10 steps in 0s of training, 0 samples/s")
  core::log::info("done      ", trainer.session_steps() == 0 ? "no step trained by this command; the run is at step " +
                                                                     std::to_string(s.steps)
                                                               : std::to_string(s.steps) + (s.steps == 1 ? " step in " : " steps in ") +
                                                                     sdk::format_duration(s.seconds) + " of training, " + rate,
                  s.final_eval ? "; " + eval_line(trainer, *s.final_eval) +
                                     // (an older one, where a stop cut the last short: said whose)
                                     (s.final_eval->step < trainer.step() ? " (at step " + std::to_string(s.final_eval->step) + ")"
                                                                          : std::string())
                               : std::string());
  core::log::info("memory    peak ", core::format_bytes(s.peak_memory), " allocated",
                  trainer.device().is_cpu() ? " (Loom's CPU allocator), " : " on the device, ",
                  core::format_bytes(s.peak_resident), " resident",
                  s.oom_recoveries ? "; " + std::to_string(s.oom_recoveries) + " out-of-memory recoveries" : std::string());
  // Only files that exist: the callbacks a run selects decide what it writes, and no best file
  // is written when no evaluation measured the best metric.
  const fs::path run = s.run_dir;
  std::vector<std::string> files;
  const std::string best = "best_" + trainer.options().best_metric + ".safetensors";
  if (fs::exists(run / "checkpoints" / best)) files.push_back((run / "checkpoints" / best).string());
  std::error_code ec;
  const bool any_step = fs::is_directory(run / "checkpoints") &&
                        std::any_of(fs::directory_iterator(run / "checkpoints", ec), fs::directory_iterator(),
                                    [](const fs::directory_entry& e) { return e.path().filename().string().rfind("step_", 0) == 0; });
  if (any_step) files.push_back((run / "checkpoints").string() + " (step folders)");
  if (fs::exists(run / "metrics.jsonl")) files.push_back((run / "metrics.jsonl").string());
  if (s.wrote_summary) files.push_back((run / "summary.json").string());
  if (fs::exists(run / "tensorboard")) files.push_back((run / "tensorboard").string() + " (tensorboard --logdir " + run.string() + ")");
  core::log::info("files     ", files.empty() ? std::string("none (trainer.callbacks selects no writer)") : core::join(files, ", "));
  // A model that diverged is a failed run, whatever files it wrote: a script that trains, then
  // deploys, stops here. (Before the signals, once every step is trained: the evaluation that ran
  // is the run's verdict, and under `loom launch` the other ranks' exit 1 may signal this one.)
  // (No evaluation ran: a resumed run that early stopping stops again at once; its verdict is the
  // one it recorded at that stop.)
  const std::optional<double> final_loss = s.final_eval ? std::optional<double>(s.final_eval->loss) : trainer.recorded_final_loss();
  if (final_loss && !std::isfinite(*final_loss) && (s.signal == 0 || s.steps >= trainer.total_steps())) {
    core::log::error(diverged(*final_loss, trainer, resolved));
    core::log::flush();
    return 1;
  }
  // A metric of NaN (a model's NaN sum, or 0 terms counted over the split) printed "accuracy nan %",
  // and no best weights came of it, in silence (a probe's plugin).
  if (s.final_eval && std::isfinite(s.final_eval->loss)) {
    std::vector<std::string> nan;
    for (const auto& [name, value] : s.final_eval->metrics)
      if (std::isnan(value)) nan.push_back(name);
    if (!nan.empty())
      core::log::warn("the final evaluation's ", core::join(nan, ", "), nan.size() == 1 ? " is" : " are", " NaN: model '",
                      resolved.at("model.name").value, "' reported a NaN sum or counted 0 terms over its ",
                      s.final_eval->samples, " samples",
                      std::find(nan.begin(), nan.end(), trainer.options().best_metric) != nan.end()
                          ? " (trainer.best_metric: no best weights come of it)" : "",
                      "; a bug of the model's, or a split it cannot measure (`loom plugins check` tests a model)");
  }
  // Trained to its end without one update: no model came of it, whatever its figures say. (With
  // fp16_amp's dynamic loss scale the first steps overflow while it comes down from 65536: a
  // short run may skip them all, and is told so.)
  // (a resumed run's steps since its checkpoint: a session that updated nothing learned nothing,
  // whatever the steps before it did)
  if (s.signal == 0 && trainer.session_skipped() > 0 && trainer.session_skipped() >= trainer.session_steps()) {
    const std::string its = trainer.session_steps() < trainer.step() ? "the " + std::to_string(trainer.session_steps()) +
                                                                           " steps since resuming"
                                                                     : "the run's " + std::to_string(trainer.session_steps()) + " steps";
    const auto scale = resolved.find("precision.fp16_amp.loss_scale");
    const bool fixed = scale != resolved.end() && sdk::trim(scale->second.value) != "dynamic";
    if (resolved.at("precision.name").value == "fp16_amp" && fixed) {  // (it never comes down: no longer run helps)
      core::log::error("the run learned nothing: every one of ", its, " had non-finite ",
                       "gradients under fp16_amp's static loss scale of ", scale->second.value, ", which overflows float16's ",
                       "gradients at every step; lower precision.loss_scale, or make it dynamic (it comes down by itself); if ",
                       "fp32 fails too, the loss itself is not finite");
      core::log::flush();
      return 1;
    }
    if (resolved.at("precision.name").value == "fp16_amp") {
      core::log::warn("no step updated the weights: every one of ", its, " had ",
                      "non-finite gradients, as fp16_amp's loss scale comes down from its start by halving at each; "
                      "train longer, or start it lower (precision.init_scale)");
    } else {
      core::log::error("the run learned nothing: ", never_updated(trainer, resolved));
      core::log::flush();
      return 1;
    }
  }
  if (s.signal != 0 && !checkpoints) {  // nothing to continue from, nor to evaluate
    core::log::warn("stopped by ", core::signal_name(s.signal), " after step ", s.steps, " of ", trainer.total_steps(), "; ",
                    unsaved, s.steps >= trainer.total_steps() ? ": its figures are in its log" : ", so it cannot be continued");
    core::log::flush();
    return 128 + s.signal;
  }
  if (s.signal != 0 && s.steps >= trainer.total_steps() && trainer.evaluation_pending()) {  // its validation was cut
    core::log::warn("stopped by ", core::signal_name(s.signal), " after the last step (", s.steps, " of ", trainer.total_steps(),
                    "): the training is complete and its checkpoint written; its final evaluation was cut short, and "
                    "a resume runs it: ", continue_hint(invocation, trainer, run.filename().string()));
    core::log::flush();
    return 128 + s.signal;
  }
  if (s.signal != 0 && s.steps >= trainer.total_steps()) {  // before or during the test evaluation, or after it
    core::log::warn("stopped by ", core::signal_name(s.signal), " after the last step (", s.steps, " of ", trainer.total_steps(),
                    "): the training is complete and its checkpoint written",
                    trainer.test_evaluation_left_pending() ? "; its test evaluation did not run, and a resume runs it alone: " +
                                                            continue_hint(invocation, trainer, run.filename().string())
                                                      : std::string());
    core::log::flush();
    return 128 + s.signal;
  }
  if (s.signal != 0) {
    core::log::warn("stopped by ", core::signal_name(s.signal), " after step ", s.steps, " of ", trainer.total_steps(),
                    "; continue with: ", continue_hint(invocation, trainer, run.filename().string()));
    core::log::flush();
    return 128 + s.signal;
  }
  return 0;
}

fs::path checkpoint_path(const Invocation& invocation) {
  // `loom eval runs/x/checkpoints/step_...` as well as `--checkpoint PATH`; one or the other.
  const bool named = invocation.options.count("checkpoint") > 0;
  if (invocation.args.size() > (named ? 0U : 1U)) {
    std::string hint;  // (`--no-amp false runs/x`: the switch's would-be value is the first argument)
    for (const auto& arg : invocation.args)
      if (hint.empty()) hint = switch_value_hint(invocation, arg);
    throw Error("one checkpoint per command: '" + invocation.args[named ? 0 : 1] +
                "' is one argument too many (the checkpoint goes as --checkpoint PATH or as the only argument)" + hint);
  }
  if (!named && invocation.args.empty())
    throw Error("--checkpoint PATH is needed: a step folder (runs/<name>/checkpoints/step_...), a run folder (its newest "
                "step) or a best_*.safetensors file");
  // (a quoted '~/x' as the only argument is the home folder, as --checkpoint=~/x is)
  fs::path checkpoint =
      fs::path(named ? invocation.options["checkpoint"].as<std::string>() : core::home_expanded(invocation.args[0])).lexically_normal();
  if (!checkpoint.has_filename() && checkpoint.has_parent_path()) checkpoint = checkpoint.parent_path();  // "step_.../"
  if (checkpoint.empty()) throw Error("--checkpoint is empty; give a step folder, a run folder or a best_*.safetensors file");
  if (!fs::exists(checkpoint)) throw Error("checkpoint " + checkpoint.string() + ": no such file or folder");
  // A run folder, or its checkpoints folder: the newest checkpoint. A file inside a step folder:
  // that step folder.
  if (checkpoint.filename() == "checkpoints" && fs::is_directory(checkpoint) &&
      !fs::is_directory(checkpoint / "checkpoints"))  // (a run that is itself named "checkpoints")
    checkpoint = checkpoint.has_parent_path() ? checkpoint.parent_path() : fs::path(".");
  if (fs::is_directory(checkpoint / "checkpoints")) {
    // The newest whole one, as --resume auto takes: a step folder a kill or a hand left without
    // its state.json (not listed), without a file, or damaged is passed over, said. One that the
    // run in progress pruned as it was read (trainer.keep_last) is none of these: the steps are
    // listed again.
    for (int listed = 1;; ++listed) {
      const auto all = core::CheckpointStore::list_run(checkpoint);
      if (all.empty()) {
        // (what it does hold, named: "pass one of its best_*.safetensors files" of a run with none)
        std::vector<std::string> best, abandoned;
        std::error_code ec;
        for (const auto& entry : fs::directory_iterator(checkpoint / "checkpoints", ec)) {
          const std::string file = entry.path().filename().string();
          if (file.rfind("best_", 0) == 0 && entry.path().extension() == ".safetensors") best.push_back(entry.path().string());
          if (file.rfind("abandoned-", 0) == 0 && entry.is_directory(ec)) abandoned.push_back(entry.path().string());
        }
        std::sort(best.begin(), best.end());
        std::sort(abandoned.begin(), abandoned.end());
        throw Error(checkpoint.string() + " is a run folder without step checkpoints; " +
                    (!best.empty() ? "pass one of its best files (" + core::join(best, ", ") + ")"
                     : !abandoned.empty()
                         ? "it has no best file either; " + core::join(abandoned, ", ") + " hold steps a resume set aside "
                           "(a timeline given up): pass one of their step folders to evaluate that"
                         : std::string("it has no best file either: pass a run that wrote a checkpoint")));
      }
      std::error_code ec;
      if (listed == 1)
        for (const auto& entry : fs::directory_iterator(checkpoint / "checkpoints", ec))
          if (entry.is_directory(ec) && core::step_of(entry.path()) > core::step_of(all.back()))
            core::log::warn(entry.path().string(), " is no whole checkpoint (its state.json is missing or damaged): passed over");
      bool pruned = false;
      for (auto it = all.rbegin(); it != all.rend() && !pruned; ++it) {
        try {
          // (what an evaluation needs, checked as `loom eval STEP` does: a step kept without its
          // optimizer.safetensors, to save space, was refused here and evaluated there)
          (void)core::CheckpointStore::load_weights(*it);
          return *it;
        } catch (const std::exception& e) {
          pruned = listed < 20 && !fs::exists(*it, ec);
          if (!pruned)
            core::log::warn(it->string(), " cannot be evaluated (", e.what(), "): ",
                            std::next(it) != all.rend() ? "taking the step before it" : "no step of the run is whole");
        }
      }
      if (!pruned)
        throw Error(checkpoint.string() + ": none of its step checkpoints can be evaluated (why is said above); pass one of its " +
                    "best_*.safetensors files, where it has one");
    }
  }
  const std::string name = checkpoint.filename().string();
  if (!fs::is_directory(checkpoint) && (name == "state.json" || name == "model.safetensors" || name == "optimizer.safetensors") &&
      checkpoint.parent_path().filename().string().rfind("step_", 0) == 0)
    return checkpoint.parent_path();
  if (fs::is_directory(checkpoint) && !fs::exists(checkpoint / "state.json")) {
    // (a work folder, `loom eval runs`: its runs named, the newest first)
    std::vector<std::pair<fs::file_time_type, std::string>> runs;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(checkpoint, ec)) {
      if (!entry.is_directory(ec)) continue;
      // (by its newest checkpoint: a run folder's own time moves little as it trains; none, no run to pass)
      std::optional<fs::file_time_type> newest;
      for (const auto& saved : fs::directory_iterator(entry.path() / "checkpoints", ec))
        if (const auto t = fs::last_write_time(saved.path(), ec); !ec) newest = std::max(newest.value_or(t), t);
      if (newest) runs.emplace_back(*newest, entry.path().string());
    }
    std::sort(runs.rbegin(), runs.rend());
    std::vector<std::string> named;
    for (size_t i = 0; i < runs.size() && i < 3; ++i) named.push_back(runs[i].second);
    if (!runs.empty())
      throw Error(checkpoint.string() + " is a work folder of " + std::to_string(runs.size()) + " run(s), not a checkpoint; " +
                  "pass one of its runs (the newest: " + core::join(named, ", ") + "), a step folder of one " +
                  "(<run>/checkpoints/step_...) or a best_*.safetensors file");
    throw Error(checkpoint.string() + " is a folder, but no checkpoint: it has no state.json. Pass a step folder "
                "(runs/<name>/checkpoints/step_...), a run folder, or a best_*.safetensors file");
  }
  // A file that is not a weights file (a run's config.json, metrics.jsonl): not "damaged", another kind of file.
  if (!fs::is_directory(checkpoint) && checkpoint.extension() != ".safetensors")
    throw Error(checkpoint.string() + " is not a checkpoint (one is a step folder or a .safetensors file); pass " +
                (checkpoint.has_parent_path() && fs::is_directory(checkpoint.parent_path() / "checkpoints")
                     ? "its run folder, " + checkpoint.parent_path().string() + ", for the newest step"
                     : std::string("a step folder (runs/<name>/checkpoints/step_...), a run folder, or a best_*.safetensors file")));
  return checkpoint;
}

/// The checkpoint's model and data configuration, with the user's settings over it; `changed`
/// gets the model and data keys the user set to another value than the checkpoint's.
namespace {

/// Why `loom eval` does not evaluate in the precision the checkpoint was trained in ("" where it
/// does): its device was another type (float16 autocast on a CPU is for tests, slow), its plugin
/// is not loaded, or bfloat16 needs a GPU this one is not.
std::string precision_elsewhere(const core::TrainedIn& trained, const core::Config& user, const core::PluginRegistry& registry) {
  const core::ConfigValue* given = user.find("trainer.device");
  const std::string device = given != nullptr ? given->value : "auto";
  const bool cuda = device.rfind("cuda", 0) == 0 || (device == "auto" && torch::cuda::is_available());
  if (registry.find(LOOM_KIND_PRECISION, trained.precision) == nullptr) return "precision '" + trained.precision + "' is not loaded";
  if (trained.device.empty()) return "the checkpoint does not say which device it trained on";
  if (trained.device != (cuda ? "cuda" : "cpu"))
    return "it trained on " + std::string(trained.device == "cuda" ? "a GPU" : trained.device) + ", this runs on " +
           (cuda ? "a GPU" : "the CPU");
  if (cuda && trained.precision == "bf16_amp" &&
      sdk::cuda_capability(device == "auto" ? c10::Device(c10::kCUDA, 0) : c10::Device(device)) < 80)
    return "this GPU has no bfloat16 (compute capability below 8.0)";
  return {};
}

}  // namespace

core::Config checkpoint_config(const Invocation& invocation, const fs::path& checkpoint, const core::PluginRegistry& registry,
                               std::vector<std::string>& changed) {
  core::Config config;
  const auto recorded = core::checkpoint_run_config(checkpoint);
  const core::Config user = config_from(invocation.options);
  // (keys of where a training run goes: this command reads a checkpoint and writes no run)
  for (const char* key : {"trainer.resume", "trainer.resume_from", "trainer.work_dir", "trainer.name", "trainer.init_from"})
    if (const core::ConfigValue* v = user.find(key))
      core::log::warn(key, " = ", v->value, " (", v->origin.describe(), ") has no effect here: this command reads the "
                      "checkpoint it is given and writes no run");
  // (and keys of how a run trains, given on the command line: `loom eval RUN --use-scheduler` was
  // silent; the docs probe. A -c file's are a training configuration's, used for its data.)
  for (const char* key : {"trainer.epochs", "trainer.max_steps", "trainer.gradient_accumulation_steps", "trainer.optimizer",
                          "trainer.lr", "trainer.schedule", "trainer.use_scheduler", "trainer.clip_grad_norm",
                          "trainer.reference_batch", "trainer.eval_every", "trainer.log_every", "trainer.checkpoint_every",
                          "trainer.keep_last", "trainer.device_step", "trainer.stop_after_skipped"})
    if (const core::ConfigValue* v = user.find(key); v != nullptr && v->origin.source != "file")
      core::log::warn(key, " = ", v->value, " (", v->origin.describe(), ") has no effect here: this command trains nothing");
  for (const auto& [key, value] : recorded) config.set(key, value, core::Origin{"checkpoint", {}, 0});
  // The precision it was trained in, where it runs here and the user chooses none (--no-amp and
  // --allow-tf32 choose through precision.name = auto): its own figures are reproduced in it.
  const bool chooses_precision = user.find("precision.name") || user.find("precision.amp") || user.find("precision.allow_tf32");
  if (const core::TrainedIn trained = core::checkpoint_trained_in(checkpoint); !trained.precision.empty() && !chooses_precision) {
    if (const std::string why = precision_elsewhere(trained, user, registry); why.empty())
      config.set("precision.name", trained.precision, core::Origin{"checkpoint", {}, 0});
    else
      core::log::info("the checkpoint was trained in precision ", trained.precision, "; ", why, ", so precision.name = auto "
                      "chooses (set precision.name to choose)");
  }
  // The checkpoint records a component's options as `model.<option>`: the user's full key for the
  // same component, `model.<name>.<option>`, is that key (or the two would be one option written
  // two ways, and the change would go unsaid), as a shorthand is (not where the core has the key).
  const core::Schema core_keys = core::core_schema();
  const auto as_recorded = [&](const std::string& key) {
    for (const std::string section : {"model", "data"}) {
      const core::ConfigValue* chosen = user.find(section + ".name");
      const auto named = recorded.find(section + ".name");
      const std::string name = chosen ? chosen->value : named != recorded.end() ? named->second : "";
      const std::string prefix = section + "." + name + ".";
      if (name.empty() || key.rfind(prefix, 0) != 0 || key.find('.', prefix.size()) != std::string::npos) continue;
      if (const std::string short_key = section + "." + key.substr(prefix.size()); core_keys.find(short_key) == nullptr)
        return short_key;
    }
    return key;
  };
  std::map<std::string, const core::ConfigValue*> given;  // each key, as the user last set it
  for (const std::string& written : user.keys_in_set_order()) {  // in the user's order (Config::set_order)
    const core::ConfigValue& value = *user.find(written);
    const std::string key = as_recorded(written);
    if (const auto twice = given.find(key); twice != given.end() && twice->second->value != value.value)
      core::log::warn(key, " is set twice, written two ways (", twice->second->value, " from ", twice->second->origin.describe(),
                      ", ", value.value, " from ", value.origin.describe(), "); the later, ", value.value, ", is used");
    given[key] = &value;
    config.set(key, value.value, value.origin);
  }
  for (const auto& [key, value] : given) {
    const auto it = recorded.find(key);
    // (data.num_workers, prefetch and pin_memory are recorded with the data, but change neither it nor the model)
    const bool loader = key == "data.num_workers" || key == "data.prefetch" || key == "data.pin_memory";
    if (key == "precision.name") continue;  // (not the model's: cmd_eval says it)
    if (it != recorded.end() && it->second != value->value && !loader)
      changed.push_back(key + " = " + value->value + " (" + value->origin.describe() + "; the checkpoint's: " + it->second + ")");
  }
  if (!changed.empty())  // (data.seed, say: other samples than the run's, so other figures)
    core::log::warn("this command's model and data differ from the checkpoint's: ", core::join(changed, "; "));
  // A path the run was given relative to the folder it trained in is relative to this command's
  // folder here: where it is not there, that is said (the dataset said only "not a folder").
  for (const auto& [key, value] : recorded) {
    const std::string last = key.substr(key.rfind('.') + 1);
    const core::ConfigValue* used = config.find(key);
    if ((last != "root" && last != "path" && last != "tokenizer" && last != "pretrained") || used == nullptr ||
        used->origin.source != "checkpoint" || value.empty() || fs::path(value).is_absolute())
      continue;
    if (std::error_code ec; !fs::exists(value, ec))
      throw Error(key + " = " + value + " comes from the checkpoint's configuration, a path relative to the folder its run "
                  "trained in, and there is no " + value + " in this one (" + fs::current_path(ec).string() +
                  "): run this command from that folder, or give --set " + key + "=<its absolute path>");
  }
  return config;
}

void load_weights(core::Trainer& trainer, const fs::path& checkpoint, const std::vector<std::string>& changed) {
  try {
    trainer.load_weights(checkpoint);
    // (the data's files changed in place, or a copy elsewhere is not what it was: data.root pointed at a
    // copy whose held-out interactions are others was said to differ only by its folder; where other
    // settings of the data changed, said above, the sizes follow them)
    const auto setting = [](const std::string& c) {
      const std::string key = c.substr(0, c.find(' '));
      return key.rfind("data.", 0) == 0 && !key.ends_with(".root") && !key.ends_with(".path");
    };
    if (std::none_of(changed.begin(), changed.end(), setting)) trainer.warn_if_data_sizes_differ(checkpoint);
  } catch (const Error& e) {
    if (changed.empty()) throw;
    throw Error(std::string(e.what()) + ". This command changes the configuration the checkpoint was trained with: " +
                core::join(changed, "; ") + "; leave those out to use the model as it was trained");
  }
}

int evaluate(const Invocation& invocation, const fs::path& checkpoint);

int cmd_eval(const Invocation& invocation) {
  const std::string given = invocation.options.count("checkpoint") ? invocation.options["checkpoint"].as<std::string>()
                            : invocation.args.empty()               ? std::string()
                                                                    : invocation.args[0];
  for (int chosen = 1;; ++chosen) {
    const fs::path checkpoint = checkpoint_path(invocation);
    try {
      return evaluate(invocation, checkpoint);
    } catch (const std::exception& e) {
      // The newest step of a run folder, pruned by the run in progress (trainer.keep_last) while
      // this command set up: the newest one again, not "cannot read ...: No such file". (Only an
      // error about that step, where a run folder was given: not an OOM, not a step folder named.)
      std::error_code ec;
      if (chosen == 20 || fs::path(given).lexically_normal() == checkpoint || fs::exists(checkpoint, ec) ||
          std::string(e.what()).find(checkpoint.string()) == std::string::npos)
        throw;
      core::log::info(checkpoint.string(), " was pruned by its run (in progress) while this command read it: taking the "
                      "run's newest step again");
    }
  }
}

int evaluate(const Invocation& invocation, const fs::path& checkpoint) {
  core::PluginRegistry registry;
  scan_plugins(registry, invocation.options);
  std::vector<std::string> changed;
  const core::Config config = checkpoint_config(invocation, checkpoint, registry, changed);
  const core::Resolved resolved = core::resolve_run(config, registry);
  core::Trainer trainer(resolved, registry);
  trainer.setup_for_evaluation();
  load_weights(trainer, checkpoint, changed);
  const std::string precision = resolved.at("precision.name").value;
  if (const core::TrainedIn trained = core::checkpoint_trained_in(checkpoint); !trained.precision.empty() && trained.precision != precision)
    core::log::info("evaluating in precision ", precision, " (", resolved.at("precision.name").origin.describe(),
                    "); the checkpoint was trained in ", trained.precision);
  const core::EvalResult e = trainer.evaluate();
  // The result is the command's output, on stdout (a script's `loom eval X > result` got nothing,
  // and --log-level warn showed nothing at all); said in the log too where stdout goes elsewhere.
  const std::string result = checkpoint.string() + ": " + eval_line(trainer, e) + " (" + sdk::format_duration(e.seconds) + ")";
  std::cout << result << std::endl;
  // (not where stderr is that same file or pipe: `loom eval X 2>&1 | tee log` showed it twice)
  struct stat out {}, err {};
  const bool same = ::fstat(STDOUT_FILENO, &out) == 0 && ::fstat(STDERR_FILENO, &err) == 0 && out.st_dev == err.st_dev &&
                    out.st_ino == err.st_ino;
  if (::isatty(STDOUT_FILENO) == 0 && !same) core::log::info(result);
  if (!std::isfinite(e.loss)) {  // (as a run whose final evaluation is so fails: a script deploys on exit 0)
    core::log::error("the evaluation's loss is ", std::isnan(e.loss) ? "nan" : e.loss > 0 ? "inf" : "-inf", ": the model of ", checkpoint.string(), " gives non-finite outputs ",
                     "on the test split (a run that diverged, or a precision it overflows in: it was evaluated in ",
                     precision, ")");
    return 1;
  }
  return 0;
}

}  // namespace loom::cli
