// Nothing a run wrote is lost through run management, and nothing Loom reads can hang it: a new
// run refuses a folder that holds one, resuming from an older checkpoint sets the newer steps
// aside, --resume auto passes over a run whose checkpoints are all damaged, a folder in use is
// refused, runs without a name never share a folder, interrupted pruning leaves no half-deleted
// step folder, and a FIFO or a device in place of a file is an error, not a hang. A run that
// wrote no checkpoint is started again with its files set aside; a resume keeps what its run
// kept (trainer.keep_last).
#include <loom/core/checkpoint.hpp>
#include <loom/core/config.hpp>
#include <loom/core/files.hpp>
#include <loom/core/log.hpp>
#include <loom/core/safetensors.hpp>
#include <loom/core/text.hpp>
#include <loom/core/trainer.hpp>

#include "trainer_testing.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

namespace fs = std::filesystem;
using namespace loom::core;

namespace {

class RunFolderTest : public testing::Test {
 protected:
  void SetUp() override { dir_ = loom::testing::fresh_test_dir("loom_run_folder_test"); }
  void TearDown() override { fs::remove_all(dir_); }

  Config base(const std::string& name, int64_t steps = 4) const {
    Config c = loom::testing::config_of(
        {"model.name=lightweight_transformer", "model.flavour=debug", "data.name=synthetic", "data.train_size=256",
         "data.test_size=64", "trainer.batch_size=32", "trainer.seed=3", "trainer.log_every=100", "trainer.eval_every=100",
         "trainer.checkpoint_every=2", "trainer.keep_last=10", "trainer.device=cpu", "precision.name=fp32",
         "memory.estimate=false", "trainer.callbacks=jsonl, checkpoint"},
        dir_, name);
    c.set_assignment("trainer.max_steps=" + std::to_string(steps));
    return c;
  }

  /// Whether an abandoned-* folder of `run` holds step `step`'s model.safetensors of `size` bytes.
  static bool kept_aside(const fs::path& run, int64_t step, uintmax_t size) {
    for (const auto& entry : fs::directory_iterator(run / "checkpoints"))
      if (const fs::path model = entry.path() / loom::core::step_dir_name(step) / "model.safetensors";
          entry.path().filename().string().rfind("abandoned-", 0) == 0 && fs::exists(model) && fs::file_size(model) == size)
        return true;
    return false;
  }

  static std::string text(const fs::path& p) {
    std::ostringstream out;
    out << std::ifstream(p).rdbuf();
    return out.str();
  }

  /// A file's size and hash: binary contents compared without printing them.
  static std::string digest(const std::string& bytes) {
    return std::to_string(bytes.size()) + " bytes, hash " + std::to_string(std::hash<std::string>{}(bytes));
  }

  static std::string error_of(const Config& c) {
    try {
      loom::testing::make_trainer(c);
    } catch (const loom::Error& e) {
      return e.what();
    }
    return "(no error)";
  }

  static std::vector<std::string> steps(const fs::path& run) {
    std::vector<std::string> out;
    for (const auto& p : CheckpointStore::list_run(run)) out.push_back(p.filename().string());
    return out;
  }

