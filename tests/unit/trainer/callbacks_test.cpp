// Callbacks on a real run (synthetic data, the debug transformer, the standard callbacks and the
// test callback `record`, which logs every hook): the order of the hooks, an error naming the
// callback, early stopping and its resume, a resume that restores every stateful component
// (callbacks, the schedule, early stopping), and the configuration of callbacks.
#include <loom/core/checkpoint.hpp>
#include <loom/core/config.hpp>
#include <loom/core/files.hpp>
#include <loom/core/log.hpp>
#include <loom/core/safetensors.hpp>
#include <loom/core/trainer.hpp>

#include "trainer_testing.hpp"

#include <ATen/ops/equal.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>

namespace fs = std::filesystem;
using namespace loom::core;

namespace {

class CallbacksTest : public testing::Test {
 protected:
  void SetUp() override { dir_ = loom::testing::fresh_test_dir("loom_callbacks_test"); }
  void TearDown() override { fs::remove_all(dir_); }

  Config base(const std::string& name) const {
    return loom::testing::config_of(
        {"model.name=lightweight_transformer", "model.flavour=debug", "model.dropout=0.1", "data.name=synthetic",
         "data.train_size=512", "data.test_size=128", "data.num_workers=2", "trainer.batch_size=32",
         "trainer.max_steps=4", "trainer.seed=7", "trainer.log_every=2", "trainer.eval_every=2",
         "trainer.device=cpu", "precision.name=fp32", "memory.estimate=false"},
        dir_, name);
  }

  /// The `record` callback's lines, without the prefix ("on_step_begin 1").
  static std::vector<std::string> recorded(const log::Capture& capture) {
    std::vector<std::string> out;
    const std::string prefix = "[record_callback] record: ";
    for (const auto& line : capture.lines())
      if (line.rfind(prefix, 0) == 0) out.push_back(line.substr(prefix.size()));
    return out;
  }

  /// (train/loss, train/lr) per step from a run's metrics.jsonl.
  static std::map<int64_t, std::pair<std::string, std::string>> train_lines(const fs::path& run) {
    std::map<int64_t, std::pair<std::string, std::string>> out;
    std::ifstream in(run / "metrics.jsonl");
    const std::regex re(R"re(^\{"step":(\d+),.*"train/loss":([^,}]+),"train/lr":([^,}]+))re");
    std::smatch m;
    for (std::string line; std::getline(in, line);)
      if (std::regex_search(line, m, re)) out[std::stoll(m[1])] = {m[2], m[3]};
    return out;
  }

