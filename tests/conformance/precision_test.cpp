// Conformance suite of precision plugins: every loaded precision plugin gets the same checks,
// on CPU, by being listed (see Note [Conformance over the registry]). A check that needs a
// feature (a loss scaler) is skipped for plugins without it.
#include <loom/core/checkpoint.hpp>
#include <loom/core/config.hpp>
#include <loom/core/plugin_registry.hpp>
#include <loom/core/trainer.hpp>

#include "trainer_testing.hpp"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include <cmath>
#include <filesystem>
#include <limits>

namespace fs = std::filesystem;
using namespace loom::core;

namespace {

using loom::testing::registry;

// Note [Conformance over the registry]
// The parameters are the precision plugins the registry loaded from the build's plugin folder,
// so a new plugin is checked as soon as it is built, without touching this file.
std::vector<std::string> precision_plugins() {
  std::vector<std::string> names;
  for (const auto& c : registry().components())
    if (c.kind == LOOM_KIND_PRECISION) names.push_back(c.name);
  std::sort(names.begin(), names.end());
  return names;
}

bool has_option(const std::string& plugin, const std::string& key) {
  const auto* c = registry().find(LOOM_KIND_PRECISION, plugin);
  return c && std::any_of(c->options.begin(), c->options.end(), [&](const auto& o) { return o.key == key; });
}

class PrecisionConformance : public testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dir_ = loom::testing::fresh_test_dir("loom_precision_" + GetParam());
  }
  void TearDown() override { fs::remove_all(dir_); }

  Config config(const std::string& name, const std::string& precision) const {
    Config c;
    for (const auto& kv : {"model.name=lightweight_transformer", "model.flavour=debug", "model.dropout=0.0",
                           "data.name=synthetic", "data.train_size=1024", "data.test_size=64", "data.noise=0.3",
                           "trainer.batch_size=32", "trainer.max_steps=40", "trainer.seed=5", "trainer.device=cpu",
                           "trainer.use_scheduler=true", "trainer.lr=0.003", "trainer.eval_every=1000",
                           "trainer.log_every=1000"})
      c.set_assignment(kv);
    c.set_assignment("precision.name=" + precision);
    c.set_assignment("trainer.work_dir=" + dir_.string());
    c.set_assignment("trainer.name=" + name);
    return c;
  }

  static std::unique_ptr<Trainer> make(const Config& c) { return loom::testing::make_trainer(c); }

  static std::vector<at::Tensor> parameters(Trainer& t) { return loom::testing::parameters_of(t); }

  static std::optional<double> scale_of(Trainer& t) {
    const auto state = t.precision().state_dict();
    auto it = state.tensors.find("scale");
    if (it == state.tensors.end()) return std::nullopt;
    return it->second.item<double>();
  }

  fs::path dir_;
};

TEST_P(PrecisionConformance, ATinyModelLearns) {
  Config c = config("learns", GetParam());
  if (has_option(GetParam(), "init_scale")) c.set_assignment("precision.init_scale=1024");
  auto t = make(c);
  double first = 0, last = 0;
  for (int i = 0; i < 40; ++i) {
    const double loss = t->train_step().loss;
    if (i < 5) first += loss / 5;
    if (i >= 35) last += loss / 5;
  }
  EXPECT_LT(last, 0.8 * first) << GetParam() << ": loss " << first << " -> " << last;
  EXPECT_EQ(t->skipped_steps(), 0) << GetParam();
}

