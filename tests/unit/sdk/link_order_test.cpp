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

TEST(LinkOrder, StdFilesystemComesFromLibstdcxx) {
  const std::string provider = loom::core::std_filesystem_provider();
  EXPECT_NE(provider.find("libstdc++.so"), std::string::npos)
      << "std::filesystem::remove_all resolves to " << provider
      << ": link libstdc++ before LibTorch (LOOM_LIBSTDCXX_FIRST in cmake/LoomTorch.cmake)";
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
