// How often a training step makes the host wait for the device (Note [The step on the device]),
// counted with CUDA's sync debug mode: every synchronising call LibTorch makes on the main thread
// (an .item(), a copy to the host, a stream synchronisation) raises a warning, which a handler
// counts. Label `gpu`; skipped where no CUDA device is visible.
#include <loom/core/config.hpp>
#include <loom/core/trainer.hpp>

#include "trainer_testing.hpp"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#if LOOM_TORCH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <cmath>
#include <filesystem>
#include <iostream>
#include <string>
#include <unistd.h>

namespace fs = std::filesystem;
using namespace loom::core;

namespace {

#if LOOM_TORCH_CUDA
class WaitCounter final : public c10::WarningHandler {
 public:
  void process(const c10::Warning& warning) override {
    if (warning.msg().find("synchroniz") != std::string::npos) ++waits;
  }
  int64_t waits = 0;
};

std::unique_ptr<Trainer> cuda_trainer(const std::string& precision, bool device_step, const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("loom_step_gpu_" + std::to_string(::getpid()));
  Config c;
  for (const auto& kv : {"model.name=lightweight_transformer", "model.flavour=debug", "data.name=synthetic",
                         "data.train_size=2048", "trainer.batch_size=64", "trainer.device=cuda", "trainer.max_steps=100"})
    c.set_assignment(kv);
  c.set_assignment("precision.name=" + precision);
  c.set_assignment(std::string("trainer.device_step=") + (device_step ? "true" : "false"));
  c.set_assignment("trainer.work_dir=" + dir.string());
  c.set_assignment("trainer.name=" + name);
  return loom::testing::make_trainer(c);
}

/// The host's waits for the device in `steps` training steps (values read) after 3 warm-up steps.
int64_t waits_in(const std::string& precision, bool device_step, int steps) {
  auto t = cuda_trainer(precision, device_step, precision + (device_step ? "_device" : "_host"));
  for (int i = 0; i < 3; ++i) t->train_step();
  WaitCounter counter;
  {
    c10::WarningUtils::WarningHandlerGuard guard(&counter);
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
    try {
      for (int i = 0; i < steps; ++i) t->train_step();
    } catch (...) {
      c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
      throw;
    }
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  }
  return counter.waits;
}

#endif

TEST(StepGpu, TheStepOnTheDeviceWaitsOncePerStepTheHostPathMore) {
  LOOM_REQUIRE_CUDA();
#if LOOM_TORCH_CUDA
  constexpr int kSteps = 8;
  for (const std::string precision : {"fp32", "bf16_amp", "fp16_amp"}) {
    const int64_t device = waits_in(precision, true, kSteps);
    const int64_t host = waits_in(precision, false, kSteps);
    std::cout << precision << ": " << device << " waits in " << kSteps << " steps with trainer.device_step, " << host
              << " without\n";
    // One read per step remains: the report (loss, metrics, norm, the skip) read together.
    EXPECT_LE(device, kSteps) << precision;
    EXPECT_GT(host, device) << precision;
  }
#endif
}

TEST(StepGpu, StepsBetweenLogStepsNeverWaitForTheDevice) {
  // The sync detector: CUDA's sync debug mode set to raise an error on any synchronising call,
  // then steps that do not read their values (the loop's steps between log steps, Callback 1.1)
  // run; any wait for the device fails the test with LibTorch's message naming the call.
  LOOM_REQUIRE_CUDA();
#if LOOM_TORCH_CUDA
  for (const std::string precision : {"fp32", "bf16_amp", "fp16_amp"}) {
    auto t = cuda_trainer(precision, true, precision + "_unread");
    for (int i = 0; i < 3; ++i) t->train_step();  // warm-up: allocations, cuBLAS handles
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
    std::string error;
    try {
      for (int i = 0; i < 10; ++i) {
        const StepResult r = t->train_step(/*read_values=*/false);
        EXPECT_FALSE(r.read);
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
    EXPECT_EQ(error, "") << precision << ": a step between log steps waited for the device";
    const StepResult read = t->train_step();  // then a log step reads, and the window holds the rest
    EXPECT_TRUE(read.read);
    EXPECT_TRUE(std::isfinite(read.loss)) << precision;
  }
#endif
}

}  // namespace
