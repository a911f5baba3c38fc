// Reading safetensors files. See safetensors.hpp.
#include <loom/sdk/safetensors.hpp>

#include <ATen/ops/from_blob.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string_view>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace loom::sdk {

namespace {

std::optional<c10::ScalarType> dtype_of(const std::string& name) {
  static const std::pair<const char*, c10::ScalarType> kDtypes[] = {
      {"BOOL", c10::ScalarType::Bool}, {"U8", c10::ScalarType::Byte},      {"I8", c10::ScalarType::Char},
      {"I16", c10::ScalarType::Short}, {"I32", c10::ScalarType::Int},      {"I64", c10::ScalarType::Long},
      {"F16", c10::ScalarType::Half},  {"BF16", c10::ScalarType::BFloat16}, {"F32", c10::ScalarType::Float},
      {"F64", c10::ScalarType::Double},
  };
  for (const auto& [text, type] : kDtypes)
    if (name == text) return type;
  return std::nullopt;
}

}  // namespace

SafetensorsHeader parse_safetensors_header(const char* bytes, size_t size, const std::string& what,
                                           const std::string& advice) {
  auto bad = [&](const std::string& why) {
    // (the file's own text in it, a tensor's name or dtype, is shown escaped and short: a name's
    // escape sequences reached the terminal, and a name of megabytes was printed whole)
    std::string shown;
    for (const unsigned char c : std::string_view(why).substr(0, 400)) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      shown += c < 0x20 || c == 0x7f ? std::string(hex) : std::string(1, static_cast<char>(c));
    }
    return Error(what + " is not a valid safetensors file: " + shown + (why.size() > 400 ? "..." : "") + advice);
  };
  if (size < 8) throw bad("shorter than its 8-byte header length");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  if (n > 100'000'000 || 8 + n > size) throw bad("header length " + std::to_string(n) + " is past the end of the file");
  nlohmann::json header;
  try {
    // (no deeper than 64 levels: an entry nested 300000 deep was refused by dump(), whose
    // recursion overflowed the stack: a SIGSEGV loading a pretrained folder or a checkpoint)
    header = nlohmann::json::parse(bytes + 8, bytes + 8 + n, [](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
      if (depth > 64) throw std::length_error("nested more than 64 levels deep, which no tensor entry is");
      return true;
    });
  } catch (const std::exception& e) {
    throw bad(std::string("header is not JSON (") + e.what() + ")");
  }
  if (!header.is_object()) throw bad("header is not a JSON object");
  SafetensorsHeader out;
  out.data_start = 8 + n;
  const uint64_t data_size = size - out.data_start;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it.value().is_object()) throw bad("__metadata__ is not an object of texts");
      for (auto m = it.value().begin(); m != it.value().end(); ++m) {
        if (!m.value().is_string()) throw bad("__metadata__ value '" + m.key() + "' is not text");
        out.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const auto& entry = it.value();
    try {
      SafetensorsEntry e;
      e.name = it.key();
      e.dtype_name = entry.at("dtype").get<std::string>();
      const auto type = dtype_of(e.dtype_name);
      if (!type) throw bad("tensor '" + e.name + "' has an unknown dtype " + entry.at("dtype").dump());
      e.dtype = *type;
      // (each a whole number: nlohmann's get<int64_t>() read a shape of 259.7 as 259, and 1e30 as
      // whatever its cast gives)
      auto whole_numbers = [&](const char* field) {
        const nlohmann::json& list = entry.at(field);
        if (!list.is_array()) throw bad("tensor '" + e.name + "' has a " + field + " that is not a list: " + list.dump().substr(0, 200));
        for (const auto& v : list)
          if (!v.is_number_integer())
            throw bad("tensor '" + e.name + "' has " + field + " " + list.dump().substr(0, 200) + ": each is a whole number");
        return list;
      };
      e.shape = whole_numbers("shape").get<std::vector<int64_t>>();
      const nlohmann::json& offset_list = whole_numbers("data_offsets");
      for (const auto& v : offset_list)
        if (!v.is_number_unsigned()) throw bad("tensor '" + e.name + "' has a negative data offset " + v.dump());
      const auto offsets = offset_list.get<std::vector<uint64_t>>();
      if (offsets.size() != 2 || offsets[0] > offsets[1] || offsets[1] > data_size)
        throw bad("tensor '" + e.name + "' has data offsets outside the file (truncated?)");
      // The size the shape needs, checked against the bytes the file has: a header declaring a
      // huge shape is refused, not allocated.
      uint64_t expected = c10::elementSize(e.dtype);
      for (int64_t d : e.shape) {
        if (d < 0) throw bad("tensor '" + e.name + "' has a negative dimension");
        if (d != 0 && expected > data_size / static_cast<uint64_t>(d))
          throw bad("tensor '" + e.name + "' declares a shape larger than the file");
        expected *= static_cast<uint64_t>(d);
      }
      if (offsets[1] - offsets[0] != expected)
        throw bad("tensor '" + e.name + "' holds " + std::to_string(offsets[1] - offsets[0]) +
                  " bytes but its shape needs " + std::to_string(expected));
      e.begin = offsets[0];
      e.end = offsets[1];
      out.entries.push_back(std::move(e));
    } catch (const nlohmann::json::exception&) {  // (its text, "[json.exception.type_error.304] cannot use at() with array", said nothing)
      throw bad("tensor '" + it.key() + "' is not {\"dtype\": text, \"shape\": [whole numbers], \"data_offsets\": [begin, "
                "end]}: its entry is " + entry.dump().substr(0, 200));
    }
  }
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& e : out.entries) ranges.emplace_back(e.begin, e.end);
  std::sort(ranges.begin(), ranges.end());
  uint64_t end = 0;
  for (const auto& [b, e] : ranges) {
    if (b != end) throw bad("tensor data overlaps or leaves a gap at byte " + std::to_string(b));
    end = e;
  }
  if (end != data_size)
    throw bad("the data is " + std::to_string(data_size) + " bytes but the tensors cover " + std::to_string(end));
  return out;
}

TensorMap map_safetensors(const std::filesystem::path& path, TextMap* metadata) {
  const std::string what = path.string();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);  // O_NONBLOCK: a FIFO does not hang
  if (fd < 0) throw Error("cannot open " + what + ": " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(what + " is not a regular file; point at the folder's model.safetensors");
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    throw Error(what + " is not a valid safetensors file: shorter than its 8-byte header length");
  }
  // Copy-on-write pages: a tensor written in place by a plugin changes its private copy only.
  void* base = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  ::close(fd);  // the mapping keeps the file
  if (base == MAP_FAILED) throw Error("cannot map " + what + ": " + std::strerror(errno));
  // Unmapped when the last tensor viewing it is freed.
  const auto mapping = std::shared_ptr<void>(base, [size](void* p) { ::munmap(p, size); });
  const SafetensorsHeader header = parse_safetensors_header(static_cast<const char*>(base), size, what);
  if (metadata != nullptr) *metadata = header.metadata;
  TensorMap out;
  char* data = static_cast<char*>(base) + header.data_start;
  for (const auto& e : header.entries) {
    auto* keep = new std::shared_ptr<void>(mapping);
    out[e.name] = at::from_blob(
        data + e.begin, e.shape, [keep](void*) { delete keep; }, at::TensorOptions().dtype(e.dtype));
  }
  return out;
}

}  // namespace loom::sdk
