// The training loop: steps until the end (or until a callback or a stop signal asks to stop),
// the window of steps whose means are logged every trainer.log_every steps (saved in checkpoints,
// so a resumed run logs the same means), evaluation every trainer.eval_every steps, the final test
// evaluation. What is written and saved, and when, is the callbacks' business
// (trainer_callbacks.cpp, sdk/callback.hpp); the loop names none of them.
#include <loom/core/checkpoint.hpp>
#include <loom/core/device_memory.hpp>
#include <loom/core/files.hpp>
#include <loom/core/log.hpp>
#include <loom/core/trainer.hpp>
#include "trainer_internal.hpp"

namespace loom::core {

using namespace detail;
namespace fs = std::filesystem;

bool Trainer::discard_if_nothing_trained() {
  if ((!made_run_dir_ && !entries_before_) || session_steps() > 0 || parallel_->rank() != 0 ||
      !CheckpointStore::list_run(run_dir_).empty())
    return false;
  std::error_code ec;
  if (entries_before_) {  // (a folder of the user's: what this command wrote in it goes, the rest stays)
    for (const auto& entry : fs::directory_iterator(run_dir_, ec))
      if (!entries_before_->count(entry.path().filename().string())) fs::remove_all(entry.path(), ec);
    log::info("no step was trained: what this command wrote in ", run_dir_.string(), " is removed");
    return true;
  }
  run_lock_.reset();
  fs::remove_all(run_dir_, ec);
  if (!ec) log::info("no step was trained: the run folder ", run_dir_.string(), " this command made is removed");
  return !ec;
}

void Trainer::PendingRecord::commit() {
  if (dir.empty()) return;
  if (!until.empty()) write_file_atomic(until, until_text);  // (first: config.json is never the only record)
  write_file_atomic(dir / "config.json", config);
  dir.clear();
}

void Trainer::LogWindow::add(const StepResult& r, double dt) {
  seconds += dt;
  ++steps;
  samples += r.samples;
  if (!r.read) return;  // its values are in device_sums
  loss += r.loss;
  terms += r.terms;
  for (const auto& [k, v] : r.metrics) metrics[k] += v;
}

std::map<std::string, double> Trainer::LogWindow::take(std::map<std::string, double> values) {
  values["train/loss"] = loss / static_cast<double>(steps);
  values["train/samples_per_s"] = static_cast<double>(samples) / std::max(1e-9, seconds);
  // Where the loss averages over something else than samples (gpt2_lm: tokens), its rate too.
  if (terms != samples) values["train/loss_terms_per_s"] = static_cast<double>(terms) / std::max(1e-9, seconds);
  for (const auto& [k, v] : metrics) values["train/" + k] = v / static_cast<double>(steps);
  *this = {};
  return values;
}

void Trainer::flush_window() {
  if (!window_.device_sums.defined()) return;
  const at::Tensor host = window_.device_sums.to(at::kCPU, at::kDouble);
  const double* v = host.data_ptr<double>();
  const int64_t n = window_.device_steps;
  window_.loss += v[0];
  window_.terms += is_count(v[1]) ? std::llround(v[1]) : 0;  // (refused below)
  size_t i = 2;
  for (const auto& name : window_.device_metrics) window_.metrics[name] += v[i++];
  const int64_t skipped = std::llround(v[i]), no_counts = std::llround(v[i + 1]), trailing = std::llround(v[i + 2]);
  window_.device_sums = at::Tensor();
  window_.device_steps = 0;
  if (no_counts > 0)
    throw no_count(model_name_, "terms, of its loss or a metric,",
                   n == 1 ? "step " + std::to_string(step_)
                          : std::to_string(no_counts) + " of the steps " + std::to_string(step_ - n + 1) + " ... " + std::to_string(step_));
  skipped_in_a_row_ = skipped == n ? skipped_in_a_row_ + n : trailing;  // (those at its end, counted on the device)
  if (skipped > 0) {
    skipped_steps_ += skipped;
    if (n == 1)
      log::warn("step ", step_, " (its values read now): non-finite gradients, update skipped (", skipped_steps_,
                " skipped so far)");
    else
      log::warn(skipped, " of the ", n, " steps ", step_ - n + 1, " ... ", step_, " (their values read now) had non-finite ",
                "gradients, updates skipped (", skipped_steps_, " skipped so far)");
  }
}

void Trainer::stop_if_skipping() const {
  const int64_t limit = options_.stop_after_skipped;
  if (limit == 0 || skipped_in_a_row_ < limit) return;
  // (not while fp16_amp's dynamic loss scale still comes down: from init_scale 1e30 by x0.75 that
  // takes 240 steps, every one skipped; read to the host only here, where the skips were read)
  if (loss_scale_descent(*precision_) > 0) return;
  // (exact where the skips are known: each read, of a step or of a window of them)
  throw Error("steps " + std::to_string(step_ - skipped_in_a_row_ + 1) + " ... " + std::to_string(step_) + " (" +
              std::to_string(skipped_in_a_row_) + " in a row) had non-finite gradients, so none of them updated the " +
              "weights: the run stops rather than train on without learning (trainer.stop_after_skipped = " +
              std::to_string(limit) + "; 0 never stops). Lower trainer.lr, keep trainer.clip_grad_norm on, check the " +
              "data for NaN or infinite values and the model's forward (a log of 0, a division by 0)");
}

TrainSummary Trainer::train() {
  const int64_t first_step = step_;
  memory_->reset_peak();
  last_eval_.reset();
  notify("on_run_begin", [&](sdk::Callback& c, sdk::RunContext& run) { c.on_run_begin(run); });
  const bool ran_pending = evaluation_pending_;
  if (evaluation_pending_) {  // the checkpoint's step was to be evaluated when a stop cut it short
    evaluation_pending_ = false;
    log::info("the evaluation of step ", step_, " that a stop or a failure cut short runs first");
    evaluate_and_report(selection_split());
  }
  const bool test_only = test_pending_;  // (a run at its end whose test evaluation a stop cut short)
  test_pending_ = false;
  if (test_only) log::info("the test evaluation of step ", step_, " that a stop or a failure cut short runs now");
  // A stop a callback asked for on one rank alone before the first step (on_run_begin, the pending
  // evaluation's hooks): every rank's, or that one would skip the loop the others enter.
  if (parallel_->world_size() > 1 && stop_signal() == 0 && another_rank_stopped_ && stop_reason_.empty())
    stop_reason_ = "another rank's callback stopped the run";
  double train_seconds = 0;
  while (step_ < total_steps_ && stop_reason_.empty()) {
    check_run_folder();  // (before a step that would be written at its old path)
    notify("on_step_begin", [&](sdk::Callback& c, sdk::RunContext& run) { c.on_step_begin(run, step_ + 1); });
    const auto start = Clock::now();
    // Only log steps read the step's values from the device, unless a callback reads every step.
    const bool log_step = (step_ + 1) % options_.log_every == 0 || step_ + 1 == total_steps_;
    StepResult r = in_phase("training step " + std::to_string(step_ + 1),
                            [&] { return step_with_recovery(read_every_step_ || log_step); });
    const double dt = seconds_since(start);
    if (!pending_record_.dir.empty()) set_aside_earlier_summary();  // (once: the first step a resume trains)
    pending_record_.commit();  // (a step trained with this configuration: config.json records it now)
    train_seconds += dt;
    window_.add(r, dt);
    const int sig = stop_signal();  // stop now: a checkpoint, no evaluation (agreed by every rank)
    if (sig != 0 && stop_reason_.empty()) stop_reason_ = signal_name(sig) + " received";
    // A callback's stop on one rank during the step is every rank's before the evaluation's decision.
    if (another_rank_stopped_ && stop_reason_.empty()) stop_reason_ = "another rank's callback stopped the run";
    const bool log_now = step_ % options_.log_every == 0 || step_ == total_steps_ || !stop_reason_.empty();
    const auto log_window = [&] {
      flush_window();
      // A stop logs a step that was not a log step: its rate and norm are still on the device (one
      // read; the norm was logged as null, a NaN in TensorBoard, at every stop).
      if (!r.read && lr_on_device_.defined()) r.lr = lr_on_device_.item<double>();
      if (!r.read && last_unread_.defined()) {
        const at::Tensor tail = last_unread_.slice(0, -3, -1).to(at::kCPU, at::kDouble);  // [norm, found-inf]
        if (tail[1].item<double>() == 0) r.grad_norm = tail[0].item<double>();
      }
      // A model whose forward counts nothing (its count 0 for a whole batch): the loss, a sum, is
      // divided by nothing, and the run went on to exit 0 with "accuracy nan %" at 237 samples/s.
      if (r.read && r.terms == 0 && r.samples > 0 && !said_no_terms_) {
        said_no_terms_ = true;
        log::warn("step ", step_, ": model '", model_name_, "' counted no loss terms in a batch of ", r.samples,
                  " samples (its forward's count is 0): the logged loss and metrics are no means. Expected only where "
                  "every label of the batch is ignored (-100); else its forward must count what its loss sums over");
      }
      if (r.grad_norm == 0 && r.terms > 0 && !said_zero_gradients_) {  // (exactly 0: not small, nothing at all)
        said_zero_gradients_ = true;
        log::warn("step ", step_, "'s gradients are all zero: no parameter learned from it (every trainable parameter "
                  "frozen, a loss that does not depend on them, or float16 gradients that underflow)");
      }
      auto values = window_.take(step_values(r));
      add_model_flops(values, flops_per_term_, devices_in_world(), peak_.tflops);  // Note [Model FLOPs in the log]
      finish_metrics(values, "train/");
      notify("on_log", [&](sdk::Callback& c, sdk::RunContext& run) { c.on_log(run, step_, values); });
    };
    if (log_now) {
      log_window();
      // (and one that on_log asked for: agreed again, on log steps only, which every rank shares)
      if (parallel_->world_size() > 1 && any_rank(!stop_reason_.empty()) && stop_reason_.empty())
        stop_reason_ = "another rank's callback stopped the run";
    }
    sdk::StepReport report = step_report(r, dt);
    // (eval_every 0: where an epoch ends, which a resume with another batch moves off the multiples
    // of the steps per epoch: Note [An epoch of whole steps])
    const bool due = (options_.eval_every > 0 ? step_ % eval_every_ == 0
                                              : train_loader_->position().offset >= train_loader_->samples_per_epoch()) ||
                     step_ == total_steps_;
    if (sig == 0 && (due || !stop_reason_.empty()))
      report.evaluated = evaluate_and_report(selection_split());
    else if (sig != 0 && due && eval_loader(selection_split()) != nullptr) {
      evaluation_cut_at_ = step_;  // a signal in the step skips its evaluation: pending in the checkpoint, as a cut one
      if (step_ >= total_steps_ && parallel_->rank() == 0) write_run_summary();  // (the end reached, its verdict not)
    }
    report.last = step_ == total_steps_ || !stop_reason_.empty();
    // A stop decided after the step's log decision (in the evaluation: a signal that cut it, early
    // stopping): the steps since the last log step are logged, before a checkpoint takes the window.
    const bool logged_late = !stop_reason_.empty() && !log_now;
    if (logged_late) log_window();
    notify("on_step_end", [&](sdk::Callback& c, sdk::RunContext& run) { c.on_step_end(run, report); });
    // A callback that stops one rank's run stops every rank's (their next step would wait for it),
    // and a signal during the evaluation (which ranks cannot cut short alone) stops them after it.
    if (parallel_->world_size() > 1) {
      const int late = stop_signal();
      if (late != 0 && stop_reason_.empty()) stop_reason_ = signal_name(late) + " received";
      if (another_rank_stopped_ && stop_reason_.empty()) stop_reason_ = "another rank's callback stopped the run";
    }
    // ... or in on_step_end (a callback's, a signal the ranks agree on here): logged too (the run's
    // last row was the log step's before; the steps after it trained and were never reported;
    // probe M), unless this step's checkpoint holds them, which its resume logs (not twice).
    if (!stop_reason_.empty() && !log_now && !logged_late && window_saved_at_ != step_) log_window();
  }
  // The pending evaluation ran at the checkpoint's step and no step followed: the checkpoint is
  // written again without its mark, or every later resume would run it again; before the test
  // split's evaluation, which a stop or a failure may cut (a failure had kept the mark: each
  // resume ran the validation again, its figures logged once more, and said "its test alone").
  if (ran_pending && step_ == first_step && evaluation_cut_at_ != step_) save_checkpoint();
  // The test split, once, at the end (when validation chose the best checkpoint); also after a
  // resume at the last step whose cut validation just ran (the stop had skipped both).
  if (selection_split() == sdk::Split::kValidation && (step_ > first_step || ran_pending || test_only) && stop_signal() == 0)
    evaluate_and_report(sdk::Split::kTest);
  check_replicas();
  // (a stop a callback asked for before the first step trains nothing: the record goes back too)
  if (step_ > first_step || ran_pending) pending_record_.commit();
  return finish_run(first_step, train_seconds);
}

}  // namespace loom::core
