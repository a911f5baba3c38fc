// safetensors reading and writing. See safetensors.hpp.
#include <loom/core/error.hpp>
#include <loom/core/files.hpp>
#include <loom/core/safetensors.hpp>
#include <loom/sdk/safetensors.hpp>

#include <ATen/ops/empty.h>

#include <nlohmann/json.hpp>
#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

namespace loom::core {

namespace {

struct DtypeName {
  c10::ScalarType type;
  const char* name;
};

constexpr DtypeName kDtypes[] = {
    {c10::ScalarType::Bool, "BOOL"},   {c10::ScalarType::Byte, "U8"},      {c10::ScalarType::Char, "I8"},
    {c10::ScalarType::Short, "I16"},   {c10::ScalarType::Int, "I32"},      {c10::ScalarType::Long, "I64"},
    {c10::ScalarType::Half, "F16"},    {c10::ScalarType::BFloat16, "BF16"}, {c10::ScalarType::Float, "F32"},
    {c10::ScalarType::Double, "F64"},
};

const char* dtype_name(c10::ScalarType t) {
  for (const auto& d : kDtypes)
    if (d.type == t) return d.name;
  throw Error(std::string("safetensors: cannot store tensors of type ") + c10::toString(t));
}

/// Note [Checkpoint checksums]
/// Every safetensors file Loom writes carries, in its metadata (so Python's reader still reads
/// it), "loom_crc32": a CRC-32 over each tensor's name, dtype, shape and offsets and over the
/// data. A flipped byte in the data, or a tensor relabelled with another dtype of the same size,
/// then fails the load instead of being trained on. Files without the key (written by other
/// tools) load unchecked.
struct TensorEntry {
  std::string name, dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

std::string checksum(std::vector<TensorEntry> entries, const char* data, size_t size) {
  std::sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  uLong crc = crc32(0L, Z_NULL, 0);
  for (const auto& e : entries) {
    std::string line = e.name + "|" + e.dtype + "|";
    for (int64_t d : e.shape) line += std::to_string(d) + ",";
    line += "|" + std::to_string(e.begin) + "|" + std::to_string(e.end) + "\n";
    crc = crc32(crc, reinterpret_cast<const Bytef*>(line.data()), static_cast<uInt>(line.size()));
  }
  for (size_t done = 0; done < size;) {  // zlib takes at most 4 GiB at a time
    const size_t chunk = std::min<size_t>(size - done, size_t{1} << 30);
    crc = crc32(crc, reinterpret_cast<const Bytef*>(data + done), static_cast<uInt>(chunk));
    done += chunk;
  }
  char text[16];
  std::snprintf(text, sizeof text, "%08lx", static_cast<unsigned long>(crc));
  return text;
}

}  // namespace

std::string to_safetensors(const sdk::TensorMap& tensors, const sdk::TextMap& metadata) {
  // Larger alignments first, then by name: every tensor starts aligned to its element size.
  std::vector<std::pair<std::string, at::Tensor>> ordered;
  for (const auto& [name, t] : tensors) ordered.emplace_back(name, t.detach().to(at::kCPU).contiguous());
  std::stable_sort(ordered.begin(), ordered.end(), [](const auto& a, const auto& b) {
    return a.second.element_size() > b.second.element_size();
  });
  std::vector<TensorEntry> entries;
  std::string data;
  for (const auto& [name, t] : ordered) {
    const size_t bytes = t.numel() * t.element_size();
    entries.push_back({name, dtype_name(t.scalar_type()), t.sizes().vec(), data.size(), data.size() + bytes});
    data.append(static_cast<const char*>(t.data_ptr()), bytes);
  }
  sdk::TextMap all = metadata;
  all["loom_crc32"] = checksum(entries, data.data(), data.size());  // Note [Checkpoint checksums]
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  header["__metadata__"] = all;
  for (const auto& e : entries) header[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {e.begin, e.end}}};
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out;
  out.reserve(8 + json.size() + data.size());
  const uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  out += json;
  out += data;
  return out;
}

sdk::TensorMap from_safetensors(const std::string& bytes, const std::string& what, sdk::TextMap* metadata) {
  const std::string advice = "; the checkpoint is damaged, use an earlier one (or --resume auto picks the newest good one)";
  const sdk::SafetensorsHeader header = sdk::parse_safetensors_header(bytes.data(), bytes.size(), what, advice);
  if (metadata) *metadata = header.metadata;
  const char* data = bytes.data() + header.data_start;
  const size_t data_size = bytes.size() - header.data_start;
  sdk::TensorMap out;
  std::vector<TensorEntry> entries;
  for (const auto& e : header.entries) {
    at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
    if (e.end > e.begin) std::memcpy(t.data_ptr(), data + e.begin, e.end - e.begin);
    entries.push_back({e.name, e.dtype_name, e.shape, e.begin, e.end});
    out[e.name] = t;
  }
  if (auto crc = header.metadata.find("loom_crc32"); crc != header.metadata.end()) {  // Note [Checkpoint checksums]
    const std::string actual = checksum(entries, data, data_size);
    if (actual != crc->second)
      throw Error(what + " is not a valid safetensors file: its checksum is " + actual + ", the file says " + crc->second +
                  ": its tensors changed after Loom wrote them (a flipped byte, a relabelled dtype)" + advice);
  }
  return out;
}

void save_safetensors(const std::filesystem::path& path, const sdk::TensorMap& tensors, const sdk::TextMap& metadata) {
  write_file_atomic(path, to_safetensors(tensors, metadata));
}

sdk::TensorMap load_safetensors(const std::filesystem::path& path, sdk::TextMap* metadata) {
  return from_safetensors(read_file(path), path.string(), metadata);
}

}  // namespace loom::core
