// Memory on CPU, for real, under Loom's budget allocator (--device-memory-limit): the cap holds,
// vram_tiers picks the seeds' batches, auto_batch finds the largest batch without leaving a
// trace, oom_recovery gives the run that never ran out of memory, and the estimator's
// prediction matches the measured peak.
#include <loom/core/checkpoint.hpp>
#include <loom/core/config.hpp>
#include <loom/core/log.hpp>
#include <loom/core/device_memory.hpp>
#include <loom/core/estimator.hpp>
#include <loom/core/files.hpp>
#include <loom/core/plugin_registry.hpp>
#include <loom/core/text.hpp>
#include <loom/core/trainer.hpp>

#include "trainer_testing.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include <cmath>
#include <cstdlib>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <functional>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

namespace fs = std::filesystem;
using namespace loom::core;

namespace {

using loom::testing::registry;

class MemoryTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = loom::testing::fresh_test_dir("loom_memory_test");
  }
  void TearDown() override {
    make_device_memory(c10::Device(c10::kCPU))->set_limit(0);  // the allocator is process-wide
    fs::remove_all(dir_);
  }

  /// Synthetic 1x28x28 images and a small transformer: activations dominate its memory.
  Config config(const std::string& name) const {
    Config c;
    for (const auto& kv : {"model.name=lightweight_transformer", "model.num_layers=2", "model.d_model=32",
                           "model.num_heads=2", "model.patch_size=4", "model.stem_channels=8", "model.dropout=0.0",
                           "data.name=synthetic", "data.image_size=28", "data.train_size=1024", "data.test_size=64",
                           "trainer.batch_size=64", "trainer.max_steps=6", "trainer.seed=3", "trainer.device=cpu",
                           "trainer.log_every=1000", "trainer.eval_every=1000", "precision.name=fp32",
                           "memory.estimate=false"})
      c.set_assignment(kv);
    c.set_assignment("trainer.work_dir=" + dir_.string());
    c.set_assignment("trainer.name=" + name);
    return c;
  }

  static std::unique_ptr<Trainer> make(const Config& c) { return loom::testing::make_trainer(c); }

  static std::vector<at::Tensor> parameters(Trainer& t) { return loom::testing::parameters_of(t); }

  /// Peaks of a probe at the full micro-batch and at half of it, unconstrained.
  std::pair<int64_t, int64_t> peaks(int64_t micro) {
    auto t = make(config("peaks"));
    return {t->probe_peak(micro), t->probe_peak(micro / 2)};
  }

  fs::path dir_;
};

TEST(MemorySuggest, TheLargestMicroBatchKeepsTheEvaluationsPeakUnderTheTargetToo) {
  // A recommender's evaluation ranks the whole catalogue and peaks above its step: `loom memory
  // suggest` gave the step's answer, whose evaluation its own table showed above the target, and
  // the run it suggested ran out of memory at its first evaluation.
  ModelStates states;
  states.parameters = 1000;
  ActivationFit fit;
  fit.fixed = 2000;
  fit.per_sample = 10;  // the step: 2000 + 10 b
  EXPECT_EQ(largest_micro_batch(states, fit, 3000), 100);
  fit.has_eval = true;
  fit.eval_fixed = 1500;
  fit.eval_per_sample = 30;  // the evaluation: 1500 + 30 b, above the step from b = 25
  const int64_t b = largest_micro_batch(states, fit, 3000);
  EXPECT_EQ(b, 50);
  EXPECT_LE(estimate(states, fit, b).peak(), 3000);
  EXPECT_GT(estimate(states, fit, b + 1).peak(), 3000);
  fit.eval_fixed = 3000;  // an evaluation of any batch is over it
  EXPECT_EQ(largest_micro_batch(states, fit, 3000), 0);
}

TEST(MemoryEstimate, TheTableOfLearningRatesComesOnTopOfTheProbedLine) {
  // The probes run before the first step makes the table: subtracted from their line, it took a
  // run of 100000 steps' activations to 0 B and its estimate 35 % under the measured peak.
  ModelStates states;
  states.parameters = 1000;
  ActivationFit fit;
  fit.fixed = 1200;  // the parameters and 200 B of workspace
  fit.per_sample = 10;
  const MemoryEstimate without = estimate(states, fit, 50);
  states.rate_table = 800;
  const MemoryEstimate with = estimate(states, fit, 50);
  EXPECT_EQ(with.activations, 500);
  EXPECT_EQ(with.workspace, 200);
  EXPECT_EQ(with.peak(), without.peak() + 800);
  EXPECT_EQ(largest_micro_batch(states, fit, 2500), 50);  // 800 + 1200 + 10 b <= 2500
}

TEST_F(MemoryTest, BudgetAllocatorCountsLimitsAndThrowsTheDevicesError) {
  auto memory = make_device_memory(c10::Device(c10::kCPU), 8 << 20);
  const int64_t before = memory->stats().allocated;
  at::Tensor a = at::empty({1 << 20}, at::TensorOptions().dtype(at::kFloat));  // 4 MiB
  EXPECT_EQ(memory->stats().allocated - before, 4 << 20);
  EXPECT_GE(memory->stats().peak, before + (4 << 20));
  EXPECT_EQ(memory->stats().limit, 8 << 20);
  EXPECT_EQ(memory->stats().total, 8 << 20);  // the CPU acts as a device of the budget's size
  try {
    at::Tensor b = at::empty({2 << 20}, at::TensorOptions().dtype(at::kFloat));  // 8 MiB more
    FAIL() << "the budget did not hold";
  } catch (const c10::OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("--device-memory-limit"), std::string::npos);
  }
  a = at::Tensor();
  EXPECT_EQ(memory->stats().allocated, before);
  {
    HostMemoryScope host;  // host memory is neither counted nor limited
    at::Tensor data = at::empty({4 << 20}, at::TensorOptions().dtype(at::kFloat));  // 16 MiB
    EXPECT_EQ(memory->stats().allocated, before);
  }
}

// Note [Host memory left]: without a cap, a block more than the host has left was lent by the
// kernel and the process killed by its OOM killer when the block was touched (probe: gpt2_lm over a
// vocabulary of 10M); now it is an out-of-memory, which oom_recovery and the run's advice answer.
TEST_F(MemoryTest, WithoutACapABlockMoreThanTheHostHasLeftIsAnOutOfMemoryNotTheKernelsKill) {
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") || std::getenv("MALLOC_TRIM_THRESHOLD_") || std::getenv("GLIBC_TUNABLES"))
    GTEST_SKIP() << "the process sets glibc's thresholds itself: Loom does not check its blocks against the host";
  auto memory = make_device_memory(c10::Device(c10::kCPU), 0);
  int64_t left = 0;
  {
    std::ifstream in("/proc/meminfo");
    std::string key, unit;
    int64_t kib = 0;
    while (in >> key >> kib >> unit)
      if (key == "MemAvailable:" || key == "SwapFree:") left += kib * 1024;
  }
  ASSERT_GT(left, 0);
  const int64_t before = memory->stats().allocated, ooms = memory->stats().ooms;
  try {  // (4 GiB over: the heap's freed bytes count as left too)
    at::Tensor huge = at::empty({left + (int64_t{4} << 30)}, at::TensorOptions().dtype(at::kByte));
    FAIL() << "a block of " << huge.numel() << " bytes was lent; the host has " << left << " left";
  } catch (const c10::OutOfMemoryError& e) {
    const std::string what = e.what_without_backtrace();
    EXPECT_NE(what.find("of the host's memory left"), std::string::npos) << what;
    EXPECT_NE(what.find("--device-memory-limit"), std::string::npos) << what;
  }
  EXPECT_EQ(memory->stats().allocated, before);  // nothing counted for the refused block, and one out-of-memory
  EXPECT_EQ(memory->stats().ooms, ooms + 1);
  at::Tensor fits = at::empty({int64_t{64} << 20}, at::TensorOptions().dtype(at::kByte));  // a mapped block that fits
  EXPECT_EQ(memory->stats().allocated - before, int64_t{64} << 20);
}

