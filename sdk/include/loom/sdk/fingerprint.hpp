// The build fingerprint of the translation unit that includes this header: which LibTorch,
// which C++ library ABI and which compiler it was compiled with. The host compares a plugin's
// fingerprint with its own before it uses any C++ interface of the plugin (See Note
// [Fingerprint] in docs/abi.md). Plugins get it through LOOM_PLUGIN; the host includes it too,
// so both sides compute it with the same code.
#pragma once

#include <loom/sdk/abi.h>
#include <loom/sdk/version.hpp>
#include <torch/version.h>

// LOOM_TORCH_CUDA is set by the SDK's CMake target (loom::sdk) from the LibTorch it found:
// the headers of a CPU and a CUDA LibTorch are the same, the libraries are not.
#ifndef LOOM_TORCH_CUDA
#error "LOOM_TORCH_CUDA is not defined: link the loom::sdk CMake target (or define it to 0 or 1)"
#endif

#if defined(__clang__)
#define LOOM_COMPILER_STRING_(major) "clang " #major
#define LOOM_COMPILER_STRING(major) LOOM_COMPILER_STRING_(major)
#define LOOM_COMPILER LOOM_COMPILER_STRING(__clang_major__)
#elif defined(__GNUC__)
#define LOOM_COMPILER_STRING_(major) "gcc " #major
#define LOOM_COMPILER_STRING(major) LOOM_COMPILER_STRING_(major)
#define LOOM_COMPILER LOOM_COMPILER_STRING(__GNUC__)
#else
#define LOOM_COMPILER "unknown"
#endif

#if defined(_GLIBCXX_USE_CXX11_ABI)
#define LOOM_CXX11_ABI _GLIBCXX_USE_CXX11_ABI
#else
#define LOOM_CXX11_ABI 2
#endif

namespace loom::sdk {

/// The fingerprint of this translation unit's build. Constant-initialized (no constructor runs).
inline constexpr loom_build_fingerprint kBuildFingerprint{
    sizeof(loom_build_fingerprint),
    TORCH_VERSION_MAJOR,
    TORCH_VERSION_MINOR,
    TORCH_VERSION_PATCH,
    LOOM_TORCH_CUDA,
    LOOM_CXX11_ABI,
    static_cast<uint32_t>(__cplusplus / 100),
    0,
    LOOM_COMPILER,
    LOOM_SDK_VERSION,
};

}  // namespace loom::sdk
