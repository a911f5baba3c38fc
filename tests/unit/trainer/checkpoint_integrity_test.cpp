// A checkpoint is verified before it is trusted: a flipped byte in any of its three files, a
// relabelled dtype, a NaN in a weight, or an impossible value in state.json is damage, and
// --resume auto falls back to the checkpoint before it; a resumed run whose steps are all
// non-finite stops with an error and writes no checkpoint over the good ones.
#include <loom/core/checkpoint.hpp>
#include <loom/core/crash_report.hpp>
#include <loom/core/config.hpp>
#include <loom/core/files.hpp>
#include <loom/core/log.hpp>
#include <loom/core/safetensors.hpp>
#include <loom/core/trainer.hpp>

#include "trainer_testing.hpp"

#include <ATen/ops/full_like.h>
#include <ATen/ops/ones.h>
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <fstream>
#include <functional>
#include <regex>

namespace fs = std::filesystem;
using namespace loom::core;

namespace {

class CheckpointIntegrityTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = loom::testing::fresh_test_dir("loom_integrity_test");
    loom::testing::make_trainer(config("run", 4))->train();  // checkpoints at steps 2 and 4
    newest_ = dir_ / "run" / "checkpoints" / step_dir_name(4);
  }
  void TearDown() override { fs::remove_all(dir_); }

  Config config(const std::string& name, int64_t steps) const {
    Config c = loom::testing::config_of(
        {"model.name=lightweight_transformer", "model.flavour=debug", "data.name=synthetic", "data.train_size=256",
         "data.test_size=64", "trainer.batch_size=32", "trainer.seed=5", "trainer.log_every=100", "trainer.eval_every=100",
         "trainer.checkpoint_every=2", "trainer.keep_last=2", "trainer.device=cpu", "precision.name=fp32",
         "memory.estimate=false", "trainer.callbacks=checkpoint, early_stopping"},
        dir_, name);
    c.set_assignment("trainer.max_steps=" + std::to_string(steps));
    return c;
  }

  /// The step --resume auto resumes at, and the warnings it gave.
  std::pair<int64_t, std::string> resume() const {
    Config c = config("run", 8);
    c.set_assignment("trainer.resume=auto");
    log::Capture capture(LOOM_LOG_WARN);
    const int64_t step = loom::testing::make_trainer(c)->step();
    std::string warnings;
    for (const auto& line : capture.lines()) warnings += line + "\n";
    return {step, warnings};
  }

  static void flip_byte(const fs::path& file, int64_t from_end) {
    std::string bytes = read_file(file);
    bytes[bytes.size() - static_cast<size_t>(from_end)] ^= 0x01;
    std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  }

  /// Replaces state.json and records its checksum, as a writer that meant it would.
  void rewrite_state(const std::string& from, const std::string& to) const {
    std::string text = read_file(newest_ / "state.json");
    text = std::regex_replace(text, std::regex(from), to);
    std::ofstream(newest_ / "state.json", std::ios::trunc) << text;
    for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
      loom::sdk::TextMap metadata;
      const auto tensors = load_safetensors(newest_ / file, &metadata);
      metadata.erase("loom_crc32");
      metadata["state_json_crc32"] = crc32_hex(text);
      save_safetensors(newest_ / file, tensors, metadata);
    }
  }

  fs::path dir_, newest_;
};

TEST_F(CheckpointIntegrityTest, AFlippedByteInAnyCheckpointFileIsFoundAndTheRunFallsBack) {
  ASSERT_EQ(resume().first, 4);
  const fs::path backup = dir_ / "backup";
  fs::copy(newest_, backup);
  for (const char* file : {"model.safetensors", "optimizer.safetensors", "state.json"}) {
    fs::remove_all(newest_);
    fs::copy(backup, newest_);
    flip_byte(newest_ / file, 3);  // in the tensor data, or in state.json's text
    const auto [step, warnings] = resume();
    EXPECT_EQ(step, 2) << file;
    EXPECT_NE(warnings.find("cannot resume from " + newest_.string()), std::string::npos) << file << "\n" << warnings;
    EXPECT_NE(warnings.find("checksum"), std::string::npos) << file << "\n" << warnings;
  }
}

