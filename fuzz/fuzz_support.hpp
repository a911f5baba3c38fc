#pragma once
// Helpers shared by the fuzz targets (fuzz/README.md).

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <unistd.h>

namespace loom::fuzz {

/// A folder of this process's own, in memory where /dev/shm exists (the targets that read files
/// write each input there first, as a user's file would be).
inline const std::filesystem::path& scratch() {
  static const std::filesystem::path dir = [] {
    const std::filesystem::path base = std::filesystem::exists("/dev/shm") ? "/dev/shm" : std::filesystem::temp_directory_path();
    auto d = base / ("loom-fuzz-" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    std::atexit([] {  // libFuzzer ends with exit() when its time is up
      std::error_code ec;
      std::filesystem::remove_all(scratch(), ec);
    });
    return d;
  }();
  return dir;
}

/// Writes the input to `name` in the scratch folder and returns the path.
inline std::filesystem::path write_input(const std::string& name, const uint8_t* data, size_t size) {
  const auto path = scratch() / name;
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) std::abort();
  if (size > 0 && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
  return path;
}

}  // namespace loom::fuzz
