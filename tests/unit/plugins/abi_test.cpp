// The promises of docs/abi.md against real plugin files: an ABI 1.0 plugin (built against the
// frozen 1.0 header) still loads; a plugin's fingerprint note is read before the file is loaded,
// so one built for another LibTorch or with a sanitizer is refused without any of its code
// running; the SDK's type info has one home, so exceptions cross the boundary by type.
#include "plugin_fingerprint.hpp"  // core/src: the fingerprint stage itself

#include <loom/core/link_check.hpp>
#include <loom/core/plugin_registry.hpp>
#include <loom/sdk/dataset.hpp>
#include <loom/sdk/error.hpp>

#include <gtest/gtest.h>
#include <torch/version.h>

#include <cstdlib>
#include <filesystem>
#include <optional>
#include <typeinfo>
#include <unistd.h>

namespace fs = std::filesystem;
using loom::core::PluginRegistry;

namespace {

const fs::path kBuild = LOOM_BINARY_DIR;

/// The refusal of `file` by a fresh registry, with the scanner (isolated) or without it.
std::optional<loom::core::PluginRefusal> refusal_of(const fs::path& file, bool isolated) {
  PluginRegistry registry;
  registry.set_log_refusals(false);
  registry.set_isolation(isolated);
  const auto report = registry.load(file);
  return report.refusal;
}

/// Points LOOM_TEST_INITIALIZER_MARKER at a file that does not exist yet.
struct Marker {
  Marker() : path(fs::temp_directory_path() / ("loom_initializer_" + std::to_string(::getpid()))) {
    fs::remove(path);
    ::setenv("LOOM_TEST_INITIALIZER_MARKER", path.c_str(), 1);
  }
  ~Marker() {
    ::unsetenv("LOOM_TEST_INITIALIZER_MARKER");
    fs::remove(path);
  }
  fs::path path;
};

bool host_has_address_sanitizer() { return loom::core::host_fingerprint().at("sanitizers").find("address") != std::string::npos; }

}  // namespace

TEST(AbiCompat, FrozenAbi10PluginLoadsAndWorks) {
  for (const bool isolated : {true, false}) {
    PluginRegistry registry;
    registry.set_isolation(isolated);
    const auto report = registry.load(kBuild / "tests" / "frozen" / "libloom_dataset_frozen_v1_0.so");
    ASSERT_TRUE(report.accepted) << (report.refusal ? report.refusal->line() : "");
    // Its fingerprint came from the descriptor, as ABI 1.0 carried it.
    EXPECT_EQ(report.fingerprint.count("layout"), 0u);
    EXPECT_EQ(report.fingerprint.at("sdk"), "0.1.0");
    const auto* info = registry.find(LOOM_KIND_DATASET, "frozen_v1_0");
    ASSERT_NE(info, nullptr);
    EXPECT_EQ(info->interface_minor, 0u);
    auto dataset = registry.create<loom::sdk::Dataset>("frozen_v1_0", {{"size", "6"}});
    EXPECT_FALSE(dataset.implements(1)) << "a Dataset 1.0 is not asked for a validation split";
    dataset->setup();
    EXPECT_EQ(dataset->size(loom::sdk::Split::kTrain), 6);
    const auto batch = dataset->get_batch(loom::sdk::Split::kTrain, {3, 4});
    EXPECT_EQ(batch.at("input")[0][1].item<float>(), -3.0f);
    EXPECT_EQ(batch.at("target")[1].item<int64_t>(), 0);
  }
}

TEST(AbiCompat, TheMarkerShowsWhenAPluginsInitializersRun) {
  // The good plugin has the same initializer as the refused ones below: loading it writes the file.
  Marker marker;
  PluginRegistry registry;
  registry.set_isolation(false);
  ASSERT_TRUE(registry.load(fs::path(LOOM_TEST_PLUGIN_DIR) / "libloom_dataset_basic_counting.so").accepted);
  EXPECT_TRUE(fs::exists(marker.path));
}

TEST(AbiCompat, AnotherLibTorchIsRefusedBeforeItsInitializersRun) {
  const fs::path file = kBuild / "tests" / "refused_before_load" / "libloom_dataset_before_load_torch_version.so";
  for (const bool isolated : {true, false}) {
    Marker marker;
    const auto refusal = refusal_of(file, isolated);
    ASSERT_TRUE(refusal.has_value());
    EXPECT_EQ(refusal->stage, "fingerprint") << refusal->line();
    EXPECT_NE(refusal->reason.find("built against LibTorch 1.13.1, host has " + loom::core::host_fingerprint().at("libtorch")),
              std::string::npos)
        << refusal->line();
    EXPECT_FALSE(fs::exists(marker.path)) << "the plugin's static initializer ran: it was loaded before it was refused";
  }
}

TEST(AbiCompat, ASanitizedPluginIsRefusedBeforeItLoads) {
  if (host_has_address_sanitizer()) GTEST_SKIP() << "this host is built with AddressSanitizer: it may load the plugin";
  const fs::path file = kBuild / "tests" / "refused_before_load" / "libloom_dataset_before_load_sanitized.so";
  for (const bool isolated : {true, false}) {
    Marker marker;
    const auto refusal = refusal_of(file, isolated);
    ASSERT_TRUE(refusal.has_value());
    EXPECT_EQ(refusal->stage, "fingerprint") << refusal->line();
    EXPECT_NE(refusal->reason.find("built with AddressSanitizer, which this Loom is not built with"), std::string::npos)
        << refusal->line();
    EXPECT_NE(refusal->hint.find("cmake --preset asan"), std::string::npos) << refusal->line();
    EXPECT_FALSE(fs::exists(marker.path));
  }
}

