// The exception Loom code throws for a user-facing error: a message that names the thing and
// the value and, where it can, says how to fix it. Plugins throw it from their factories and
// Tier-1 methods; the host reports its message as is.
#pragma once

#include <stdexcept>
#include <string>

#define LOOM_SDK_API __attribute__((visibility("default")))

namespace loom::sdk {

class LOOM_SDK_API Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
  ~Error() override;  // defined in libloom_sdk: one type_info for host and plugins
};

}  // namespace loom::sdk