TEST_F(CheckpointIntegrityTest, AFileOfAnotherSaveCopiedIntoAStepFolderIsNamed) {
  // (step 2's weights copied over step 4's evaluated and resumed as step 4, without a word)
  const fs::path older = newest_.parent_path() / loom::core::step_dir_name(2);
  const fs::path backup = dir_ / "backup";
  fs::copy(newest_, backup);
  for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
    fs::remove_all(newest_);
    fs::copy(backup, newest_);
    fs::copy_file(older / file, newest_ / file, fs::copy_options::overwrite_existing);
    const auto [step, warnings] = resume();
    EXPECT_EQ(step, 2) << file;
    EXPECT_NE(warnings.find((newest_ / file).string() + " is not of this step folder's save"), std::string::npos)
        << file << "\n" << warnings;
  }
  // Another run's, alike in state.json but not in its weights (optimizer.weight_decay is not in it).
  Config other = config("other", 4);
  other.set_assignment("optimizer.weight_decay=0.9");
  loom::testing::make_trainer(other)->train();
  fs::remove_all(newest_);
  fs::copy(backup, newest_);
  fs::copy_file(dir_ / "other" / "checkpoints" / step_dir_name(4) / "model.safetensors", newest_ / "model.safetensors",
                fs::copy_options::overwrite_existing);
  const auto [step, warnings] = resume();
  EXPECT_EQ(step, 2);
  EXPECT_CONTAINS(warnings, (newest_ / "model.safetensors").string() + " is not of this step folder's save");
  // Evaluation reads the weights alone: the same check.
  fs::remove_all(newest_);
  fs::copy(backup, newest_);
  fs::copy_file(older / "model.safetensors", newest_ / "model.safetensors", fs::copy_options::overwrite_existing);
  fs::remove(newest_ / "optimizer.safetensors");
  try {
    loom::core::CheckpointStore::load_weights(newest_);
    ADD_FAILURE() << "step 2's weights were taken as step 4's";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.safetensors recorded"), std::string::npos) << e.what();
  }
}

TEST_F(CheckpointIntegrityTest, AChangedByteInAWeightsFilesRecordedConfigurationIsFound) {
  // A best file's metadata records the model and data settings `loom eval` rebuilds its model
  // from; the checksum covered the tensors only, so a flipped digit (text_tokens 24 to 25) was
  // evaluated as another model, exit 0.
  const fs::path file = dir_ / "best_x.safetensors";
  const loom::sdk::TensorMap tensors = {{"w", at::ones({4})}};
  save_safetensors(file, tensors, {{"model", "{\"config\":{\"text_tokens\":\"24\"}}"}, {"step", "4"}});
  EXPECT_EQ(load_safetensors_metadata(file).at("step"), "4");
  std::string bytes = read_file(file);
  const auto at = bytes.find("\\\"24\\\"");
  ASSERT_NE(at, std::string::npos) << bytes.substr(0, 200);
  bytes[at + 3] = '5';
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  for (const auto& read : {std::function<void()>([&] { load_safetensors_metadata(file); }),
                           std::function<void()>([&] { load_safetensors(file); })}) {
    try {
      read();
      ADD_FAILURE() << "the changed configuration was read";
    } catch (const loom::Error& e) {
      EXPECT_CONTAINS(std::string(e.what()), file.string() + " is not a valid safetensors file: the checksum of its "
                                             "metadata is ");
    }
  }
  // A file without the metadata's checksum (an older Loom's, another tool's) is read as before.
  save_safetensors(file, tensors, {{"step", "4"}});
  bytes = read_file(file);
  const auto crc = bytes.find("\"loom_metadata_crc32\"");
  ASSERT_NE(crc, std::string::npos);
  bytes.replace(crc, 21, "\"loom_metadata_crcXX\"");
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  EXPECT_EQ(load_safetensors_metadata(file).at("step"), "4");
}

TEST_F(CheckpointIntegrityTest, ARelabelledDtypeIsFound) {
  std::string bytes = read_file(newest_ / "model.safetensors");
  const auto at = bytes.find("\"F32\"");
  ASSERT_NE(at, std::string::npos);
  bytes.replace(at, 5, "\"I32\"");  // the same size: only the checksum or the model can tell
  std::ofstream(newest_ / "model.safetensors", std::ios::binary | std::ios::trunc) << bytes;
  const auto [step, warnings] = resume();
  EXPECT_EQ(step, 2);
  EXPECT_NE(warnings.find("checksum"), std::string::npos) << warnings;
}

