// safetensors files (huggingface/safetensors format): an 8-byte little-endian header length, a
// JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {string: string}}, then the
// tensors' bytes, contiguous and in header order. Loom writes checkpoints in this format so any
// safetensors reader (Python's `safetensors`, for one) can open them.
#pragma once

#include <loom/sdk/types.hpp>

#include <filesystem>
#include <string>

namespace loom::core {

/// Serializes tensors (copied to CPU, contiguous) and string metadata into safetensors bytes.
std::string to_safetensors(const sdk::TensorMap& tensors, const sdk::TextMap& metadata = {});

/// Parses safetensors bytes. Throws loom::Error naming `what` (usually the file) on anything
/// malformed: short file, header out of bounds, bad JSON, unknown dtype, offsets that overlap,
/// leave gaps or do not match the shape.
sdk::TensorMap from_safetensors(const std::string& bytes, const std::string& what,
                                sdk::TextMap* metadata = nullptr);

/// Atomically writes a safetensors file.
void save_safetensors(const std::filesystem::path& path, const sdk::TensorMap& tensors,
                      const sdk::TextMap& metadata = {});

/// Reads a safetensors file, memory-mapped: the tensors view the file (copy-on-write) and keep it
/// mapped while they live.
sdk::TensorMap load_safetensors(const std::filesystem::path& path, sdk::TextMap* metadata = nullptr);

/// The metadata of a safetensors file, from its header alone: its tensors are neither read nor
/// checked against their checksum.
sdk::TextMap load_safetensors_metadata(const std::filesystem::path& path);

}  // namespace loom::core
