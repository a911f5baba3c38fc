// The build fingerprint of the translation unit that includes this header: what decides whether
// C++ objects made by a plugin can be used by the host (Note [Fingerprint] in docs/abi.md).
// LOOM_PLUGIN writes it into the plugin file as an ELF note (abi.h, LOOM_NOTE_SECTION), which
// the host reads before it loads the file; the host includes this header too, so both sides
// compute it with the same code.
#pragma once

#include <loom/sdk/abi.h>
#include <loom/sdk/layout.hpp>
#include <loom/sdk/version.hpp>
#include <torch/version.h>

#include <cstddef>
#include <cstdint>
#include <string_view>

// LOOM_TORCH_CUDA is set by the SDK's CMake target (loom::sdk) from the LibTorch it found:
// the headers of a CPU and a CUDA LibTorch are the same, the libraries are not. So are
// LOOM_TORCH_BUILD (the full version, "2.15.0+cu132"), LOOM_TORCH_GIT (the commit it was built
// from) and LOOM_TORCH_CUDA_VERSION ("13.2", or "none" for a CPU build), read from the LibTorch
// installation (version.py of a wheel, build-version and build-hash of a LibTorch archive).
#ifndef LOOM_TORCH_CUDA
#error "LOOM_TORCH_CUDA is not defined: link the loom::sdk CMake target (or define it to 0 or 1)"
#endif
#ifndef LOOM_TORCH_BUILD
#define LOOM_TORCH_BUILD TORCH_VERSION
#endif
#ifndef LOOM_TORCH_GIT
#define LOOM_TORCH_GIT "unknown"
#endif
#ifndef LOOM_TORCH_CUDA_VERSION
#define LOOM_TORCH_CUDA_VERSION (LOOM_TORCH_CUDA ? "unknown" : "none")
#endif

#define LOOM_STRINGIFY_(x) #x
#define LOOM_STRINGIFY(x) LOOM_STRINGIFY_(x)

#if defined(__clang__)
#define LOOM_COMPILER "clang " __clang_version__
#define LOOM_COMPILER_MAJOR_ "clang " LOOM_STRINGIFY(__clang_major__)
#elif defined(__GNUC__)
#define LOOM_COMPILER "gcc " __VERSION__
#define LOOM_COMPILER_MAJOR_ "gcc " LOOM_STRINGIFY(__GNUC__)
#else
#define LOOM_COMPILER "unknown"
#define LOOM_COMPILER_MAJOR_ "unknown"
#endif

#if defined(_GLIBCXX_USE_CXX11_ABI)
#define LOOM_CXX11_ABI _GLIBCXX_USE_CXX11_ABI
#else
#define LOOM_CXX11_ABI 2
#endif

// The standard library and the switches that change its types' layout.
#if defined(_LIBCPP_VERSION)
#define LOOM_STDLIB "libc++"
#define LOOM_STDLIB_ABI "libc++ abi " LOOM_STRINGIFY(_LIBCPP_ABI_VERSION)
#define LOOM_STDLIB_VERSION LOOM_STRINGIFY(_LIBCPP_VERSION)
#if defined(_LIBCPP_ENABLE_DEBUG_MODE) || (defined(_LIBCPP_HARDENING_MODE) && defined(_LIBCPP_HARDENING_MODE_DEBUG) && _LIBCPP_HARDENING_MODE == _LIBCPP_HARDENING_MODE_DEBUG)
#define LOOM_DEBUG_CONTAINERS "1"
#else
#define LOOM_DEBUG_CONTAINERS "0"
#endif
#elif defined(__GLIBCXX__)
#define LOOM_STDLIB "libstdc++"
#if LOOM_CXX11_ABI == 1
#define LOOM_STDLIB_ABI "cxx11"
#else
#define LOOM_STDLIB_ABI "pre-cxx11"
#endif
#define LOOM_STDLIB_VERSION LOOM_STRINGIFY(_GLIBCXX_RELEASE)
#if defined(_GLIBCXX_DEBUG)
#define LOOM_DEBUG_CONTAINERS "1"
#else
#define LOOM_DEBUG_CONTAINERS "0"
#endif
#else
#define LOOM_STDLIB "other"
#define LOOM_STDLIB_ABI "unknown"
#define LOOM_STDLIB_VERSION "unknown"
#define LOOM_DEBUG_CONTAINERS "0"
#endif

