// What the trainer-level tests share: the registry of the build's real plugins, a trainer built
// from a configuration, a fresh folder per test, and a skip where CUDA is needed.
#pragma once

#include <loom/core/config.hpp>
#include <loom/core/plugin_registry.hpp>
#include <loom/core/trainer.hpp>

#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include <filesystem>
#include <initializer_list>
#include <memory>
#include <string>
#include <unistd.h>
#include <vector>

/// `haystack` (a string) contains `needle`; the message shows the whole haystack. (Evaluated
/// once: a haystack that trains a run would train it again for the message, into a taken folder.)
#define EXPECT_CONTAINS(haystack, needle)                                                  \
  do {                                                                                     \
    const std::string loom_haystack_(haystack);                                            \
    EXPECT_NE(loom_haystack_.find(needle), std::string::npos) << "in: " << loom_haystack_; \
  } while (false)

namespace loom::testing {

/// The build's in-tree plugins and the test models (the out-of-tree example MLP), loaded once.
inline const core::PluginRegistry& registry() {
  static core::PluginRegistry* r = [] {
    auto* reg = new core::PluginRegistry();  // never destroyed: plugins stay loaded (design notes)
    const std::filesystem::path build(LOOM_BINARY_DIR);
    std::vector<std::filesystem::path> dirs{build / "lib" / "loom" / "plugins"};
    if (std::filesystem::is_directory(build / "tests" / "models")) dirs.push_back(build / "tests" / "models");
    reg->scan(dirs);
    return reg;
  }();
  return *r;
}

/// A trainer for `c`, set up (built, ready to train).
inline std::unique_ptr<core::Trainer> make_trainer(const core::Config& c) {
  auto t = std::make_unique<core::Trainer>(core::resolve_run(c, registry()), registry());
  t->setup();
  return t;
}

/// The error that setting up and training the run `c` ends with ("" and a test failure where it
/// trains to its end).
inline std::string training_error(const core::Config& c) {
  try {
    make_trainer(c)->train();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << c.get("trainer.name").value_or("?") << " trained to its end";
  return {};
}

/// Copies of the model's parameters, in order.
inline std::vector<at::Tensor> parameters_of(core::Trainer& t) {
  std::vector<at::Tensor> out;
  for (const auto& p : t.model().module().parameters()) out.push_back(p.detach().clone());
  return out;
}

/// A configuration from `section.key=value` assignments, writing run `name` into `work_dir`.
inline core::Config config_of(std::initializer_list<const char*> assignments, const std::filesystem::path& work_dir,
                              const std::string& name) {
  core::Config c;
  for (const char* kv : assignments) c.set_assignment(kv);
  c.set_assignment("trainer.work_dir=" + work_dir.string());
  c.set_assignment("trainer.name=" + name);
  return c;
}

/// An empty folder for the running test under the system's temporary folder, unique per process.
inline std::filesystem::path fresh_test_dir(const std::string& prefix) {
  std::string test = ::testing::UnitTest::GetInstance()->current_test_info()->name();
  for (char& ch : test)
    if (ch == '/') ch = '_';
  const auto dir = std::filesystem::temp_directory_path() / (prefix + "_" + std::to_string(::getpid()) + "_" + test);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace loom::testing

#define LOOM_REQUIRE_CUDA() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible"