  fs::path dir_;
};

TEST_F(RunFolderTest, ANewRunRefusesAFolderThatHoldsARun) {
  loom::testing::make_trainer(base("taken"))->train();
  const auto before = steps(dir_ / "taken");
  ASSERT_EQ(before.size(), 2u);
  const std::string m = error_of(base("taken"));
  EXPECT_NE(m.find("already holds a run named 'taken' (2 checkpoints); continue it with --resume auto, or choose "
                   "another trainer.name (nothing was written)"),
            std::string::npos)
      << m;
  EXPECT_EQ(steps(dir_ / "taken"), before);
}

TEST_F(RunFolderTest, ANewRunRefusesAFolderHoldingOnlyARunsBestWeightsSummaryOrEvents) {
  // A folder left with a run's deliverables only (its step folders and metrics deleted): a new run
  // of that name wrote over its best weights and summary.json, exit 0, not a word.
  for (const std::string kept : {"checkpoints/best_accuracy.safetensors", "summary.json", "tensorboard/events.out"}) {
    const std::string name = "kept_" + std::to_string(kept.size());
    const fs::path file = dir_ / name / kept;
    fs::create_directories(file.parent_path());
    std::ofstream(file) << "the run's";
    const std::string m = error_of(base(name));
    EXPECT_NE(m.find("already holds a run named '" + name + "' (0 checkpoints)"), std::string::npos) << kept << ": " << m;
    EXPECT_EQ(text(file), "the run's") << kept;
    // ("nothing was written": nor a lock file, which it made to look, and which a copy of the
    // folder then carried)
    EXPECT_FALSE(fs::exists(fs::symlink_status(dir_ / name / ".lock"))) << kept;
    // --resume auto starts it again, the file moved aside, not written over.
    Config again = base(name);
    again.set_assignment("trainer.resume=auto");
    loom::testing::make_trainer(again)->train();
    const std::string there = kept.rfind("checkpoints/", 0) == 0 ? kept.substr(12) : kept;
    bool aside = false;
    for (const auto& entry : fs::directory_iterator(dir_ / name / "checkpoints"))
      aside = aside || (entry.path().filename().string().rfind("abandoned-", 0) == 0 && text(entry.path() / there) == "the run's");
    EXPECT_TRUE(aside) << kept;
  }
}

TEST_F(RunFolderTest, AResumeFromAnOlderStepMovesFilesOntoTheDiskItsCheckpointsFolderLinksTo) {
  // checkpoints/ a link onto another filesystem: the resume's moves of summary.json and the
  // records beside it into checkpoints/abandoned-... failed with "Invalid cross-device link"
  // half-way (newer steps already moved), and every retry failed the same way.
  const fs::path other = fs::path("/dev/shm") / dir_.filename();
  struct stat here {}, there {};
  if (::stat(dir_.c_str(), &here) != 0 || ::stat("/dev/shm", &there) != 0 || here.st_dev == there.st_dev)
    GTEST_SKIP() << "needs /dev/shm on another filesystem than " << dir_;
  fs::remove_all(other);
  fs::create_directories(other);
  struct Cleanup {
    fs::path p;
    ~Cleanup() { fs::remove_all(p); }
  } cleanup{other};
  fs::create_directories(dir_ / "linked");
  fs::create_directory_symlink(other, dir_ / "linked" / "checkpoints");
  Config c = base("linked", 6);
  loom::testing::make_trainer(c)->train();
  ASSERT_TRUE(fs::exists(dir_ / "linked" / "summary.json"));
  c.set_assignment("trainer.resume_from=" + (dir_ / "linked" / "checkpoints" / step_dir_name(2)).string());
  auto t = loom::testing::make_trainer(c);
  EXPECT_EQ(t->step(), 2);
  EXPECT_EQ(steps(dir_ / "linked"), std::vector<std::string>{step_dir_name(2)});
  bool summary_aside = false;
  for (const auto& entry : fs::recursive_directory_iterator(other)) {
    EXPECT_NE(entry.path().extension(), ".partial") << entry.path() << ": a partial copy left";
    summary_aside = summary_aside || entry.path().filename() == "summary.json";
  }
  EXPECT_TRUE(summary_aside);
  EXPECT_FALSE(fs::exists(dir_ / "linked" / "summary.json"));
  t->train();
  EXPECT_EQ(t->step(), 6);
}

TEST_F(RunFolderTest, AResumeFromAStepSetAsideStartsANewRunNotOneNamedCheckpoints) {
  loom::testing::make_trainer(base("timeline", 6))->train();
  Config back = base("timeline", 6);
  back.set_assignment("trainer.resume_from=" + (dir_ / "timeline" / "checkpoints" / step_dir_name(2)).string());
  loom::testing::make_trainer(back);  // steps 4 and 6 go aside
  fs::path aside;
  for (const auto& entry : fs::directory_iterator(dir_ / "timeline" / "checkpoints"))
    if (entry.path().filename().string().rfind("abandoned-", 0) == 0) aside = entry.path();
  ASSERT_TRUE(fs::exists(aside / step_dir_name(6)));
  Config again = base("", 8);
  again.set_assignment("trainer.name=");
  again.set_assignment("trainer.resume_from=" + (aside / step_dir_name(6)).string());
  auto t = loom::testing::make_trainer(again);
  EXPECT_EQ(t->step(), 6);
  EXPECT_FALSE(fs::exists(dir_ / "checkpoints")) << "the run was named after the folder of the run's checkpoints";
}

TEST_F(RunFolderTest, ARefusedStartLeavesNoFolderBehindButKeepsOneThatWasThere) {
  loom::testing::make_trainer(base("source"))->train();
  // Resuming a new run from a checkpoint of another model: refused, and the folder the command
  // made for it (with only its lock file) is gone, so the name is free, not "in use" or "taken".
  Config other = base("other");
  other.set_assignment("model.flavour=standard");
  other.set_assignment("trainer.resume_from=" + (dir_ / "source" / "checkpoints" / step_dir_name(2)).string());
  EXPECT_NE(error_of(other).find("refusing to resume"), std::string::npos);
  EXPECT_FALSE(fs::exists(dir_ / "other"));
  // The same refusal into a folder the user made beforehand leaves that folder.
  fs::create_directories(dir_ / "mine");
  Config mine = other;
  mine.set_assignment("trainer.name=mine");
  EXPECT_NE(error_of(mine).find("refusing to resume"), std::string::npos);
  EXPECT_TRUE(fs::is_directory(dir_ / "mine"));
  EXPECT_EQ(steps(dir_ / "source").size(), 2u);
  // A new run from a checkpoint at its last step would train nothing: said, no folder left.
  Config late = base("late");
  late.set_assignment("trainer.resume_from=" + (dir_ / "source" / "checkpoints" / step_dir_name(4)).string());
  EXPECT_NE(error_of(late).find("is at step 4, and this run ends at step 4 (trainer.max_steps or trainer.epochs): "
                                "nothing to train. Raise trainer.max_steps"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(dir_ / "late"));
}

TEST_F(RunFolderTest, ACheckpointToStartFromThatIsNotThereIsSaidBeforeTheDataIsRead) {
  // The data is read first, and may take minutes: a mistyped --resume-from or init_from was said
  // only after it. Here the data cannot be read at all, so the error says which came first.
  for (const std::string key : {"trainer.resume_from", "trainer.init_from"}) {
    Config c = base("typo");
    c.set_assignment("data.name=fashion_mnist");
    c.set_assignment("data.fashion_mnist.path=" + (dir_ / "no-data").string());
    c.set_assignment(key + "=" + (dir_ / "nope").string());
    EXPECT_CONTAINS(error_of(c), key + " = " + (dir_ / "nope").string() + ": no such checkpoint (a ");
    EXPECT_FALSE(fs::exists(dir_ / "typo"));
  }
}

TEST_F(RunFolderTest, ResumingFromAnOlderCheckpointSetsTheNewerStepsAside) {
  loom::testing::make_trainer(base("timeline", 6))->train();
  ASSERT_EQ(steps(dir_ / "timeline"), (std::vector<std::string>{step_dir_name(2), step_dir_name(4), step_dir_name(6)}));
  ASSERT_TRUE(fs::exists(dir_ / "timeline" / "summary.json"));  // (the verdict of step 6: that timeline's)
  Config again = base("", 6);
  again.set_assignment("trainer.resume_from=" + (dir_ / "timeline" / "checkpoints" / step_dir_name(2)).string());
  auto t = loom::testing::make_trainer(again);
  EXPECT_EQ(t->run_dir(), dir_ / "timeline");
  EXPECT_EQ(steps(dir_ / "timeline"), (std::vector<std::string>{step_dir_name(2)}));
  // The abandoned steps are kept, out of the way of resuming and pruning.
  int aside = 0;
  for (const auto& entry : fs::directory_iterator(dir_ / "timeline" / "checkpoints"))
    if (entry.path().filename().string().rfind("abandoned-", 0) == 0) {
      EXPECT_TRUE(fs::exists(entry.path() / step_dir_name(4) / "model.safetensors"));
      EXPECT_TRUE(fs::exists(entry.path() / step_dir_name(6) / "state.json"));
      EXPECT_TRUE(fs::exists(entry.path() / "summary.json"));
      ++aside;
    }
  EXPECT_EQ(aside, 1);
  EXPECT_FALSE(fs::exists(dir_ / "timeline" / "summary.json"));
  t->train();
  EXPECT_TRUE(fs::exists(dir_ / "timeline" / "summary.json"));
  t.reset();
  // --resume auto now continues the resumed timeline, whose newest checkpoint is its own step 6.
  Config resume = base("timeline", 8);
  resume.set_assignment("trainer.resume=auto");
  EXPECT_EQ(loom::testing::make_trainer(resume)->step(), 6);
}

TEST_F(RunFolderTest, ABestFileOfTheAbandonedStepsGoesAsideWithThemOneOfTheResumedStepsStays) {
  Config c = base("best", 6);
  c.set_assignment("trainer.callbacks=jsonl, checkpoint, best");
  c.set_assignment("trainer.eval_every=2");
  loom::testing::make_trainer(c)->train();
  const fs::path checkpoints = dir_ / "best" / "checkpoints";
  const fs::path best = checkpoints / "best_accuracy.safetensors";
  ASSERT_TRUE(fs::exists(best));
  const auto written_at = [&](const std::string& step) {  // the file as if the best had come at `step`
    loom::sdk::TextMap metadata;
    const auto tensors = load_safetensors(best, &metadata);
    metadata["step"] = step;
    metadata.erase("loom_crc32");
    save_safetensors(best, tensors, metadata);
  };
  const auto resume_from_step_2 = [&] {
    Config again = base("", 6);
    again.set_assignment("trainer.callbacks=jsonl, checkpoint, best");
    again.set_assignment("trainer.resume_from=" + (checkpoints / step_dir_name(2)).string());
    log::Capture capture(LOOM_LOG_WARN);
    loom::testing::make_trainer(again);
    std::string warnings;
    for (const auto& line : capture.lines()) warnings += line + "\n";
    return warnings;
  };
  // Written at step 6: the abandoned timeline's weights; `loom eval best_accuracy.safetensors` must
  // not evaluate them as this timeline's best.
  written_at("6");
  const std::string warnings = resume_from_step_2();
  // The resumed timeline's best is step 2's own: written again from the weights just loaded (a run
  // that never beat it ended with no best file, the best weights nowhere once step 2 was pruned).
  loom::sdk::TextMap again;
  ASSERT_TRUE(fs::exists(best));
  load_safetensors(best, &again);
  EXPECT_EQ(again.at("step"), "2");
  EXPECT_NE(warnings.find("best_accuracy.safetensors held weights of steps after " + step_dir_name(2) + ": moved there"),
            std::string::npos) << warnings;
  int aside = 0;
  for (const auto& entry : fs::directory_iterator(checkpoints))
    if (entry.path().filename().string().rfind("abandoned-", 0) == 0)
      aside += fs::exists(entry.path() / "best_accuracy.safetensors") ? 1 : 0;
  EXPECT_EQ(aside, 1);
}

TEST_F(RunFolderTest, ABestFileWrittenAfterTheNewestCheckpointGoesAsideOnResumeAuto) {
  // A run killed after an evaluation wrote best_* at step 5 and before its step 6 checkpoint:
  // --resume auto continues from step 4, and the best file of a step it will train again (to other
  // weights on a GPU, or with other settings) is not left as this run's best.
  Config c = base("died", 4);
  c.set_assignment("trainer.callbacks=jsonl, checkpoint, best");
  c.set_assignment("trainer.eval_every=2");
  loom::testing::make_trainer(c)->train();
  const fs::path best = dir_ / "died" / "checkpoints" / "best_accuracy.safetensors";
  ASSERT_TRUE(fs::exists(best));
  loom::sdk::TextMap metadata;
  const auto tensors = load_safetensors(best, &metadata);
  metadata["step"] = "5";
  metadata.erase("loom_crc32");
  save_safetensors(best, tensors, metadata);
  Config again = c;
  again.set_assignment("trainer.max_steps=8");
  again.set_assignment("trainer.resume=auto");
  std::string warnings;
  {
    log::Capture capture(LOOM_LOG_WARN);
    EXPECT_EQ(loom::testing::make_trainer(again)->step(), 4);
    for (const auto& line : capture.lines()) warnings += line + "\n";
  }
  // The resumed timeline's best is step 2's (seeded), whose weights are in its step folder, not
  // the checkpoint's just loaded: no best file is written from them, and where they are is said.
  EXPECT_FALSE(fs::exists(best));
  EXPECT_NE(warnings.find("at step 2) has no best_accuracy.safetensors in checkpoints/"), std::string::npos) << warnings;
  EXPECT_NE(warnings.find("its weights are in " + (dir_ / "died" / "checkpoints" / step_dir_name(2)).string()),
            std::string::npos)
      << warnings;
  EXPECT_NE(warnings.find("best_accuracy.safetensors held weights of steps after " + step_dir_name(4)), std::string::npos)
      << warnings;
  // Written at the checkpoint's own step: the resumed timeline's best, left in place.
  c.set_assignment("trainer.name=kept");
  loom::testing::make_trainer(c)->train();
  const fs::path kept = dir_ / "kept" / "checkpoints" / "best_accuracy.safetensors";
  ASSERT_TRUE(fs::exists(kept));
  again.set_assignment("trainer.name=kept");
  EXPECT_EQ(loom::testing::make_trainer(again)->step(), 4);
  EXPECT_TRUE(fs::exists(kept));
}

TEST_F(RunFolderTest, AStepSavedAgainAndKilledBeforeItsFolderArrivedKeepsTheOlderFolder) {
  // save() of a step that has a folder renames the older one to .step_*.replaced, then the new one
  // into place. Killed between the two: the next store puts the older one back, the new partial
  // one goes; killed after both: the leftover is removed.
  loom::testing::make_trainer(base("replay"))->train();
  const fs::path checkpoints = dir_ / "replay" / "checkpoints";
  const std::string step4 = step_dir_name(4);
  fs::rename(checkpoints / step4, checkpoints / ("." + step4 + ".replaced"));
  fs::create_directories(checkpoints / ("." + step4 + ".tmp"));
  CheckpointStore store(dir_ / "replay");
  EXPECT_EQ(steps(dir_ / "replay"), (std::vector<std::string>{step_dir_name(2), step4}));
  EXPECT_TRUE(fs::exists(checkpoints / step4 / "state.json"));
  fs::copy(checkpoints / step4, checkpoints / ("." + step4 + ".replaced"));
  CheckpointStore again(dir_ / "replay");
  EXPECT_FALSE(fs::exists(checkpoints / ("." + step4 + ".replaced")));
  EXPECT_FALSE(fs::exists(checkpoints / ("." + step4 + ".tmp")));
  EXPECT_TRUE(fs::exists(checkpoints / step4 / "state.json"));
}

TEST_F(RunFolderTest, ResumeAutoPassesOverARunWhoseCheckpointsAreAllDamaged) {
  loom::testing::make_trainer(base("good"))->train();
  loom::testing::make_trainer(base("damaged"))->train();
  for (const auto& step : CheckpointStore::list_run(dir_ / "damaged")) {
    std::ofstream(step / "state.json") << "{\"step\": \"four\"";  // torn and mistyped
    fs::last_write_time(step, fs::file_time_type::clock::now());  // the newest run
  }
  fs::remove(dir_ / "damaged" / ".lock");  // (a copied run folder has none)
  Config c = base("", 8);
  c.set_assignment("trainer.resume=auto");
  auto t = loom::testing::make_trainer(c);
  EXPECT_EQ(t->run_dir(), dir_ / "good");
  EXPECT_EQ(t->step(), 4);
  EXPECT_FALSE(fs::exists(dir_ / "damaged" / ".lock")) << "a run passed over keeps no lock file it had not";
  t.reset();
  // Named, the damaged run is not restarted over its own files.
  Config named = base("damaged", 8);
  named.set_assignment("trainer.resume=auto");
  const std::string m = error_of(named);
  EXPECT_NE(m.find("none of the checkpoints of"), std::string::npos) << m;
  EXPECT_NE(m.find("move the folder away to start again, or choose another trainer.name"), std::string::npos) << m;
}

TEST_F(RunFolderTest, ResumeAutoTakesTheNewestRunAlsoOneStoppedBeforeItsFirstCheckpoint) {
  // An older run that finished, then a newer one killed before its first checkpoint (set up, its
  // config.json written, no step): --resume auto without a name is the newer run, started again;
  // it used to pass over it and change the older run (its config.json, checkpoints and metrics).
  loom::testing::make_trainer(base("finished"))->train();
  const auto old = fs::file_time_type::clock::now() - std::chrono::hours(1);
  for (const auto& step : CheckpointStore::list_run(dir_ / "finished")) fs::last_write_time(step, old);
  fs::last_write_time(dir_ / "finished" / "config.json", old);
  const std::string config = text(dir_ / "finished" / "config.json");
  loom::testing::make_trainer(base("killed", 8));
  Config c = base("", 8);
  c.set_assignment("trainer.resume=auto");
  {
    log::Capture capture(LOOM_LOG_WARN);
    auto t = loom::testing::make_trainer(c);
    EXPECT_EQ(t->run_dir(), dir_ / "killed");
    EXPECT_EQ(t->step(), 0);
    EXPECT_TRUE(capture.contains("resume = auto: the newest run, " + (dir_ / "killed").string() +
                                 ", stopped before its first checkpoint, so it starts again (to continue the older run "
                                 "finished instead, name it: --set trainer.name=finished)"));
  }
  EXPECT_EQ(text(dir_ / "finished" / "config.json"), config) << "the older run is left as it was";
  EXPECT_EQ(steps(dir_ / "finished"), (std::vector<std::string>{"step_00000002", "step_00000004"}));
  // A newer run in progress in another process (its lock held), without a checkpoint yet, has not
  // stopped: a new run starts, said (a sweep of `--resume auto` jobs in one folder each start their
  // own), and no older run is taken in its place.
  {
    auto busy = loom::testing::make_trainer(base("busy", 8));
    log::Capture capture(LOOM_LOG_INFO);
    auto t = loom::testing::make_trainer(c);
    for (const char* taken : {"busy", "killed", "finished"}) EXPECT_NE(t->run_dir(), dir_ / taken);
    EXPECT_EQ(t->step(), 0);
    EXPECT_TRUE(capture.contains("resume = auto: starting a new run: the newest, " + (dir_ / "busy").string() +
                                 " is in progress in another process (no checkpoint yet)"));
  }
  // A run with a checkpoint newer than the killed one's start is the newest again.
  Config named = base("finished", 8);
  named.set_assignment("trainer.resume=auto");
  loom::testing::make_trainer(named)->train();
  auto t = loom::testing::make_trainer(c);
  EXPECT_EQ(t->run_dir(), dir_ / "finished");
}

TEST_F(RunFolderTest, AResumeIntoALossScaledPrecisionStartsItsScalerAfresh) {
  // fp32 keeps no state; fp16_amp's loss scaler does. Resumed with the change allowed, the scaler
  // starts at its initial scale; its absence from the checkpoint was taken for damage, and every
  // checkpoint was passed over ("none of the checkpoints can be loaded").
  loom::testing::make_trainer(base("to_fp16"))->train();
  Config c = base("to_fp16", 8);
  c.set_assignment("trainer.resume=auto");
  c.set_assignment("precision.name=fp16_amp");
  c.set_assignment("precision.allow_precision_change=true");
  log::Capture capture(LOOM_LOG_WARN);
  auto t = loom::testing::make_trainer(c);
  EXPECT_EQ(t->step(), 4);
  EXPECT_TRUE(capture.contains("precision 'fp16_amp' starts afresh (the checkpoint's precision kept no state of its "
                               "own, such as a loss scale)"));
  t->train();
  EXPECT_EQ(t->step(), 8);
}

TEST_F(RunFolderTest, AResumeIntoACheckpointsFolderThatCannotBeWrittenIsRefusedBeforeTraining) {
  // A read-only checkpoints/ (here immutable, which root cannot write either) was found at the
  // first save, after the steps before it had trained for nothing and config.json was rewritten.
  loom::testing::make_trainer(base("frozen"))->train();
  const fs::path checkpoints = dir_ / "frozen" / "checkpoints";
  const std::string config = text(dir_ / "frozen" / "config.json");
  if (std::system(("chattr +i '" + checkpoints.string() + "' 2>/dev/null").c_str()) != 0)
    GTEST_SKIP() << "chattr +i is not available here (a file system without it, or no CAP_LINUX_IMMUTABLE)";
  struct Thaw {
    fs::path path;
    ~Thaw() {
      if (std::system(("chattr -i '" + path.string() + "'").c_str()) != 0) ADD_FAILURE() << "chattr -i " << path;
    }
  } thaw{checkpoints};
  Config c = base("frozen", 8);
  c.set_assignment("trainer.resume=auto");
  const std::string m = error_of(c);
  EXPECT_CONTAINS(m, "cannot write in " + checkpoints.string() + ": Operation not permitted");
  EXPECT_CONTAINS(m, "; the run's checkpoints go there (nothing was written)");
  EXPECT_EQ(text(dir_ / "frozen" / "config.json"), config);
}

TEST_F(RunFolderTest, AValueThatIsNotUtf8IsRefusedBeforeAnythingIsMade) {
  // A work_dir in a folder named in Latin-1 failed as "opening the run folder: [json.exception.
  // type_error.316] invalid UTF-8 byte at index 4: 0x2F" (no key named; the byte shown not the bad
  // one), and left the run folder behind with a lock and an empty checkpoints/.
  Config c = base("latin1");
  c.set_assignment("trainer.work_dir=" + (dir_ / "caf\xe9").string());
  EXPECT_CONTAINS(error_of(c), "--set: trainer.work_dir is not UTF-8 text (byte 0xE9 at position " +
                                   std::to_string(dir_.string().size() + 5) + "): a run records its configuration in its "
                                   "config.json, as UTF-8");
  EXPECT_FALSE(fs::exists(dir_ / "caf\xe9"));
}

TEST_F(RunFolderTest, AResumeKeepsTheMetricsRowsUpToItsCheckpointHoweverTheyAreSpacedAndLinesAUserAdded) {
  // The resume kept only lines starting with the exact bytes {"step": : a file rewritten by
  // Python's json.dumps ({"step": 1, ...}) lost its whole history, and a note a user added went too.
  Config first = base("spaced");
  first.set_assignment("trainer.log_every=1");
  loom::testing::make_trainer(first)->train();
  const fs::path metrics = dir_ / "spaced" / "metrics.jsonl";
  std::string rewritten;
  {
    std::ifstream in(metrics);
    for (std::string line; std::getline(in, line);) {
      const auto colon = line.find("\"step\":");
      ASSERT_NE(colon, std::string::npos) << line;
      rewritten += line.substr(0, colon) + "\"step\": " + line.substr(colon + 7) + "\n";
    }
  }
  rewritten += "# the learning rate was too high here\n{\"step\": 9, \"train/loss\": 1}\n{\"a/b\": 2, \"step\": 11}\n"
               + std::string(300, '\0') + "\n{\"step\": 10, \"train/lo";
  std::ofstream(metrics, std::ios::trunc) << rewritten;
  Config resume = base("spaced", 6);
  resume.set_assignment("trainer.log_every=1");
  resume.set_assignment("trainer.resume=auto");
  loom::testing::make_trainer(resume)->train();
  const std::string after = text(metrics);
  for (int step = 1; step <= 4; ++step) EXPECT_CONTAINS(after, "{\"step\": " + std::to_string(step) + ",");
  EXPECT_CONTAINS(after, "# the learning rate was too high here\n");
  EXPECT_EQ(after.find('\0'), std::string::npos) << "a crash's zero-filled tail stays, and no reader parses the file";
  EXPECT_EQ(after.find("{\"step\": 9"), std::string::npos) << "a row after the checkpoint stays: " << after;
  EXPECT_EQ(after.find("{\"step\": 10"), std::string::npos) << "a torn row stays: " << after;
  EXPECT_EQ(after.find("\"step\": 11"), std::string::npos) << "a row with its keys sorted, after the checkpoint, stays: " << after;
  EXPECT_CONTAINS(after, "{\"step\":5,");
  EXPECT_CONTAINS(after, "{\"step\":6,");
}

TEST_F(RunFolderTest, ACheckpointsFolderThatLinksToAnotherRunsIsRefusedAndOneOnAnotherDiskIsUsed) {
  // Run B's checkpoints a link to run A's: B resumed from A's weights, pruned A's steps and wrote
  // over A's best file. Refused, A untouched; a link to a plain folder (a larger disk) is B's own.
  loom::testing::make_trainer(base("a"))->train();
  loom::testing::make_trainer(base("b"))->train();
  const auto a_steps = steps(dir_ / "a");
  fs::remove_all(dir_ / "b" / "checkpoints");
  fs::create_directory_symlink(dir_ / "a" / "checkpoints", dir_ / "b" / "checkpoints");
  Config c = base("b", 8);
  c.set_assignment("trainer.resume=auto");
  c.set_assignment("trainer.keep_last=1");
  const std::string m = error_of(c);
  EXPECT_CONTAINS(m, (dir_ / "b" / "checkpoints").string() + " is a link to " + fs::canonical(dir_ / "a" / "checkpoints").string() +
                         ", another run's checkpoints, which this run would prune and write over");
  EXPECT_EQ(steps(dir_ / "a"), a_steps);
  fs::remove(dir_ / "b" / "checkpoints");
  fs::create_directories(dir_ / "disk" / "b_checkpoints");
  fs::create_directory_symlink(dir_ / "disk" / "b_checkpoints", dir_ / "b" / "checkpoints");
  Config fresh = base("b", 4);
  fresh.set_assignment("trainer.resume=auto");
  loom::testing::make_trainer(fresh)->train();
  EXPECT_FALSE(steps(dir_ / "b").empty());
  EXPECT_TRUE(fs::exists(dir_ / "disk" / "b_checkpoints" / "step_00000004"));
  // Another run linked to that same folder is refused (it resumed b's steps and wrote over b's
  // best weights), and so is a link to another run's folder itself.
  fs::create_directories(dir_ / "c");
  fs::create_directory_symlink(dir_ / "disk" / "b_checkpoints", dir_ / "c" / "checkpoints");
  Config shared = base("c", 8);
  shared.set_assignment("trainer.resume=auto");
  EXPECT_CONTAINS(error_of(shared), "the checkpoints of the run " + fs::canonical(dir_ / "b").string() + " (its .loom-run says so");
  fs::create_directories(dir_ / "d");
  fs::create_directory_symlink(dir_ / "a", dir_ / "d" / "checkpoints");
  EXPECT_CONTAINS(error_of(base("d")), "another run's folder, which this run would prune and write over");
  EXPECT_EQ(steps(dir_ / "a"), a_steps);
}

TEST_F(RunFolderTest, ResumeAutoOfANameNoRunHasSaysItStartsAndNamesACloseOne) {
  // `--set trainer.name=myrnu --resume auto` beside run myrun trained afresh without a word.
  loom::testing::make_trainer(base("myrun"))->train();
  Config typo = base("myrnu");
  typo.set_assignment("trainer.resume=auto");
  {
    log::Capture capture(LOOM_LOG_INFO);
    loom::testing::make_trainer(typo);
    EXPECT_TRUE(capture.contains("resume = auto: no run named 'myrnu' in " + dir_.string() + ", so it starts; did you mean 'myrun'?"))
        << join(capture.lines(), "\n");
  }
  Config other = base("zebra");
  other.set_assignment("trainer.resume=auto");
  log::Capture capture(LOOM_LOG_INFO);
  loom::testing::make_trainer(other);
  EXPECT_TRUE(capture.contains("resume = auto: no run named 'zebra' in " + dir_.string() + " yet; starting it"))
      << join(capture.lines(), "\n");
}

TEST_F(RunFolderTest, ALockFileThatIsALinkIsNamedAsOne) {
  // A run folder copied with links (cp -rs): "Too many levels of symbolic links".
  loom::testing::make_trainer(base("original"))->train();
  fs::create_directory(dir_ / "copy");
  for (const auto& entry : fs::directory_iterator(dir_ / "original"))
    fs::create_symlink(entry.path(), dir_ / "copy" / entry.path().filename());
  Config c = base("copy", 8);
  c.set_assignment("trainer.resume=auto");
  EXPECT_CONTAINS(error_of(c), (dir_ / "copy" / ".lock").string() + " is a link (a run folder copied with links, cp -rs?): "
                               "a run's lock file is its own; remove the link, and Loom makes the file");
}

TEST_F(RunFolderTest, AMetricsFileThatIsALinkIsLeftAsItIsSaidAndASummaryThatIsAFolderIsSaidOnce) {
  // metrics.jsonl as a link to another run's file (a copy of a run made with links): the resume
  // writes a copy of its own, said, and leaves that file whole (cutting its rows after the
  // checkpoint would lose them there). A folder where summary.json goes: one warning with the fix
  // (it was said after each final evaluation, with advice to give another path).
  Config first = base("linked");
  first.set_assignment("trainer.callbacks=jsonl, tensorboard, checkpoint");
  loom::testing::make_trainer(first)->train();
  const fs::path run = dir_ / "linked", store = dir_ / "store.jsonl";
  fs::rename(run / "metrics.jsonl", store);
  std::ofstream(store, std::ios::app) << "{\"step\":5,\"train/loss\":1}\n";  // (a row after the checkpoint: the other run's)
  std::ostringstream before;
  before << std::ifstream(store).rdbuf();
  fs::create_symlink(store, run / "metrics.jsonl");
  fs::remove(run / "summary.json");
  fs::create_directory(run / "summary.json");
  // The TensorBoard folder likewise, linked into another run's folder: the resume cut the events
  // after the checkpoint in the folder the link named.
  fs::create_directories(dir_ / "other");
  std::ofstream(dir_ / "other" / ".lock") << "";
  const fs::path events = dir_ / "other" / "tensorboard";
  fs::rename(run / "tensorboard", events);
  fs::create_directory_symlink(events, run / "tensorboard");
  std::map<std::string, std::string> events_before;
  for (const auto& e : fs::directory_iterator(events)) events_before[e.path().filename().string()] = digest(text(e.path()));
  ASSERT_FALSE(events_before.empty());
  Config c = base("linked", 8);
  c.set_assignment("trainer.callbacks=jsonl, tensorboard, checkpoint");
  c.set_assignment("trainer.resume=auto");
  c.set_assignment("trainer.log_every=2");
  log::Capture capture(LOOM_LOG_WARN);
  loom::testing::make_trainer(c)->train();
  EXPECT_FALSE(fs::is_symlink(run / "metrics.jsonl"));
  std::ostringstream rows, after;
  rows << std::ifstream(run / "metrics.jsonl").rdbuf();
  EXPECT_CONTAINS(rows.str(), "{\"step\":8,");
  after << std::ifstream(store).rdbuf();
  EXPECT_EQ(after.str(), before.str()) << "the linked file is left as it was";
  EXPECT_TRUE(capture.contains("metrics.jsonl of " + run.string() + " is a link to " + store.string() +
                               ": this run writes its own copy from here, and leaves that file as it is"));
  std::map<std::string, std::string> events_after;
  for (const auto& e : fs::directory_iterator(events)) events_after[e.path().filename().string()] = digest(text(e.path()));
  EXPECT_EQ(events_after, events_before) << "the linked TensorBoard folder is left as it was";
  EXPECT_FALSE(fs::is_symlink(run / "tensorboard"));
  EXPECT_FALSE(fs::is_empty(run / "tensorboard"));
  EXPECT_TRUE(capture.contains("tensorboard of " + run.string() + " is a link to " + events.string() +
                               ": this run writes its own event files in a folder in its place, and leaves that folder as it is"));
  const auto lines = capture.lines();
  EXPECT_EQ(std::count_if(lines.begin(), lines.end(),
                          [&](const std::string& l) { return l.find("could not write " + (run / "summary.json").string()) != std::string::npos; }),
            1)
      << join(lines, "\n");
  EXPECT_TRUE(capture.contains("move what is at that path (a folder) out of the run folder for later runs to write it"));
}

TEST_F(RunFolderTest, ANewerStepFolderThatLostItsStateGoesAsideNotUnderTheResumedTimeline) {
  // step_6 without its state.json is no checkpoint: not listed, so the resume from step 4 said
  // nothing of it and the resumed timeline saved its own step 6 over it (its weights lost).
  loom::testing::make_trainer(base("lost_state", 6))->train();
  const fs::path step6 = dir_ / "lost_state" / "checkpoints" / step_dir_name(6);
  fs::remove(step6 / "state.json");
  const auto size = fs::file_size(step6 / "model.safetensors");
  Config c = base("lost_state", 8);
  c.set_assignment("trainer.resume=auto");
  log::Capture capture(LOOM_LOG_WARN);
  auto t = loom::testing::make_trainer(c);
  EXPECT_EQ(t->step(), 4);
  EXPECT_TRUE(capture.contains("step_00000006 (no whole checkpoint: its state.json is missing or damaged)"))
      << join(capture.lines(), "\n");
  t->train();
  EXPECT_TRUE(kept_aside(dir_ / "lost_state", 6, size)) << "the old step 6's weights are kept aside";
  EXPECT_TRUE(fs::exists(step6 / "state.json")) << "the resumed timeline's own step 6";
}

TEST_F(RunFolderTest, TheOnlyStepFolderThatLostItsStateGoesAsideWithTheRunsFiles) {
  // The run's one step folder without its state.json: "no checkpoint", the run's files set aside
  // ("a run that wrote no checkpoint"), but the step folder stayed, and the new timeline saved its
  // own step 2 over it (probe: the weights in it gone).
  loom::testing::make_trainer(base("only_lost", 2))->train();
  const fs::path step2 = dir_ / "only_lost" / "checkpoints" / step_dir_name(2);
  fs::remove(step2 / "state.json");
  const auto size = fs::file_size(step2 / "model.safetensors");
  Config c = base("only_lost", 4);
  c.set_assignment("trainer.resume=auto");
  log::Capture capture(LOOM_LOG_WARN);
  auto t = loom::testing::make_trainer(c);
  EXPECT_EQ(t->step(), 0);
  EXPECT_TRUE(capture.contains("holds files of a run that wrote no whole checkpoint (")) << join(capture.lines(), "\n");
  EXPECT_TRUE(capture.contains("step_00000002 (no whole checkpoint: its state.json is missing)")) << join(capture.lines(), "\n");
  t->train();
  EXPECT_TRUE(kept_aside(dir_ / "only_lost", 2, size)) << "the old step 2's weights are kept aside";
  EXPECT_TRUE(fs::exists(step2 / "state.json")) << "the new timeline's own step 2";
}

TEST_F(RunFolderTest, TemporaryFilesAKilledWriterLeftAreRemovedWhenTheRunOpens) {
  // (a run killed while it wrote config.json left config.json.tmp.<host>.<pid>.<n> for good: never
  // read back, piling up on a disk that fills)
  loom::testing::make_trainer(base("killed"))->train();
  const fs::path run = dir_ / "killed";
  char host[64] = {};
  ::gethostname(host, sizeof host - 1);
  const pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  ::waitpid(dead, nullptr, 0);
  const std::string of_dead = std::string(".tmp.") + host + "." + std::to_string(dead) + ".12345";
  const std::string of_live = std::string(".tmp.") + host + "." + std::to_string(::getpid()) + ".12345";
  for (const fs::path& left : {run / ("config.json" + of_dead), run / "checkpoints" / ("best_loss.safetensors" + of_dead),
                               run / ("config.json" + of_live), run / ("notes" + std::string(".tmp.otherhost.1.2"))})
    std::ofstream(left) << "half";
  Config again = base("killed");
  again.set_assignment("trainer.resume=auto");
  loom::testing::make_trainer(again);
  EXPECT_FALSE(fs::exists(run / ("config.json" + of_dead)));
  EXPECT_FALSE(fs::exists(run / "checkpoints" / ("best_loss.safetensors" + of_dead)));
  EXPECT_TRUE(fs::exists(run / ("config.json" + of_live))) << "a live writer's file stays";
  EXPECT_TRUE(fs::exists(run / "notes.tmp.otherhost.1.2")) << "another host's (a shared disk) stays";
}

TEST_F(RunFolderTest, AFolderInUseIsRefused) {
  auto first = loom::testing::make_trainer(base("busy"));
  Config second = base("busy");
  second.set_assignment("trainer.resume=auto");
  const std::string m = error_of(second);
  EXPECT_NE(m.find("is in use by process " + std::to_string(::getpid())), std::string::npos) << m;
  // Its lock file removed by hand (it looks stale): still refused, the folder itself locked (a
  // second process made a new lock file, locked it, and the two runs wrote one folder, both exit 0).
  fs::remove(first->run_dir() / ".lock");
  EXPECT_CONTAINS(error_of(second), "is in use by another process (its lock file .lock is empty or missing: that process is "
                                    "starting or ending, or the file was removed by hand; the folder itself stays locked "
                                    "while that process runs); wait for that run to end");
  EXPECT_FALSE(fs::exists(first->run_dir() / ".lock")) << "the refused one made no lock file of its own";
  first.reset();  // the lock ends with the trainer
  EXPECT_NO_THROW(loom::testing::make_trainer(second));
}

TEST_F(RunFolderTest, RunsWithoutANameNeverShareAFolder) {
  auto a = loom::testing::make_trainer(base(""));
  auto b = loom::testing::make_trainer(base(""));
  auto c = loom::testing::make_trainer(base(""));
  EXPECT_NE(a->run_dir(), b->run_dir());
  EXPECT_NE(b->run_dir(), c->run_dir());
  EXPECT_NE(a->run_dir(), c->run_dir());
}

TEST_F(RunFolderTest, PruningLeavesNoHalfDeletedStepFolder) {
  // A process killed while deleting leaves .step_*.deleting: the next run removes it.
  fs::create_directories(dir_ / "pruned" / "checkpoints" / ".step_00000002.deleting");
  std::ofstream(dir_ / "pruned" / "checkpoints" / ".step_00000002.deleting" / "state.json") << "{}";
  Config c = base("pruned", 8);
  c.set_assignment("trainer.keep_last=2");
  c.set_assignment("trainer.resume=auto");
  loom::testing::make_trainer(c)->train();
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir_ / "pruned" / "checkpoints")) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{step_dir_name(6), step_dir_name(8)}));
}

