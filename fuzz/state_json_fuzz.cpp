// Fuzz target: a checkpoint's state.json as a resume reads it. Expected outcome for bad input:
// loom::Error naming the field.
#include "saved_state.hpp"

#include <loom/core/error.hpp>

#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    (void)loom::core::parse_state_json(text, "state.json", 60000);
  } catch (const loom::Error&) {
  }
  return 0;
}