TEST(AbiCompat, SdkExceptionsAreCaughtByTypeWithOneTypeInfo) {
  PluginRegistry registry;
  registry.set_isolation(false);
  ASSERT_TRUE(registry.load(fs::path(LOOM_TEST_PLUGIN_DIR) / "libloom_dataset_basic_counting.so").accepted);
  auto dataset = registry.create<loom::sdk::Dataset>("counting", {{"size", "3"}});
  try {
    dataset->get_batch(loom::sdk::Split::kTrain, {7});
    FAIL() << "expected loom::sdk::Error";
  } catch (const loom::sdk::Error& e) {
    EXPECT_NE(std::string(e.what()).find("index 7 out of range"), std::string::npos);
    // The plugin threw an object whose type_info is the host's own, not a copy of it with the same
    // name: the SDK's type info lives in libloom_sdk alone.
    EXPECT_EQ(&typeid(e), &typeid(loom::sdk::Error));
  }
  // That one type_info comes from libloom_sdk, which the plugin links (the package test checks
  // its NEEDED entry) and this process loaded once.
  EXPECT_NE(loom::core::loaded_library("libloom_sdk.so"), "");
  // And dynamic_cast across the boundary finds the interface by the same type info.
  EXPECT_NE(dynamic_cast<loom::sdk::Dataset*>(dataset.get()), nullptr);
}

TEST(AbiCompat, TheHostFingerprintSaysWhatDecides) {
  const auto& f = loom::core::host_fingerprint();
  for (const char* key : {"format", "tier", "libtorch", "libtorch_git", "cuda", "stdlib", "stdlib_abi", "debug_containers",
                          "sanitizers", "layout", "compiler", "sdk"})
    EXPECT_EQ(f.count(key), 1u) << key;
  EXPECT_EQ(f.at("tier"), "cxx");
  EXPECT_EQ(f.at("layout").size(), 16u);
  EXPECT_EQ(f.at("libtorch").rfind(TORCH_VERSION, 0), 0u) << f.at("libtorch");  // 2.15.0 of 2.15.0+cu132
}

// Note [Fingerprint], field by field: what decides refuses with the field named, what is only
// recorded does not, and a C-tier plugin is held to its sanitizers alone.
TEST(AbiCompat, EachFingerprintFieldDecidesAsDocumented) {
  using loom::core::check_fingerprint;
  using loom::core::PluginRefused;
  const auto& host = loom::core::host_fingerprint();
  auto reason_with = [&](const std::string& key, const std::string& value) -> std::string {
    auto f = host;
    f[key] = value;
    try {
      check_fingerprint(f);
    } catch (const PluginRefused& r) {
      EXPECT_EQ(r.stage, "fingerprint");
      return r.reason;
    }
    return "";
  };
  EXPECT_EQ(reason_with("libtorch", "2.15.0+cu126"), "built against LibTorch 2.15.0+cu126, host has " + host.at("libtorch"));
  EXPECT_NE(reason_with("libtorch_git", "0123abc").find("built against the LibTorch commit 0123abc"), std::string::npos);
  EXPECT_EQ(reason_with("libtorch_git", "unknown"), "");  // a commit one side could not learn is not held against it
  EXPECT_NE(reason_with("cuda", "12.6").find("LibTorch's CUDA version 12.6"), std::string::npos);
  EXPECT_NE(reason_with("stdlib", "libc++").find("the C++ standard library libc++"), std::string::npos);
  EXPECT_NE(reason_with("stdlib_abi", "pre-cxx11").find("the standard library ABI pre-cxx11"), std::string::npos);
  EXPECT_NE(reason_with("debug_containers", "1").find("debug containers (_GLIBCXX_DEBUG) set to 1, host has 0"), std::string::npos);
  EXPECT_NE(reason_with("layout", "0000000000000000").find("SDK value types of layout 0000000000000000"), std::string::npos);
  EXPECT_NE(reason_with("sanitizers", "thread").find("built with ThreadSanitizer"), std::string::npos);
  EXPECT_NE(reason_with("format", "2").find("format '2'"), std::string::npos);
  // Recorded only.
  EXPECT_EQ(reason_with("compiler", "clang 99.0.0"), "");
  EXPECT_EQ(reason_with("stdlib_version", "99"), "");
  EXPECT_EQ(reason_with("cxx_standard", "2023"), "");
  EXPECT_EQ(reason_with("sdk", "0.1.7"), "");
  // A C-tier plugin names no LibTorch: any host takes it, unless it is sanitized and the host not.
  EXPECT_NO_THROW(check_fingerprint({{"format", "1"}, {"tier", "c"}, {"sanitizers", "none"}}));
  if (!host_has_address_sanitizer()) {
    EXPECT_THROW(check_fingerprint({{"format", "1"}, {"tier", "c"}, {"sanitizers", "address"}}), PluginRefused);
  }
  // The note's text itself: lines of key=value, each key once.
  EXPECT_EQ(loom::core::parse_fingerprint("a=1\nb=x=y\n\n").at("b"), "x=y");
  EXPECT_THROW(loom::core::parse_fingerprint("a=1\na=2\n"), PluginRefused);
  EXPECT_THROW(loom::core::parse_fingerprint("no equals sign\n"), PluginRefused);
  EXPECT_THROW(loom::core::parse_fingerprint("=value\n"), PluginRefused);
}
