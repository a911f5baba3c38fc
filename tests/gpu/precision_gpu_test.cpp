// Precision plugins on a CUDA device: autocast dtypes, TF32 switches, and a short training run
// per plugin. Label `gpu`; skipped where no CUDA device is visible.
#include <loom/core/config.hpp>
#include <loom/core/plugin_registry.hpp>
#include <loom/core/trainer.hpp>

#include "trainer_testing.hpp"

#include <ATen/Context.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <filesystem>

namespace fs = std::filesystem;
using namespace loom::core;

namespace {

using loom::testing::registry;

TEST(PrecisionGpu, AutocastDtypesOnCuda) {
  LOOM_REQUIRE_CUDA();
  const c10::Device cuda(c10::kCUDA, 0);
  const at::Tensor x = at::randn({64, 64}, at::TensorOptions().device(cuda));
  for (const auto& [name, dtype] : std::vector<std::pair<std::string, at::ScalarType>>{
           {"fp16_amp", at::kHalf}, {"bf16_amp", at::kBFloat16}, {"fp32", at::kFloat}, {"tf32", at::kFloat}}) {
    auto p = registry().create<loom::sdk::PrecisionStrategy>(name);
    try {
      p->setup(cuda);
    } catch (const loom::Error& e) {
      ASSERT_EQ(name, "bf16_amp") << e.what();  // an older GPU without bfloat16
      continue;
    }
    auto guard = p->forward_guard();
    EXPECT_EQ(at::linear(x, x).scalar_type(), dtype) << name;
  }
}

TEST(PrecisionGpu, Tf32SwitchesFollowThePlugin) {
  LOOM_REQUIRE_CUDA();
  const c10::Device cuda(c10::kCUDA, 0);
  registry().create<loom::sdk::PrecisionStrategy>("tf32")->setup(cuda);
  EXPECT_TRUE(at::globalContext().allowTF32CuBLAS());
  EXPECT_TRUE(at::globalContext().allowTF32CuDNN());
  registry().create<loom::sdk::PrecisionStrategy>("fp32")->setup(cuda);
  EXPECT_FALSE(at::globalContext().allowTF32CuBLAS());
  EXPECT_FALSE(at::globalContext().allowTF32CuDNN());
  registry().create<loom::sdk::PrecisionStrategy>("fp16_amp", {{"tf32", "true"}})->setup(cuda);
  EXPECT_TRUE(at::globalContext().allowTF32CuBLAS());
}

TEST(PrecisionGpu, EveryPrecisionTrainsOnCuda) {
  LOOM_REQUIRE_CUDA();
  const fs::path dir = fs::temp_directory_path() / ("loom_precision_gpu_" + std::to_string(::getpid()));
  for (const std::string name : {"fp32", "tf32", "fp16_amp", "bf16_amp"}) {
    Config c;
    for (const auto& kv : {"model.name=lightweight_transformer", "model.flavour=debug", "data.name=synthetic",
                           "data.train_size=2048", "trainer.batch_size=64", "trainer.max_steps=60",
                           "trainer.device=cuda", "trainer.lr=0.003"})
      c.set_assignment(kv);
    c.set_assignment("precision.name=" + name);
    c.set_assignment("trainer.work_dir=" + dir.string());
    c.set_assignment("trainer.name=" + name);
    std::unique_ptr<Trainer> t;
    try {
      t = loom::testing::make_trainer(c);
    } catch (const loom::Error& e) {
      ASSERT_EQ(name, "bf16_amp") << e.what();
      continue;
    }
    double first = 0, last = 0;
    for (int i = 0; i < 60; ++i) {
      const double loss = t->train_step().loss;
      if (i < 5) first += loss / 5;
      if (i >= 55) last += loss / 5;
    }
    EXPECT_LT(last, 0.8 * first) << name;
  }
  fs::remove_all(dir);
}

}  // namespace