TEST_F(RunFolderTest, AFifoOrADeviceInPlaceOfAFileIsAnErrorNotAHang) {
  const fs::path fifo = dir_ / "run.ini";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  Config c;
  try {
    c.load_file(fifo);
    FAIL() << "a FIFO config file must be refused";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("not a regular file (a FIFO)"), std::string::npos) << e.what();
  }
  {  // named bare (`loom train -c run.ini`): the FIFO here is what the user meant, and the error says what it is
    const fs::path here = fs::current_path();
    fs::current_path(dir_);
    const fs::path found = find_config("run.ini");
    fs::current_path(here);
    EXPECT_EQ(found, fs::path("run.ini"));
  }
  fs::create_symlink("/dev/zero", dir_ / "zero.safetensors");
  try {
    load_safetensors(dir_ / "zero.safetensors");
    FAIL() << "a device must be refused";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("not a regular file (a character device)"), std::string::npos) << e.what();
  }
  // A checkpoint whose state.json is a FIFO is damaged: --resume auto falls back to the one before.
  loom::testing::make_trainer(base("fifo"))->train();
  const fs::path newest = dir_ / "fifo" / "checkpoints" / step_dir_name(4) / "state.json";
  fs::remove(newest);
  ASSERT_EQ(::mkfifo(newest.c_str(), 0644), 0);
  Config resume = base("fifo", 8);
  resume.set_assignment("trainer.resume=auto");
  EXPECT_EQ(loom::testing::make_trainer(resume)->step(), 2);
}

