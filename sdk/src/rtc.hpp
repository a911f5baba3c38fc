// Kernels compiled at run time (internal to libloom_sdk). NVRTC and the CUDA driver API are opened
// with dlopen, never linked: libloom_sdk builds and loads on machines without either, and uses the
// libnvrtc that the CUDA LibTorch in the process ships (site-packages/nvidia/*/lib for a wheel).
// See Note [Kernels compiled at run time] in rtc.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace loom::sdk::rtc {

/// CUBIN of `source` for sm_<major><minor>; throws loom::sdk::Error naming NVRTC's problem or the
/// compiler's log.
std::string compile(const std::string& source, const std::string& program_name, int major, int minor);

/// "" when NVRTC can be opened, otherwise why not.
std::string nvrtc_unavailable();

/// The kernels of one compiled source, loaded on each device that asks for them.
class Kernels {
 public:
  Kernels(std::string source, std::string program_name, std::vector<std::string> names);

  /// The kernel `name` (one of the constructor's names) on CUDA device `device`: compiled and
  /// loaded at first use (thread-safe). Throws loom::sdk::Error when that is not possible; it is
  /// not tried again for that device, and the same error is thrown again.
  void* function(int device, const std::string& name);

  /// cuLaunchKernel on `stream` (a cudaStream_t); throws loom::sdk::Error with the driver's message.
  static void launch(void* function, unsigned grid_x, unsigned block_x, void* stream, void** args);

 private:
  struct Loaded;
  std::string source_, program_name_;
  std::vector<std::string> names_;
  std::vector<Loaded*> devices_;  // by device index; never freed (modules live as long as the process)
};

}  // namespace loom::sdk::rtc
