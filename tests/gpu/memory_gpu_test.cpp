// Memory on a CUDA device: the cap through the caching allocator, real out-of-memory recovery,
// and a memory snapshot file. Label `gpu`; skipped where no CUDA device is visible.
#include <loom/core/config.hpp>
#include <loom/core/device_memory.hpp>
#include <loom/core/plugin_registry.hpp>
#include <loom/core/trainer.hpp>

#include "trainer_testing.hpp"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <filesystem>
#include <fstream>

namespace fs = std::filesystem;
using namespace loom::core;

namespace {

using loom::testing::registry;

TEST(MemoryGpu, TheCapHoldsThroughTheCachingAllocator) {
  LOOM_REQUIRE_CUDA();
  const c10::Device cuda(c10::kCUDA, 0);
  auto memory = make_device_memory(cuda);
  memory->empty_cache();
  memory->set_limit(512LL << 20);
  EXPECT_GT(memory->stats().limit, 0);
  EXPECT_THROW(at::empty({1LL << 30}, at::TensorOptions().device(cuda).dtype(at::kByte)), c10::OutOfMemoryError);
  at::Tensor small = at::empty({64LL << 20}, at::TensorOptions().device(cuda).dtype(at::kByte));
  EXPECT_GE(memory->stats().allocated, 64LL << 20);
  small = at::Tensor();
  memory->set_limit(0);
  memory->empty_cache();
}

TEST(MemoryGpu, OutOfMemoryIsRecoveredOnTheDevice) {
  LOOM_REQUIRE_CUDA();
  const fs::path dir = fs::temp_directory_path() / ("loom_memory_gpu_" + std::to_string(::getpid()));
  Config c;
  for (const auto& kv : {"model.name=lightweight_transformer", "model.num_layers=4", "model.d_model=256",
                         "model.num_heads=8", "model.patch_size=4", "model.image_size=112", "data.name=synthetic",
                         "data.image_size=28", "data.train_size=2048", "trainer.batch_size=256", "trainer.max_steps=3",
                         "trainer.device=cuda", "precision.name=fp32", "memory.policies=oom_recovery",
                         "memory.estimate=false"})
    c.set_assignment(kv);
  c.set_assignment("trainer.work_dir=" + dir.string());
  c.set_assignment("trainer.name=oom_probe");
  int64_t full = 0, half = 0;
  {
    Trainer probe(resolve_run(c, registry()), registry());
    probe.setup();
    full = probe.probe_peak(256);
    half = probe.probe_peak(128);
  }
  c.set_assignment("memory.device_memory_limit=" + std::to_string((full + half) / 2));
  c.set_assignment("trainer.name=oom");  // a run folder of its own: the probe's is taken
  Trainer t(resolve_run(c, registry()), registry());
  t.setup();
  for (int i = 0; i < 3; ++i) t.step_with_recovery();
  EXPECT_GE(t.oom_recoveries(), 1);
  EXPECT_EQ(t.plan().global(), 256);
  EXPECT_LE(t.plan().micro_batch, 128);
  t.memory().set_limit(0);
  fs::remove_all(dir);
}

TEST(MemoryGpu, SnapshotFileIsWritten) {
  LOOM_REQUIRE_CUDA();
  const c10::Device cuda(c10::kCUDA, 0);
  start_memory_history(cuda);
  at::Tensor t = at::empty({16LL << 20}, at::TensorOptions().device(cuda));
  const fs::path path = fs::temp_directory_path() / ("loom_snapshot_" + std::to_string(::getpid()) + ".pickle");
  write_memory_snapshot(cuda, path);
  ASSERT_TRUE(fs::exists(path));
  EXPECT_GT(fs::file_size(path), 100u);
  std::ifstream in(path, std::ios::binary);
  EXPECT_EQ(in.get(), 0x80);  // a pickle
  fs::remove(path);
}

TEST(MemoryGpu, SnapshotOnCpuIsAClearError) {
  EXPECT_THROW(write_memory_snapshot(c10::Device(c10::kCPU), "/tmp/x.pickle"), loom::Error);
}

}  // namespace
