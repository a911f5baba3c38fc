// Version differences between the LibTorch releases Loom builds against (the pinned wheel and
// the GPU machine's 2.11) live here and nowhere else. Code elsewhere asks LOOM_TORCH_AT_LEAST or
// calls the helpers below. scripts/torch_compat.py compiles every translation unit against the
// GPU machine's headers in CI, so an API that release lacks is found here, not on the GPU.
#pragma once

#include <torch/version.h>

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <c10/core/Device.h>

#define LOOM_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||       \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#if !LOOM_TORCH_AT_LEAST(2, 4)
#error "Loom needs LibTorch 2.4 or newer (device-generic autocast, CPU loss-scaling kernels)"
#endif

namespace loom::sdk::compat {

/// The default random generator of `device` (the CPU's, or an accelerator's by its index). A
/// handle: a copy shares the generator's state, so get_state/set_state act on the default one.
///
/// `at::accelerator::getDefaultGenerator` (newer releases) is not in 2.11; `Context::
/// defaultGenerator(Device)` is in every release Loom supports and covers the CPU as well, so
/// one spelling serves all of them and no version branch is needed.
inline at::Generator default_generator(c10::Device device) {
  return at::globalContext().defaultGenerator(device);
}

}  // namespace loom::sdk::compat
