// safetensors reading and writing. See safetensors.hpp.
#include <loom/core/error.hpp>
#include <loom/core/files.hpp>
#include <loom/core/safetensors.hpp>

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

std::optional<c10::ScalarType> dtype_of(const std::string& name) {
  for (const auto& d : kDtypes)
    if (name == d.name) return d.type;
  return std::nullopt;
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
  auto bad = [&](const std::string& why) {
    return Error(what + " is not a valid safetensors file: " + why +
                 "; the checkpoint is damaged, use an earlier one (or --resume auto picks the newest good one)");
  };
  if (bytes.size() < 8) throw bad("shorter than its 8-byte header length");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  if (n > 100'000'000 || 8 + n > bytes.size()) throw bad("header length " + std::to_string(n) + " is past the end of the file");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<std::ptrdiff_t>(n));
  } catch (const std::exception& e) {
    throw bad(std::string("header is not JSON (") + e.what() + ")");
  }
  if (!header.is_object()) throw bad("header is not a JSON object");
  const size_t data_start = 8 + n;
  const size_t data_size = bytes.size() - data_start;
  sdk::TensorMap out;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  std::vector<TensorEntry> entries;
  std::string expected_crc;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it.value().is_object()) throw bad("__metadata__ is not an object of texts");
      for (auto m = it.value().begin(); m != it.value().end(); ++m) {
        if (!m.value().is_string()) throw bad("__metadata__ value '" + m.key() + "' is not text");
        if (m.key() == "loom_crc32") expected_crc = m.value().get<std::string>();
        if (metadata) (*metadata)[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const auto& entry = it.value();
    try {
      const auto type = dtype_of(entry.at("dtype").get<std::string>());
      if (!type) throw bad("tensor '" + it.key() + "' has an unknown dtype " + entry.at("dtype").dump());
      const auto shape = entry.at("shape").get<std::vector<int64_t>>();
      const auto offsets = entry.at("data_offsets").get<std::vector<uint64_t>>();
      if (offsets.size() != 2 || offsets[0] > offsets[1] || offsets[1] > data_size)
        throw bad("tensor '" + it.key() + "' has data offsets outside the file (truncated?)");
      // The size the shape needs, checked against the bytes the file has before anything is
      // allocated: a header declaring a huge shape is refused, not allocated.
      uint64_t expected = c10::elementSize(*type);
      for (int64_t d : shape) {
        if (d < 0) throw bad("tensor '" + it.key() + "' has a negative dimension");
        if (d != 0 && expected > data_size / static_cast<uint64_t>(d))
          throw bad("tensor '" + it.key() + "' declares a shape larger than the file");
        expected *= static_cast<uint64_t>(d);
      }
      if (offsets[1] - offsets[0] != expected)
        throw bad("tensor '" + it.key() + "' holds " + std::to_string(offsets[1] - offsets[0]) +
                  " bytes but its shape needs " + std::to_string(expected));
      at::Tensor t = at::empty(shape, at::TensorOptions().dtype(*type));
      if (expected) std::memcpy(t.data_ptr(), bytes.data() + data_start + offsets[0], expected);
      ranges.emplace_back(offsets[0], offsets[1]);
      entries.push_back({it.key(), entry.at("dtype").get<std::string>(), shape, offsets[0], offsets[1]});
      out[it.key()] = t;
    } catch (const nlohmann::json::exception& e) {
      throw bad("tensor '" + it.key() + "': " + e.what());
    }
  }
  std::sort(ranges.begin(), ranges.end());
  uint64_t end = 0;
  for (const auto& [b, e] : ranges) {
    if (b != end) throw bad("tensor data overlaps or leaves a gap at byte " + std::to_string(b));
    end = e;
  }
  if (end != data_size) throw bad("the data is " + std::to_string(data_size) + " bytes but the tensors cover " + std::to_string(end));
  if (!expected_crc.empty()) {
    const std::string actual = checksum(entries, bytes.data() + data_start, data_size);
    if (actual != expected_crc)
      throw bad("its checksum is " + actual + ", the file says " + expected_crc +
                ": its tensors changed after Loom wrote them (a flipped byte, a relabelled dtype)");
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
