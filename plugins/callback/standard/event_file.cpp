// TensorBoard event files (event_file.hpp): TFRecord framing and hand-encoded protobuf.
#include "event_file.hpp"

#include <loom/sdk/error.hpp>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <unistd.h>

namespace fs = std::filesystem;

namespace loom::callbacks {

namespace {

const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

uint32_t masked_crc(const void* data, size_t size) {
  const uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xA282EAD8u;
}

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

template <class T>
void put_le(std::string& out, T v) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &v, sizeof(T));
  out.append(bytes, sizeof(T));
}

void put_bytes_field(std::string& out, int field, const std::string& bytes) {
  put_varint(out, static_cast<uint64_t>(field) << 3 | 2);
  put_varint(out, bytes.size());
  out += bytes;
}

std::string event_header(int64_t step) {
  std::string e;
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  e.push_back(0x09);  // wall_time, field 1, fixed64
  put_le(e, now);
  e.push_back(0x10);  // step, field 2, varint
  put_varint(e, static_cast<uint64_t>(step));
  return e;
}

std::string hostname() {
  char name[256] = {0};
  if (::gethostname(name, sizeof name - 1) != 0) return "localhost";
  return name;
}

}  // namespace

uint32_t crc32c(const void* data, size_t size, uint32_t crc) {
  const auto& table = crc_table();
  crc = ~crc;
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

EventFileWriter::EventFileWriter(const fs::path& dir) {
  // (its folder again where it was removed, but not the folders above it: the run folder moved
  // away mid-run was made again at its old path)
  fs::create_directory(dir);
  const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(
                           std::chrono::system_clock::now().time_since_epoch()).count();
  // Unique even when two writers start within the same second (a resumed run).
  fs::path p;
  for (int i = 0;; ++i) {
    p = dir / ("events.out.tfevents." + std::to_string(seconds) + "." + hostname() + (i ? "." + std::to_string(i) : ""));
    if (!fs::exists(p)) break;
  }
  path_ = p;
  out_.open(path_, std::ios::binary | std::ios::app);
  if (!out_) throw loom::sdk::Error("cannot create the TensorBoard file " + path_.string());
  std::string e = event_header(0);
  put_bytes_field(e, 3, "brain.Event:2");  // file_version
  write_event(e);
}

void EventFileWriter::write_event(const std::string& event) {
  std::string record;
  const uint64_t length = event.size();
  put_le(record, length);
  put_le(record, masked_crc(&length, sizeof length));
  record += event;
  put_le(record, masked_crc(event.data(), event.size()));
  // A failed write throws, the file cut back to its last whole record; the callback says it and
  // the run goes on without its events (TensorBoard::on_log).
  append_whole(out_, path_, record);
}

void append_whole(std::ofstream& out, const std::filesystem::path& path, const std::string& bytes) {
  std::error_code ec;
  const std::uintmax_t before = std::filesystem::file_size(path, ec);  // (every append is flushed: the file's size is all of it)
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.flush();
  if (out) return;
  const int code = errno;
  out.close();
  std::error_code cut;
  if (!ec) std::filesystem::resize_file(path, before, cut);
  std::string why = code != 0 ? std::strerror(code) : "a write failed";
  if (code == ENOSPC) why += ": the disk is full";
  else if (code == EDQUOT) why += ": this user's disk quota is used up";
  else if (code == EFBIG) why += ": the file-size limit of this process (`ulimit -f`)";
  throw loom::sdk::Error("cannot write " + path.string() + " (" + why + ")" +
                         (!ec && !cut ? "; it is kept as it was before this write (no half line or record)" : "") +
                         "; free space or raise the limit, then run it again (--resume auto continues from its last checkpoint, "
                         "where it has one: the lines below say)");
}

void EventFileWriter::purge_from(int64_t step) {
  std::string e = event_header(step);
  std::string session_log;
  session_log.push_back(0x08);  // status, field 1, varint
  put_varint(session_log, 1);   // START
  put_bytes_field(e, 7, session_log);  // Event.session_log (6 is the deprecated log_message)
  write_event(e);
}

void EventFileWriter::scalar(const std::string& tag, int64_t step, double value) {
  std::string v;
  put_bytes_field(v, 1, tag);  // Value.tag
  v.push_back(0x15);           // Value.simple_value, field 2, fixed32
  put_le(v, static_cast<float>(value));
  std::string summary;
  put_bytes_field(summary, 1, v);  // Summary.value
  std::string e = event_header(step);
  put_bytes_field(e, 5, summary);  // Event.summary
  write_event(e);
}

}  // namespace loom::callbacks