TEST_F(CheckpointIntegrityTest, AHeaderEntryNestedDeepIsDamageNotAStackOverflow) {
  // (an entry 300000 arrays deep: the refusal's dump() of it recursed until SIGSEGV, in eval, a
  // resume and a pretrained folder's weights)
  const std::string bytes = read_file(newest_ / "model.safetensors");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  std::string header = bytes.substr(8, n);
  header.erase(header.find_last_not_of(' ') + 1);  // (the padding, then the closing brace)
  header.pop_back();
  header += ", \"zzz\": " + std::string(300000, '[') + std::string(300000, ']') + "}";
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string length(8, '\0');
  for (int i = 0; i < 8; ++i) length[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  std::ofstream(newest_ / "model.safetensors", std::ios::binary | std::ios::trunc) << length << header << bytes.substr(8 + n);
  const auto [step, warnings] = resume();
  EXPECT_EQ(step, 2);
  EXPECT_NE(warnings.find("nested more than 64 levels deep"), std::string::npos) << warnings.substr(0, 2000);
}

TEST_F(CheckpointIntegrityTest, ANonFiniteWeightIsDamageEvenWithAValidChecksum) {
  auto model = load_safetensors(newest_ / "model.safetensors");
  auto& weight = model.begin()->second;
  weight = at::full_like(weight, std::nan(""));
  save_safetensors(newest_ / "model.safetensors", model);
  const auto [step, warnings] = resume();
  EXPECT_EQ(step, 2);
  EXPECT_NE(warnings.find("holds NaN or infinite values"), std::string::npos) << warnings;
}

TEST_F(CheckpointIntegrityTest, ImpossibleValuesInStateJsonAreDamageNamedByField) {
  const fs::path backup = dir_ / "backup";
  fs::copy(newest_, backup);
  const std::vector<std::tuple<std::string, std::string, std::string>> cases = {
      {R"re("skipped_steps": 0)re", R"("skipped_steps": 99)", "field 'skipped_steps' = 99 is outside [0, 4]"},
      {R"re("offset": (\d+))re", R"("offset": -5)", "field 'loader.offset' = -5 is outside"},
      {R"re("step": 4,)re", R"("step": "four",)", "field 'step' is \"four\", not an integer"},
      {R"re("micro_batch": 32)re", R"("micro_batch": 0)", "field 'plan.micro_batch' = 0 is outside"},
      {R"re("format": 1)re", R"("format": 7)", "field 'format' = 7 is outside [1, 1]"},
      {R"re("ranks": 1)re", R"("ranks": 0)", "field 'loader.ranks' = 0 is outside"},
      // a global batch past trainer.batch_size's bound
      {R"re("accumulation": 1)re", R"("accumulation": 1000000000)",
       "plan gives a global batch of 32000000000, more than 16777216 (trainer.batch_size's largest)"},
      // a callback's state: a step of 1e300 would be cast to an integer, a best of NaN never beaten
      {R"re("best_step": "\d+")re", R"("best_step": "1e300")", "callback state 'best_step' = '1e300' is not a count"},
      {R"re("best": "[^"]+")re", R"("best": "nan")", "callback state 'best' = 'nan' is not a finite number"},
  };
  for (const auto& [from, to, expected] : cases) {
    fs::remove_all(newest_);
    fs::copy(backup, newest_);
    rewrite_state(from, to);
    const auto [step, warnings] = resume();
    EXPECT_EQ(step, 2) << to;
    EXPECT_NE(warnings.find(expected), std::string::npos) << to << "\n" << warnings;
  }
}

TEST_F(CheckpointIntegrityTest, AResumeWhoseStepsAreAllNonFiniteStopsAndSavesNothing) {
  // Finite but enormous weights (a checksum cannot tell): every step's gradients overflow.
  auto model = load_safetensors(newest_ / "model.safetensors");
  for (auto& [name, t] : model)
    if (name.rfind("param.", 0) == 0) t = at::full_like(t, 1e30);
  save_safetensors(newest_ / "model.safetensors", model);
  Config c = config("run", 20);
  c.set_assignment("trainer.resume=auto");
  c.set_assignment("trainer.checkpoint_every=1");
  auto t = loom::testing::make_trainer(c);
  ASSERT_EQ(t->step(), 4);
  try {
    t->train();
    FAIL() << "the run must stop";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("had non-finite gradients: the checkpoint is probably damaged"), std::string::npos)
        << e.what();
  }
  std::vector<std::string> kept;
  for (const auto& p : CheckpointStore::list_run(dir_ / "run")) kept.push_back(p.filename().string());
  EXPECT_EQ(kept, (std::vector<std::string>{step_dir_name(2), step_dir_name(4)})) << "nothing written over the good ones";
}

TEST_F(CheckpointIntegrityTest, ACheckpointThatCannotBeWrittenIsOneErrorAndLeavesNoPartialFolder) {
  // A full disk, as the kernel says it to a writer: a file size limit (ulimit -f) smaller than the
  // model's weights makes the next checkpoint's write fail with EFBIG.
  Config c = config("run", 8);
  c.set_assignment("trainer.resume=auto");
  auto t = loom::testing::make_trainer(c);
  ASSERT_EQ(t->step(), 4);
  rlimit before{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &before), 0);
  rlimit small = before;
  small.rlim_cur = fs::file_size(newest_ / "model.safetensors") / 2;
  const auto previous_handler = std::signal(SIGXFSZ, SIG_IGN);  // (the limit's signal would end the process)
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string what;
  try {
    t->train();
  } catch (const std::exception& e) {
    what = e.what();
  }
  setrlimit(RLIMIT_FSIZE, &before);
  std::signal(SIGXFSZ, previous_handler);
  EXPECT_NE(what.find("the checkpoint of step 6 could not be written to " + (dir_ / "run" / "checkpoints").string()),
            std::string::npos) << what;
  EXPECT_NE(what.find("File too large"), std::string::npos) << what;
  // (the limit named, not the free space: the disk is not what is short)
  EXPECT_NE(what.find("File too large, the file-size limit of this process (`ulimit -f`)"), std::string::npos) << what;
  EXPECT_NE(what.find("(raise the file-size limit, or lift it: `ulimit -f unlimited`); its partial folder is removed"),
            std::string::npos)
      << what;
  std::vector<std::string> left;
  for (const auto& entry : fs::directory_iterator(dir_ / "run" / "checkpoints")) left.push_back(entry.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{step_dir_name(2), step_dir_name(4)})) << "no .step_*.tmp, nothing pruned";
  t.reset();  // (its lock on the run folder goes with it)
  const auto [step, warnings] = resume();
  EXPECT_EQ(step, 4);
  EXPECT_EQ(warnings.find("cannot resume"), std::string::npos) << warnings;
}

