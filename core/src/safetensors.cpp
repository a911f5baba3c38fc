// safetensors reading and writing. See safetensors.hpp.
#include <loom/core/error.hpp>
#include <loom/core/files.hpp>
#include <loom/core/safetensors.hpp>
#include <loom/sdk/safetensors.hpp>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <nlohmann/json.hpp>
#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>

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
/// tools) load unchecked. "loom_metadata_crc32" covers the rest of the metadata (metadata_checksum).
struct TensorEntry {
  std::string name, dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

/// The CRC over the entries (by name) and the data, given as consecutive parts.
std::string checksum(std::vector<TensorEntry> entries, const std::vector<std::string_view>& data) {
  std::sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  uLong crc = crc32(0L, Z_NULL, 0);
  for (const auto& e : entries) {
    std::string line = e.name + "|" + e.dtype + "|";
    for (int64_t d : e.shape) line += std::to_string(d) + ",";
    line.append("|").append(std::to_string(e.begin)).append("|").append(std::to_string(e.end)).append("\n");
    crc = crc32(crc, reinterpret_cast<const Bytef*>(line.data()), static_cast<uInt>(line.size()));
  }
  for (const std::string_view part : data)
    for (size_t done = 0; done < part.size();) {  // zlib takes at most 4 GiB at a time
      const size_t chunk = std::min<size_t>(part.size() - done, size_t{1} << 30);
      crc = crc32(crc, reinterpret_cast<const Bytef*>(part.data() + done), static_cast<uInt>(chunk));
      done += chunk;
    }
  char text[16];
  std::snprintf(text, sizeof text, "%08lx", static_cast<unsigned long>(crc));
  return text;
}

/// The CRC over the metadata but its checksums (std::map: by key), each entry length-prefixed:
/// the model and data configuration a best file records, from which `loom eval` rebuilds its
/// model. "loom_metadata_crc32"; files without it (older, or another tool's) are not checked.
std::string metadata_checksum(const sdk::TextMap& metadata) {
  uLong crc = crc32(0L, Z_NULL, 0);
  for (const auto& [key, value] : metadata) {
    if (key == "loom_crc32" || key == "loom_metadata_crc32" || value.size() > (size_t{1} << 30)) continue;
    const std::string entry = std::to_string(key.size()) + ":" + key + std::to_string(value.size()) + ":";
    crc = crc32(crc, reinterpret_cast<const Bytef*>(entry.data()), static_cast<uInt>(entry.size()));
    crc = crc32(crc, reinterpret_cast<const Bytef*>(value.data()), static_cast<uInt>(value.size()));
  }
  char text[16];
  std::snprintf(text, sizeof text, "%08lx", static_cast<unsigned long>(crc));
  return text;
}

/// The metadata's own checksum, where the file has one, else one error naming the file.
void check_metadata(const sdk::TextMap& metadata, const std::string& what, const std::string& advice) {
  if (const auto crc = metadata.find("loom_metadata_crc32"); crc != metadata.end())
    if (const std::string actual = metadata_checksum(metadata); actual != crc->second)
      throw Error(what + " is not a valid safetensors file: the checksum of its metadata is " + actual + ", the file says " +
                  crc->second + ": the configuration it records changed after Loom wrote it (a flipped byte, an edit)" +
                  advice);
}

/// A safetensors file laid out: its header (length and JSON) and its tensors' bytes in order,
/// as views of contiguous CPU tensors it keeps (a CPU tensor that already is contiguous is not
/// copied).
struct Layout {
  std::string header;
  std::vector<at::Tensor> keep;
  std::vector<std::string_view> data;
};

Layout lay_out(const sdk::TensorMap& tensors, const sdk::TextMap& metadata) {
  // Larger alignments first, then by name: every tensor starts aligned to its element size.
  std::vector<std::pair<std::string, at::Tensor>> ordered;
  for (const auto& [name, t] : tensors) ordered.emplace_back(name, t.detach().to(at::kCPU).contiguous());
  std::stable_sort(ordered.begin(), ordered.end(), [](const auto& a, const auto& b) {
    return a.second.element_size() > b.second.element_size();
  });
  Layout out;
  std::vector<TensorEntry> entries;
  uint64_t offset = 0;
  for (const auto& [name, t] : ordered) {
    const size_t bytes = t.numel() * t.element_size();
    entries.push_back({name, dtype_name(t.scalar_type()), t.sizes().vec(), offset, offset + bytes});
    out.data.emplace_back(static_cast<const char*>(t.data_ptr()), bytes);
    out.keep.push_back(t);
    offset += bytes;
  }
  sdk::TextMap all = metadata;
  all["loom_crc32"] = checksum(entries, out.data);  // Note [Checkpoint checksums]
  all["loom_metadata_crc32"] = metadata_checksum(all);
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  header["__metadata__"] = all;
  for (const auto& e : entries) header[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {e.begin, e.end}}};
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');
  const uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out.header.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  out.header += json;
  return out;
}

