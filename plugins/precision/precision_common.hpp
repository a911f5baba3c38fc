// Shared by the in-tree precision plugins (header-only, compiled into each): the TF32 switches
// and what a device can compute in. Uses only LibTorch and the SDK.
#pragma once

#include <loom/sdk/sdk.hpp>

#include <ATen/Context.h>
#if LOOM_TORCH_CUDA
#include <ATen/cuda/CUDAContextLight.h>
#endif

namespace loom::plugins {

/// TF32 for float32 matmuls and cuDNN convolutions, on or off. Only the legacy setters: they keep
/// the newer fp32_precision state consistent (research/libtorch-api.md, "Mixing trap").
inline void set_tf32(bool on) {
  at::globalContext().setAllowTF32CuBLAS(on);
  at::globalContext().setAllowTF32CuDNN(on);
}

/// Compute capability major.minor of a CUDA device as 10*major+minor (80 for Ampere), or 0.
inline int cuda_capability(const c10::Device& device) {
#if LOOM_TORCH_CUDA
  if (device.is_cuda()) {
    const auto* p = at::cuda::getDeviceProperties(device.index());
    return p->major * 10 + p->minor;
  }
#else
  (void)device;
#endif
  return 0;
}

}  // namespace loom::plugins
