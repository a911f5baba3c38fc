// Reading safetensors files (Hugging Face's format: an 8-byte little-endian header length, a
// JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {text: text}}, then the
// tensors' bytes) for plugins: a model plugin loads pretrained weights (a Hugging Face
// model.safetensors) with map_safetensors, which maps the file instead of reading it, so a 500 MB
// checkpoint costs no 500 MB copy before the weights are copied into the model. Loom's own
// checkpoints go through the same header checks (core/src/safetensors.cpp).
#pragma once

#include <loom/sdk/error.hpp>
#include <loom/sdk/types.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace loom::sdk {

/// One tensor of a safetensors file as its header describes it (checked: a known dtype, a shape
/// whose size matches its bytes, inside the file).
struct SafetensorsEntry {
  std::string name;
  std::string dtype_name;  ///< as written: "F32", "BF16", ...
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  ///< byte offsets in the data section
};

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;  ///< in the header's order
  TextMap metadata;                       ///< "__metadata__"
  uint64_t data_start = 0;                ///< where the data section begins in the file
};

/// Parses and checks the header of safetensors bytes (`size` bytes at `bytes`): throws Error
/// "<what> is not a valid safetensors file: <why><advice>" on a short file, a header out of
/// bounds, bad JSON, an unknown dtype, a shape that does not match its bytes, or data that
/// overlaps or leaves gaps. Nothing is allocated from the header's claims before they are checked
/// against the file's size.
LOOM_SDK_API SafetensorsHeader parse_safetensors_header(const char* bytes, size_t size, const std::string& what,
                                                        const std::string& advice = "");

/// Opens a safetensors file memory-mapped: each tensor is a CPU tensor viewing the mapping
/// (copy-on-write: writing to one changes neither the file nor the other tensors), and the file
/// stays mapped while any of them lives. Throws Error naming the file when it cannot be opened
/// or is not valid.
LOOM_SDK_API TensorMap map_safetensors(const std::filesystem::path& path, TextMap* metadata = nullptr);

}  // namespace loom::sdk
