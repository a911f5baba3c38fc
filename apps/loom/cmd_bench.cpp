// `loom bench configs A.ini B.ini ... --steps 100`: each configuration for a few steps, side by
// side: micro-batch, accumulation, global batch, peak memory, samples/s (seed 004's comparison
// script, built in). Runs in a temporary work folder that is removed afterwards.
#include "cli.hpp"

#include <loom/core/error.hpp>
#include <loom/core/text.hpp>
#include <loom/core/trainer.hpp>

#include <chrono>
#include <cstdio>
#include <cctype>
#include <filesystem>
#include <iostream>
#include <unistd.h>

namespace fs = std::filesystem;

namespace loom::cli {

int cmd_bench(const Invocation& invocation) {
  std::vector<std::string> files(invocation.args.begin(), invocation.args.end());
  if (!files.empty() && files.front() == "configs") files.erase(files.begin());
  if (files.empty()) throw Error("usage: loom bench configs A.ini B.ini ... [--steps 100] [--set ...]");
  const int64_t steps = invocation.options["steps"].as<int64_t>();
  if (steps < 2) throw Error("--steps must be at least 2 (the first step is a warm-up)");
  core::PluginRegistry registry;
  scan_plugins(registry, invocation.options);
  const fs::path work = fs::temp_directory_path() / ("loom-bench-" + std::to_string(::getpid()));

  struct Row {
    std::string name;
    sdk::BatchPlan plan;
    int64_t peak;
    double rate;
  };
  std::vector<Row> rows;
  for (const auto& file : files) {
    core::Config config;
    config.load_file(core::find_config(file));
    const core::Config user = config_from(invocation.options);
    for (const auto& [key, value] : user.values()) config.set(key, value.value, value.origin);
    config.set("trainer.work_dir", work.string(), {"loom bench", {}, 0});
    // One folder per configuration, even when two files share a name (a run refuses a used folder).
    std::string stem = fs::path(file).stem().string();
    for (char& ch : stem)
      if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '-' && ch != '_' && ch != '.') ch = '_';
    config.set("trainer.name", std::to_string(rows.size() + 1) + "-" + stem, {"loom bench", {}, 0});
    config.set("trainer.max_steps", std::to_string(steps), {"--steps", {}, 0});
    config.set("trainer.resume", "none", {"loom bench", {}, 0});
    config.set("trainer.resume_from", "", {"loom bench", {}, 0});
    core::Trainer trainer(core::resolve_run(config, registry), registry);
    trainer.setup();
    trainer.step_with_recovery();  // warm-up, not timed
    trainer.memory().reset_peak();
    const auto start = std::chrono::steady_clock::now();
    int64_t samples = 0;
    for (int64_t i = 1; i < steps; ++i) samples += trainer.step_with_recovery().samples;
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    rows.push_back({fs::path(file).filename().string(), trainer.plan(), trainer.memory().stats().peak, samples / seconds});
  }
  std::error_code ec;
  fs::remove_all(work, ec);

  std::printf("\n%-28s %11s %12s %12s %12s %12s\n", "configuration", "micro-batch", "accumulation", "global batch",
              "peak memory", "samples/s");
  for (const auto& r : rows)
    std::printf("%-28s %11lld %12lld %12lld %12s %12.0f\n", r.name.c_str(), static_cast<long long>(r.plan.micro_batch),
                static_cast<long long>(r.plan.accumulation), static_cast<long long>(r.plan.global()),
                core::format_bytes(r.peak).c_str(), r.rate);
  std::printf("(%lld steps each, the first one not timed; peak memory allocated on the device, on CPU by Loom's allocator)\n",
              static_cast<long long>(steps));
  return 0;
}

}  // namespace loom::cli