TEST_F(MemoryTest, ARunThatNeedsMoreThanTheCapFailsClearlyOrAdaptsButNeverExceedsIt) {
  const auto [full, half] = peaks(64);
  const int64_t cap = (full + half) / 2;
  Config failing = config("fails");
  failing.set_assignment("memory.device_memory_limit=" + std::to_string(cap));
  auto t = make(failing);
  try {
    t->step_with_recovery();
    FAIL() << "expected out of memory";
  } catch (const loom::Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("out of memory at micro-batch 64"), std::string::npos) << message;
    EXPECT_NE(message.find("What would help, in order:\n  1. a smaller batch"), std::string::npos) << message;
  }
  EXPECT_LE(t->memory().stats().peak, cap);

  Config adapting = config("adapts");
  adapting.set_assignment("memory.device_memory_limit=" + std::to_string(cap));
  adapting.set_assignment("memory.policies=oom_recovery");
  auto a = make(adapting);
  for (int i = 0; i < 3; ++i) a->step_with_recovery();
  EXPECT_EQ(a->plan().micro_batch, 32);
  EXPECT_EQ(a->plan().global(), 64);
  EXPECT_LE(a->memory().stats().peak, cap);
}

TEST_F(MemoryTest, FractionCapCapsAShareOfTheDevice) {
  Config c = config("fraction");
  c.set_assignment("memory.device_memory_limit=1GiB");
  c.set_assignment("memory.fraction=0.25");
  auto t = make(c);
  EXPECT_EQ(t->memory().stats().limit, 256 << 20);
}

/// A device whose memory is whatever the test says.
class FakeDevice final : public loom::sdk::DeviceMemory {
 public:
  explicit FakeDevice(int64_t total) : total_(total) {}
  c10::Device device() const override { return c10::Device(c10::kCUDA, 0); }
  loom::sdk::MemoryStats stats() const override {
    loom::sdk::MemoryStats s;
    s.total = s.free = total_;
    return s;
  }
  void reset_peak() override {}
  void set_limit(int64_t) override {}
  void empty_cache() override {}

 private:
  int64_t total_;
};