// Sanitizers that change what a library needs from the process (their runtime first in it).
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LOOM_SANITIZE_ADDRESS_ 1
#endif
#if __has_feature(thread_sanitizer)
#define LOOM_SANITIZE_THREAD_ 1
#endif
#if __has_feature(memory_sanitizer)
#define LOOM_SANITIZE_MEMORY_ 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) && !defined(LOOM_SANITIZE_ADDRESS_)
#define LOOM_SANITIZE_ADDRESS_ 1
#endif
#if defined(__SANITIZE_THREAD__) && !defined(LOOM_SANITIZE_THREAD_)
#define LOOM_SANITIZE_THREAD_ 1
#endif

namespace loom::sdk {

/// The fingerprint of this translation unit's build as the descriptor carried it before ABI 1.4
/// (kept filled, and read from plugins older than 1.4; see fingerprint_text for what decides).
inline constexpr loom_build_fingerprint kBuildFingerprint{
    sizeof(loom_build_fingerprint),
    TORCH_VERSION_MAJOR,
    TORCH_VERSION_MINOR,
    TORCH_VERSION_PATCH,
    LOOM_TORCH_CUDA,
    LOOM_CXX11_ABI,
    static_cast<uint32_t>(__cplusplus / 100),
    0,
    LOOM_COMPILER_MAJOR_,
    LOOM_SDK_VERSION,
};

namespace detail {

/// Fixed-capacity text built at compile time.
struct NoteText {
  char text[LOOM_NOTE_CAPACITY]{};
  size_t size = 0;
  constexpr NoteText& put(std::string_view s) {
    for (char c : s)
      if (size + 1 < LOOM_NOTE_CAPACITY) text[size++] = c;
    return *this;
  }
  constexpr NoteText& line(std::string_view key, std::string_view value) {
    return put(key).put("=").put(value).put("\n");
  }
  constexpr NoteText& number_line(std::string_view key, uint64_t value) {
    char digits[21]{};
    int n = 20;
    do {
      digits[--n] = static_cast<char>('0' + value % 10);
      value /= 10;
    } while (value != 0);
    return line(key, std::string_view(digits + n, static_cast<size_t>(20 - n)));
  }
  constexpr NoteText& hex_line(std::string_view key, uint64_t value) {
    char digits[17]{};
    for (int i = 15; i >= 0; --i, value >>= 4) digits[i] = "0123456789abcdef"[value & 0xF];
    return line(key, std::string_view(digits, 16));
  }
};

constexpr std::string_view sanitizers() {
#if defined(LOOM_SANITIZE_ADDRESS_) && defined(LOOM_SANITIZE_THREAD_)
  return "address,thread";
#elif defined(LOOM_SANITIZE_ADDRESS_)
  return "address";
#elif defined(LOOM_SANITIZE_THREAD_)
  return "thread";
#elif defined(LOOM_SANITIZE_MEMORY_)
  return "memory";
#else
  return "none";
#endif
}

}  // namespace detail

/// The fingerprint as "key=value" lines: what decides compatibility (tier, LibTorch's full
/// version, its commit and CUDA version, the standard library, its ABI and debug switches, the
/// sanitizers, the layout of the SDK's value types) and what is only recorded for people
/// (compiler, library release, C++ standard, SDK version). Compared by the host, key by key.
constexpr detail::NoteText fingerprint_text() {
  detail::NoteText t;
  t.line("format", "1")
      .line("tier", "cxx")
      .line("libtorch", LOOM_TORCH_BUILD)
      .line("libtorch_git", LOOM_TORCH_GIT)
      .line("cuda", LOOM_TORCH_CUDA_VERSION)
      .line("stdlib", LOOM_STDLIB)
      .line("stdlib_abi", LOOM_STDLIB_ABI)
      .line("debug_containers", LOOM_DEBUG_CONTAINERS)
      .line("sanitizers", detail::sanitizers())
      .hex_line("layout", kLayoutHash)
      .line("compiler", LOOM_COMPILER)
      .line("stdlib_version", LOOM_STDLIB_VERSION)
      .number_line("cxx_standard", __cplusplus / 100)
      .line("sdk", LOOM_SDK_VERSION);
  return t;
}

namespace detail {

/// An ELF note as the linker lays it out: header, owner name padded to 4 bytes, description.
struct FingerprintNote {
  uint32_t name_size;
  uint32_t desc_size;
  uint32_t type;
  char name[8];
  char desc[LOOM_NOTE_CAPACITY];
};

constexpr FingerprintNote fingerprint_note() {
  FingerprintNote note{sizeof(LOOM_NOTE_NAME), LOOM_NOTE_CAPACITY, LOOM_NOTE_FINGERPRINT, LOOM_NOTE_NAME, {}};
  const NoteText text = fingerprint_text();
  for (size_t i = 0; i < text.size; ++i) note.desc[i] = text.text[i];
  return note;
}

}  // namespace detail
}  // namespace loom::sdk