TEST_F(RunFolderTest, ASafetensorsHeaderDeclaringAHugeShapeIsRefusedBeforeAllocating) {
  const std::string header = R"({"t":{"dtype":"F32","shape":[1000000000000,1000],"data_offsets":[0,4]}})";
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  bytes += header + std::string(4, '\0');
  try {
    from_safetensors(bytes, "huge.safetensors");
    FAIL() << "the shape cannot fit in 4 bytes";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 't' declares a shape larger than the file"), std::string::npos) << e.what();
  }
  // An entry of another form was the JSON library's "[json.exception.type_error.304] cannot use at() with array".
  for (const std::string entry : {R"([1,2])", R"({"dtype":"F32"})"}) {
    const std::string odd = R"({"t":)" + entry + "}";
    std::string file(8, '\0');
    for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((odd.size() >> (8 * i)) & 0xff);
    file += odd;
    try {
      from_safetensors(file, "odd.safetensors");
      ADD_FAILURE() << entry << " was read";
    } catch (const loom::Error& e) {
      EXPECT_CONTAINS(std::string(e.what()), "odd.safetensors is not a valid safetensors file: tensor 't' is not {\"dtype\": "
                                             "text, \"shape\": [whole numbers], \"data_offsets\": [begin, end]}: its entry is " + entry);
      EXPECT_EQ(std::string(e.what()).find("json.exception"), std::string::npos) << e.what();
    }
  }
}

