// C-tier components (sdk/include/loom/sdk/c_plugin.h) in real runs: the C99 Fashion-MNIST
// dataset of examples/c_dataset trains to exactly what its C++ twin trains to, and a C memory
// policy and callback plan, stop and keep their state across a resume.
#include "trainer_testing.hpp"

#include <loom/core/checkpoint.hpp>
#include <loom/sdk/version.hpp>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

namespace fs = std::filesystem;
using namespace loom::core;

namespace {

class CTierTest : public testing::Test {
 protected:
  void SetUp() override { dir_ = loom::testing::fresh_test_dir("loom_c_tier_test"); }
  void TearDown() override { fs::remove_all(dir_); }

  Config base(const std::string& name, const std::string& dataset) const {
    Config c = loom::testing::config_of(
        {"model.name=lightweight_transformer", "model.flavour=debug", "data.limit_train=1024", "data.limit_test=512",
         "data.num_workers=2", "trainer.batch_size=32", "trainer.max_steps=40", "trainer.seed=11",
         "trainer.eval_every=40", "trainer.device=cpu", "precision.name=fp32", "memory.estimate=false",
         "trainer.callbacks=checkpoint"},
        dir_, name);
    c.set_assignment("data.name=" + dataset);
    return c;
  }

  fs::path dir_;
};

bool have_fashion_mnist() { return fs::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"); }

}  // namespace

TEST_F(CTierTest, TheCDatasetTrainsToExactlyWhatItsCppTwinTrainsTo) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "Fashion-MNIST is not installed (scripts/setup.sh installs it)";
  const auto* info = loom::testing::registry().find(LOOM_KIND_DATASET, "c_fashion_mnist");
  ASSERT_NE(info, nullptr) << "the C-tier example was not loaded from tests/models";
  EXPECT_TRUE(info->c_tier());
  EXPECT_EQ(info->plugin->sdk_version, "");  // its fingerprint names no SDK build, no LibTorch
  EXPECT_EQ(loom::testing::registry().find(LOOM_KIND_DATASET, "fashion_mnist")->plugin->sdk_version, LOOM_SDK_VERSION);

  const TrainSummary cpp = loom::testing::make_trainer(base("cpp", "fashion_mnist"))->train();
  const TrainSummary c = loom::testing::make_trainer(base("c", "c_fashion_mnist"))->train();
  ASSERT_TRUE(cpp.final_eval && c.final_eval);
  EXPECT_EQ(c.final_eval->samples, 512);
  EXPECT_GT(cpp.final_eval->metrics.at("accuracy"), 0.3) << "40 steps learn more than chance (0.1)";
  // The same samples in the same order give the same weights: the same loss and accuracy, bit for bit.
  EXPECT_EQ(c.final_eval->metrics.at("accuracy"), cpp.final_eval->metrics.at("accuracy"));
  EXPECT_EQ(c.final_eval->loss, cpp.final_eval->loss);
}

TEST_F(CTierTest, ACDatasetErrorNamesTheComponentAndTheFile) {
  auto dataset = loom::testing::registry().create<loom::sdk::Dataset>("c_fashion_mnist", {{"path", dir_.string()}});
  try {
    dataset->setup();
    FAIL() << "expected an error";
  } catch (const loom::sdk::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("dataset 'c_fashion_mnist': setup failed: " + dir_.string() + "/train-images-idx3-ubyte[.gz]: not found"),
              std::string::npos)
        << m;
  }
}

TEST_F(CTierTest, ACMemoryPolicyAndCallbackPlanStopAndKeepTheirState) {
  Config c = loom::testing::config_of(
      {"model.name=lightweight_transformer", "model.flavour=debug", "data.name=synthetic", "data.train_size=512",
       "data.test_size=64", "trainer.batch_size=32", "trainer.max_steps=20", "trainer.eval_every=2",
       "trainer.log_every=1", "trainer.device=cpu", "precision.name=fp32", "memory.estimate=false",
       "memory.policies=c_halve", "memory.c_halve.max=8", "trainer.callbacks=c_stop_at, checkpoint",
       "callback.c_stop_at.step=3"},
      dir_, "c_policy");
  {
    auto t = loom::testing::make_trainer(c);
    EXPECT_EQ(t->plan(), (loom::sdk::BatchPlan{8, 4, 1}));  // 32 = 8 x 4: halved twice
    const TrainSummary s = t->train();
    EXPECT_EQ(s.steps, 3);
    EXPECT_EQ(s.stop_reason, "c_stop_at: step 3 reached") << s.stop_reason;
  }
  // Its state went into the checkpoint of step 3: three steps seen, two validations (step 2, and
  // step 3 where the run stopped), five logs (one per step, one per validation).
  const auto saved = CheckpointStore(dir_ / "c_policy").list();
  ASSERT_FALSE(saved.empty());
  std::ifstream in(saved.back() / "state.json");
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_NE(text.str().find("\"steps_seen\": \"3\""), std::string::npos) << text.str();
  EXPECT_NE(text.str().find("\"evaluations\": \"2\""), std::string::npos) << text.str();
  EXPECT_NE(text.str().find("\"logs\": \"5\""), std::string::npos) << text.str();

  // Resumed, the callback gets its counts back and goes on counting from them.
  c.set_assignment("trainer.resume=auto");
  c.set_assignment("callback.c_stop_at.step=4");
  auto again = loom::testing::make_trainer(c);
  EXPECT_EQ(again->train().steps, 4);
  std::ifstream in2(CheckpointStore(dir_ / "c_policy").list().back() / "state.json");
  std::stringstream text2;
  text2 << in2.rdbuf();
  EXPECT_NE(text2.str().find("\"steps_seen\": \"4\""), std::string::npos) << text2.str();
}

