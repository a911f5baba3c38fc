// The IDX reader of idx.hpp. Every file is checked (a regular file, magic number, counts, sizes,
// labels in range, no truncated or trailing bytes); a bad one is one error that names the file
// and what is wrong. Data are read in chunks and stored only as they arrive, so a header that
// promises more than the file holds costs nothing before the file runs out.
#include "idx.hpp"

#include <loom/sdk/error.hpp>

#include <ATen/ops/empty.h>

#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <vector>

namespace fs = std::filesystem;

namespace loom::fashion_mnist {

namespace {

/// One IDX file, plain or gzip-compressed (the first two bytes say which), read through zlib's
/// inflate rather than its gz* reader: gzread passes over bytes after the last gzip member that do
/// not start another one, so a file with junk appended read as whole. Here the file must end where
/// its last member ends, each member's checksum and size checked.
struct GzFile {
  explicit GzFile(const fs::path& path) : path(path), buffer(kBuffer) {
    // Only a regular file is read: opening without blocking and checking the type first means a
    // FIFO or a device in the data folder is an error, not a hang or an endless read.
    fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) throw loom::sdk::Error("cannot open " + path.string() + ": " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      throw loom::sdk::Error("cannot read " + path.string() + ": not a regular file; point data.path at the Fashion-MNIST files");
    }
    try {
      gzip = starts_a_member();
    } catch (...) {
      ::close(fd);
      throw;
    }
    if (gzip && inflateInit2(&z, 16 + MAX_WBITS) != Z_OK) {  // 16: the gzip wrapper, its CRC-32 and size checked
      ::close(fd);
      throw loom::sdk::Error("cannot read " + path.string() + ": zlib could not start (out of memory?)");
    }
  }
  ~GzFile() {
    if (gzip) inflateEnd(&z);
    ::close(fd);
  }
  GzFile(const GzFile&) = delete;
  GzFile& operator=(const GzFile&) = delete;

  /// The file holds no gzip stream (and is read as it is).
  bool plain() const { return !gzip; }

  /// Reads up to n bytes; returns how many it read, fewer only at the data's end. A corrupt or
  /// truncated stream, or bytes after the last gzip member, is an error.
  int64_t read(void* out, int64_t n) {
    auto* p = static_cast<unsigned char*>(out);
    int64_t done = 0;
    while (done < n && !ended) {
      const bool more = z.avail_in > 0 || fill() > 0;  // (false: the file's end)
      if (!gzip) {
        if (!more) break;
        const auto take = static_cast<uInt>(std::min<int64_t>(n - done, z.avail_in));
        std::memcpy(p + done, z.next_in, take);
        z.next_in += take;
        z.avail_in -= take;
        done += take;
        continue;
      }
      z.next_out = p + done;
      z.avail_out = static_cast<uInt>(std::min<int64_t>(n - done, 1 << 30));
      const uInt room = z.avail_out;
      // (at the file's end inflate may still have output from what it holds: a stream is cut short
      // only where it can make no progress without more input)
      const int code = inflate(&z, Z_NO_FLUSH);
      const uInt produced = room - z.avail_out;
      done += produced;
      if (!more && code != Z_STREAM_END && produced == 0 && (code == Z_OK || code == Z_BUF_ERROR))
        throw loom::sdk::Error(path.string() + " is truncated: its gzip stream ends before its end (and its checksum); "
                               "reinstall dataset-fashion-mnist or download the file again");
      if (code == Z_STREAM_END) {
        // Another member may follow (gzip's own concatenation); anything else is not gzip data.
        if (!starts_a_member()) {
          if (z.avail_in == 0) {
            ended = true;
          } else {
            throw loom::sdk::Error(path.string() + " has bytes after its gzip stream: the file is damaged or "
                                   "something was appended to it; download it again");
          }
        } else if (inflateReset(&z) != Z_OK) {
          throw loom::sdk::Error(path.string() + " is corrupt: zlib could not read its next gzip member");
        }
      } else if (code != Z_OK && code != Z_BUF_ERROR) {
        throw loom::sdk::Error(path.string() + " is corrupt: " + (z.msg != nullptr ? z.msg : "gzip error " + std::to_string(code)) +
                               "; reinstall dataset-fashion-mnist or download the file again");
      }
    }
    return done;
  }

  /// Reads up to n bytes in chunks of 1 MiB, keeping only what arrived.
  std::vector<uint8_t> read_up_to(int64_t n) {
    std::vector<uint8_t> out;
    constexpr int64_t kChunk = 1 << 20;
    while (static_cast<int64_t>(out.size()) < n) {
      const int64_t want = std::min<int64_t>(kChunk, n - static_cast<int64_t>(out.size()));
      const size_t at = out.size();
      out.resize(at + static_cast<size_t>(want));
      const int64_t got = read(out.data() + at, want);
      out.resize(at + static_cast<size_t>(got));
      if (got < want) break;
    }
    return out;
  }

  uint32_t read_be32(const char* what) {
    std::array<unsigned char, 4> b{};
    if (read(b.data(), 4) != 4)
      throw loom::sdk::Error(path.string() + " is truncated: it ends inside the header (" + what + ")");
    return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | uint32_t{b[3]};
  }