TEST_F(RunFolderTest, AbsurdValuesAreRefusedBeforeAnythingRunsByConfigShowToo) {
  // resolve_run is what both `loom train` and `loom config show` call.
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"trainer.name=../elsewhere", "trainer.name = '../elsewhere' is not a run name"},
      {"trainer.name=/abs", "trainer.name = '/abs' is not a run name"},
      {"trainer.name=two\nlines", "--set: trainer.name holds a control character (byte 0x0a at position 4); a value is one line of text"},
      {"data.num_workers=100000", "--set: data.num_workers = 100000 is outside its range [-1, 64]"},
      {"trainer.batch_size=0", "--set: trainer.batch_size = 0 is outside its range [1, 16777216]"},
      {"trainer.lr=-0.1", "--set: trainer.lr = -0.1 is outside its range [1e-12, 10]"},
      {"trainer.keep_last=-2", "trainer.keep_last = -2 is outside its range [0, 1000000]"},
      {"data.validation_fraction=1", "data.validation_fraction = 1 is outside its range [0, 0.999]"},
      {"optimizer.weight_decay=-0.1", "--set: optimizer.weight_decay = -0.1 is outside its range [0, 10]"},
      {"optimizer.beta2=1.5", "--set: optimizer.beta2 = 1.5 is outside its range [0, 0.999999]"},
      {"schedule.min_lr_ratio=-1", "--set: schedule.min_lr_ratio = -1 is outside its range [0, 1]"},
      {"model.dropout=1.5", "--set: model.dropout = 1.5 is outside its range [0, 0.99]"},
      {"trainer.device=cuda:99", "trainer.device = 'cuda:99', but "},
      {"trainer.device=cpu:5", "trainer.device = 'cpu:5': the CPU is one device, cpu (or cpu:0); trainer.threads"},
      {"trainer.device=quantum", "trainer.device = 'quantum' is not a device Loom trains on"},
      {"model.d_model=64", "flavour = debug builds num_layers 1, d_model 32, num_heads 2, patch_size 7 and "
                           "stem_channels 0, so model.d_model = 64 would be ignored"},
  };
  for (const auto& [assignment, expected] : cases) {
    Config c = base("absurd");
    try {
      c.set_assignment(assignment);
      resolve_run(c, loom::testing::registry());
      ADD_FAILURE() << assignment << " was accepted";
    } catch (const loom::Error& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << assignment << ": " << e.what();
    }
  }
  EXPECT_FALSE(fs::exists(dir_ / "absurd")) << "nothing is written";
  // The debug flavour's own width is no conflict (it was refused as "would be ignored").
  Config debug = base("debug_width");
  debug.set_assignment("model.d_model=32");
  EXPECT_NO_THROW(resolve_run(debug, loom::testing::registry()));
}

TEST(TrainerThreads, MoreThreadsThanUlimitUAllowsIsOneErrorBeforeAnyOperator) {
  // (Trainer::setup applies it where the kernel enforces the limit: not to root.)
  EXPECT_EQ(threads_over_process_limit(4096, 300),
            "trainer.threads = 4096, but this user may run at most 300 processes and threads (ulimit -u); set "
            "trainer.threads = 0 (LibTorch's default, the physical cores) or a number of cores");
  EXPECT_NE(threads_over_process_limit(300, 300), "");
  EXPECT_EQ(threads_over_process_limit(16, 300), "");
  EXPECT_EQ(threads_over_process_limit(4096, UINT64_MAX), "");
}

TEST_F(RunFolderTest, AWriteThatFailsStopsTheRunAndNamesTheFile) {
  // A file-size limit of 100 bytes fails every write that would grow a file past it (EFBIG, with
  // SIGXFSZ ignored, as loom does): a full disk under the run's files from the first step on. The
  // run folder and its config.json are written before it (make_trainer). The first line of
  // metrics.jsonl is longer: the kernel writes its first 100 bytes, then refuses; the file is cut
  // back to no line rather than left with half of one.
  Config c = base("full");
  c.set_assignment("trainer.log_every=1");
  auto t = loom::testing::make_trainer(c);
  struct rlimit before {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &before), 0);
  const auto previous = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit none = before;
  none.rlim_cur = 100;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &none), 0);
  std::string m = "(no error)";
  try {
    t->train();
  } catch (const loom::Error& e) {
    m = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &before);
  std::signal(SIGXFSZ, previous);
  EXPECT_NE(m.find("callback 'jsonl' (on_log): cannot write " + (dir_ / "full" / "metrics.jsonl").string() +
                   " (File too large: the file-size limit of this process (`ulimit -f`)); it is kept as it was before "
                   "this write (no half line or record)"),
            std::string::npos)
      << m;
  EXPECT_EQ(fs::file_size(dir_ / "full" / "metrics.jsonl"), 0u) << "no half line";
  EXPECT_EQ(t->step(), 1) << "it stops at the first write";
}