TEST_F(CTierTest, ACTierPluginWrittenInCppExportsItsEntryPoint) {
  // LOOM_C_PLUGIN in a .cpp file mangled the entry point's name: "no entry symbol ... is exported".
  for (const auto& r : loom::testing::registry().refusals())
    EXPECT_NE(r.file.filename().string(), "libloom_c_tier_cxx.so") << r.line();
  const auto* info = loom::testing::registry().find(LOOM_KIND_CALLBACK, "c_from_cxx");
  ASSERT_NE(info, nullptr);
  EXPECT_TRUE(info->c_tier());
  EXPECT_NE(loom::testing::registry().create<loom::sdk::Callback>("c_from_cxx"), nullptr);
}

TEST_F(CTierTest, ASpecNamingAnInputItDoesNotHaveIsTheDatasetsErrorNotTheModels) {
  // The model's fields.at(input_key) said "model 'x': map::at", blaming the model.
  Config c = base("bad_key", "c_faulty");
  c.set_assignment("data.c_faulty.fault=bad_key");
  try {
    loom::testing::make_trainer(c);
    ADD_FAILURE() << "no error";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("dataset 'c_faulty': its spec() names field 'nope' as its input_key, but it has no "
                                         "such field (its fields: x, y)"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(CTierTest, TensorsThatBreakTheContractAreOneClearErrorEach) {
  const std::vector<std::pair<std::string, std::string>> faults = {
      {"error", "dataset 'c_faulty': get_batch failed: the disk is on fire"},
      {"wrong_shape", "get_batch's tensor for field 'x' does not have the shape [4, <the field's shape>]"},
      {"wrong_dtype", "get_batch's tensor for field 'y' does not have the field's dtype"},
      {"missing", "get_batch's tensor for field 'y' is missing"},
      {"cuda_memory", "get_batch's tensor for field 'x' is not in CPU memory"},
      {"old_dlpack", "get_batch's tensor for field 'x' is DLPack 0.x, the host reads 1.x"},
      {"null_data", "get_batch's tensor for field 'x' has no data (a null pointer)"},
  };
  for (const auto& [fault, expected] : faults) {
    auto dataset = loom::testing::registry().create<loom::sdk::Dataset>("c_faulty", {{"fault", fault}});
    dataset->setup();
    try {
      dataset->get_batch(loom::sdk::Split::kTrain, {0, 1, 2, 3});
      ADD_FAILURE() << fault << ": no error";
    } catch (const loom::sdk::Error& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << fault << ": " << e.what();
    }
  }
  // A callback that saves a state no resume gives back: refused as it is made (the check said
  // only "its text state differs after load_state_dict(state_dict())", the C++ tier's words).
  try {
    loom::testing::registry().create<loom::sdk::Callback>("c_stop_at", {{"step", "3"}, {"no_load_state", "true"}});
    ADD_FAILURE() << "save_state without load_state was taken";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("callback 'c_stop_at': its table has save_state without load_state: a resumed run "
                                         "would not get its state back; give both, or neither"),
              std::string::npos)
        << e.what();
  }
  // The well-behaved case, for contrast.
  auto fine = loom::testing::registry().create<loom::sdk::Dataset>("c_faulty", {{"fault", "none"}});
  fine->setup();
  const auto batch = fine->get_batch(loom::sdk::Split::kTrain, {0, 1, 2, 3});
  EXPECT_EQ(batch.at("x").sizes(), (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(batch.at("y").scalar_type(), at::kLong);
}