/// The tensors of safetensors bytes: copies, or, given the file's mapping, views of it that keep
/// it mapped while they live.
sdk::TensorMap parse(const char* bytes, size_t size, const std::string& what, sdk::TextMap* metadata,
                     const std::shared_ptr<const MappedFile>& mapping = nullptr) {
  const std::string advice = "; the checkpoint is damaged, use an earlier one (or --resume auto picks the newest good one)";
  const sdk::SafetensorsHeader header = sdk::parse_safetensors_header(bytes, size, what, advice);
  check_metadata(header.metadata, what, advice);
  if (metadata) *metadata = header.metadata;
  const char* data = bytes + header.data_start;
  const size_t data_size = size - header.data_start;
  sdk::TensorMap out;
  std::vector<TensorEntry> entries;
  for (const auto& e : header.entries) {
    at::Tensor t;
    if (mapping) {
      auto* keep = new std::shared_ptr<const MappedFile>(mapping);
      t = at::from_blob(const_cast<char*>(data + e.begin), e.shape, [keep](void*) { delete keep; },
                        at::TensorOptions().dtype(e.dtype));
    } else {
      t = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
      if (e.end > e.begin) std::memcpy(t.data_ptr(), data + e.begin, e.end - e.begin);
    }
    entries.push_back({e.name, e.dtype_name, e.shape, e.begin, e.end});
    out[e.name] = t;
  }
  if (auto crc = header.metadata.find("loom_crc32"); crc != header.metadata.end()) {  // Note [Checkpoint checksums]
    const std::string actual = checksum(entries, {std::string_view(data, data_size)});
    if (actual != crc->second)
      throw Error(what + " is not a valid safetensors file: its checksum is " + actual + ", the file says " + crc->second +
                  ": its tensors changed after Loom wrote them (a flipped byte, a relabelled dtype)" + advice);
  }
  return out;
}

}  // namespace

std::string to_safetensors(const sdk::TensorMap& tensors, const sdk::TextMap& metadata) {
  const Layout layout = lay_out(tensors, metadata);
  std::string out = layout.header;
  for (const std::string_view part : layout.data) out += part;
  return out;
}

sdk::TensorMap from_safetensors(const std::string& bytes, const std::string& what, sdk::TextMap* metadata) {
  return parse(bytes.data(), bytes.size(), what, metadata);
}

void save_safetensors(const std::filesystem::path& path, const sdk::TensorMap& tensors, const sdk::TextMap& metadata) {
  const Layout layout = lay_out(tensors, metadata);
  std::vector<std::string_view> parts{layout.header};
  parts.insert(parts.end(), layout.data.begin(), layout.data.end());
  write_file_atomic(path, parts);  // streamed: the tensors are not copied into one buffer first
}

sdk::TensorMap load_safetensors(const std::filesystem::path& path, sdk::TextMap* metadata) {
  // No copy of the file and no size cap: the tensors view the mapping (copy-on-write), which
  // stays while any of them lives; a resume copies them into the model and the optimizer.
  const auto file = std::make_shared<const MappedFile>(path);
  return parse(file->data(), file->size(), path.string(), metadata, file);
}

sdk::TextMap load_safetensors_metadata(const std::filesystem::path& path) {
  const MappedFile file(path);  // the header's pages only are read
  sdk::TextMap metadata = sdk::parse_safetensors_header(file.data(), file.size(), path.string(), "").metadata;
  check_metadata(metadata, path.string(), "");
  return metadata;
}

}  // namespace loom::core