TEST_F(RunFolderTest, AMetricsFileThatIsNotARegularFileIsAnErrorNotAHangAndLosesNothing) {
  loom::testing::make_trainer(base("special"))->train();
  const fs::path metrics = dir_ / "special" / "metrics.jsonl";
  const fs::path kept = dir_ / "metrics.jsonl.kept";
  fs::rename(metrics, kept);
  const auto before = steps(dir_ / "special");
  ASSERT_EQ(before.size(), 2u);
  auto resume_error = [&] {
    Config c = base("special", 8);
    c.set_assignment("trainer.resume=auto");
    try {
      loom::testing::make_trainer(c)->train();
    } catch (const loom::Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  // A FIFO would block the resume for ever (it waited for a writer); a device would be read
  // without end (/dev/zero); a folder cannot be read or written.
  ASSERT_EQ(::mkfifo(metrics.c_str(), 0644), 0);
  std::string m = resume_error();
  EXPECT_NE(m.find(metrics.string() + " is a FIFO, not the run's metrics (metrics.jsonl); move it out of the run folder"),
            std::string::npos)
      << m;
  fs::remove(metrics);
  fs::create_symlink("/dev/zero", metrics);
  m = resume_error();
  EXPECT_NE(m.find(metrics.string() + " is a character device, not the run's metrics"), std::string::npos) << m;
  fs::remove(metrics);
  fs::create_directory(metrics);
  m = resume_error();
  EXPECT_NE(m.find(metrics.string() + " is a folder, not the run's metrics"), std::string::npos) << m;
  fs::remove(metrics);
  fs::create_symlink(dir_ / "nowhere", metrics);
  m = resume_error();
  EXPECT_NE(m.find(metrics.string() + " is a symbolic link to nothing"), std::string::npos) << m;
  fs::remove(metrics);
  // Each refusal changed nothing; with the file back, the run resumes and keeps its lines.
  EXPECT_EQ(steps(dir_ / "special"), before);
  fs::rename(kept, metrics);
  Config c = base("special", 8);
  c.set_assignment("trainer.resume=auto");
  c.set_assignment("trainer.log_every=1");
  auto t = loom::testing::make_trainer(c);
  EXPECT_EQ(t->step(), 4);
  t->train();
  std::ifstream in(metrics);
  std::vector<int64_t> logged;
  for (std::string line; std::getline(in, line);)
    if (line.find("\"train/loss\"") != std::string::npos) logged.push_back(std::stoll(line.substr(8)));
  EXPECT_EQ(logged, (std::vector<int64_t>{4, 5, 6, 7, 8})) << "the first run's last step, then the resumed run's";
}

TEST_F(RunFolderTest, ABestWeightsPathThatIsNotARegularFileIsRefusedBeforeAStepTrains) {
  // A FIFO or a folder at best_accuracy.safetensors was found at the first evaluation, which ended
  // the run without a checkpoint of the steps trained since the last one (probe).
  Config first = base("best_fifo");
  first.set_assignment("trainer.callbacks=jsonl, checkpoint, best");
  first.set_assignment("trainer.eval_every=2");
  loom::testing::make_trainer(first)->train();
  const fs::path best = dir_ / "best_fifo" / "checkpoints" / "best_accuracy.safetensors";
  ASSERT_TRUE(fs::is_regular_file(best));
  fs::remove(best);
  ASSERT_EQ(::mkfifo(best.c_str(), 0644), 0);
  Config resume = first;
  resume.set_assignment("trainer.max_steps=8");
  resume.set_assignment("trainer.resume=auto");
  std::unique_ptr<loom::core::Trainer> t;
  std::string m = "(no error)";
  try {
    t = loom::testing::make_trainer(resume);
    t->train();
  } catch (const std::exception& e) {
    m = e.what();
  }
  EXPECT_NE(m.find(best.string() + " is a FIFO, not the run's best weights; move it out of the run folder"), std::string::npos)
      << m;
  EXPECT_TRUE(!t || t->step() == 4) << "refused before a step trained";
  // A symbolic link there (a run copied with links, its source gone) is what the writer replaces: no refusal.
  t.reset();
  fs::remove(best);
  fs::create_symlink(dir_ / "gone" / "best_accuracy.safetensors", best);
  t = loom::testing::make_trainer(resume);
  t->train();
  EXPECT_EQ(t->step(), 8);
}

TEST_F(RunFolderTest, ResumeAutoSetsAsideTheFilesOfARunThatWroteNoCheckpoint) {
  // A run killed before its first checkpoint left its config.json and metrics.jsonl.
  const fs::path run = dir_ / "early";
  fs::create_directories(run);
  std::ofstream(run / "config.json") << "{\"trainer.lr\": {\"value\": \"0.5\", \"origin\": \"--set\"}}\n";
  std::ofstream(run / "metrics.jsonl") << "{\"step\":1,\"train/loss\":2.5}\n{\"step\":2,\"train/loss\":2.4}\n";
  std::string m = error_of(base("early"));
  EXPECT_NE(m.find("already holds a run named 'early' (0 checkpoints); it has no checkpoint to continue from: "
                   "--resume auto starts it again, with its files moved aside, or choose another trainer.name"),
            std::string::npos)
      << m;
  Config c = base("early");
  c.set_assignment("trainer.resume=auto");
  auto t = loom::testing::make_trainer(c);
  EXPECT_EQ(t->step(), 0);
  int aside = 0;
  for (const auto& entry : fs::directory_iterator(run / "checkpoints")) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("abandoned-", 0) != 0) continue;
    EXPECT_NE(name.find("-without-checkpoint"), std::string::npos) << name;
    std::ifstream in(entry.path() / "metrics.jsonl");
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(text, "{\"step\":1,\"train/loss\":2.5}\n{\"step\":2,\"train/loss\":2.4}\n");
    EXPECT_TRUE(fs::exists(entry.path() / "config.json"));
    ++aside;
  }
  EXPECT_EQ(aside, 1);
  t->train();
  EXPECT_EQ(steps(run).size(), 2u);
}

TEST_F(RunFolderTest, AResumeKeepsTheCheckpointsItsRunKept) {
  // The run kept 10 checkpoints (base sets trainer.keep_last = 10); a resume that does not repeat
  // the setting keeps them too, where the default (3) would have deleted the oldest.
  loom::testing::make_trainer(base("kept", 8))->train();
  ASSERT_EQ(steps(dir_ / "kept").size(), 4u);
  Config c = loom::testing::config_of(
      {"model.name=lightweight_transformer", "model.flavour=debug", "data.name=synthetic", "data.train_size=256",
       "data.test_size=64", "trainer.batch_size=32", "trainer.seed=3", "trainer.log_every=100", "trainer.eval_every=100",
       "trainer.checkpoint_every=2", "trainer.device=cpu", "precision.name=fp32", "memory.estimate=false",
       "trainer.callbacks=jsonl, checkpoint", "trainer.max_steps=10", "trainer.resume=auto"},
      dir_, "kept");
  loom::testing::make_trainer(c)->train();
  EXPECT_EQ(steps(dir_ / "kept"), (std::vector<std::string>{step_dir_name(2), step_dir_name(4), step_dir_name(6),
                                                            step_dir_name(8), step_dir_name(10)}));
  // Set for the resume, it is the user's choice.
  c.set_assignment("trainer.max_steps=12");
  c.set_assignment("trainer.keep_last=2");
  loom::testing::make_trainer(c)->train();
  EXPECT_EQ(steps(dir_ / "kept"), (std::vector<std::string>{step_dir_name(10), step_dir_name(12)}));
}

TEST_F(RunFolderTest, AResumeThatTrainsOtherwiseSaysWhatChangedAndKeepsTheRunsRecord) {
  // The run was started with -c files and --set that a resume command may leave out: its learning
  // rate and clipping then become the defaults, from the resumed step on. Said, with both values,
  // and config.json of the steps before is kept (config.until_step_4.json).
  Config first = base("changed", 4);
  first.set_assignment("trainer.lr=0.01");
  first.set_assignment("trainer.clip_grad_norm=0.5");
  loom::testing::make_trainer(first)->train();
  Config again = base("changed", 6);  // (max_steps 4 -> 6: a routine change, said at info level)
  again.set_assignment("trainer.resume=auto");
  {
    log::Capture capture;
    loom::testing::make_trainer(again)->train();
    const std::string said = join(capture.lines(), "\n");
    EXPECT_TRUE(capture.contains("this resume trains otherwise than the run did until step 4 (" +
                                 (dir_ / "changed" / "config.json").string() + "): "))
        << said;
    EXPECT_TRUE(capture.contains("trainer.clip_grad_norm 0.5 -> 1.0 (default)")) << said;
    EXPECT_TRUE(capture.contains("trainer.lr 0.01 -> ")) << said;
    EXPECT_TRUE(capture.contains("resumed with trainer.max_steps 4 -> 6 (--set)")) << said;
    // (the defaults undid the run's settings: they are to be given again)
    EXPECT_TRUE(capture.contains("To go on as it was, give the -c files and --set of the run's first command")) << said;
    const fs::path until = dir_ / "changed" / "config.until_step_4.json";
    ASSERT_TRUE(fs::exists(until));
    EXPECT_NE(read_file(until).find("\"value\": \"0.01\""), std::string::npos);
    EXPECT_EQ(read_file(dir_ / "changed" / "config.json").find("\"value\": \"0.01\""), std::string::npos);
  }
  // The same command again: nothing differs from config.json, nothing is said or kept.
  again.set_assignment("trainer.max_steps=6");
  {
    log::Capture quiet;
    loom::testing::make_trainer(again)->train();
    EXPECT_FALSE(quiet.contains("trains otherwise")) << join(quiet.lines(), "\n");
    EXPECT_FALSE(fs::exists(dir_ / "changed" / "config.until_step_6.json"));
  }
  // A rate this --resume auto command gives itself: leaving it out goes on as it was (the run's
  // settings are --resume auto's where a command gives none), not "give the first command's".
  {
    Config faster = again;
    faster.set_assignment("trainer.lr=0.05");
    faster.set_assignment("trainer.max_steps=8");  // (steps to train: a resume at its end compares nothing)
    log::Capture said;
    loom::testing::make_trainer(faster);
    EXPECT_TRUE(said.contains(" -> 0.05 (--set). To go on as it was, leave these out of the command "
                              "(--resume auto takes the run's own)"))
        << join(said.lines(), "\n");
  }

  // From step 4 again, with the first learning rate: compared with what trained up to step 4
  // (config.until_step_4.json, lr 0.01), not with what trained the steps now set aside.
  again.set_assignment("trainer.resume=none");
  again.set_assignment("trainer.resume_from=" + (dir_ / "changed" / "checkpoints" / step_dir_name(4)).string());
  again.set_assignment("trainer.lr=0.01");
  again.set_assignment("trainer.clip_grad_norm=0.5");
  log::Capture from_4;
  loom::testing::make_trainer(again);
  EXPECT_FALSE(from_4.contains("trains otherwise")) << join(from_4.lines(), "\n");
}

