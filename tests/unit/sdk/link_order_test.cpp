// Loom's executables take the C++ standard library from libstdc++, never from a LibTorch library
// that exports copies of it: torch 2.11's libtorch.so exports std::filesystem's functions, and
// its remove_all crashed every run that pruned a checkpoint on the GPU machine (a call through a
// null pointer). This test binary is linked like `loom` (cmake/LoomTorch.cmake).
#include <loom/core/link_check.hpp>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <unistd.h>

namespace {

// On the CPU machines it resolves to libstdc++.so.6; on the GPU machine, whose toolchain put
// libstdc++'s code into Loom's libraries, to libloom_sdk.so's own copy of GCC's code (docs/gpu.md, "The fourth
// run"). Either is right; a LibTorch library is what crashed.
TEST(LinkOrder, StdFilesystemDoesNotComeFromLibTorch) {
  const std::string provider = loom::core::std_filesystem_provider();
  EXPECT_NE(provider, "(not loaded)");
  EXPECT_FALSE(loom::core::is_libtorch_library(provider))
      << "std::filesystem::remove_all resolves to " << provider
      << ": link libstdc++ before LibTorch (Note [libstdc++ first] in cmake/LoomTorch.cmake)";
}

TEST(LinkOrder, LibTorchLibrariesAreRecognisedByName) {
  EXPECT_TRUE(loom::core::is_libtorch_library("/venv/torch/lib/libtorch_cpu.so"));
  EXPECT_TRUE(loom::core::is_libtorch_library("/venv/torch/lib/libtorch.so"));
  EXPECT_TRUE(loom::core::is_libtorch_library("/venv/torch/lib/libc10.so"));
  EXPECT_FALSE(loom::core::is_libtorch_library("/usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.33"));
  EXPECT_FALSE(loom::core::is_libtorch_library("/work/build/lib/libloom_sdk.so.0.1.0"));
}

TEST(LinkOrder, RemoveAllRemovesATree) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("loom_link_order_" + std::to_string(::getpid()));
  fs::create_directories(dir / "a" / "b");
  std::ofstream(dir / "a" / "b" / "f") << "x";
  std::error_code ec;
  EXPECT_EQ(fs::remove_all(dir, ec), 4u);
  EXPECT_FALSE(ec);
  EXPECT_FALSE(fs::exists(dir));
}

}  // namespace