  void expect_end() {
    unsigned char extra[64];
    const int64_t n = read(extra, sizeof extra);
    if (n > 0)
      throw loom::sdk::Error(path.string() + " has unexpected bytes after its data: the file is not an IDX "
                             "file of the size its header says; download it again");
  }

  /// Whether the unread input starts with gzip's magic bytes (reading more of the file to see).
  bool starts_a_member() {
    if (z.avail_in < 2) fill();
    if (z.avail_in < 2) fill();  // a read may stop short once
    return z.avail_in >= 2 && z.next_in[0] == 0x1f && z.next_in[1] == 0x8b;
  }

  /// Moves the unread input to the buffer's start and reads more of the file behind it; returns
  /// the bytes read, 0 at the file's end.
  size_t fill() {
    if (z.avail_in > 0 && z.next_in != buffer.data()) std::memmove(buffer.data(), z.next_in, z.avail_in);
    z.next_in = buffer.data();
    for (;;) {
      const ssize_t got = ::read(fd, buffer.data() + z.avail_in, buffer.size() - z.avail_in);
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) throw loom::sdk::Error("cannot read " + path.string() + ": " + std::strerror(errno));
      z.avail_in += static_cast<uInt>(got);
      return static_cast<size_t>(got);
    }
  }

  static constexpr size_t kBuffer = 1 << 16;
  fs::path path;
  std::vector<unsigned char> buffer;
  z_stream z{};  // its next_in and avail_in are the unread input, in either kind of file
  int fd = -1;
  bool gzip = false;
  bool ended = false;  // the last gzip member's end, at the file's end
};

/// "X is not an IDX image file: magic number M, expected E" with what the file is instead.
loom::sdk::Error not_idx(const GzFile& file, const fs::path& path, const char* what, uint32_t magic, uint32_t expected) {
  // (in hex, as IDX writes it: 0x00000D03 against 0x00000803 shows the type byte is what differs)
  const auto hex = [](uint32_t v) {
    char text[16];
    std::snprintf(text, sizeof text, "0x%08X", v);
    return std::string(text);
  };
  std::string text = path.string() + " is not an IDX " + what + " file: magic number " + hex(magic) + ", expected " +
                     hex(expected);
  // (the other file of the pair in its place: the four files' names mixed up)
  if (magic == kImageMagic || magic == kLabelMagic)
    text += std::string(" (the magic number of an IDX ") + (magic == kImageMagic ? "image" : "label") +
            " file: the files' names are swapped?)";
  if (path.extension() == ".gz" && file.plain()) text += " (and it holds no gzip data, though its name ends in .gz)";
  return loom::sdk::Error(text + "; download the Fashion-MNIST files again (scripts/setup.sh installs them)");
}

}  // namespace

at::Tensor read_images(const fs::path& path) {
  GzFile images(path);
  const uint32_t magic = images.read_be32("magic number");
  if (magic != kImageMagic) throw not_idx(images, path, "image", magic, kImageMagic);
  const int64_t count = images.read_be32("image count");
  const int64_t rows = images.read_be32("rows"), cols = images.read_be32("columns");
  if (rows != 28 || cols != 28 || count <= 0 || count > kMaxImages)
    throw loom::sdk::Error(path.string() + ": header says " + std::to_string(count) + " images of " +
                           std::to_string(rows) + "x" + std::to_string(cols) + ", expected 1 to " +
                           std::to_string(kMaxImages) + " images of 28x28");
  const int64_t bytes = count * rows * cols;
  const std::vector<uint8_t> data = images.read_up_to(bytes);
  if (static_cast<int64_t>(data.size()) != bytes)
    throw loom::sdk::Error(path.string() + " is truncated: its header promises " + std::to_string(count) +
                           " images (" + std::to_string(bytes) + " bytes of pixels) but it holds " +
                           std::to_string(data.size()) + "; download it again");
  images.expect_end();
  at::Tensor pixels = at::empty({count, 1, rows, cols}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(pixels.data_ptr(), data.data(), data.size());
  return pixels;
}

at::Tensor read_labels(const fs::path& path, int64_t count, const std::string& images_file) {
  GzFile labels_file(path);
  const uint32_t label_magic = labels_file.read_be32("magic number");
  if (label_magic != kLabelMagic) throw not_idx(labels_file, path, "label", label_magic, kLabelMagic);
  const int64_t label_count = labels_file.read_be32("label count");
  if (label_count != count)
    throw loom::sdk::Error(path.string() + " has " + std::to_string(label_count) + " labels but " + images_file +
                           " has " + std::to_string(count) + " images");
  const std::vector<uint8_t> raw = labels_file.read_up_to(count);
  if (static_cast<int64_t>(raw.size()) != count)
    throw loom::sdk::Error(path.string() + " is truncated: its header promises " + std::to_string(count) +
                           " labels but it holds " + std::to_string(raw.size()) + "; download it again");
  labels_file.expect_end();
  at::Tensor labels = at::empty({count}, at::TensorOptions().dtype(at::kLong));
  auto* out = labels.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    if (raw[static_cast<size_t>(i)] >= kClasses)
      throw loom::sdk::Error(path.string() + ": label " + std::to_string(raw[static_cast<size_t>(i)]) + " of image " +
                             std::to_string(i) + " is not a class (0 to 9)");
    out[i] = raw[static_cast<size_t>(i)];
  }
  return labels;
}

}  // namespace loom::fashion_mnist