TEST_F(MemoryTest, VramTiersPicksTheSeedsBatchForEachTier) {
  auto tiers = registry().create<loom::sdk::MemoryPolicy>("vram_tiers");
  const std::vector<std::pair<int64_t, int64_t>> cases = {
      {24'000'000'000, 128}, {20'000'000'000, 128}, {16'000'000'000, 64}, {10'000'000'000, 64}, {8'000'000'000, 32}};
  for (const auto& [memory, batch] : cases) {
    FakeDevice device(memory);
    loom::sdk::PlanContext c;
    c.memory = &device;
    c.plan = {128, 1, 1};
    c.global_batch = 128;
    c.global_batch_given = false;
    tiers->plan(c);
    EXPECT_EQ(c.plan.micro_batch, batch) << memory;
    EXPECT_EQ(c.plan.global(), batch) << memory;
  }
  // A global batch the user gave holds; the accumulation follows.
  FakeDevice gpu(8'000'000'000);
  loom::sdk::PlanContext given;
  given.memory = &gpu;
  given.plan = {256, 1, 1};
  given.global_batch = 256;
  given.global_batch_given = true;
  tiers->plan(given);
  EXPECT_EQ(given.plan, (loom::sdk::BatchPlan{32, 8, 1}));
  // A batch it chooses is bounded by the samples a micro-batch may take (18 left its 128 no step
  // in an epoch, blamed on trainer.batch_size, which the user never gave); a given one is not its.
  FakeDevice large(24'000'000'000);
  loom::sdk::PlanContext few;
  few.memory = &large;
  few.plan = {128, 2, 1};
  few.global_batch = 256;
  few.max_micro_batch = 9;
  tiers->plan(few);
  EXPECT_EQ(few.plan, (loom::sdk::BatchPlan{9, 2, 1}));
  EXPECT_CONTAINS(tiers->describe(), "-> micro-batch 9 x accumulation 2 = 18 (its tier's 128, bounded by the training "
                                     "split's samples)");
  // The micro-batch `tiers` plan on a device of `bytes`, and the policy's line.
  const auto plan_on = [](const std::string& tiers, int64_t bytes) {
    auto policy = registry().create<loom::sdk::MemoryPolicy>("vram_tiers", {{"tiers", tiers}});
    FakeDevice device(bytes);
    loom::sdk::PlanContext c;
    c.memory = &device;
    c.plan = {128, 1, 1};
    policy->plan(c);
    return std::pair{c.plan.micro_batch, policy->describe()};
  };
  EXPECT_EQ(plan_on("40GB:256, 0:16", 80'000'000'000).first, 256);
  // One size twice: which batch a device of that size got depended on the order (taken in silence).
  try {
    registry().create<loom::sdk::MemoryPolicy>("vram_tiers", {{"tiers", "20GB:128, 20GB:64, 0:16"}});
    ADD_FAILURE() << "a size given twice was taken";
  } catch (const std::exception& e) {
    // (in the decimal GB the tiers are written in: it said "18.6 GiB" of a tier written 20GB)
    EXPECT_NE(std::string(e.what()).find("memory.tiers gives 20.0 GB twice (micro-batch "), std::string::npos) << e.what();
  }
  // A size without its unit was bytes ("30:128": every device's tier); a batch of 0 was "not MEMORY:BATCH".
  for (const auto& [tiers, says] : std::vector<std::pair<std::string, std::string>>{
           {"30:128, 0:8", "memory.tiers: '30:128' gives a size without its unit, which would be 30 bytes; write the "
                           "unit, e.g. 30GB:128 (0 alone needs none)"},
           {"1GB:0", "memory.tiers: '1GB:0' gives micro-batch 0; a micro-batch is at least 1"}}) {
    try {
      registry().create<loom::sdk::MemoryPolicy>("vram_tiers", {{"tiers", tiers}});
      ADD_FAILURE() << tiers << " was taken";
    } catch (const std::exception& e) {
      EXPECT_CONTAINS(std::string(e.what()), says);
    }
  }
  // In any order, the largest tier the device reaches (the key's text said "the first").
  const auto [batch, said] = plan_on("10GB:64, 20GB:128, 0:16", 24'000'000'000);
  EXPECT_EQ(batch, 128);
  EXPECT_CONTAINS(said, "vram_tiers: device memory 24.0 GB (tier 20.0 GB) -> ");
  // A device below every tier is none of them (the smallest tier's batch was taken in silence).
  auto only_large = registry().create<loom::sdk::MemoryPolicy>("vram_tiers", {{"tiers", "100GB:7"}});
  loom::sdk::PlanContext small;
  small.memory = &gpu;
  small.plan = {128, 1, 1};
  try {
    only_large->plan(small);
    ADD_FAILURE() << "a device below every tier got micro-batch " << small.plan.micro_batch;
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("the device's memory, 8.0 GB, reaches no tier of memory.tiers (the smallest needs "
                                         "100.0 GB); add a tier for it, e.g. 0:7"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(MemoryTest, AutoBatchFindsTheLargestBatchInAtMostSixProbesAndLeavesNoTrace) {
  const auto [full, half] = peaks(64);
  const int64_t cap = full + (full - half);  // room for about 96 samples
  Config c = config("auto");
  c.set_assignment("memory.device_memory_limit=" + std::to_string(cap));
  auto t = make(c);
  const auto params = parameters(*t);
  const auto optimizer_before = t->save_checkpoint();  // optimizer state and RNG, to compare with
  const at::Tensor rng = at::detail::getDefaultCPUGenerator().get_state();

  auto policy = registry().create<loom::sdk::MemoryPolicy>("auto_batch", {{"cache", "off"}});
  int probes = 0;
  loom::sdk::PlanContext context;
  context.memory = &t->memory();
  context.plan = t->plan();
  context.global_batch = 64;
  context.global_batch_given = false;
  context.max_micro_batch = 1024;
  context.probe = [&](int64_t b) {
    ++probes;
    return t->probe_peak(b);
  };
  policy->plan(context);
  const int64_t b = context.plan.micro_batch;
  EXPECT_LE(probes, 6);
  EXPECT_GT(b, 64);

  // The chosen batch runs under the budget; b x (1 + margin) does not.
  EXPECT_LE(t->probe_peak(b), cap);
  const int64_t bigger = static_cast<int64_t>(std::ceil(b * 1.05));
  try {
    EXPECT_GT(t->probe_peak(bigger), cap) << "micro-batch " << bigger << " fits too: auto_batch left room unused";
  } catch (const c10::OutOfMemoryError&) {
  }

  // No trace: weights, optimizer state and RNG are as before the search.
  const auto after = parameters(*t);
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(at::equal(params[i], after[i])) << "parameter " << i;
  for (const auto& p : t->model().module().parameters())
    EXPECT_TRUE(!p.grad().defined() || p.grad().abs().sum().item<double>() == 0);
  EXPECT_TRUE(at::equal(rng, at::detail::getDefaultCPUGenerator().get_state()));
  const auto now = t->save_checkpoint();
  EXPECT_EQ(CheckpointStore::load(optimizer_before).extra.size(), CheckpointStore::load(now).extra.size());
  for (const auto& [k, v] : CheckpointStore::load(optimizer_before).extra)
    if (k.rfind("optimizer.", 0) == 0) {
      EXPECT_TRUE(at::equal(v, CheckpointStore::load(now).extra.at(k))) << k;
    }
}

TEST_F(MemoryTest, AutoBatchCachesItsAnswer) {
  const auto [full, half] = peaks(64);
  Config c = config("cached");
  c.set_assignment("memory.device_memory_limit=" + std::to_string(full + (full - half)));
  c.set_assignment("memory.policies=auto_batch");
  c.set_assignment("memory.cache=" + (dir_ / "cache.tsv").string());
  auto first = make(c);
  EXPECT_GT(first->probes_run(), 0);
  c.set_assignment("trainer.name=cached_again");
  auto second = make(c);
  EXPECT_EQ(second->probes_run(), 0);
  EXPECT_EQ(second->plan(), first->plan());
  // The loader's settings move samples, not more of them: the answer stands (it searched again).
  c.set_assignment("trainer.name=more_workers");
  c.set_assignment("data.num_workers=1");
  c.set_assignment("data.pin_memory=false");
  EXPECT_EQ(make(c)->probes_run(), 0);
  c.set_assignment("trainer.name=other_model");  // (what sizes the model: searched again)
  c.set_assignment("model.d_model=48");
  EXPECT_GT(make(c)->probes_run(), 0);
}

TEST_F(MemoryTest, AutoBatchKeepsItsCacheUnderWhatItReadsAndItsNewAnswerInIt) {
  // The cache grew past the 16 MiB Loom reads: every later run warned of its own file and cached
  // nothing (probe). Writing an answer into a cache that would pass 8 MiB drops others.
  const fs::path cache = dir_ / "cache.tsv";
  {
    std::ofstream out(cache);
    for (int i = 0; i < 9000; ++i) out << "cpu|cap=1|other configuration " << i << "|" << std::string(1000, 'k') << "\t8\n";
  }
  ASSERT_GT(fs::file_size(cache), uintmax_t{8} << 20);
  const auto [full, half] = peaks(64);
  Config c = config("bounded");
  c.set_assignment("memory.device_memory_limit=" + std::to_string(full + (full - half)));
  c.set_assignment("memory.policies=auto_batch");
  c.set_assignment("memory.cache=" + cache.string());
  {
    loom::core::log::Capture capture(LOOM_LOG_INFO);
    EXPECT_GT(make(c)->probes_run(), 0);
    EXPECT_TRUE(capture.contains("would pass 8 MiB: ")) << "the dropping is said";
  }
  EXPECT_LE(fs::file_size(cache), uintmax_t{4} << 20);
  c.set_assignment("trainer.name=bounded_again");
  EXPECT_EQ(make(c)->probes_run(), 0) << "the new answer is kept";
  // One an older Loom grew past the 16 MiB it reads is set aside, said, and the cache starts again
  // (every run warned of it and cached nothing); a file over 16 MiB that is no cache stays as it is.
  {
    std::ofstream out(cache);
    for (int i = 0; i < 17000; ++i) out << "cpu|cap=1|other configuration " << i << "|" << std::string(1000, 'k') << "\t8\n";
  }
  ASSERT_GT(fs::file_size(cache), uintmax_t{16} << 20);
  c.set_assignment("trainer.name=grown");
  {
    loom::core::log::Capture capture(LOOM_LOG_WARN);
    EXPECT_GT(make(c)->probes_run(), 0);
    EXPECT_TRUE(capture.contains("had grown past the 16 MiB Loom reads")) << join(capture.lines(), "\n");
  }
  EXPECT_TRUE(fs::exists(cache.string() + ".too-large"));
  c.set_assignment("trainer.name=grown_again");
  EXPECT_EQ(make(c)->probes_run(), 0) << "the answer is cached again";
  const fs::path other = dir_ / "not_a_cache.txt";
  std::ofstream(other) << std::string((size_t{16} << 20) + 10, 'x');
  c.set_assignment("memory.cache=" + other.string());
  c.set_assignment("trainer.name=not_a_cache");
  make(c);
  EXPECT_EQ(fs::file_size(other), (uintmax_t{16} << 20) + 10);
}

// The search's edge cases, on peaks given as functions of the batch (the probes a device would
// measure); the search on real probes is the test above.
struct ProbedDevice {
  std::function<int64_t(int64_t)> peak;
  int64_t cap;
  int probes = 0;
  FakeDevice memory{cap};  // a device of `cap` bytes
  loom::sdk::PlanContext context(int64_t max_micro_batch) {
    loom::sdk::PlanContext c;
    c.memory = &memory;
    c.plan = loom::sdk::BatchPlan{32, 1, 1};
    c.global_batch = 32;
    c.global_batch_given = false;
    c.max_micro_batch = max_micro_batch;
    c.device_name = "fake";
    c.config_key = "fake";
    c.probe = [this](int64_t b) {
      ++probes;
      const int64_t p = peak(b);
      if (p > cap) throw c10::OutOfMemoryError({__func__, __FILE__, __LINE__}, "fake device out of memory");
      return p;
    };
    return c;
  }
};

TEST_F(MemoryTest, AutoBatchTriesMicroBatchOneBeforeGivingUp) {
  ProbedDevice device{[](int64_t b) { return int64_t{1000} * b; }, 1500};
  auto policy = registry().create<loom::sdk::MemoryPolicy>("auto_batch", {{"cache", "off"}});
  auto context = device.context(1024);
  policy->plan(context);
  EXPECT_EQ(context.plan.micro_batch, 1);
  EXPECT_EQ(device.probes, 2);  // 2 failed, 1 fits
}

TEST_F(MemoryTest, AutoBatchKeepsItsMarginBelowEightSamplesToo) {
  // Micro-batch 8 does not fit, so the search bisects between 2 and 8: it took the largest batch
  // under the cap itself (99.75 % of it) whatever memory.margin asked.
  const auto chosen = [](const std::string& margin) {
    ProbedDevice device{[](int64_t b) { return 1000 + 100 * b; }, 1650};  // 6 fits, 7 does not
    auto policy = registry().create<loom::sdk::MemoryPolicy>("auto_batch", {{"cache", "off"}, {"margin", margin}});
    auto context = device.context(64);
    policy->plan(context);
    return context.plan.micro_batch;
  };
  EXPECT_EQ(chosen("0.05"), 6);  // headroom 11 bytes: 1600 is under 1639
  EXPECT_EQ(chosen("0.5"), 5);   // headroom 112 bytes: 1600 is not under 1537
}

TEST_F(MemoryTest, AutoBatchBisectsWhereItsLineIsWrongAndDoesNotCacheAnUnsettledAnswer) {
  // Flat up to 100 samples, then steep: the probes at 2 and 8 see the flat part, so the line
  // aims far too high. The search must fall back to bisection, answer a batch that fits, and
  // not cache an answer it did not settle within its probes.
  ProbedDevice device{[](int64_t b) { return b <= 100 ? 1000 + b : 1000 * b; }, 60000};
  const fs::path cache = dir_ / "cache.tsv";
  auto policy = registry().create<loom::sdk::MemoryPolicy>("auto_batch", {{"cache", cache.string()}});
  auto context = device.context(4096);
  policy->plan(context);
  const int64_t b = context.plan.micro_batch;
  EXPECT_LE(device.probes, 6);
  EXPECT_LE(device.peak(b), device.cap);
  EXPECT_GE(b, 50) << "bisection should get within a factor of two of the largest batch that fits (100)";
  EXPECT_FALSE(fs::exists(cache)) << "an answer found before the search settled was cached";

  // Nearer the answer (the largest batch that fits is 100, the limit 128) it gets closer.
  ProbedDevice near{[](int64_t b) { return b <= 100 ? 1000 + b : 1000 * b; }, 60000};
  auto settled = registry().create<loom::sdk::MemoryPolicy>("auto_batch", {{"cache", cache.string()}});
  auto c2 = near.context(128);
  settled->plan(c2);
  EXPECT_LE(near.probes, 6);
  EXPECT_LE(near.peak(c2.plan.micro_batch), near.cap);
  EXPECT_GE(c2.plan.micro_batch, 80);
}

TEST_F(MemoryTest, AutoBatchLeavesACacheThatIsNoFileAsItIsAndSearches) {
  // A FIFO blocked set-up for ever (a plain ifstream), /dev/zero filled the memory, and writing
  // the answer renamed a regular file over the special one (as root: /dev/zero itself).
  const fs::path fifo = dir_ / "cache.fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  ProbedDevice device{[](int64_t b) { return int64_t{1000} * b; }, 100000};
  auto policy = registry().create<loom::sdk::MemoryPolicy>("auto_batch", {{"cache", fifo.string()}});
  auto context = device.context(64);
  const loom::core::log::Capture capture(LOOM_LOG_WARN);
  policy->plan(context);
  EXPECT_GE(context.plan.micro_batch, 32);
  EXPECT_TRUE(capture.contains("the answer cache " + fifo.string() + " is a FIFO, not a regular file: the search runs "
                               "without it and writes nothing there"))
      << ::testing::PrintToString(capture.lines());
  EXPECT_TRUE(fs::is_fifo(fifo)) << "the FIFO was replaced";
  // A user's file named as the cache (here a config file) was replaced by the cache, in silence.
  const fs::path mine = dir_ / "my.ini";
  const std::string text = "base = debug.ini\n\n[trainer]\nlr = 3e-4\n";
  std::ofstream(mine) << text;
  auto other = registry().create<loom::sdk::MemoryPolicy>("auto_batch", {{"cache", mine.string()}});
  auto context2 = device.context(64);
  other->plan(context2);
  EXPECT_EQ(loom::core::read_file(mine), text) << "a file that is no cache was replaced";
  EXPECT_TRUE(capture.contains(mine.string() + ":1 is no answer of the cache (a key, a tab, a micro-batch), nor is any "
                               "line of it: the file is not auto_batch's cache, and Loom does not replace it"))
      << ::testing::PrintToString(capture.lines());
  // A cache with a line cut short (a full disk under an older Loom) is still the cache: its
  // answers are read, and its next write leaves the cut line out.
  const fs::path cut = dir_ / "cut.tsv";
  std::ofstream(cut) << "other|cap=1\t7\r\nfake|cap=100000|marg";
  auto repaired = registry().create<loom::sdk::MemoryPolicy>("auto_batch", {{"cache", cut.string()}});
  auto context4 = device.context(64);
  repaired->plan(context4);
  EXPECT_CONTAINS(loom::core::read_file(cut), "other|cap=1\t7\n");
  std::istringstream lines(loom::core::read_file(cut));
  for (std::string line; std::getline(lines, line);) EXPECT_NE(line.find('\t'), std::string::npos) << line;
  // "OFF" is off, not a file of that name in the working folder.
  auto off = registry().create<loom::sdk::MemoryPolicy>("auto_batch", {{"cache", "OFF"}});
  auto context3 = device.context(64);
  off->plan(context3);
  EXPECT_FALSE(fs::exists("OFF"));
}

TEST_F(MemoryTest, AutoBatchLeavesItsCacheWholeWhereTheAnswerCannotBeWritten) {
  // (on a full disk the file was rewritten in place: every other entry was lost, without a word)
  const fs::path cache = dir_ / "cache.tsv";
  std::string entries;
  for (int i = 0; i < 200; ++i) entries.append("k").append(std::to_string(i)).append("|cap=1\t").append(std::to_string(i + 1)).append("\n");
  std::ofstream(cache) << entries;
  ProbedDevice device{[](int64_t b) { return int64_t{1000} * b; }, 100000};
  auto policy = registry().create<loom::sdk::MemoryPolicy>("auto_batch", {{"cache", cache.string()}});
  auto context = device.context(64);
  const loom::core::log::Capture capture(LOOM_LOG_WARN);
  {  // files of at most 1 KiB: the cache's new version (over 4 KiB) cannot be written, as on a full disk
    rlimit before{};
    ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &before), 0);
    const auto sigxfsz = std::signal(SIGXFSZ, SIG_IGN);
    rlimit small = before;
    small.rlim_cur = 1024;
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
    policy->plan(context);
    ::setrlimit(RLIMIT_FSIZE, &before);
    std::signal(SIGXFSZ, sigxfsz);
  }
  EXPECT_GE(context.plan.micro_batch, 32);
  EXPECT_EQ(loom::core::read_file(cache), entries) << "the cache changed";
  EXPECT_TRUE(capture.contains(": the answer is not cached")) << ::testing::PrintToString(capture.lines());
}

TEST_F(MemoryTest, AutoBatchKeepsItsCachedAnswerWhereAnotherPlanRanOutOfMemoryAndHalvesAnEvaluation) {
  // (vram_tiers after it planned a larger micro-batch, which ran out of memory: auto_batch said
  // "the cached micro-batch ran out of memory" and removed its good entry)
  const fs::path cache = dir_ / "cache.tsv";
  ProbedDevice device{[](int64_t b) { return int64_t{1000} * b; }, 100000};
  auto first = registry().create<loom::sdk::MemoryPolicy>("auto_batch", {{"cache", cache.string()}});
  auto context = device.context(64);
  first->plan(context);
  const std::string cached = loom::core::read_file(cache);
  auto again = registry().create<loom::sdk::MemoryPolicy>("auto_batch", {{"cache", cache.string()}});
  auto from_cache = device.context(64);
  again->plan(from_cache);
  loom::sdk::OomContext oom;
  oom.plan = from_cache.plan;
  oom.plan.micro_batch *= 2;  // another policy's plan
  EXPECT_FALSE(again->on_oom(oom));
  EXPECT_EQ(loom::core::read_file(cache), cached);
  // Evaluation: never searched, so halved until it fits (the run died at its first evaluation).
  loom::sdk::OomContext eval;
  eval.evaluation = true;
  eval.plan = loom::sdk::BatchPlan{256, 1, 1};
  EXPECT_TRUE(again->on_oom(eval));
  EXPECT_EQ(eval.plan.micro_batch, 128);
  eval.plan.micro_batch = 1;
  EXPECT_FALSE(again->on_oom(eval));
}

TEST_F(MemoryTest, OomRecoveryGivesTheRunThatNeverRanOutOfMemory) {
  // With SGD the update is linear in the gradient: the weights agree to float rounding. AdamW
  // divides by sqrt(v) + eps, which at the default eps (1e-8) turns rounding in near-zero
  // gradients (the two ways of summing the batch round differently) into updates of up to lr:
  // 6e-5 apart after 17 steps here, 1.1e-4 with oneDNN and ATen held to SSE4 kernels. At eps
  // 1e-3 Adam's update is linear in such gradients again (lr x g / eps) and the weights agree
  // to 4e-7 on both, so the test sets it and compares AdamW's weights at 1e-6. Past the first
  // epoch's end too: 1000 samples are 15 steps of 64 (40 left over), and the epoch of 32 x 2
  // ended after 31 micro-batches, so the recovered run's step 16 took the first epoch's last 32
  // and the second's first 32 (Note [An epoch of whole steps]).
  const auto [full, half] = peaks(64);
  constexpr int kSteps = 17;
  for (const std::string optimizer : {"sgd", "adamw"}) {
    Config tight = config("tight_" + optimizer), free = config("free_" + optimizer);
    for (Config* c : {&tight, &free})
      for (const std::string& kv : {"trainer.optimizer=" + optimizer, std::string("data.train_size=1000"),
                                   std::string("data.validation_fraction=0"), std::string("trainer.max_steps=17")})
        c->set_assignment(kv);
    if (optimizer == "adamw")
      for (Config* c : {&tight, &free}) c->set_assignment("optimizer.eps=1e-3");
    tight.set_assignment("memory.device_memory_limit=" + std::to_string((full + half) / 2));
    tight.set_assignment("memory.policies=oom_recovery");
    // One after the other: the CPU budget is process-wide, the newest run's.
    std::vector<double> tight_losses, free_losses;
    auto a = make(tight);
    for (int i = 0; i < kSteps; ++i) tight_losses.push_back(a->step_with_recovery().loss);
    EXPECT_EQ(a->oom_recoveries(), 1);
    EXPECT_EQ(a->plan(), (loom::sdk::BatchPlan{32, 2, 1}));
    const auto pa = parameters(*a);
    auto b = make(free);
    for (int i = 0; i < kSteps; ++i) free_losses.push_back(b->step_with_recovery().loss);
    EXPECT_EQ(b->plan(), (loom::sdk::BatchPlan{64, 1, 1}));
    for (int i = 0; i < kSteps; ++i)
      EXPECT_LE(std::abs(tight_losses[i] - free_losses[i]), 1e-5 * std::abs(free_losses[i]))
          << optimizer << " step " << i + 1;
    const auto pb = parameters(*b);
    const double atol = optimizer == "sgd" ? 1e-7 : 1e-6;
    for (size_t i = 0; i < pa.size(); ++i)
      EXPECT_TRUE(at::allclose(pa[i], pb[i], 1e-5, atol))
          << optimizer << " parameter " << i << ": max difference " << (pa[i] - pb[i]).abs().max().item<double>();
  }
}

TEST_F(MemoryTest, AResumeStartsAtTheMicroBatchItsRunRecoveredTo) {
  // The run ran out of memory at micro-batch 64 and went on at 32 x 2. Resumed on the same device
  // and cap it starts there (each resume met the same out-of-memory: replayed with oom_recovery,
  // fatal without it); under another cap it plans afresh.
  const auto [full, half] = peaks(64);
  const std::string tight = "memory.device_memory_limit=" + std::to_string((full + half) / 2);
  const auto run = [&](const std::string& limit, const std::string& policies) {
    Config c = config("resume_oom");
    c.set_assignment(limit);
    c.set_assignment("memory.policies=" + policies);
    c.set_assignment("trainer.resume=auto");
    return c;
  };
  {
    auto t = make(run(tight, "oom_recovery"));
    for (int i = 0; i < 3; ++i) t->step_with_recovery();
    ASSERT_EQ(t->oom_recoveries(), 1);
    ASSERT_EQ(t->plan(), (loom::sdk::BatchPlan{32, 2, 1}));
    t->save_checkpoint();
  }
  {
    loom::core::log::Capture log(LOOM_LOG_INFO);
    auto resumed = make(run(tight, ""));  // (no oom_recovery: the plan must fit from the start)
    ASSERT_EQ(resumed->step(), 3);
    EXPECT_EQ(resumed->plan(), (loom::sdk::BatchPlan{32, 2, 1})) << join(log.lines(), "\n");
    EXPECT_TRUE(log.contains("-> micro-batch 32 x accumulation 2 = 64: the run ran out of memory at a larger "
                             "micro-batch on this device and configuration before, and went on at this one"))
        << join(log.lines(), "\n");
    resumed->step_with_recovery();
    EXPECT_EQ(resumed->oom_recoveries(), 0);
    resumed->save_checkpoint();  // (the record stays: a resume of this resume starts there too)
  }
  {
    auto again = make(run(tight, ""));
    EXPECT_EQ(again->plan(), (loom::sdk::BatchPlan{32, 2, 1}));
  }
  {  // (the settings that only choose the precision, at the same one, fp32: it planned afresh and ran out of memory)
    Config same_precision = run(tight, "");
    same_precision.set_assignment("precision.amp=false");
    same_precision.set_assignment("precision.allow_precision_change=true");
    EXPECT_EQ(make(same_precision)->plan(), (loom::sdk::BatchPlan{32, 2, 1}));
  }
  auto elsewhere = make(run("memory.device_memory_limit=" + std::to_string(4 * full), ""));
  EXPECT_EQ(elsewhere->plan(), (loom::sdk::BatchPlan{64, 1, 1})) << "another cap: its own plan";
}

TEST_F(MemoryTest, AProbeOutsideTheMicroBatchesIsRefusedWithAnError) {
  // (a policy's probe at -5 ended as "cannot create std::vector larger than max_size()", at 2^40
  // as std::bad_alloc: neither the out-of-memory that a search catches, and the command went down)
  auto t = make(config("probe_range"));
  for (const int64_t b : {int64_t{-5}, int64_t{0}, int64_t{1} << 40}) {
    try {
      t->probe_peak(b);
      ADD_FAILURE() << "a probe at " << b << " ran";
    } catch (const loom::Error& e) {
      EXPECT_NE(std::string(e.what()).find("a memory probe at micro-batch " + std::to_string(b) + " is refused"),
                std::string::npos) << e.what();
    }
  }
  EXPECT_GT(t->probe_peak(2), 0);
}

TEST_F(MemoryTest, APolicyCountsStepsAsTheLogsDo) {
  // OomContext.step is the step the logs name: the run's first step is "step 1" for the host and
  // for every policy (record_oom logs the context as it gets it).
  const auto [full, half] = peaks(64);
  Config c = config("count");
  c.set_assignment("memory.device_memory_limit=" + std::to_string((full + half) / 2));
  c.set_assignment("memory.policies=record_oom");
  auto t = make(c);
  loom::core::log::Capture log(LOOM_LOG_INFO);
  t->step_with_recovery();
  EXPECT_TRUE(log.contains("[record_oom] record_oom: step 1, micro-batch 64")) << join(log.lines(), "\n");
  EXPECT_TRUE(log.contains("after running out of memory at step 1")) << join(log.lines(), "\n");
}

TEST_F(MemoryTest, ThePlansKeyNamesReplicasThatShareTheDevice) {
  // auto_batch caches its answer under this key: two replicas on one device (data_parallel over
  // cpu,cpu) each hold their part's activations, so a single device's answer ran out of memory at
  // step 1 there. One replica per device keeps the key it had.
  for (const std::string devices : {"cpu,cpu", ""}) {
    Config c = config("key_" + std::to_string(devices.size()));
    c.set_assignment("memory.policies=record_oom");
    if (!devices.empty()) {
      c.set_assignment("parallel.name=data_parallel");
      c.set_assignment("parallel.devices=" + devices);
    }
    loom::core::log::Capture log(LOOM_LOG_INFO);
    auto t = make(c);
    EXPECT_TRUE(log.contains("record_oom: config key model.")) << join(log.lines(), "\n");
    EXPECT_EQ(log.contains("replicas_on_device=2;"), !devices.empty()) << join(log.lines(), "\n");
  }
}

TEST_F(MemoryTest, APolicyThatAnswersAnOutOfMemoryWithNoSmallerPlanIsOneErrorNotAReplayForEver) {
  const auto [full, half] = peaks(64);
  Config c = config("same_plan");
  c.set_assignment("memory.device_memory_limit=" + std::to_string((full + half) / 2));
  c.set_assignment("memory.policies=record_oom");
  c.set_assignment("memory.record_oom.same_plan=true");
  auto t = make(c);
  try {
    t->step_with_recovery();
    FAIL() << "a replay with the plan that ran out of memory must be refused";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("memory policy 'record_oom' answered an out-of-memory at step 1 with the plan "
                                         "micro-batch 64 x accumulation 1 = 64 (it was micro-batch 64 x accumulation 1 = 64)"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("a replay needs a smaller micro-batch"), std::string::npos) << e.what();
  }
}

TEST_F(MemoryTest, APolicysImpossiblePlanIsNamedWithThePolicyAndWhatIsWrong) {
  // (it said "memory policy '<its describe()>' made an invalid plan", and a changed global batch
  // named no policy)
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"-3", "memory policy 'record_oom' made an impossible plan, micro-batch -3 x accumulation 1 x world size 1: the "
             "micro-batch and the accumulation are at least 1"},
      {"16", "memory policy 'record_oom' changed the global batch from 64 to 16 (micro-batch 16 x accumulation 1 = 16); "
             "a policy may only re-split a batch the user chose"}};
  for (const auto& [micro_batch, said] : cases) {
    Config c = config("plan_" + micro_batch);
    c.set_assignment("memory.policies=record_oom");
    c.set_assignment("memory.record_oom.plan_micro_batch=" + micro_batch);
    try {
      make(c);
      ADD_FAILURE() << "the plan of micro-batch " << micro_batch << " was taken";
    } catch (const loom::Error& e) {
      EXPECT_NE(std::string(e.what()).find(said), std::string::npos) << e.what();
    }
  }
}

TEST_F(MemoryTest, EvaluationThatRunsOutOfMemoryIsReplannedLikeAStepOrSaysItWasEvaluation) {
  // Evaluation at micro-batch 64 needs more than the cap set below; at 32 it fits. With
  // oom_recovery it evaluates in smaller micro-batches and gives the same figures; without a
  // policy the error says that evaluation ran out of memory, and at which micro-batch.
  for (const bool recover : {true, false}) {
    Config c = config(recover ? "eval_recover" : "eval_plain");
    c.set_assignment("memory.policies=" + std::string(recover ? "oom_recovery" : ""));
    auto t = make(c);
    t->memory().reset_peak();
    const int64_t base = t->memory().stats().allocated;
    const EvalResult free = t->evaluate();
    const int64_t peak = t->memory().stats().peak;
    ASSERT_EQ(free.samples, 64);
    t->memory().set_limit(base + (peak - base) * 6 / 10);
    if (recover) {
      const EvalResult capped = t->evaluate();
      EXPECT_EQ(capped.samples, 64);
      EXPECT_NEAR(capped.loss, free.loss, 1e-5 * std::abs(free.loss));
      EXPECT_EQ(capped.metrics, free.metrics);
    } else {
      try {
        t->evaluate();
        FAIL() << "evaluation above the cap did not fail";
      } catch (const loom::Error& e) {
        EXPECT_NE(std::string(e.what()).find("evaluation ran out of memory at micro-batch 64"), std::string::npos)
            << e.what();
      }
    }
    t->memory().set_limit(0);
  }
  // An evaluation's micro-batch has no global batch to divide: halved (97 -> 48, not to 1, the
  // largest divisor of 97 under half, for the rest of the run), and said without the training's
  // advice about uneven splits.
  auto policy = registry().create<loom::sdk::MemoryPolicy>("oom_recovery", {});
  loom::sdk::OomContext eval;
  eval.evaluation = true;
  eval.plan = loom::sdk::BatchPlan{97, 1, 1};
  loom::core::log::Capture log(LOOM_LOG_INFO);
  ASSERT_TRUE(policy->on_oom(eval));
  EXPECT_EQ(eval.plan, (loom::sdk::BatchPlan{48, 1, 1}));
  EXPECT_FALSE(log.contains("splits evenly only")) << join(log.lines(), "\n");
}

TEST_F(MemoryTest, AModelThatCannotEvenBeBuiltIsOneClearError) {
  Config c = config("too_small");
  c.set_assignment("memory.device_memory_limit=16KiB");
  try {
    make(c);
    FAIL();
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("out of memory while building the model"), std::string::npos) << e.what();
  }
}

TEST_F(MemoryTest, AtMicroBatchOneTheErrorSaysWhatWouldHelp) {
  int64_t states = 0, one = 0;
  {
    auto probe = make(config("probe"));
    states = probe->model_states().total();
    one = probe->probe_peak(1);
  }
  Config c = config("hopeless");
  c.set_assignment("memory.device_memory_limit=" + std::to_string(states + (one - states) / 2));
  c.set_assignment("memory.policies=oom_recovery");
  const auto failure = [](Trainer& run) -> std::string {
    try {
      run.step_with_recovery();
    } catch (const loom::Error& e) {
      return e.what();
    }
    return "(no error)";
  };
  auto t = make(c);
  {
    const std::string m = failure(*t);
    EXPECT_NE(m.find("out of memory at micro-batch 1 "), std::string::npos) << m;
    // (no "a smaller batch": at micro-batch 1 it means fewer micro-batches of 1; on the CPU no fp16_amp)
    for (const char* advice : {"1. gradient accumulation", "2. mixed precision: precision.name = bf16_amp (not --no-amp; "
                               "fp16_amp has no fast path on most CPUs)", "3. the memory cap: this run may use",
                               "4. a smaller input", "The estimator: the model states alone need"})
      EXPECT_NE(m.find(advice), std::string::npos) << advice << " missing from: " << m;
    EXPECT_EQ(m.find("a smaller batch"), std::string::npos) << m;
    // (the table of learning rates, one per step, on the device: in "model states" unnamed, where a run
    // of 100000 steps under a small cap needed 781 KiB of it and no advice named it)
    EXPECT_CONTAINS(m, "optimizer " + format_bytes(t->model_states().optimizer_states) + ", the learning rates, one per "
                       "step of the run, " + format_bytes(t->model_states().rate_table) + " (trainer.device_step = false "
                       "keeps them on the host)) of the ");
    EXPECT_NE(m.find("oom_recovery re-planned to micro-batch 1 x accumulation 64 and stopped there (micro-batch 1 is "
                     "the smallest)"), std::string::npos) << m;
  }
  // At micro-batch 1 from the start it re-planned nothing, and says so (it claimed a re-plan).
  c.set_assignment("trainer.batch_size=1");
  c.set_assignment("trainer.name=hopeless_from_the_start");
  t.reset();  // (the budget is the process's: the first run's model and optimizer go first)
  const std::string m = failure(*make(c));
  EXPECT_NE(m.find("1. gradient accumulation: oom_recovery is on and made no smaller plan (micro-batch 1 is the "
                   "smallest)"), std::string::npos) << m;
}

TEST_F(MemoryTest, ReluKeepsFewerActivationsForBackwardThanGelu) {
  // model.activation = relu: ReLU's backward reads its output, which the next layer keeps anyway,
  // where GELU's reads its input, kept for it alone: the stem's and each MLP's pre-activations
  // are not kept. The peak comes during backward, when some of them are already freed; the
  // stem's (64 x 784 x 8 floats, 1.6 MB) are kept until the very end. Same parameters.
  auto peak = [&](const char* activation) {
    Config c = config(std::string("activation_") + activation);
    c.set_assignment(std::string("model.activation=") + activation);
    auto t = make(c);
    const int64_t bytes = t->probe_peak(64);
    int64_t count = 0;
    for (const auto& p : parameters(*t)) count += p.numel();
    return std::make_pair(bytes, count);
  };
  const auto gelu = peak("gelu"), relu = peak("relu");
  EXPECT_EQ(relu.second, gelu.second);
  const int64_t stem = int64_t{64} * 784 * 8 * 4;
  EXPECT_LE(relu.first, gelu.first - stem) << "gelu " << gelu.first << ", relu " << relu.first << " bytes";
}

TEST_F(MemoryTest, EstimatorPredictsThePeakOfTwoDifferentModels) {
  for (const std::string model : {"lightweight_transformer", "mlp_classifier"}) {
    Config c = config("estimate_" + model);
    c.set_assignment("model.name=" + model);
    if (model == "mlp_classifier") {
      c = Config();
      for (const auto& kv : {"model.name=mlp_classifier", "model.hidden=512", "model.layers=3",
                             "data.name=synthetic", "data.image_size=28", "data.train_size=1024", "data.test_size=64",
                             "trainer.batch_size=128", "trainer.max_steps=6", "trainer.device=cpu",
                             "precision.name=fp32", "trainer.eval_every=1000"})
        c.set_assignment(kv);
      c.set_assignment("trainer.work_dir=" + dir_.string());
      c.set_assignment("trainer.name=estimate_mlp");
    }
    c.set_assignment("memory.estimate=true");
    auto t = make(c);
    const int64_t predicted = t->predicted_peak();
    ASSERT_GT(predicted, 0) << model;
    t->memory().reset_peak();
    for (int i = 0; i < 3; ++i) t->train_step();
    const int64_t measured = t->memory().stats().peak;
    const double error = std::abs(static_cast<double>(predicted - measured)) / static_cast<double>(measured);
    EXPECT_LE(error, 0.10) << model << ": predicted " << predicted << ", measured " << measured;
    std::printf("[ estimate ] %s: predicted %lld, measured %lld bytes, error %+.2f %%\n", model.c_str(),
                static_cast<long long>(predicted), static_cast<long long>(measured),
                100.0 * static_cast<double>(predicted - measured) / static_cast<double>(measured));
  }
}

}  // namespace

TEST(CgroupMemory, AContainersLimitIsTheMemoryItHasInV2AndV1) {
  // The memory Loom plans a CPU run with (auto_batch's cap without a budget, the start-up report)
  // is a container's limit where one is set, not the host's: read from a fake /proc and /sys.
  const auto root = std::filesystem::temp_directory_path() / ("loom_cgroup_" + std::to_string(::getpid()));
  std::filesystem::remove_all(root);
  const auto write = [&](const std::string& file, const std::string& text) {
    std::filesystem::create_directories((root / file).parent_path());
    std::ofstream(root / file) << text;
  };
  EXPECT_EQ(loom::core::cgroup_memory(root).limit, -1) << "no cgroup files: no limit";
  write("proc/self/cgroup", "0::/job.slice/run\n");
  write("sys/fs/cgroup/memory.max", "max\n");  // the root group: none
  write("sys/fs/cgroup/job.slice/run/memory.max", "8589934592\n");
  write("sys/fs/cgroup/job.slice/run/memory.current", "1073741824\n");
  auto m = loom::core::cgroup_memory(root);
  EXPECT_EQ(m.limit, int64_t{8} << 30);
  EXPECT_EQ(m.usage, int64_t{1} << 30);
  // A smaller limit on a parent (the job's, over its step's) holds; reclaimable page cache is not used.
  write("sys/fs/cgroup/job.slice/memory.max", "4294967296\n");
  write("sys/fs/cgroup/job.slice/run/memory.stat", "anon 1000\ninactive_file 268435456\n");
  m = loom::core::cgroup_memory(root);
  EXPECT_EQ(m.limit, int64_t{4} << 30);
  EXPECT_EQ(m.usage, (int64_t{1} << 30) - (int64_t{256} << 20));
  std::filesystem::remove(root / "sys/fs/cgroup/job.slice/memory.max");
  write("sys/fs/cgroup/job.slice/run/memory.max", "max\n");
  EXPECT_EQ(loom::core::cgroup_memory(root).limit, -1) << "v2's max: no limit";
  std::filesystem::remove_all(root / "sys");
  write("sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");  // v1's "no limit"
  EXPECT_EQ(loom::core::cgroup_memory(root).limit, -1);
  write("sys/fs/cgroup/memory/memory.limit_in_bytes", "4294967296\n");
  write("sys/fs/cgroup/memory/memory.usage_in_bytes", "100\n");
  m = loom::core::cgroup_memory(root);
  EXPECT_EQ(m.limit, int64_t{4} << 30);
  EXPECT_EQ(m.usage, 100);
  std::filesystem::remove_all(root);
}

TEST_F(MemoryTest, AResumeKeepsTheGlobalBatchAPolicyChoseOnAnotherDevice) {
  // No batch given: vram_tiers chooses it from the device's memory (the budget here). Resumed
  // where it chooses less, the run keeps its global batch (and so its schedule and epochs), at the
  // micro-batch that fits here; a batch given for the resume is the user's.
  const auto run = [&](const std::string& limit, const std::string& batch) {
    Config c;
    for (const auto& kv : {"model.name=lightweight_transformer", "model.num_layers=1", "model.d_model=32",
                           "model.num_heads=2", "model.patch_size=4", "model.stem_channels=8", "data.name=synthetic",
                           "data.image_size=28", "data.train_size=1024", "data.test_size=64", "trainer.epochs=1",
                           "trainer.seed=3", "trainer.device=cpu", "precision.name=fp32", "memory.estimate=false",
                           "memory.policies=vram_tiers", "memory.tiers=1GB:64, 0:16", "trainer.callbacks=checkpoint",
                           "trainer.checkpoint_every=4", "trainer.resume=auto", "trainer.name=tiers"})
      c.set_assignment(kv);
    c.set_assignment("trainer.work_dir=" + dir_.string());
    c.set_assignment("memory.device_memory_limit=" + limit);
    if (!batch.empty()) c.set_assignment("trainer.batch_size=" + batch);
    return c;
  };
  {
    Config first = run("2GB", "");
    first.set_assignment("trainer.max_steps=4");
    auto t = make(first);
    EXPECT_EQ(t->plan(), (loom::sdk::BatchPlan{64, 1, 1}));
    t->train();
  }
  {
    loom::core::log::Capture log(LOOM_LOG_INFO);
    auto resumed = make(run("512MB", ""));
    ASSERT_EQ(resumed->step(), 4);
    EXPECT_EQ(resumed->plan(), (loom::sdk::BatchPlan{16, 4, 1})) << join(log.lines(), "\n");
    EXPECT_TRUE(log.contains("-> micro-batch 16 x accumulation 4 = 64: the checkpoint's global batch")) << join(log.lines(), "\n");
    EXPECT_EQ(resumed->total_steps(), 1024 * 9 / 10 / 64) << "one epoch of the global batch 64, as the run began";
  }
  {  // an accumulation given for the resume that its kept batch does not take is said (it went unsaid)
    Config accumulated = run("512MB", "");
    accumulated.set_assignment("trainer.gradient_accumulation_steps=2");
    loom::core::log::Capture log(LOOM_LOG_WARN);
    EXPECT_EQ(make(accumulated)->plan(), (loom::sdk::BatchPlan{16, 4, 1}));
    EXPECT_TRUE(log.contains("gradient_accumulation_steps = 2 (--set) is not this resume's: it trains the run's global "
                             "batch 64 as micro-batch 16 x accumulation 4")) << join(log.lines(), "\n");
  }
  auto given = make(run("512MB", "32"));  // (the run folder's lock went with the trainer above)
  EXPECT_EQ(given->plan().global(), 32);
  given.reset();
  // The data shrank below the checkpoint's global batch since: no step fits in an epoch. One error
  // (the resume planned 0 steps, "nothing to train", or its loader failed at the first batch).
  Config shrunk = run("512MB", "");
  shrunk.set_assignment("data.train_size=64");
  try {
    make(shrunk);
    FAIL() << "a resume whose global batch no epoch holds went on";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("the global batch, 64 (the checkpoint's, which a resume that gives none keeps), is more than the "), std::string::npos) << e.what();
  }
}