TEST(CrashReport, AFileCutShortWhileItIsMappedIsNamedNotCalledABug) {
  // `loom eval` of a best file another process rewrote in place (cp over it) died of SIGBUS with
  // "a bug in Loom or in a plugin". Here a child maps a checkpoint, the file is cut short, and the
  // child reads it: the report names the file and the cause, and the child still dies of SIGBUS.
  const fs::path file = fs::temp_directory_path() / ("loom_sigbus_" + std::to_string(::getpid()) + ".safetensors");
  loom::sdk::TensorMap tensors{{"w", at::ones({4096})}};
  save_safetensors(file, tensors, {});
  int out[2];
  ASSERT_EQ(::pipe(out), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::dup2(out[1], STDERR_FILENO);
    install_crash_report("loom");
    const loom::sdk::TensorMap mapped = load_safetensors(file);
    if (::truncate(file.c_str(), 64) != 0) ::_exit(3);
    const float sum = mapped.at("w").sum().item<float>();  // (reads the pages past the end: SIGBUS)
    ::_exit(sum > 0 ? 4 : 5);
  }
  ::close(out[1]);
  std::string said;
  char buffer[4096];
  for (ssize_t n; (n = ::read(out[0], buffer, sizeof buffer)) > 0;) said.append(buffer, static_cast<size_t>(n));
  ::close(out[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  fs::remove(file);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGBUS) << "status " << status << ": " << said;
  EXPECT_NE(said.find("loom: crashed with SIGBUS"), std::string::npos) << said;
  EXPECT_NE(said.find(", in " + file.string() + ", which became shorter while it was read: another process wrote it in place"),
            std::string::npos) << said;
  EXPECT_EQ(said.find("This is a bug"), std::string::npos) << said;
}

}  // namespace

