// loom::Error: the one exception type for user-facing errors, in the host and in plugins (it is
// the SDK's type, so a plugin's error reaches the user unchanged).
#pragma once

#include <loom/sdk/error.hpp>

#include <filesystem>
#include <string>

namespace c10 {
class Error;
}  // namespace c10

namespace loom {
using Error = sdk::Error;

/// A checkpoint that is intact but does not fit this run (another model configuration,
/// precision, or tensor shapes): the user's choice to make, so `--resume auto` stops on it
/// instead of falling back to an older checkpoint as it does for damage.
class ResumeRefused : public Error {
 public:
  using Error::Error;
};

/// A training step's out-of-memory that no memory policy recovered from, with the advice of what
/// would help (Trainer::oom_advice): a command that holds memory of its own (loom profile's records)
/// adds what it holds.
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

/// A LibTorch error's text for the user, without its C++ backtrace: a host allocation that
/// failed (DefaultCPUAllocator's "[enforce fail at alloc_cpu.cpp:127] err == 0. ... you tried to
/// allocate N bytes") says what it means and what to do instead.
std::string explained(const c10::Error& e);
/// A std::filesystem error as "cannot create directories runs/x: Not a directory (a part of that
/// path is a file, not a folder: ...)", without libstdc++'s "filesystem error:" and brackets.
std::string explained(const std::filesystem::filesystem_error& e);
}  // namespace loom
