// Reading a device the user named ("cpu", "cuda", "cuda:1") against what this process can see:
// for parallel strategies, which turn trainer.device (and their own device lists) into devices.
#pragma once

#include <loom/sdk/error.hpp>

#include <c10/core/Device.h>
#include <torch/cuda.h>

#include <string>

namespace loom::sdk {

/// `text` ("cpu", "cuda", "cuda:N") as a device this process has; "cuda" is cuda:0. `key` names
/// where the text came from in the error ("trainer.device"): not a device, no CUDA device
/// visible, an index past the visible ones (CUDA_VISIBLE_DEVICES counts), another device type.
inline c10::Device parse_device(const std::string& text, const std::string& key) {
  c10::Device parsed(c10::kCPU);
  try {
    parsed = c10::Device(text);
  } catch (const std::exception&) {
    throw Error(key + " = '" + text + "' is not a device; use cpu, cuda or cuda:N");
  }
  if (parsed.is_cpu()) return parsed;
  if (!parsed.is_cuda()) throw Error(key + " = '" + text + "': Loom trains on cpu or cuda devices");
  if (!torch::cuda::is_available())
    throw Error(key + " = '" + text + "' but no CUDA device is available to this process; use cpu (or auto)");
  const int64_t index = parsed.has_index() ? parsed.index() : 0;
  const auto count = static_cast<int64_t>(torch::cuda::device_count());
  if (index >= count)
    throw Error(key + " = '" + text + "' but this process sees " + std::to_string(count) +
                " CUDA device(s) (CUDA_VISIBLE_DEVICES counts)");
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
}

}  // namespace loom::sdk
