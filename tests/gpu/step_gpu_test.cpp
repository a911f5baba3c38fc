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

std::unique_ptr<Trainer> cuda_trainer(const std::string& precision, bool device_step, const std::string& name,
                                      std::initializer_list<const char*> more = {}) {
  const fs::path dir = fs::temp_directory_path() / ("loom_step_gpu_" + std::to_string(::getpid()));
  Config c;
  for (const auto& kv : {"model.name=lightweight_transformer", "model.flavour=debug", "data.name=synthetic",
                         "data.train_size=2048", "trainer.batch_size=64", "trainer.device=cuda", "trainer.max_steps=100"})
    c.set_assignment(kv);
  c.set_assignment("precision.name=" + precision);
  c.set_assignment(std::string("trainer.device_step=") + (device_step ? "true" : "false"));
  c.set_assignment("trainer.work_dir=" + dir.string());
  c.set_assignment("trainer.name=" + name);
  for (const char* kv : more) c.set_assignment(kv);
  return loom::testing::make_trainer(c);
}

/// Runs `steps` under CUDA's sync debug mode set to raise an error on any synchronising call;
/// returns LibTorch's message if one waited, else "".
std::string wait_in(Trainer& t, int steps) {
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
  std::string error;
  try {
    for (int i = 0; i < steps; ++i) {
      const StepResult r = t.train_step(/*read_values=*/false);
      EXPECT_FALSE(r.read);
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  return error;
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
    EXPECT_EQ(wait_in(*t, 10), "") << precision << ": a step between log steps waited for the device";
    const StepResult read = t->train_step();  // then a log step reads, and the window holds the rest
    EXPECT_TRUE(read.read);
    EXPECT_TRUE(std::isfinite(read.loss)) << precision;
  }
#endif
}

TEST(StepGpu, ACudaGraphTrainsAsTheEagerStepDoes) {
  // Note [The step as a CUDA graph]: after the warm-up the step is captured once and replayed.
  // The replays run the same kernels on the same tensors as the eager step: 20 steps in fp32
  // give the same losses (within 1e-6) and the same weights; with gradient accumulation too,
  // where one graph holds every micro-batch of the step (GPT-2's benchmark runs 4 per step).
  LOOM_REQUIRE_CUDA();
#if LOOM_TORCH_CUDA
  constexpr int kSteps = 20;
  for (const std::string accumulation : {"1", "2"}) {
    auto run = [&](bool graph) {
      const std::string accumulate = "trainer.gradient_accumulation_steps=" + accumulation;
      auto t = cuda_trainer("fp32", true, (graph ? "graph_" : "eager_") + accumulation,
                            {"model.dropout=0", graph ? "step.cuda_graph=true" : "step.cuda_graph=false",
                             "step.cuda_graph_warmup=3", accumulate.c_str()});
      EXPECT_EQ(t->plan().accumulation, std::stoll(accumulation));
      std::vector<double> losses;
      for (int i = 0; i < kSteps; ++i) losses.push_back(t->train_step().loss);
      EXPECT_EQ(t->graph_captures(), graph ? 1 : 0);
      std::vector<at::Tensor> weights;
      for (const auto& p : t->model().module().parameters()) weights.push_back(p.detach().cpu());
      return std::make_pair(losses, weights);
    };
    const auto [eager, eager_weights] = run(false);
    const auto [graph, graph_weights] = run(true);
    ASSERT_EQ(eager.size(), graph.size());
    for (size_t i = 0; i < eager.size(); ++i)
      EXPECT_NEAR(eager[i], graph[i], 1e-6) << "step " << i + 1 << ", accumulation " << accumulation;
    ASSERT_EQ(eager_weights.size(), graph_weights.size());
    for (size_t i = 0; i < eager_weights.size(); ++i)
      EXPECT_TRUE(at::allclose(eager_weights[i], graph_weights[i], 1e-5, 1e-6))
          << "parameter " << i << ", accumulation " << accumulation;
  }
#endif
}

TEST(StepGpu, CudaGraphStepsBetweenLogStepsNeverWaitForTheDevice) {
  // The replayed step, its input copies and the loader's prefetch on the copy stream: no wait.
  LOOM_REQUIRE_CUDA();
#if LOOM_TORCH_CUDA
  for (const std::string precision : {"fp32", "bf16_amp", "fp16_amp"}) {
    auto t = cuda_trainer(precision, true, precision + "_graph_unread", {"step.cuda_graph=true", "step.cuda_graph_warmup=2"});
    for (int i = 0; i < 3; ++i) t->train_step();  // two eager steps, then the capture
    ASSERT_EQ(t->graph_captures(), 1) << precision;
    EXPECT_EQ(wait_in(*t, 10), "") << precision << ": a replayed step waited for the device";
    const StepResult read = t->train_step();
    EXPECT_TRUE(read.read);
    EXPECT_TRUE(std::isfinite(read.loss)) << precision;
  }
#endif
}

TEST(StepGpu, ACudaGraphIsCapturedAgainAtTheNewPlanAfterAnOutOfMemory) {
  // A plan change (out-of-memory recovery here) changes the shapes: the graphs of the old plan
  // are dropped with their memory, and the step is warmed up and captured again at the new one.
  LOOM_REQUIRE_CUDA();
#if LOOM_TORCH_CUDA
  const fs::path dir = fs::temp_directory_path() / ("loom_step_gpu_oom_" + std::to_string(::getpid()));
  Config c;
  for (const auto& kv : {"model.name=lightweight_transformer", "model.num_layers=4", "model.d_model=256",
                         "model.num_heads=8", "model.patch_size=4", "model.image_size=112", "data.name=synthetic",
                         "data.image_size=28", "data.train_size=4096", "trainer.batch_size=256", "trainer.max_steps=20",
                         "trainer.device=cuda", "precision.name=fp32", "memory.policies=oom_recovery",
                         "memory.estimate=false", "step.cuda_graph=true", "step.cuda_graph_warmup=1"})
    c.set_assignment(kv);
  c.set_assignment("trainer.work_dir=" + dir.string());
  c.set_assignment("trainer.name=probe");
  int64_t full = 0, half = 0;
  {
    Trainer probe(resolve_run(c, loom::testing::registry()), loom::testing::registry());
    probe.setup();
    full = probe.probe_peak(256);
    half = probe.probe_peak(128);
  }
  c.set_assignment("memory.device_memory_limit=" + std::to_string((full + half) / 2));
  c.set_assignment("trainer.name=graph_oom");
  Trainer t(resolve_run(c, loom::testing::registry()), loom::testing::registry());
  t.setup();
  double loss = 0;
  for (int i = 0; i < 4; ++i) loss = t.step_with_recovery().loss;
  EXPECT_GE(t.oom_recoveries(), 1);
  EXPECT_LE(t.plan().micro_batch, 128);
  EXPECT_GE(t.graph_captures(), 1);  // at the plan that fits
  EXPECT_TRUE(std::isfinite(loss));
  t.memory().set_limit(0);
  fs::remove_all(dir);
#endif
}

}  // namespace
