// Version differences between the LibTorch releases Loom builds against (the pinned wheel and
// the GPU machine's 2.11) live here and nowhere else. Code elsewhere asks LOOM_TORCH_AT_LEAST.
#pragma once

#include <torch/version.h>

#define LOOM_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||       \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#if !LOOM_TORCH_AT_LEAST(2, 4)
#error "Loom needs LibTorch 2.4 or newer (device-generic autocast, CPU loss-scaling kernels)"
#endif