TEST_P(PrecisionConformance, NonFiniteGradientsSkipTheStepWithoutTouchingTheWeights) {
  for (const double bad : {std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
    Config c = config(std::isnan(bad) ? "nan" : "inf", GetParam());
    if (has_option(GetParam(), "init_scale")) c.set_assignment("precision.init_scale=1024");
    auto t = make(c);
    bool inject = false;
    t->set_gradient_hook([&](const std::vector<at::Tensor>& grads) {
      if (inject) {
        at::NoGradGuard g;
        grads.front().view(-1)[0].fill_(bad);
      }
    });
    t->train_step();
    const auto before = parameters(*t);
    const auto scale_before = scale_of(*t);
    inject = true;
    const StepResult skipped = t->train_step();
    inject = false;
    EXPECT_TRUE(skipped.skipped) << GetParam() << " with " << bad;
    EXPECT_EQ(t->skipped_steps(), 1);
    const auto after = parameters(*t);
    for (size_t i = 0; i < before.size(); ++i)
      EXPECT_TRUE(at::equal(before[i], after[i])) << GetParam() << ": parameter " << i << " changed in a skipped step";
    const auto scale_after = scale_of(*t);
    const bool dynamic = t->precision().manifest().at("loss_scale").rfind("dynamic", 0) == 0;
    if (dynamic) {
      EXPECT_DOUBLE_EQ(*scale_after, *scale_before * 0.5) << GetParam();
    } else if (scale_before) {
      EXPECT_DOUBLE_EQ(*scale_after, *scale_before) << GetParam();
    }
    // The schedule did not move: the next step uses the learning rate the skipped one would have.
    const StepResult next = t->train_step();
    EXPECT_FALSE(next.skipped);
    EXPECT_DOUBLE_EQ(next.lr, skipped.lr) << GetParam();
  }
}

TEST_P(PrecisionConformance, DynamicScaleGrowsAfterTheIntervalAndStaticScaleNeverMoves) {
  if (!has_option(GetParam(), "loss_scale")) GTEST_SKIP() << GetParam() << " has no loss scaler";
  Config dynamic = config("dynamic", GetParam());
  dynamic.set_assignment("precision.init_scale=256");
  dynamic.set_assignment("precision.growth_interval=3");
  auto d = make(dynamic);
  EXPECT_DOUBLE_EQ(*scale_of(*d), 256);
  for (int i = 0; i < 3; ++i) d->train_step();
  ASSERT_EQ(d->skipped_steps(), 0);
  EXPECT_DOUBLE_EQ(*scale_of(*d), 512);
  for (int i = 0; i < 3; ++i) d->train_step();
  EXPECT_DOUBLE_EQ(*scale_of(*d), 1024);

  Config fixed = config("static", GetParam());
  fixed.set_assignment("precision.loss_scale=512");
  fixed.set_assignment("precision.growth_interval=1");
  auto s = make(fixed);
  EXPECT_NE(s->precision().manifest().at("loss_scale").find("static 512"), std::string::npos);
  bool inject = false;
  s->set_gradient_hook([&](const std::vector<at::Tensor>& grads) {
    if (inject) grads.front().view(-1)[0].fill_(std::numeric_limits<double>::infinity());
  });
  for (int i = 0; i < 4; ++i) s->train_step();
  inject = true;
  EXPECT_TRUE(s->train_step().skipped);
  EXPECT_DOUBLE_EQ(*scale_of(*s), 512);
}

TEST_P(PrecisionConformance, StateRoundTripsThroughACheckpoint) {
  Config c = config("roundtrip", GetParam());
  if (has_option(GetParam(), "growth_interval")) {
    c.set_assignment("precision.init_scale=128");
    c.set_assignment("precision.growth_interval=2");
  }
  auto t = make(c);
  for (int i = 0; i < 5; ++i) t->train_step();
  const auto saved = t->save_checkpoint();
  const auto state = t->precision().state_dict();

  Config resumed = c;
  resumed.set_assignment("trainer.name=roundtrip_resumed");
  resumed.set_assignment("trainer.resume_from=" + saved.string());
  auto r = make(resumed);
  const auto restored = r->precision().state_dict();
  EXPECT_EQ(restored.text, state.text);
  ASSERT_EQ(restored.tensors.size(), state.tensors.size());
  for (const auto& [k, v] : state.tensors) EXPECT_TRUE(at::equal(v, restored.tensors.at(k))) << k;
  EXPECT_EQ(r->precision().manifest(), t->precision().manifest());
  // The two continue alike.
  EXPECT_DOUBLE_EQ(t->train_step().loss, r->train_step().loss);
}

TEST_P(PrecisionConformance, ResumingUnderAnotherPrecisionIsRefusedUnlessAllowed) {
  const std::string other = GetParam() == "fp32" ? "bf16_amp" : "fp32";
  if (!registry().find(LOOM_KIND_PRECISION, other)) GTEST_SKIP() << other << " is not loaded";
  auto t = make(config("first", GetParam()));
  t->train_step();
  const auto saved = t->save_checkpoint();
  Config next = config("second", other);
  next.set_assignment("trainer.resume_from=" + saved.string());
  try {
    make(next);
    FAIL() << "expected a refusal";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("the precision differs"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("allow_precision_change"), std::string::npos) << e.what();
  }
  next.set_assignment("precision.allow_precision_change=true");
  EXPECT_EQ(make(next)->step(), 1);
}

TEST_P(PrecisionConformance, TheScalerIsInvisibleWhenNothingOverflows) {
  // Four micro-batches of 8 under this precision against one batch of 32 in float32, plain SGD:
  // the same update within the rounding of the autocast dtype.
  Config reference = config("reference", "fp32");
  reference.set_assignment("trainer.optimizer=sgd");
  reference.set_assignment("trainer.lr=0.05");
  Config scaled = config("scaled", GetParam());
  scaled.set_assignment("trainer.optimizer=sgd");
  scaled.set_assignment("trainer.lr=0.05");
  scaled.set_assignment("trainer.gradient_accumulation_steps=4");
  if (has_option(GetParam(), "init_scale")) scaled.set_assignment("precision.init_scale=1024");
  auto a = make(reference);
  auto b = make(scaled);
  for (int i = 0; i < 2; ++i) {
    a->train_step();
    EXPECT_FALSE(b->train_step().skipped);
  }
  const std::string dtype = b->precision().manifest().at("autocast");
  const double tolerance = dtype == "float16" ? 5e-3 : dtype == "bfloat16" ? 3e-2 : 1e-5;
  const auto pa = parameters(*a), pb = parameters(*b);
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_TRUE(at::allclose(pa[i], pb[i], tolerance, tolerance))
        << GetParam() << " parameter " << i << ": max difference " << (pa[i] - pb[i]).abs().max().item<double>();
}

TEST_P(PrecisionConformance, ManifestSaysWhatItDoes) {
  auto t = make(config("manifest", GetParam()));
  const auto m = t->precision().manifest();
  for (const char* key : {"precision", "autocast", "tf32_matmul", "tf32_cudnn", "loss_scale"})
    EXPECT_TRUE(m.count(key)) << GetParam() << " manifest lacks " << key;
  EXPECT_EQ(m.at("precision"), GetParam());
}

TEST_P(PrecisionConformance, ForwardRunsInTheManifestsAutocastDtype) {
  auto precision = registry().create<loom::sdk::PrecisionStrategy>(GetParam());
  precision->setup(c10::Device(c10::kCPU));
  const std::string dtype = precision->manifest().at("autocast");
  const at::ScalarType expected = dtype == "float16" ? at::kHalf : dtype == "bfloat16" ? at::kBFloat16 : at::kFloat;
  const at::Tensor x = at::randn({4, 8}), w = at::randn({3, 8});
  at::Tensor inside;
  {
    auto guard = precision->forward_guard();
    inside = at::linear(x, w);
  }
  EXPECT_EQ(inside.scalar_type(), expected) << GetParam() << " (manifest autocast " << dtype << ")";
  EXPECT_EQ(at::linear(x, w).scalar_type(), at::kFloat) << GetParam() << ": autocast leaked out of the guard";
}

INSTANTIATE_TEST_SUITE_P(Plugins, PrecisionConformance, testing::ValuesIn(precision_plugins()),
                         [](const testing::TestParamInfo<std::string>& info) { return info.param; });

TEST(PrecisionPlugins, AllFourAreLoaded) {
  const auto names = precision_plugins();
  for (const char* expected : {"bf16_amp", "fp16_amp", "fp32", "tf32"})
    EXPECT_NE(std::find(names.begin(), names.end(), expected), names.end()) << expected;
}

}  // namespace
