// loom::Error: the one exception type for user-facing errors, in the host and in plugins (it is
// the SDK's type, so a plugin's error reaches the user unchanged).
#pragma once

#include <loom/sdk/error.hpp>

namespace loom {
using Error = sdk::Error;
}  // namespace loom
