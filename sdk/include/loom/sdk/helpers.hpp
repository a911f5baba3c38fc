// Small helpers that plugins of several kinds need, in the SDK so that out-of-tree plugins use
// the same ones as Loom's own: sizes and durations for messages, splitting a global batch into micro-batches,
// a device's compute capability and the TF32 switches. Header-only; LibTorch and std only.
#pragma once

#include <loom/sdk/types.hpp>

#include <ATen/Context.h>
#if LOOM_TORCH_CUDA
#include <ATen/cuda/CUDAContextLight.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

namespace loom::sdk {

/// "512 B", "37.5 KiB", "47.6 MiB", "2.0 GiB": a size for messages (binary units); "n/a" below 0.
inline std::string format_bytes(int64_t bytes) {
  if (bytes < 0) return "n/a";
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};  // (1 EiB was "1048576.0 TiB")
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 6) {
    value /= 1024.0;
    ++unit;
  }
  char buffer[32];
  if (unit == 0) std::snprintf(buffer, sizeof buffer, "%lld B", static_cast<long long>(bytes));
  else std::snprintf(buffer, sizeof buffer, "%.1f %s", value, units[unit]);
  return buffer;
}

/// "1h02m", "3m05s", "12s": a duration for messages; "?" when not finite or negative.
inline std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<long long>(std::llround(seconds));
  char buffer[32];
  if (s >= 3600) std::snprintf(buffer, sizeof buffer, "%lldh%02lldm", s / 3600, s / 60 % 60);
  else if (s >= 60) std::snprintf(buffer, sizeof buffer, "%lldm%02llds", s / 60, s % 60);
  else std::snprintf(buffer, sizeof buffer, "%llds", s);
  return buffer;
}

/// The plan with the largest micro-batch <= `limit` that divides the per-rank share of the
/// global batch evenly (so the global batch stays what it is); accumulation follows.
inline BatchPlan split_global_batch(int64_t global, int64_t world, int64_t limit) {
  const int64_t per_rank = global / world;
  int64_t micro = std::max<int64_t>(1, std::min(limit, per_rank));
  while (per_rank % micro != 0) --micro;
  return BatchPlan{micro, per_rank / micro, world};
}

/// "micro-batch 32 x accumulation 4 = 128" (with " x 8 devices" when there are several).
inline std::string plan_text(const BatchPlan& p) {
  return "micro-batch " + std::to_string(p.micro_batch) + " x accumulation " + std::to_string(p.accumulation) +
         (p.world_size > 1 ? " x " + std::to_string(p.world_size) + " devices" : std::string()) + " = " +
         std::to_string(p.global());
}

/// Compute capability of a CUDA device as 10 x major + minor (80 for Ampere), or 0 (not CUDA,
/// or a CPU build of LibTorch).
inline int cuda_capability(const c10::Device& device) {
#if LOOM_TORCH_CUDA
  if (device.is_cuda()) {
    const auto* p = at::cuda::getDeviceProperties(device.has_index() ? device.index() : 0);
    return p->major * 10 + p->minor;
  }
#else
  (void)device;
#endif
  return 0;
}

/// TF32 for float32 matmuls and cuDNN convolutions, on or off. Only the legacy setters: they keep
/// the newer fp32_precision state consistent (research/libtorch-api.md, "Mixing trap").
inline void set_tf32(bool on) {
  at::globalContext().setAllowTF32CuBLAS(on);
  at::globalContext().setAllowTF32CuDNN(on);
}

}  // namespace loom::sdk
