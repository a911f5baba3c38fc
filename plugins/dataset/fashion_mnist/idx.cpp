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
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <vector>

namespace fs = std::filesystem;

namespace loom::fashion_mnist {

namespace {

struct GzFile {
  explicit GzFile(const fs::path& path) : path(path) {
    // Only a regular file is read: opening without blocking and checking the type first means a
    // FIFO or a device in the data folder is an error, not a hang or an endless read.
    const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) throw loom::sdk::Error("cannot open " + path.string() + ": " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      throw loom::sdk::Error("cannot read " + path.string() + ": not a regular file; point data.path at the Fashion-MNIST files");
    }
    handle = gzdopen(fd, "rb");
    if (handle == nullptr) {
      ::close(fd);
      throw loom::sdk::Error("cannot open " + path.string());
    }
  }
  ~GzFile() {
    if (handle != nullptr) gzclose(handle);
  }
  GzFile(const GzFile&) = delete;
  GzFile& operator=(const GzFile&) = delete;

  /// After a read: the file holds no gzip stream (zlib reads such a file as it is).
  bool plain() const { return gzdirect(handle) == 1; }

  /// Reads up to n bytes; returns how many it read. A corrupt stream is an error.
  int64_t read(void* out, int64_t n) {
    auto* p = static_cast<char*>(out);
    int64_t done = 0;
    while (done < n) {
      const unsigned chunk = static_cast<unsigned>(std::min<int64_t>(n - done, 1 << 30));
      const int got = gzread(handle, p + done, chunk);
      if (got < 0) {
        int code = 0;
        std::string message = gzerror(handle, &code) ? gzerror(handle, &code) : "gzip error";
        if (message.rfind("<fd:", 0) == 0 && message.find(": ") != std::string::npos)
          message = message.substr(message.find(": ") + 2);  // zlib's name for a gzdopen'd file: "<fd:3>: "
        throw loom::sdk::Error(path.string() + " is corrupt: " + message +
                               "; reinstall dataset-fashion-mnist or download the file again");
      }
      if (got == 0) {
        // (zlib's end of a stream cut short, in its data or its trailer of checksum and size, is a
        // soft error, Z_BUF_ERROR, beside a read of 0: the file was taken, its checksum unchecked)
        int code = Z_OK;
        (void)gzerror(handle, &code);
        if (code == Z_BUF_ERROR)
          throw loom::sdk::Error(path.string() + " is truncated: its gzip stream ends before its end (and its checksum); "
                                 "reinstall dataset-fashion-mnist or download the file again");
        break;
      }
      done += got;
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

  fs::path path;
  gzFile handle = nullptr;
};

/// "X is not an IDX image file: magic number M, expected E" with what the file is instead.
loom::sdk::Error not_idx(const GzFile& file, const fs::path& path, const char* what, uint32_t magic, uint32_t expected) {
  std::string text = path.string() + " is not an IDX " + what + " file: magic number " + std::to_string(magic) +
                     ", expected " + std::to_string(expected);
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