  fs::path dir_;
};

TEST_F(CallbacksTest, HooksRunInTheirDocumentedOrder) {
  Config c = base("order");
  c.set_assignment("trainer.callbacks=record, checkpoint");
  auto t = loom::testing::make_trainer(c);
  log::Capture capture;
  t->train();
  const std::vector<std::string> expected = {
      "on_run_begin 0",
      "on_step_begin 1", "on_after_backward 1", "on_before_optimizer_step 1", "on_step_end 1",
      "on_step_begin 2", "on_after_backward 2", "on_before_optimizer_step 2", "on_log train 2", "on_log eval 2",
      "on_evaluation_end validation 2", "on_step_end evaluated 2", "on_checkpoint_saved 2",
      "on_step_begin 3", "on_after_backward 3", "on_before_optimizer_step 3", "on_step_end 3",
      "on_step_begin 4", "on_after_backward 4", "on_before_optimizer_step 4", "on_log train 4", "on_log eval 4",
      "on_evaluation_end validation 4", "on_step_end evaluated last 4", "on_checkpoint_saved 4",
      "on_log eval 4", "on_evaluation_end test 4", "on_run_end 4"};
  EXPECT_EQ(recorded(capture), expected);
}

TEST_F(CallbacksTest, AnErrorInACallbackNamesTheCallbackAndTheHook) {
  Config c = base("failing");
  c.set_assignment("trainer.callbacks=progress, record");
  c.set_assignment("callback.record.fail_in=on_log");
  EXPECT_CONTAINS(loom::testing::training_error(c), "callback 'record' (on_log): record fails in on_log as asked");
}

TEST_F(CallbacksTest, ACallbacksTextThatJsonCannotHoldIsNamedOrMadeSafe) {
  // A state that is not UTF-8: its callback named (the first checkpoint failed as "callback
  // 'checkpoint': [json.exception.type_error.316]"); a stop reason: written with '?' (summary.json
  // was lost); a weights name with a NUL: refused (it wrote checkpoints/a).
  Config state = base("odd_state");
  state.set_assignment("trainer.callbacks=record, checkpoint");
  state.set_assignment("callback.record.odd_text=state");
  EXPECT_CONTAINS(loom::testing::training_error(state),
                  "the state_dict of callback 'record' has the value of 'odd' that is not UTF-8 text");
  Config stop = base("odd_stop");
  stop.set_assignment("trainer.callbacks=record");
  stop.set_assignment("callback.record.stop_at=2");
  stop.set_assignment("callback.record.odd_text=stop_reason");
  loom::testing::make_trainer(stop)->train();
  std::ifstream summary(dir_ / "odd_stop" / "summary.json");
  const std::string text((std::istreambuf_iterator<char>(summary)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("record ?? asked"), std::string::npos) << text;
  Config weights = base("odd_weights");
  weights.set_assignment("trainer.callbacks=record");
  weights.set_assignment("callback.record.stop_at=2");
  weights.set_assignment("callback.record.odd_text=weights_name");
  EXPECT_CONTAINS(loom::testing::training_error(weights), "without '/' or a NUL byte");
  EXPECT_FALSE(fs::exists(dir_ / "odd_weights" / "checkpoints" / "a"));
  // A callback's best_loss.safetensors replaced the best callback's file, its metric and value gone.
  Config best = base("odd_best");
  best.set_assignment("trainer.callbacks=best, record");
  best.set_assignment("trainer.best_metric=loss");
  best.set_assignment("trainer.eval_every=1");  // (best's file of step 1, before the callback's save at step 2)
  best.set_assignment("callback.record.stop_at=2");
  best.set_assignment("callback.record.odd_text=best_name");
  EXPECT_CONTAINS(loom::testing::training_error(best), "save_weights(best_loss.safetensors) of callback 'record': names "
                                                       "starting with best_ are the best callback's");
  // (the best callback's own file, of its evaluation at step 1, keeps its metric)
  std::ifstream best_file(dir_ / "odd_best" / "checkpoints" / "best_loss.safetensors");
  ASSERT_TRUE(best_file.good());
  const std::string header((std::istreambuf_iterator<char>(best_file)), std::istreambuf_iterator<char>());
  EXPECT_NE(header.find("\"direction\""), std::string::npos);
}

TEST_F(CallbacksTest, ACheckpointAskedForMidStepOrFromASaveIsRefusedAndOneBetweenStepsIsWritten) {
  // From on_checkpoint_saved a save saved again until the process crashed; from on_after_backward
  // it wrote a state that was no step's over the good checkpoint of the step before.
  for (const std::string hook : {"on_checkpoint_saved", "on_after_backward"}) {
    Config c = base("save_in_" + hook);
    c.set_assignment("trainer.callbacks=record, checkpoint");
    c.set_assignment("callback.record.save_in=" + hook);
    EXPECT_CONTAINS(loom::testing::training_error(c),
                    "callback 'record' (" + hook + "): save_checkpoint() from " + hook + " is refused");
  }
  Config c = base("save_in_on_log");
  c.set_assignment("trainer.callbacks=record");
  c.set_assignment("callback.record.save_in=on_log");
  loom::testing::make_trainer(c)->train();
  EXPECT_TRUE(fs::exists(dir_ / "save_in_on_log" / "checkpoints" / loom::core::step_dir_name(2) / "state.json"));
}

TEST_F(CallbacksTest, WithoutCallbacksARunWritesNothingButStillEvaluates) {
  Config c = base("silent");
  c.set_assignment("trainer.callbacks=");
  auto t = loom::testing::make_trainer(c);
  const TrainSummary s = t->train();
  EXPECT_EQ(s.steps, 4);
  ASSERT_TRUE(s.final_eval.has_value());
  EXPECT_EQ(s.final_eval->split, loom::sdk::Split::kTest);
  EXPECT_FALSE(fs::exists(dir_ / "silent" / "metrics.jsonl"));
  EXPECT_FALSE(fs::exists(dir_ / "silent" / "tensorboard"));
  EXPECT_TRUE(CheckpointStore(dir_ / "silent").list().empty());
}

TEST_F(CallbacksTest, EarlyStoppingStopsTheRunAndAResumedRunStaysStopped) {
  Config c = base("early");
  c.set_assignment("trainer.max_steps=40");
  c.set_assignment("trainer.eval_every=1");
  c.set_assignment("trainer.callbacks=checkpoint, early_stopping");
  // No evaluation can improve the loss by 100: the first sets the best, the next two do not.
  c.set_assignment("callback.early_stopping.metric=loss");
  c.set_assignment("callback.early_stopping.min_delta=100");
  c.set_assignment("callback.early_stopping.patience=2");
  {
    auto t = loom::testing::make_trainer(c);
    const TrainSummary s = t->train();
    EXPECT_EQ(s.steps, 3);
    EXPECT_NE(s.stop_reason.find("early_stopping: validation loss has not improved by more than 100 for 2 evaluations "
                                 "(best loss "),
              std::string::npos)
        << s.stop_reason;
    EXPECT_NE(s.stop_reason.find("at step 1)"), std::string::npos) << s.stop_reason;
    ASSERT_TRUE(s.final_eval.has_value());
    EXPECT_EQ(s.final_eval->split, loom::sdk::Split::kTest);  // the test split still runs at the end
  }
  const auto saved = CheckpointStore(dir_ / "early").list();
  ASSERT_FALSE(saved.empty());
  EXPECT_EQ(saved.back().filename(), step_dir_name(3));  // the step it stopped at is saved
  {
    // Another run resumed from this one's stopped checkpoint (--resume-from into a new name): its
    // count, best and stop are the other run's (it stopped at once, training nothing, or at its
    // first evaluation naming the other run's best step); they start afresh, as best's does.
    Config next = base("early_next");
    next.set_assignment("trainer.max_steps=40");
    next.set_assignment("trainer.eval_every=1");
    next.set_assignment("trainer.callbacks=checkpoint, early_stopping");
    next.set_assignment("callback.early_stopping.metric=loss");
    next.set_assignment("callback.early_stopping.min_delta=100");
    next.set_assignment("callback.early_stopping.patience=2");
    next.set_assignment("trainer.resume_from=" + (dir_ / "early" / "checkpoints" / step_dir_name(3)).string());
    log::Capture capture;
    const TrainSummary s = loom::testing::make_trainer(next)->train();
    EXPECT_EQ(s.steps, 3 + 3);  // a best at step 4, then 2 evaluations without improvement
    EXPECT_NE(s.stop_reason.find("for 2 evaluations (best loss "), std::string::npos) << s.stop_reason;
    EXPECT_NE(s.stop_reason.find("at step 4)"), std::string::npos) << s.stop_reason;
    EXPECT_TRUE(capture.contains("is another run's checkpoint: its count of evaluations without improvement (2), its best and "
                                 "its stop are not this run's: they start afresh"))
        << ::testing::PrintToString(capture.lines());
  }

  {
    // The same stop at the run's last step ends nothing early; summary.json still names it, as a
    // resume with more steps meets it at once.
    Config last = base("early_last");
    for (const char* a : {"trainer.max_steps=3", "trainer.eval_every=1", "trainer.callbacks=checkpoint, early_stopping",
                          "callback.early_stopping.metric=loss", "callback.early_stopping.min_delta=100",
                          "callback.early_stopping.patience=2"})
      last.set_assignment(a);
    const TrainSummary s = loom::testing::make_trainer(last)->train();
    EXPECT_EQ(s.steps, 3);
    EXPECT_EQ(s.stop_reason, "");
    std::ifstream in(dir_ / "early_last" / "summary.json");
    const std::string summary((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(summary.find("stopped_early"), std::string::npos) << summary;
    EXPECT_NE(summary.find("\"stop_asked_at_last_step\": \"early_stopping: validation loss has not improved"),
              std::string::npos)
        << summary;
  }

  c.set_assignment("trainer.resume=auto");
  {
    auto again = loom::testing::make_trainer(c);
    EXPECT_EQ(again->step(), 3);
    const TrainSummary s = again->train();
    EXPECT_EQ(s.steps, 3);
    EXPECT_NE(s.stop_reason.find("early_stopping: validation loss has not improved"), std::string::npos) << s.stop_reason;
    EXPECT_NE(s.stop_reason.find("to train on, resume with callback.early_stopping.patience above 2"), std::string::npos)
        << s.stop_reason;
  }
  {
    // A higher patience lets the stopped run go on, its count kept: 2 evaluations without
    // improvement so far, so 3 more at patience 5 (steps 4, 5, 6).
    c.set_assignment("callback.early_stopping.patience=5");
    auto more = loom::testing::make_trainer(c);
    const TrainSummary s = more->train();
    EXPECT_EQ(s.steps, 6);
    EXPECT_NE(s.stop_reason.find("for 5 evaluations"), std::string::npos) << s.stop_reason;
  }
  {
    // Another metric: the checkpoint's best and count are of the loss and say nothing of it.
    c.set_assignment("callback.early_stopping.metric=accuracy");
    c.set_assignment("callback.early_stopping.min_delta=10");
    auto other = loom::testing::make_trainer(c);
    const TrainSummary s = other->train();
    EXPECT_EQ(s.steps, 6 + 6);  // the first evaluation sets a best, then 5 without improvement
    EXPECT_NE(s.stop_reason.find("validation accuracy has not improved by more than 10 for 5 evaluations"),
              std::string::npos)
        << s.stop_reason;
  }
}

TEST_F(CallbacksTest, AResumeWithAnotherBestMetricStartsItsBestAfresh) {
  // The checkpoint's best is an accuracy (a small number, higher is better); a loss compared with
  // it (lower is better) would never beat it, and best_loss.safetensors would never be written.
  Config c = base("best_metric");
  c.set_assignment("trainer.callbacks=best, checkpoint");
  c.set_assignment("trainer.best_metric=accuracy");
  EXPECT_EQ(loom::testing::make_trainer(c)->train().steps, 4);
  EXPECT_TRUE(fs::exists(dir_ / "best_metric" / "checkpoints" / "best_accuracy.safetensors"));
  EXPECT_FALSE(fs::exists(dir_ / "best_metric" / "checkpoints" / "best_loss.safetensors"));

  c.set_assignment("trainer.resume=auto");
  c.set_assignment("trainer.max_steps=6");
  c.set_assignment("trainer.best_metric=loss");
  log::Capture capture;
  EXPECT_EQ(loom::testing::make_trainer(c)->train().steps, 6);
  EXPECT_TRUE(capture.contains("best: the checkpoint's best is of accuracy; trainer.best_metric is now loss"));
  EXPECT_TRUE(fs::exists(dir_ / "best_metric" / "checkpoints" / "best_loss.safetensors"));
  EXPECT_TRUE(fs::exists(dir_ / "best_metric" / "checkpoints" / "best_accuracy.safetensors")) << "the other metric's best file stays";
}

TEST_F(CallbacksTest, TheBestFileIsReplacedOnlyByABetterEvaluationWhateverTheSessionsBetweenSelected) {
  // A session without the best callback, or measuring another best metric, left checkpoints
  // without the best accuracy; the next session with it wrote best_accuracy.safetensors at its
  // first evaluation, however much worse (probe): the run's best weights were lost. The sessions
  // after the first train at a learning rate of 1e-12, so that their evaluations are the last
  // checkpoint's again, no better than the best (a tie replaces no best file either).
  const fs::path file = dir_ / "keep_best" / "checkpoints" / "best_accuracy.safetensors";
  const auto best_file = [&] {
    loom::sdk::TextMap metadata;
    load_safetensors(file, &metadata);
    return std::make_pair(std::stod(metadata.at("value")), metadata.at("step"));
  };
  const auto val_accuracies = [&] {  // step -> val/accuracy, from metrics.jsonl
    std::map<int64_t, double> out;
    std::ifstream in(dir_ / "keep_best" / "metrics.jsonl");
    const std::regex re(R"re(^\{"step":(\d+),.*"val/accuracy":([-0-9.eE+]+))re");
    std::smatch m;
    for (std::string line; std::getline(in, line);)
      if (std::regex_search(line, m, re)) out[std::stoll(m[1])] = std::stod(m[2]);
    return out;
  };
  Config c = base("keep_best");
  c.set_assignment("trainer.callbacks=jsonl, best, checkpoint");
  c.set_assignment("trainer.best_metric=accuracy");
  c.set_assignment("trainer.max_steps=8");
  EXPECT_EQ(loom::testing::make_trainer(c)->train().steps, 8);
  const auto first = best_file();

  c.set_assignment("trainer.resume=auto");
  c.set_assignment("trainer.lr=1e-12");
  c.set_assignment("trainer.callbacks=jsonl, checkpoint");  // (a session without it)
  c.set_assignment("trainer.max_steps=10");
  EXPECT_EQ(loom::testing::make_trainer(c)->train().steps, 10);
  const std::string state = read_file(dir_ / "keep_best" / "checkpoints" / step_dir_name(10) / "state.json");
  EXPECT_NE(state.find("\"best\""), std::string::npos) << "the state of a callback not selected stays in the checkpoints";

  c.set_assignment("trainer.callbacks=jsonl, best, checkpoint");
  c.set_assignment("trainer.max_steps=12");
  EXPECT_EQ(loom::testing::make_trainer(c)->train().steps, 12);
  ASSERT_EQ(val_accuracies().at(12), val_accuracies().at(8)) << "the sessions after the first do not change the model";
  EXPECT_EQ(best_file(), first) << "an evaluation no better than the best replaced the best file";

  // A session measuring the loss carries no best accuracy at all; the file is still the best.
  c.set_assignment("trainer.best_metric=loss");
  c.set_assignment("trainer.max_steps=14");
  EXPECT_EQ(loom::testing::make_trainer(c)->train().steps, 14);
  c.set_assignment("trainer.best_metric=accuracy");
  c.set_assignment("trainer.max_steps=16");
  {
    log::Capture capture;
    EXPECT_EQ(loom::testing::make_trainer(c)->train().steps, 16);
    EXPECT_TRUE(capture.contains("best: best_accuracy.safetensors (accuracy ")) << ::testing::PrintToString(capture.lines());
  }
  EXPECT_EQ(best_file(), first) << "an evaluation no better than the best replaced the best file";

  // Training again: a better evaluation still replaces it; the file holds the run's best.
  c.set_assignment("trainer.lr=0.002");
  c.set_assignment("trainer.max_steps=30");
  EXPECT_EQ(loom::testing::make_trainer(c)->train().steps, 30);
  const auto all = val_accuracies();
  double best = 0;
  for (const auto& [step, accuracy] : all) best = std::max(best, accuracy);
  const auto [value, step] = best_file();
  EXPECT_NEAR(value, best, 1e-12) << "the best file holds the best evaluation of the run: " << ::testing::PrintToString(all);
  EXPECT_NEAR(all.at(std::stoll(step)), value, 1e-12);
}

TEST_F(CallbacksTest, ABestFileWithDamagedMetadataIsReplacedWithAWarningThatSaysTheFileIsDamaged) {
  // (the warning said "the checkpoint is damaged", of a file that is no checkpoint)
  Config c = base("damaged_best");
  c.set_assignment("trainer.callbacks=checkpoint");
  EXPECT_EQ(loom::testing::make_trainer(c)->train().steps, 4);
  const fs::path file = dir_ / "damaged_best" / "checkpoints" / "best_accuracy.safetensors";
  save_safetensors(file, load_safetensors(dir_ / "damaged_best" / "checkpoints" / step_dir_name(4) / "model.safetensors"),
                   {{"metric", "accuracy"}, {"direction", "max"}, {"value", "nan"}, {"step", "2"}});
  c.set_assignment("trainer.resume=auto");
  c.set_assignment("trainer.callbacks=best, checkpoint");
  c.set_assignment("trainer.best_metric=accuracy");
  c.set_assignment("trainer.max_steps=6");
  log::Capture capture;
  EXPECT_EQ(loom::testing::make_trainer(c)->train().steps, 6);
  EXPECT_TRUE(capture.contains("is not this run's best of accuracy (metadata 'value' = 'nan' is not a finite number; the file "
                               "is damaged): the run's next best evaluation replaces it"))
      << ::testing::PrintToString(capture.lines());
  loom::sdk::TextMap metadata;
  load_safetensors(file, &metadata);
  EXPECT_TRUE(std::isfinite(std::stod(metadata.at("value")))) << metadata.at("value");
  EXPECT_EQ(metadata.at("step"), "6");
}

TEST_F(CallbacksTest, ARunResumedFromAnotherRunsCheckpointWritesItsOwnBest) {
  // (the other run's best value came with the checkpoint, its weights did not: the new run had to
  // beat it to write best_accuracy.safetensors, and ended without one)
  Config c = base("best_source");
  c.set_assignment("trainer.callbacks=best, checkpoint");
  c.set_assignment("trainer.best_metric=accuracy");
  EXPECT_EQ(loom::testing::make_trainer(c)->train().steps, 4);
  Config next = base("best_continued");
  next.set_assignment("trainer.callbacks=best, checkpoint");
  next.set_assignment("trainer.best_metric=accuracy");
  next.set_assignment("trainer.max_steps=6");
  next.set_assignment("trainer.resume_from=" + (dir_ / "best_source" / "checkpoints" / loom::core::step_dir_name(4)).string());
  log::Capture capture;
  EXPECT_EQ(loom::testing::make_trainer(next)->train().steps, 6);
  EXPECT_TRUE(capture.contains("is another run's checkpoint, whose best accuracy ("))
      << ::testing::PrintToString(capture.lines());
  EXPECT_TRUE(fs::exists(dir_ / "best_continued" / "checkpoints" / "best_accuracy.safetensors"));
}

TEST_F(CallbacksTest, ANaNMetricIsNeverTheBestThatLaterEvaluationsMustBeat) {
  // The first validation (2 batches: 51 held-out samples at 32) reports NaN. As the best it would
  // be beaten by nothing (every comparison with NaN is false): best_correct.safetensors stayed the
  // NaN step's, and early stopping stopped after `patience` evaluations, however the model improved.
  Config c = loom::testing::config_of(
      {"model.name=metric_model", "model.nan_eval_batches=2", "data.name=synthetic", "data.train_size=512",
       "data.test_size=128", "trainer.batch_size=32", "trainer.seed=7", "trainer.log_every=2", "trainer.eval_every=2",
       "trainer.device=cpu", "precision.name=fp32", "memory.estimate=false"},
      dir_, "nan_best");
  c.set_assignment("trainer.best_metric=correct");
  c.set_assignment("trainer.callbacks=best, early_stopping");
  c.set_assignment("callback.early_stopping.patience=2");  // (the NaN counts as one without improvement)
  c.set_assignment("trainer.max_steps=8");
  const TrainSummary s = loom::testing::make_trainer(c)->train();
  EXPECT_EQ(s.steps, 8) << "step 4's evaluation is a best, not a second failure to improve: " << s.stop_reason;
  loom::sdk::TextMap metadata;
  load_safetensors(dir_ / "nan_best" / "checkpoints" / "best_correct.safetensors", &metadata);
  EXPECT_NE(metadata.at("step"), "2");
  EXPECT_TRUE(std::isfinite(std::stod(metadata.at("value")))) << metadata.at("value");
}

TEST_F(CallbacksTest, EarlyStoppingRefusesAMetricTheModelDoesNotReport) {
  Config c = base("typo");
  c.set_assignment("trainer.callbacks=early_stopping");
  c.set_assignment("callback.early_stopping.metric=acuracy");
  auto t = loom::testing::make_trainer(c);
  try {
    t->train();
    FAIL() << "an unknown metric must be refused";
  } catch (const loom::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("'acuracy' is not a metric of this run's model, which reports accuracy, loss"), std::string::npos) << m;
    EXPECT_EQ(t->step(), 0) << "refused before the first step";
  }
}

TEST_F(CallbacksTest, AStopInTheEvaluationOfAStepThatIsNoLogStepLogsItsStepsOnce) {
  // Early stopping at step 3 (evaluations at 1, 2, 3; logs every 10): steps 1 ... 3 were never
  // logged (the log decision came before the evaluation's stop). They are, once, before the
  // checkpoint of step 3 takes the window, so that its resume does not log them again.
  Config c = base("late");
  c.set_assignment("trainer.max_steps=40");
  c.set_assignment("trainer.eval_every=1");
  c.set_assignment("trainer.log_every=10");
  c.set_assignment("trainer.callbacks=jsonl, checkpoint, early_stopping");
  c.set_assignment("callback.early_stopping.metric=loss");
  c.set_assignment("callback.early_stopping.min_delta=100");
  c.set_assignment("callback.early_stopping.patience=2");
  EXPECT_EQ(loom::testing::make_trainer(c)->train().steps, 3);
  const auto logged = train_lines(dir_ / "late");
  ASSERT_EQ(logged.size(), 1u);
  EXPECT_EQ(logged.begin()->first, 3);
  const std::string state = loom::core::read_file(dir_ / "late" / "checkpoints" / step_dir_name(3) / "state.json");
  EXPECT_TRUE(std::regex_search(state, std::regex(R"re("log_window":\s*\{\s*"steps":\s*0)re"))) << state.substr(0, 2000);
}

TEST_F(CallbacksTest, ResumeRestoresCallbacksScheduleAndEarlyStoppingExactly) {
  // One run of 8 steps against the same run stopped at step 4 (by `record`) and resumed: the
  // same logged losses and learning rates (warm-up then cosine; the logging window of steps 4-6
  // spans the resume), the same weights, the same state in every callback (record's step count
  // and loss sum, best's value, early stopping's counters).
  auto configure = [&](const std::string& name) {
    Config c = base(name);
    c.set_assignment("trainer.max_steps=8");
    c.set_assignment("trainer.log_every=3");  // the checkpoint at 4 falls inside a logging window
    c.set_assignment("trainer.checkpoint_every=4");
    c.set_assignment("trainer.schedule=warmup_cosine");
    c.set_assignment("trainer.callbacks=record, jsonl, best, early_stopping, checkpoint");
    c.set_assignment("callback.early_stopping.patience=50");
    c.set_assignment("callback.early_stopping.min_delta=0.001");
    return c;
  };
  auto whole = loom::testing::make_trainer(configure("whole"));
  EXPECT_EQ(whole->train().steps, 8);

  Config first = configure("split");
  first.set_assignment("callback.record.stop_at=4");
  EXPECT_EQ(loom::testing::make_trainer(first)->train().steps, 4);
  Config rest = configure("split");
  rest.set_assignment("trainer.resume=auto");
  auto resumed = loom::testing::make_trainer(rest);
  ASSERT_EQ(resumed->step(), 4);
  EXPECT_EQ(resumed->train().steps, 8);

  const auto a = train_lines(dir_ / "whole"), b = train_lines(dir_ / "split");
  ASSERT_EQ(a.size(), 3u);  // steps 3, 6 and the last, 8
  EXPECT_EQ(a, b) << "train/loss and train/lr of every logged window (the one of steps 4-6 spans the resume)";
  const auto pa = loom::testing::parameters_of(*whole), pb = loom::testing::parameters_of(*resumed);
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(at::equal(pa[i], pb[i])) << "parameter " << i;
  ASSERT_EQ(whole->callbacks().size(), resumed->callbacks().size());
  for (size_t i = 0; i < whole->callbacks().size(); ++i) {
    const auto& [name, callback] = whole->callbacks()[i];
    const loom::sdk::State sa = callback->state_dict(), sb = resumed->callbacks()[i].second->state_dict();
    EXPECT_EQ(sa.text, sb.text) << "callback " << name;
    ASSERT_EQ(sa.tensors.size(), sb.tensors.size()) << "callback " << name;
    for (const auto& [key, tensor] : sa.tensors) EXPECT_TRUE(at::equal(tensor, sb.tensors.at(key))) << name << "." << key;
  }
  EXPECT_EQ(whole->callbacks()[0].second->state_dict().text.at("steps"), "8");
}

TEST_F(CallbacksTest, ConfigurationNamesUnknownDuplicateAndUnselectedCallbacks) {
  {
    Config c = base("unknown");
    c.set_assignment("trainer.callbacks=progres");
    try {
      loom::testing::make_trainer(c);
      FAIL() << "an unknown callback must be refused";
    } catch (const loom::Error& e) {
      EXPECT_NE(std::string(e.what()).find("progress"), std::string::npos) << e.what();
    }
  }
  {
    Config c = base("twice");
    c.set_assignment("trainer.callbacks=jsonl, jsonl");
    try {
      loom::testing::make_trainer(c);
      FAIL() << "a callback listed twice must be refused";
    } catch (const loom::Error& e) {
      EXPECT_NE(std::string(e.what()).find("trainer.callbacks lists 'jsonl' twice"), std::string::npos) << e.what();
    }
  }
  {
    Config c = base("unselected");
    c.set_assignment("callback.early_stopping.patience=5");
    log::Capture capture(LOOM_LOG_WARN);
    const Resolved r = resolve_run(c, loom::testing::registry());
    EXPECT_TRUE(capture.contains("callback.early_stopping.patience is an option of callback 'early_stopping', which this "
                                 "run does not select (trainer.callbacks = "))
        << (capture.lines().empty() ? "" : capture.lines().front());
    EXPECT_FALSE(r.count("callback.early_stopping.patience"));
  }
}

}  // namespace
