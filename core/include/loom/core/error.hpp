// loom::Error: the one exception type for user-facing errors, in the host and in plugins (it is
// the SDK's type, so a plugin's error reaches the user unchanged).
#pragma once

#include <loom/sdk/error.hpp>

namespace loom {
using Error = sdk::Error;

/// A checkpoint that is intact but does not fit this run (another model configuration,
/// precision, or tensor shapes): the user's choice to make, so `--resume auto` stops on it
/// instead of falling back to an older checkpoint as it does for damage.
class ResumeRefused : public Error {
 public:
  using Error::Error;
};
}  // namespace loom