TEST_F(CheckpointIntegrityTest, ALogWindowWithANonFiniteOrNegativeSumIsLoomsOwnAndResumes) {
  // A checkpoint saved between log steps (step 2 here: log_every is 100) carries the window's sums.
  // JSON has no NaN: a window that saw a skipped step's NaN loss, or a metric over no samples, is
  // written as null; a model's loss may be below 0. Each is a checkpoint Loom wrote, never "damaged".
  const std::string loss = R"re(("log_window": \{\s*"steps": \d+,\s*"loss": )[-0-9.eE+]+)re";
  rewrite_state(loss, "$1\"much\"");  // (step 4's) not a number at all: damage, named
  {
    const auto [step, warnings] = resume();
    EXPECT_EQ(step, 2);
    EXPECT_NE(warnings.find("field 'log_window.loss' is \"much\", not a number"), std::string::npos) << warnings;
  }
  fs::remove_all(newest_);
  newest_ = newest_.parent_path() / step_dir_name(2);
  ASSERT_NE(read_file(newest_ / "state.json").find("\"accuracy\": "), std::string::npos) << "the window holds a metric";
  const fs::path backup = dir_ / "backup";
  fs::copy(newest_, backup);
  for (const char* value : {"null", "-3.5"}) {
    fs::remove_all(newest_);
    fs::copy(backup, newest_);
    rewrite_state(loss, std::string("$1") + value);
    rewrite_state(R"re(("metrics": \{\s*"accuracy": )[-0-9.eE+]+)re", "$1null");
    ASSERT_NE(read_file(newest_ / "state.json").find(std::string("\"loss\": ") + value), std::string::npos);
    const auto [step, warnings] = resume();
    EXPECT_EQ(step, 2) << value << "\n" << warnings;
    EXPECT_EQ(warnings.find("cannot resume"), std::string::npos) << value << "\n" << warnings;
  }
}

TEST_F(CheckpointIntegrityTest, AValidationCutShortAtTheLastStepRunsOnResumeAndThenTheTestSplit) {
  // A stop in the last step's validation: the checkpoint says it is pending. The resume has no step
  // left to train, runs the validation first, then the test split the stop skipped too.
  rewrite_state(R"re(^\{)re", "{\n  \"evaluation_pending\": true,");
  Config c = config("run", 4);
  c.set_assignment("trainer.resume=auto");
  log::Capture capture;
  auto t = loom::testing::make_trainer(c);
  ASSERT_EQ(t->step(), 4);
  const TrainSummary s = t->train();
  EXPECT_TRUE(capture.contains("the evaluation of step 4 that a stop or a failure cut short runs first"));
  ASSERT_TRUE(s.final_eval.has_value());
  EXPECT_EQ(s.final_eval->split, loom::sdk::Split::kTest);
}

TEST_F(CheckpointIntegrityTest, AStateJsonWithoutRanksIsAnOlderFileAndResumes) {
  // Loom before data_parallel wrote no loader.ranks: the plan's world_size was the ranks then.
  rewrite_state(R"re(,\s*"ranks": 1)re", "");
  ASSERT_EQ(read_file(newest_ / "state.json").find("\"ranks\""), std::string::npos);
  const auto [step, warnings] = resume();
  EXPECT_EQ(step, 4) << warnings;
}

TEST_F(CheckpointIntegrityTest, AModelOptionYoungerThanTheCheckpointIsComparedAtItsDefault) {
  // A checkpoint written before the plugin had an option does not name it, and its model ran as
  // the option's default does. Resuming with the default resumes; with another value, it is
  // another model, refused, naming the option (no key of the checkpoint differs).
  rewrite_state(R"re("attention": "auto",\s*)re", "");
  ASSERT_EQ(read_file(newest_ / "state.json").find("\"attention\""), std::string::npos);
  EXPECT_EQ(resume().first, 4);
  Config other = config("run", 8);
  other.set_assignment("trainer.resume=auto");
  other.set_assignment("model.attention=math");
  try {
    loom::testing::make_trainer(other);
    FAIL() << "expected a refusal";
  } catch (const loom::Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("refusing to resume"), std::string::npos) << message;
    EXPECT_NE(message.find("model.attention: not in the checkpoint (written before the option existed, so trained as "
                           "its default auto), this run math"),
              std::string::npos)
        << message;
  }
  // A value written otherwise is the same value: 2 is the default mlp_ratio 2.0
  Config spelled = config("run", 8);
  spelled.set_assignment("trainer.resume=auto");
  spelled.set_assignment("model.mlp_ratio=2");
  EXPECT_EQ(loom::testing::make_trainer(spelled)->step(), 4);
}
