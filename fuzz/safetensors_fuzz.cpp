// Fuzz target: the bytes of a safetensors file (a checkpoint's model.safetensors, optimizer.
// safetensors, a best file, Hugging Face weights) as the reader parses them. Expected outcome
// for bad input: loom::Error; never an allocation larger than the input promises to hold.
#include <loom/core/error.hpp>
#include <loom/core/safetensors.hpp>

#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  try {
    loom::sdk::TextMap metadata;
    (void)loom::core::from_safetensors(bytes, "fuzz.safetensors", &metadata);
  } catch (const loom::Error&) {
  }
  return 0;
}
