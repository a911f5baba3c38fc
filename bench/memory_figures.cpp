// Memory figures (a benchmark, not a test), on CPU under Loom's budget allocator or on a GPU:
//   1. the estimator's error on four models (the default transformer, a smaller one with finer
//      patches, two MLPs), as Loom probes (1/4 and 1/2 of the micro-batch), from probes at 1/8 and
//      1/4, and from the smallest probes (2 and 4 samples);
//   2. auto_batch: probes used, and its micro-batch against the largest that fits (bisection);
//   3. one out-of-memory recovery, in step-times.
//
//   build/bin/loom_memory_figures [--device cpu|cuda]
#include <loom/core/config.hpp>
#include <loom/core/crash_report.hpp>
#include <loom/core/estimator.hpp>
#include <loom/core/log.hpp>
#include <loom/core/plugin_registry.hpp>
#include <loom/core/text.hpp>
#include <loom/core/trainer.hpp>

#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <unistd.h>

namespace fs = std::filesystem;
using namespace loom::core;
using Clock = std::chrono::steady_clock;

namespace {

std::string device = "cpu";
fs::path work;

Config base(const std::string& model, const std::string& name) {
  Config c;
  const std::vector<std::string> common = {"data.name=synthetic", "data.image_size=28", "data.train_size=4096",
                                           "data.test_size=64", "trainer.max_steps=1000", "trainer.log_every=1000",
                                           "trainer.eval_every=100000", "precision.name=fp32", "memory.estimate=false",
                                           "trainer.device=" + device, "trainer.batch_size=128"};
  for (const auto& kv : common) c.set_assignment(kv);
  if (model == "default")  // the default job's transformer
    c.set_assignment("model.name=lightweight_transformer");
  else if (model == "transformer")
    for (const auto& kv : {"model.name=lightweight_transformer", "model.num_layers=2", "model.d_model=64",
                           "model.num_heads=4", "model.patch_size=4", "model.stem_channels=8"})
      c.set_assignment(kv);
  else if (model == "mlp512")  // the estimator test's MLP
    for (const auto& kv : {"model.name=mlp_classifier", "model.hidden=512", "model.layers=3"}) c.set_assignment(kv);
  else
    for (const auto& kv : {"model.name=mlp_classifier", "model.hidden=1024", "model.layers=3"}) c.set_assignment(kv);
  c.set_assignment("trainer.work_dir=" + work.string());
  c.set_assignment("trainer.name=" + name);
  return c;
}

std::unique_ptr<Trainer> make(const Config& c, const PluginRegistry& registry) {
  auto t = std::make_unique<Trainer>(resolve_run(c, registry), registry);
  t->setup();
  return t;
}

bool fits(Trainer& t, int64_t b, int64_t cap) {
  try {
    return t.probe_peak(b) <= cap;
  } catch (const c10::OutOfMemoryError&) {
    t.memory().empty_cache();
    return false;
  }
}

}  // namespace

int main(int argc, char** argv) {
  install_crash_report("loom_memory_figures");
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == "--device") device = argv[i + 1];
  init_logging("warn");
  work = fs::temp_directory_path() / ("loom-memory-figures-" + std::to_string(::getpid()));
  PluginRegistry registry;
  registry.set_log_refusals(false);
  const fs::path exe_dir = fs::read_symlink("/proc/self/exe").parent_path();
  registry.scan({exe_dir / ".." / "lib" / "loom" / "plugins", exe_dir / ".." / "tests" / "models"});

  std::printf("device: %s\n\n1. estimator (micro-batch 128): predicted vs measured peak\n", device.c_str());
  for (const std::string model : {"default", "transformer", "mlp", "mlp512"}) {
    auto t = make(base(model, "est_" + model), registry);
    const auto near = t->activation_fit(128);
    const ActivationFit eighth = fit_activations([&](int64_t b) { return t->probe_peak(b); }, 16, 32);
    const ActivationFit small = fit_activations([&](int64_t b) { return t->probe_peak(b); }, 2, 4);
    const int64_t predicted = estimate(t->model_states(), *near, 128).total();
    const int64_t farther = estimate(t->model_states(), eighth, 128).total();
    const int64_t extrapolated = estimate(t->model_states(), small, 128).total();
    t->memory().reset_peak();
    for (int i = 0; i < 3; ++i) t->train_step();
    const int64_t measured = t->memory().stats().peak;
    auto err = [&](int64_t p) { return 100.0 * static_cast<double>(p - measured) / static_cast<double>(measured); };
    std::printf("   %-12s measured %10s | Loom's probes (%lld+%lld): %10s (%+.2f %%) | probes 16+32: %+.2f %% | "
                "probes 2+4: %+.1f %%\n",
                model.c_str(), format_bytes(measured).c_str(), static_cast<long long>(near->probe_small),
                static_cast<long long>(near->probe_large), format_bytes(predicted).c_str(), err(predicted),
                err(farther), err(extrapolated));
  }

  std::printf("\n2. auto_batch against bisection (transformer, cap = the peak of micro-batch 300)\n");
  {
    auto t = make(base("transformer", "auto"), registry);
    const int64_t cap = t->probe_peak(300);
    t->memory().set_limit(cap);
    auto policy = registry.create<loom::sdk::MemoryPolicy>("auto_batch", {{"cache", "off"}});
    int probes = 0;
    loom::sdk::PlanContext context;
    context.memory = &t->memory();
    context.plan = t->plan();
    context.global_batch = 128;
    context.max_micro_batch = 4096;
    context.probe = [&](int64_t b) {
      ++probes;
      return t->probe_peak(b);
    };
    policy->plan(context);
    int64_t lo = 1, hi = 4096;  // bisection: largest b that fits
    int bisection_probes = 0;
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      ++bisection_probes;
      (fits(*t, mid, cap) ? lo : hi) = mid;
    }
    std::printf("   auto_batch: micro-batch %lld in %d probes; bisection: largest that fits %lld (%d probes); %.1f %%\n",
                static_cast<long long>(context.plan.micro_batch), probes, static_cast<long long>(lo), bisection_probes,
                100.0 * static_cast<double>(context.plan.micro_batch) / static_cast<double>(lo));
    t->memory().set_limit(0);
  }

  std::printf("\n3. one out-of-memory recovery (transformer, micro-batch 128 -> 64)\n");
  {
    int64_t full = 0, half = 0;
    {
      auto probe = make(base("transformer", "probe"), registry);
      full = probe->probe_peak(128);
      half = probe->probe_peak(64);
    }
    Config c = base("transformer", "recover");
    c.set_assignment("memory.policies=oom_recovery");
    c.set_assignment("memory.device_memory_limit=" + std::to_string((full + half) / 2));
    auto t = make(c, registry);
    std::vector<double> times;
    for (int i = 0; i < 12; ++i) {
      const auto start = Clock::now();
      t->step_with_recovery();
      times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
    }
    std::vector<double> later(times.begin() + 2, times.end());
    std::sort(later.begin(), later.end());
    const double step = later[later.size() / 2];
    const double lost = times[0] - step;
    std::printf("   step-time at the new plan %.1f ms; first step (ran out of memory, re-planned, replayed) %.1f ms\n",
                1000 * step, 1000 * times[0]);
    std::printf("   time lost to the recovery: %.1f ms = %.2f step-times (the failed attempt, unwinding, re-planning)\n",
                1000 * lost, lost / step);
    t->memory().set_limit(0);
  }
  fs::remove_all(work);
  return 0;
}