TEST_F(RunFolderTest, AResumeFromAnOlderStepComparesWithTheRecordOfThatStep) {
  // Steps 1-4 at lr 0.01, 5-8 at 0.02 (config.until_step_4.json keeps the first). Resumed from
  // step 2 at 0.03: what trained up to step 2 was 0.01, not the set-aside steps' 0.02.
  Config first = base("rewind", 4);
  first.set_assignment("trainer.lr=0.01");
  loom::testing::make_trainer(first)->train();
  Config second = base("rewind", 8);
  second.set_assignment("trainer.resume=auto");
  second.set_assignment("trainer.lr=0.02");
  loom::testing::make_trainer(second)->train();
  ASSERT_TRUE(fs::exists(dir_ / "rewind" / "config.until_step_4.json"));
  Config third = base("rewind", 8);
  third.set_assignment("trainer.resume_from=" + (dir_ / "rewind" / "checkpoints" / step_dir_name(2)).string());
  third.set_assignment("trainer.lr=0.03");
  log::Capture capture;
  loom::testing::make_trainer(third);
  EXPECT_TRUE(capture.contains("trainer.lr 0.01 -> 0.03 (--set)")) << join(capture.lines(), "\n");
  EXPECT_NE(read_file(dir_ / "rewind" / "config.until_step_2.json").find("\"value\": \"0.01\""), std::string::npos);
  EXPECT_FALSE(fs::exists(dir_ / "rewind" / "config.until_step_4.json")) << "the set-aside timeline's record goes with it";
  int aside = 0;
  for (const auto& entry : fs::directory_iterator(dir_ / "rewind" / "checkpoints"))
    aside += fs::exists(entry.path() / "config.until_step_4.json") && fs::exists(entry.path() / "config.json");
  EXPECT_EQ(aside, 1);
}

TEST_F(RunFolderTest, AResumeThatTrainsNothingChangesNoRecordAndAnUnreadableOneIsSaid) {
  loom::testing::make_trainer(base("done", 4))->train();
  const fs::path record = dir_ / "done" / "config.json";
  const std::string before = read_file(record);
  Config again = base("done", 4);
  again.set_assignment("trainer.resume=auto");
  again.set_assignment("trainer.lr=0.5");  // (a complete run: nothing trains with it)
  loom::testing::make_trainer(again);
  EXPECT_EQ(read_file(record), before);
  EXPECT_FALSE(fs::exists(dir_ / "done" / "config.until_step_4.json"));

  std::ofstream(record, std::ios::trunc) << "{\"trainer.lr\": {\"value\": \"0.0";  // cut short
  again.set_assignment("trainer.max_steps=6");
  log::Capture capture;
  loom::testing::make_trainer(again)->train();  // (a resume that trains no step puts the record back as it was)
  EXPECT_TRUE(capture.contains("cannot compare this resume with how the run was trained: " + record.string() +
                               " is unreadable"))
      << join(capture.lines(), "\n");
  EXPECT_EQ(read_file(dir_ / "done" / "config.until_step_4.json"), "{\"trainer.lr\": {\"value\": \"0.0");
}

TEST_F(RunFolderTest, AResumeThatAnEarlyStopEndsBeforeItsFirstStepLeavesTheRecordAsItWas) {
  // A run early_stopping stopped, resumed with another rate (the patience as it was): the stop
  // holds at once and no step trains, but config.json had recorded the rate as the run's.
  Config c = base("stopped", 8);
  c.set_assignment("trainer.callbacks=jsonl, checkpoint, early_stopping");
  c.set_assignment("trainer.eval_every=2");
  c.set_assignment("callback.early_stopping.patience=1");
  c.set_assignment("callback.early_stopping.min_delta=1000");  // (nothing improves by that much)
  c.set_assignment("callback.early_stopping.metric=loss");
  const auto first = loom::testing::make_trainer(c)->train();
  ASSERT_LT(first.steps, 8);
  const std::string before = read_file(dir_ / "stopped" / "config.json");
  Config again = c;
  again.set_assignment("trainer.resume=auto");
  again.set_assignment("trainer.lr=0.5");
  const auto second = loom::testing::make_trainer(again)->train();
  EXPECT_EQ(second.steps, first.steps);
  EXPECT_EQ(read_file(dir_ / "stopped" / "config.json"), before);
  EXPECT_FALSE(fs::exists(dir_ / "stopped" / ("config.until_step_" + std::to_string(first.steps) + ".json")));
  // --resume-from into a folder of the user's, where a callback stops the run before its first step
  // (another run's early stop no longer holds in a new run, which starts it afresh): what the
  // command wrote there goes, the user's file stays (its config.json made the same command "a run" there).
  fs::create_directories(dir_ / "mine");
  std::ofstream(dir_ / "mine" / "notes.txt") << "precious";
  Config into = c;
  into.set_assignment("trainer.name=mine");
  into.set_assignment("trainer.callbacks=jsonl, checkpoint, record");
  into.set_assignment("callback.record.stop_main_at=" + std::to_string(first.steps + 1));
  into.set_assignment("callback.record.stop_main_in=on_run_begin");
  into.set_assignment("trainer.resume_from=" + (dir_ / "stopped" / "checkpoints" / step_dir_name(first.steps)).string());
  auto trainer = loom::testing::make_trainer(into);
  trainer->train();
  EXPECT_TRUE(trainer->discard_if_nothing_trained());
  trainer.reset();
  std::vector<std::string> left;
  for (const auto& entry : fs::directory_iterator(dir_ / "mine")) left.push_back(entry.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{".lock", "notes.txt"}));  // (the lock file, as every run folder keeps)
}

TEST_F(RunFolderTest, AResumeFromAnOlderStepThatWouldTrainNothingMovesNothing) {
  // max_steps at the older step: its newer steps went aside (and the best file, and summary.json),
  // then the command said "nothing to train".
  loom::testing::make_trainer(base("older", 6))->train();
  Config again = base("older", 4);
  again.set_assignment("trainer.resume_from=" + (dir_ / "older" / "checkpoints" / step_dir_name(4)).string());
  EXPECT_CONTAINS(error_of(again),
                  "is at step 4, and this run ends at step 4 (trainer.max_steps or trainer.epochs): nothing to train");
  EXPECT_EQ(steps(dir_ / "older"), (std::vector<std::string>{step_dir_name(2), step_dir_name(4), step_dir_name(6)}));
}

TEST_F(RunFolderTest, TheUsersOwnCopiesBesideTheStepsAreNeitherResumedNorPruned) {
  Config c = base("copies", 6);
  c.set_assignment("trainer.keep_last=2");
  loom::testing::make_trainer(c)->train();
  const fs::path checkpoints = dir_ / "copies" / "checkpoints";
  ASSERT_EQ(steps(dir_ / "copies"), (std::vector<std::string>{step_dir_name(4), step_dir_name(6)}));
  // A backup named past the newest step, one with a suffix, and a copy of step 4 under step 8's name.
  for (const auto& copy : {step_dir_name(6) + ".bak", step_dir_name(4) + "_keep", step_dir_name(8)})
    fs::copy(checkpoints / step_dir_name(4), checkpoints / copy);
  // `loom eval` of the run would take the misnamed copy for step 8: it is refused by name.
  try {
    checkpoint_run_config(checkpoints / step_dir_name(8));
    ADD_FAILURE() << "a step folder holding another step must be refused";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("holds step 4 (its state.json) under the name of step 8"), std::string::npos)
        << e.what();
  }
  c.set_assignment("trainer.resume=auto");
  c.set_assignment("trainer.max_steps=10");
  std::string warnings;
  {
    log::Capture capture(LOOM_LOG_WARN);
    auto t = loom::testing::make_trainer(c);
    EXPECT_EQ(t->step(), 6) << "the real newest step, not a copy named after it";
    t->train();
    for (const auto& line : capture.lines()) warnings += line + "\n";
  }
  EXPECT_NE(warnings.find(step_dir_name(8) + " holds step 4 (its state.json) under the name of step 8"), std::string::npos)
      << warnings;
  EXPECT_EQ(steps(dir_ / "copies"), (std::vector<std::string>{step_dir_name(8), step_dir_name(10)}));
  EXPECT_TRUE(fs::exists(checkpoints / (step_dir_name(6) + ".bak") / "model.safetensors")) << "not pruned";
  EXPECT_TRUE(fs::exists(checkpoints / (step_dir_name(4) + "_keep") / "model.safetensors")) << "not pruned";
  int aside = 0;  // the misnamed copy, set aside before this timeline wrote its own step 8
  for (const auto& entry : fs::directory_iterator(checkpoints))
    if (entry.path().filename().string().rfind("abandoned-", 0) == 0)
      aside += fs::exists(entry.path() / step_dir_name(8) / "state.json") ? 1 : 0;
  EXPECT_EQ(aside, 1);
}

