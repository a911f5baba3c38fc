// Plugins that crash, abort, exit or hang while loading are refused by name, through the scanner's
// child process, and the other plugins still load; the verdicts are cached by file.
#include <loom/core/plugin_registry.hpp>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <unistd.h>

namespace fs = std::filesystem;

namespace {

class PluginScan : public testing::Test {
 protected:
  void SetUp() override {
    cache_ = fs::temp_directory_path() / ("loom_plugin_scan_" + std::to_string(::getpid()));
    fs::remove_all(cache_);
    ::setenv("LOOM_CACHE", cache_.c_str(), 1);
    ::setenv("LOOM_PLUGIN_SCAN_TIMEOUT", "3", 1);
  }
  void TearDown() override { fs::remove_all(cache_); }

  /// Scans the crashing plugins and the real plugin folder; the refusals by file name.
  static std::map<std::string, loom::core::PluginRefusal> scan(loom::core::PluginRegistry& r) {
    r.set_log_refusals(false);
    r.scan({fs::path(LOOM_BINARY_DIR) / "tests" / "crashing", fs::path(LOOM_BINARY_DIR) / "lib" / "loom" / "plugins"});
    std::map<std::string, loom::core::PluginRefusal> out;
    for (const auto& refusal : r.refusals()) out[refusal.file.filename().string()] = refusal;
    return out;
  }

  fs::path cache_;
};

TEST_F(PluginScan, CrashingExitingAndHangingPluginsAreRefusedByNameAndTheOthersLoad) {
  loom::core::PluginRegistry registry;
  const auto start = std::chrono::steady_clock::now();
  const auto refused = scan(registry);
  const std::map<std::string, std::string> expected = {
#if defined(__SANITIZE_ADDRESS__)
      // Under AddressSanitizer the scanner's SEGV handler reports the crash and exits with 1.
      {"libloom_dataset_crashing_init_segv.so", "ended the scanner with exit status 1 while loading"},
#else
      {"libloom_dataset_crashing_init_segv.so", "crashed with SIGSEGV while loading in the scanner"},
#endif
      {"libloom_dataset_crashing_init_abort.so", "crashed with SIGABRT while loading in the scanner"},
      {"libloom_dataset_crashing_init_exit.so", "ended the scanner with exit status 3 while loading"},
      {"libloom_dataset_crashing_init_hang.so", "did not finish loading within 3 s in the scanner"},
  };
  for (const auto& [file, reason] : expected) {
    auto it = refused.find(file);
    ASSERT_NE(it, refused.end()) << file << " was not refused";
    EXPECT_EQ(it->second.stage, "scan") << file;
    EXPECT_NE(it->second.reason.find(reason), std::string::npos) << file << ": " << it->second.reason;
  }
  EXPECT_EQ(refused.size(), expected.size()) << "only the crashing plugins are refused";
  EXPECT_NE(registry.find(LOOM_KIND_MODEL, "lightweight_transformer"), nullptr);
  EXPECT_NE(registry.find(LOOM_KIND_CALLBACK, "early_stopping"), nullptr);
  const double first = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  // The verdicts are cached by path, size and time: a second scan runs no child and waits for
  // no hang, and says the verdict is the cached one.
  loom::core::PluginRegistry again;
  const auto start2 = std::chrono::steady_clock::now();
  const auto cached = scan(again);
  const double second = std::chrono::duration<double>(std::chrono::steady_clock::now() - start2).count();
  ASSERT_EQ(cached.size(), expected.size());
  EXPECT_NE(cached.at("libloom_dataset_crashing_init_hang.so").reason.find("(cached verdict)"), std::string::npos);
  EXPECT_LT(second, 3.0) << "a cached scan waits for no timeout (first scan " << first << " s)";
}

}  // namespace
