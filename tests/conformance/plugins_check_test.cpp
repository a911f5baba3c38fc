// The conformance suites (core/conformance.hpp, what `loom plugins check` runs) over every
// in-tree plugin, the examples and the test plugins, which must all pass; and over a plugin that
// breaks two contracts on purpose, whose failing checks must be named with their reasons.
#include <loom/core/conformance.hpp>
#include <loom/core/kinds.hpp>

#include "trainer_testing.hpp"

#include <gtest/gtest.h>

#include <tuple>

#include <cstdlib>
#include <fstream>
#include <set>

namespace fs = std::filesystem;
using loom::core::ConformanceCheck;
using loom::core::ConformanceReport;

namespace {

std::string failures(const ConformanceReport& r) {
  std::string out;
  for (const auto& c : r.checks)
    if (c.outcome == ConformanceCheck::Outcome::kFail) out += "\n  " + c.name + ": " + c.reason;
  return out;
}

const ConformanceCheck* find(const ConformanceReport& r, const std::string& name) {
  for (const auto& c : r.checks)
    if (c.name == name) return &c;
  return nullptr;
}

// The check `name` fails with a reason that says `reason`; every other check of the report passes
// (or, with `skips`, passes or is skipped).
void expect_fails_only(const ConformanceReport& r, const std::string& name, const std::string& reason, bool skips = false) {
  const ConformanceCheck* check = find(r, name);
  ASSERT_NE(check, nullptr) << r.component << " has no check " << name;
  EXPECT_EQ(check->outcome, ConformanceCheck::Outcome::kFail) << r.component << ": " << name;
  EXPECT_NE(check->reason.find(reason), std::string::npos) << check->reason;
  for (const auto& c : r.checks)
    if (c.name != name && skips) {
      EXPECT_NE(c.outcome, ConformanceCheck::Outcome::kFail) << r.component << ": " << c.name << ": " << c.reason;
    } else if (c.name != name) {
      EXPECT_EQ(c.outcome, ConformanceCheck::Outcome::kPass) << r.component << ": " << c.name << ": " << c.reason;
    }
}

class PluginsCheck : public testing::Test {
 protected:
  void SetUp() override {
    scratch_ = loom::testing::fresh_test_dir("loom_plugins_check");
    ::setenv("LOOM_CACHE", scratch_.c_str(), 1);  // auto_batch's answers stay out of the user's cache
  }
  void TearDown() override { fs::remove_all(scratch_); }
  fs::path scratch_;
};

TEST_F(PluginsCheck, EveryLoadedPluginConforms) {
  const auto& registry = loom::testing::registry();
  // interactions reads MovieLens from a folder: a small ml-latest one, written here.
  const fs::path movielens = scratch_ / "ml-latest-small";
  fs::create_directories(movielens);
  std::ofstream(movielens / "movies.csv") << "movieId,title,genres\n1,Heat (1995),Action|Crime\n"
                                             "2,\"Babe, the Pig (1995)\",Children\n3,Fargo (1996),Crime\n4,Up (2009),Animation\n"
                                             "5,Alien (1979),Horror|Sci-Fi\n6,Amélie (2001),Comedy|Romance\n";
  std::ofstream ratings(movielens / "ratings.csv");
  ratings << "userId,movieId,rating,timestamp\n";
  for (int user = 1; user <= 6; ++user)
    for (int movie = 1; movie <= 6; ++movie) ratings << user << "," << movie << "," << (user + movie) % 5 + 1 << ".0," << movie << "\n";
  ratings.close();
  loom::core::ConformanceOptions options;
  options.options["interactions"] = {{"root", movielens.string()}};
  std::set<std::string> kinds;
  int checks = 0;
  for (const auto& component : registry.components()) {
    const ConformanceReport r = loom::core::check_component(registry, component, options);
    EXPECT_TRUE(r.passed()) << r.kind << " '" << component.name << "' " << r.context << failures(r);
    for (const auto& c : r.checks) {  // none skipped for want of options or data
      if (component.kind == LOOM_KIND_DATASET || component.kind == LOOM_KIND_MODEL) {
        EXPECT_NE(c.outcome, ConformanceCheck::Outcome::kSkip) << component.name << " " << c.name << ": " << c.reason;
      }
    }
    EXPECT_GE(r.checks.size(), 2u) << component.name;
    checks += static_cast<int>(r.checks.size());
    kinds.insert(r.kind);
  }
  // Every kind that has plugins in the tree was checked.
  for (const char* kind : {"model", "dataset", "precision", "memory", "parallel", "optimizer", "schedule", "callback"})
    EXPECT_TRUE(kinds.count(kind)) << kind;
  EXPECT_GT(checks, 100);
}

TEST_F(PluginsCheck, ADatasetThatNeedsItsFilesIsSkippedWithTheReasonWithoutThem) {
  const auto& registry = loom::testing::registry();
  const auto* interactions = registry.find(LOOM_KIND_DATASET, "interactions");
  ASSERT_NE(interactions, nullptr);
  const ConformanceReport r = loom::core::check_component(registry, *interactions);
  EXPECT_TRUE(r.passed()) << failures(r);
  const ConformanceCheck* create = find(r, "create");
  ASSERT_NE(create, nullptr);
  EXPECT_EQ(create->outcome, ConformanceCheck::Outcome::kSkip);
  EXPECT_NE(create->reason.find("data.root is not set"), std::string::npos) << create->reason;
}

TEST_F(PluginsCheck, TheModelIsCheckedWithItsOwnPluginsDataset) {
  const auto& registry = loom::testing::registry();
  const auto* regressor = registry.find(LOOM_KIND_MODEL, "mlp_regressor");
  ASSERT_NE(regressor, nullptr);
  const ConformanceReport r = loom::core::check_component(registry, *regressor);
  EXPECT_EQ(r.context, "with dataset sine_regression");
  EXPECT_TRUE(r.passed()) << failures(r);
}

// `loom plugins check FILE --set SECTION.COMPONENT.OPTION=VALUE` builds every kind with the value
// (a dataset alone took it: a model or a policy passed with a value its factory refuses).
TEST_F(PluginsCheck, EveryKindIsBuiltWithTheOptionsGivenIt) {
  const auto& registry = loom::testing::registry();
  loom::core::ConformanceOptions options;
  options.options["vram_tiers"] = {{"tiers", "foo"}};
  options.options["lightweight_transformer"] = {{"num_layers", "0"}};
  options.options["sgd"] = {{"momentum", "0.5"}};
  for (const auto& [kind, name, says] :
       {std::tuple<uint32_t, const char*, const char*>{LOOM_KIND_MEMORY, "vram_tiers", "'foo'"},
        {LOOM_KIND_MODEL, "lightweight_transformer", "num_layers"}}) {
    const ConformanceReport r = loom::core::check_component(registry, registry.require(kind, name), options);
    const ConformanceCheck* create = find(r, "create");
    ASSERT_NE(create, nullptr) << name;
    EXPECT_EQ(create->outcome, ConformanceCheck::Outcome::kFail) << name;
    EXPECT_NE(create->reason.find(says), std::string::npos) << name << ": " << create->reason;
  }
  const ConformanceReport sgd = loom::core::check_component(registry, registry.require(LOOM_KIND_OPTIMIZER, "sgd"), options);
  EXPECT_TRUE(sgd.passed()) << failures(sgd);  // (a value in range: built, and checked)
}

TEST_F(PluginsCheck, ANonConformingPluginFailsTheChecksItBreaksAndOnlyThose) {
  loom::core::PluginRegistry registry;
  registry.set_log_refusals(false);
  const fs::path file = fs::path(LOOM_BINARY_DIR) / "tests" / "nonconforming" / "libloom_model_nonconforming.so";
  ASSERT_TRUE(registry.load(file).accepted);
  registry.scan({fs::path(LOOM_BINARY_DIR) / "lib" / "loom" / "plugins"});  // the dataset a model is checked with
  const auto reports = loom::core::check_plugin(registry, file);
  ASSERT_EQ(reports.size(), 3u);

  const ConformanceReport& model = reports[0];
  EXPECT_EQ(model.component, "mean_loss_model");
  EXPECT_EQ(model.context, "with dataset synthetic");
  expect_fails_only(model, "loss_is_a_sum", "return the loss summed over samples with its count, not a mean");
  // (a model that declares no FLOPs passes, with a note that says so: "pass" alone read as "declared")
  const ConformanceCheck* flops = find(model, "flops_declared");
  ASSERT_NE(flops, nullptr);
  EXPECT_EQ(flops->reason, "not declared (flops_per_loss_term() is 0): the log shows no TFLOP/s or MFU for it");

  const ConformanceReport& callback = reports[1];
  EXPECT_EQ(callback.component, "forgetful");
  expect_fails_only(callback, "state_round_trip", "its text state differs after load_state_dict(state_dict())");

  // (a save from on_after_backward overwrote a good checkpoint with a state that was no step's)
  const ConformanceReport& saver = reports[2];
  EXPECT_EQ(saver.component, "mid_step_saver");
  expect_fails_only(saver, "hooks_of_a_short_run", "save_checkpoint() from on_after_backward is refused");
}

TEST_F(PluginsCheck, ACTableWithoutItsFunctionsFailsItsCreateCheckNotSkipsIt) {
  // (it was skipped as "cannot be created with its default options": a defect said as a want)
  loom::core::PluginRegistry registry;
  registry.set_log_refusals(false);
  const fs::path file = fs::path(LOOM_BINARY_DIR) / "tests" / "nonconforming" / "libloom_dataset_tableless.so";
  ASSERT_TRUE(registry.load(file).accepted);
  const auto reports = loom::core::check_plugin(registry, file);
  ASSERT_EQ(reports.size(), 1u);
  const ConformanceCheck* create = find(reports[0], "create");
  ASSERT_NE(create, nullptr);
  EXPECT_EQ(create->outcome, ConformanceCheck::Outcome::kFail) << create->reason;
  EXPECT_NE(create->reason.find("its table lacks setup, spec, size or get_batch"), std::string::npos) << create->reason;
}

TEST_F(PluginsCheck, ADatasetWhoseLabelsAreNotItsClassesFailsThatCheckAlone) {
  // (labels 1..3 of 3 classes passed, and training failed in the model: "Target 3 is out of bounds")
  loom::core::PluginRegistry registry;
  registry.set_log_refusals(false);
  const fs::path file = fs::path(LOOM_BINARY_DIR) / "tests" / "nonconforming" / "libloom_dataset_one_based_labels.so";
  ASSERT_TRUE(registry.load(file).accepted);
  const auto reports = loom::core::check_plugin(registry, file);
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].component, "one_based_labels");
  expect_fails_only(reports[0], "targets_are_classes", "targets run from 1 to 3, outside the classes 0..2", /*skips=*/true);
}

}  // namespace