TEST_F(RunFolderTest, ADurableWriteDoesNotReplaceADeviceOrAFifo) {
  // Renaming the new file over the path would replace the special file itself (as root, an
  // output given as /dev/null: not tried here, where a regression would replace it); a symbolic
  // link is replaced, its target left as it was.
  const fs::path fifo = dir_ / "out.fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  try {
    loom::core::write_file_atomic(fifo, "x");
    ADD_FAILURE() << fifo << " was written";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("it is a FIFO, which Loom does not replace; give the path of a file"), std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(fs::is_fifo(fifo));
  const fs::path target = dir_ / "target.txt", link = dir_ / "link.txt";
  loom::core::write_file_atomic(target, "kept");
  fs::create_symlink(target, link);
  loom::core::write_file_atomic(link, "new");
  EXPECT_TRUE(fs::is_regular_file(fs::symlink_status(link)));
  EXPECT_EQ(loom::core::read_file(target), "kept");
}

TEST_F(RunFolderTest, CheckpointsAreListedInStepOrderNotNameOrder) {
  const fs::path run = dir_ / "order";
  for (const std::string name : {"step_99999999", "step_100000000", "step_abc", "step_99999999999999999999"}) {
    fs::create_directories(run / "checkpoints" / name);
    std::ofstream(run / "checkpoints" / name / "state.json") << "{}";
  }
  EXPECT_EQ(steps(run), (std::vector<std::string>{"step_99999999", "step_100000000"}));
}

TEST_F(RunFolderTest, ResumingFromTheSameOlderCheckpointTwiceKeepsBothTimelines) {
  loom::testing::make_trainer(base("twice", 6))->train();
  const fs::path step2 = dir_ / "twice" / "checkpoints" / step_dir_name(2);
  for (int i = 0; i < 2; ++i) {  // within a second: the two set-asides need two folders
    Config again = base("", 6);
    // with the trailing slash a shell's completion adds: the same step folder
    again.set_assignment("trainer.resume_from=" + step2.string() + "/");
    auto t = loom::testing::make_trainer(again);
    EXPECT_EQ(t->run_dir(), dir_ / "twice");
    EXPECT_EQ(t->step(), 2);
    t->train();
  }
  std::vector<std::string> aside;
  for (const auto& entry : fs::directory_iterator(dir_ / "twice" / "checkpoints"))
    if (entry.path().filename().string().rfind("abandoned-", 0) == 0) {
      EXPECT_TRUE(fs::exists(entry.path() / step_dir_name(6) / "state.json")) << entry.path();
      aside.push_back(entry.path().filename().string());
    }
  EXPECT_EQ(aside.size(), 2u);
}

TEST_F(RunFolderTest, ARunFolderMovedMidRunIsNotMadeAgainAtItsOldPath) {
  // A run folder renamed while its run went on (a user tidying up): the checkpoint store, the
  // TensorBoard writer and summary.json made the old path again, and the run trained to its end
  // into a second, partial folder there (checkpoints, events, a verdict; its config.json and the
  // metrics in the moved one), exiting 0. It stops, writes nothing there, and says where to go on.
  Config c = base("moving");
  c.set_assignment("trainer.callbacks=record, jsonl, tensorboard, checkpoint");
  c.set_assignment("callback.record.move_run_at=1");
  c.set_assignment("trainer.log_every=2");
  const std::string error = loom::testing::training_error(c);
  const fs::path run = dir_ / "moving";
  std::vector<std::string> there;
  for (std::error_code ec; const auto& e : fs::recursive_directory_iterator(run, ec)) there.push_back(e.path().string());
  EXPECT_FALSE(fs::exists(run)) << "made again, holding: " << join(there, ", ") << "; the run said: " << error;
  EXPECT_TRUE(fs::exists(dir_ / "moving.moved" / "metrics.jsonl"));
  EXPECT_NE(error.find("run folder " + run.string() + " was moved to " + fs::canonical(dir_).string() +
                       "/moving.moved while the run went on: the run stops at step 1"),
            std::string::npos) << error;
  // (in the same work_dir: its name alone)
  EXPECT_NE(error.find("--resume auto --set trainer.name=moving.moved"), std::string::npos) << error;
  EXPECT_EQ(error.find("trainer.work_dir"), std::string::npos) << error;
}

TEST_F(RunFolderTest, ARunFolderRemovedOrReplacedMidRunStopsIt) {
  // Removed, or replaced by a copy of it (cp -r, rm -r, mv): nothing is written at the path, which
  // is no folder of the run's lock (a second process could lock the copy and write it too).
  for (const std::string how : {"remove", "replace"}) {
    Config c = base(how);
    c.set_assignment("trainer.callbacks=record, jsonl, checkpoint");
    c.set_assignment("callback.record.move_run_at=1");
    c.set_assignment("callback.record.move_run=" + how);
    const std::string error = loom::testing::training_error(c);
    const fs::path run = dir_ / how;
    EXPECT_EQ(fs::exists(run), how == "replace") << error;
    EXPECT_FALSE(fs::exists(run / "checkpoints" / step_dir_name(2))) << error;
    EXPECT_NE(error.find("run folder " + run.string() + " was removed while the run went on" +
                         (how == "replace" ? " (the folder at that path now is another)" : "") +
                         ": the run stops at step 1, and writes nothing more"),
              std::string::npos) << error;
    EXPECT_NE(error.find(how == "replace" ? "continue that with --resume auto --set trainer.name=replace"
                                          : "its checkpoints went with it"),
              std::string::npos) << error;
  }
}

TEST_F(RunFolderTest, AFinalCheckpointThatFailsIsSaidInTheSummaryWrittenBeforeIt) {
  // The run's verdict is written after its last evaluation, before that step's checkpoint; a save
  // that then fails (a full disk: here a file-size limit from the last step's on_step_end on) left
  // a summary.json of a finished run while the command exited 1 and the newest checkpoint was an
  // older step's. It says so; the resume trains from that one and writes its own.
  Config c = base("unsaved");
  c.set_assignment("trainer.callbacks=record, jsonl, checkpoint");
  c.set_assignment("callback.record.limit_files_at=4");
  c.set_assignment("callback.record.limit_files_to=8192");
  struct rlimit before {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &before), 0);
  const auto previous = std::signal(SIGXFSZ, SIG_IGN);
  const std::string error = loom::testing::training_error(c);
  ::setrlimit(RLIMIT_FSIZE, &before);
  std::signal(SIGXFSZ, previous);
  const fs::path run = dir_ / "unsaved";
  EXPECT_NE(error.find("the checkpoint of step 4 could not be written"), std::string::npos) << error;
  EXPECT_EQ(steps(run), std::vector<std::string>{step_dir_name(2)});
  ASSERT_TRUE(fs::exists(run / "summary.json")) << error;
  const std::string summary = text(run / "summary.json");
  EXPECT_NE(summary.find("\"step\": 4"), std::string::npos) << summary;
  EXPECT_NE(summary.find("\"val/accuracy\""), std::string::npos) << "the figures stay: " << summary;
  EXPECT_NE(summary.find("\"final_checkpoint\": \"not written: the checkpoint of step 4 could not be written"),
            std::string::npos) << summary;
  EXPECT_NE(summary.find("a resume of the run (--resume auto) trains from that one"), std::string::npos) << summary;

  Config again = base("unsaved");
  again.set_assignment("trainer.resume=auto");
  auto t = loom::testing::make_trainer(again);
  t->train();
  EXPECT_EQ(steps(run), (std::vector<std::string>{step_dir_name(2), step_dir_name(4)}));
  const std::string resumed = text(run / "summary.json");
  EXPECT_NE(resumed.find("\"step\": 4"), std::string::npos) << resumed;
  EXPECT_EQ(resumed.find("final_checkpoint"), std::string::npos) << "its own, not the failed one's: " << resumed;
}

TEST_F(RunFolderTest, ARunResumedPastItsEndKeepsItsEarlierSummaryAsThatStepsRecordOnly) {
  // A finished run extended (trainer.max_steps raised) kept its summary.json of the old end until
  // the new end: killed at step 1850 of 5000, it read as finished at step 50 (probe).
  Config c = base("extended", 4);
  loom::testing::make_trainer(c)->train();
  const fs::path run = dir_ / "extended";
  ASSERT_NE(text(run / "summary.json").find("\"step\": 4"), std::string::npos) << text(run / "summary.json");

  c.set_assignment("trainer.resume=auto");
  c.set_assignment("trainer.max_steps=8");
  c.set_assignment("trainer.callbacks=jsonl, checkpoint, record");
  c.set_assignment("callback.record.stop_at=6");  // (stopped as a kill would: before its end)
  loom::testing::make_trainer(c)->train();
  const std::string earlier = text(run / "summary.until_step_4.json");
  EXPECT_NE(earlier.find("\"step\": 4"), std::string::npos) << "the old end's summary is kept: " << earlier;
  if (fs::exists(run / "summary.json")) {
    EXPECT_EQ(text(run / "summary.json").find("\"step\": 4"), std::string::npos)
        << "summary.json is not the old end's while the run trains past it";
  }

  c.set_assignment("callback.record.stop_at=0");
  loom::testing::make_trainer(c)->train();
  EXPECT_NE(text(run / "summary.json").find("\"step\": 8"), std::string::npos) << text(run / "summary.json");
  EXPECT_EQ(text(run / "summary.until_step_4.json"), earlier);

  // A resume that trains nothing (the run complete) moves nothing.
  loom::testing::make_trainer(c)->train();
  EXPECT_NE(text(run / "summary.json").find("\"step\": 8"), std::string::npos);
  EXPECT_FALSE(fs::exists(run / "summary.until_step_8.json"));
}

}  // namespace
