// fashion_mnist: the Fashion-MNIST images (28x28 grey, 10 classes; 60,000 train, 10,000 test)
// read from the IDX files, gzipped or not, of Debian's dataset-fashion-mnist package or of
// `path`. Every file is checked (magic number, counts, sizes, labels in range, no truncated or
// trailing bytes); a bad one is one error that names the file and what is wrong.
#include <loom/sdk/sdk.hpp>
#include <loom/sdk/tensor_dataset.hpp>

#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/tensor.h>

#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <filesystem>
#include <memory>

namespace fs = std::filesystem;

namespace {

constexpr uint32_t kImageMagic = 0x00000803;  // unsigned byte, 3 dimensions
constexpr uint32_t kLabelMagic = 0x00000801;  // unsigned byte, 1 dimension
constexpr int64_t kClasses = 10;

struct GzFile {
  explicit GzFile(const fs::path& path) : path(path) {
    // Only a regular file is read: opening without blocking and checking the type first means a
    // FIFO or a device in the data folder is an error, not a hang or an endless read.
    const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) throw loom::sdk::Error("cannot open " + path.string() + ": " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      throw loom::sdk::Error("cannot read " + path.string() + ": not a regular file; point data_dir at the Fashion-MNIST files");
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

  /// Reads up to n bytes; returns how many it read. A corrupt stream is an error.
  int64_t read(void* out, int64_t n) {
    auto* p = static_cast<char*>(out);
    int64_t done = 0;
    while (done < n) {
      const unsigned chunk = static_cast<unsigned>(std::min<int64_t>(n - done, 1 << 30));
      const int got = gzread(handle, p + done, chunk);
      if (got < 0) {
        int code = 0;
        const char* message = gzerror(handle, &code);
        throw loom::sdk::Error(path.string() + " is corrupt: " + (message ? message : "gzip error") +
                               "; reinstall dataset-fashion-mnist or download the file again");
      }
      if (got == 0) break;
      done += got;
    }
    return done;
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

class FashionMnist final : public loom::sdk::TensorDataset {
 public:
  static constexpr loom_option_spec kOptions[] = {
      loom::sdk::option_string("path", "/usr/share/datasets/fashion-mnist",
                               "folder with train-images-idx3-ubyte[.gz] and the three other IDX files"),
      loom::sdk::option_int("limit_train", "0", "use only the first N training images (0: all)"),
      loom::sdk::option_int("limit_test", "0", "use only the first N test images (0: all)"),
  };

  explicit FashionMnist(const loom::sdk::Options& options)
      : TensorDataset("fashion_mnist"),
        folder_(options.get_string("path")),
        limit_train_(options.get_int("limit_train")),
        limit_test_(options.get_int("limit_test")) {
    if (limit_train_ < 0 || limit_test_ < 0) throw loom::sdk::Error("fashion_mnist: limits must be >= 0");
  }

  void setup() override {
    const auto [train_images, train_labels] = read_split("train", limit_train_);
    const auto [test_images, test_labels] = read_split("t10k", limit_test_);
    set_split(loom::sdk::Split::kTrain, {{"image", train_images}, {"label", train_labels}});
    set_split(loom::sdk::Split::kTest, {{"image", test_images}, {"label", test_labels}});
    loom::sdk::log::info("Fashion-MNIST from ", folder_.string(), ": ", train_images.size(0), " train, ",
                         test_images.size(0), " test images");
  }

  loom::sdk::DataSpec spec() const override {
    loom::sdk::DataSpec spec;
    spec.fields["image"] = {{1, 28, 28}, c10::ScalarType::Byte};
    spec.fields["label"] = {{}, c10::ScalarType::Long};
    spec.input_key = "image";
    spec.target_key = "label";
    spec.num_classes = kClasses;
    // Pixel statistics of the training set, for models that normalize their input.
    spec.attributes["mean"] = "0.2860";
    spec.attributes["std"] = "0.3530";
    return spec;
  }

 private:
  fs::path find(const std::string& stem) const {
    for (const char* suffix : {".gz", ""}) {
      const fs::path p = folder_ / (stem + suffix);
      if (fs::is_regular_file(p)) return p;
    }
    throw loom::sdk::Error("fashion_mnist: " + (folder_ / stem).string() + "[.gz] not found; install Debian's "
                           "dataset-fashion-mnist package (scripts/setup.sh does) or set data.path to a "
                           "folder with the four IDX files");
  }

  std::pair<at::Tensor, at::Tensor> read_split(const std::string& prefix, int64_t limit) const {
    const fs::path image_path = find(prefix + "-images-idx3-ubyte");
    const fs::path label_path = find(prefix + "-labels-idx1-ubyte");

    GzFile images(image_path);
    const uint32_t magic = images.read_be32("magic number");
    if (magic != kImageMagic)
      throw loom::sdk::Error(image_path.string() + " is not an IDX image file: magic number " + std::to_string(magic) +
                             ", expected " + std::to_string(kImageMagic));
    const int64_t count = images.read_be32("image count");
    const int64_t rows = images.read_be32("rows"), cols = images.read_be32("columns");
    if (rows != 28 || cols != 28 || count <= 0 || count > 1'000'000)
      throw loom::sdk::Error(image_path.string() + ": header says " + std::to_string(count) + " images of " +
                             std::to_string(rows) + "x" + std::to_string(cols) + ", expected 28x28 images");
    at::Tensor pixels = at::empty({count, 1, rows, cols}, at::TensorOptions().dtype(at::kByte));
    const int64_t bytes = count * rows * cols;
    const int64_t got = images.read(pixels.data_ptr(), bytes);
    if (got != bytes)
      throw loom::sdk::Error(image_path.string() + " is truncated: its header promises " + std::to_string(count) +
                             " images (" + std::to_string(bytes) + " bytes of pixels) but it holds " +
                             std::to_string(got) + "; download it again");
    images.expect_end();

    GzFile labels_file(label_path);
    const uint32_t label_magic = labels_file.read_be32("magic number");
    if (label_magic != kLabelMagic)
      throw loom::sdk::Error(label_path.string() + " is not an IDX label file: magic number " +
                             std::to_string(label_magic) + ", expected " + std::to_string(kLabelMagic));
    const int64_t label_count = labels_file.read_be32("label count");
    if (label_count != count)
      throw loom::sdk::Error(label_path.string() + " has " + std::to_string(label_count) + " labels but " +
                             image_path.filename().string() + " has " + std::to_string(count) + " images");
    at::Tensor raw = at::empty({count}, at::TensorOptions().dtype(at::kByte));
    const int64_t label_got = labels_file.read(raw.data_ptr(), count);
    if (label_got != count)
      throw loom::sdk::Error(label_path.string() + " is truncated: its header promises " + std::to_string(count) +
                             " labels but it holds " + std::to_string(label_got) + "; download it again");
    labels_file.expect_end();
    const auto* p = raw.data_ptr<uint8_t>();
    for (int64_t i = 0; i < count; ++i)
      if (p[i] >= kClasses)
        throw loom::sdk::Error(label_path.string() + ": label " + std::to_string(p[i]) + " of image " +
                               std::to_string(i) + " is not a class (0 to 9)");
    at::Tensor labels = raw.to(at::kLong);
    if (limit > 0 && limit < count) {
      pixels = pixels.narrow(0, 0, limit).clone();
      labels = labels.narrow(0, 0, limit).clone();
    }
    return {pixels, labels};
  }

  fs::path folder_;
  int64_t limit_train_, limit_test_;
};

}  // namespace

LOOM_PLUGIN("fashion_mnist", "1.0.0",
            loom::sdk::component<FashionMnist>("fashion_mnist", "Fashion-MNIST images (IDX files, gzipped or not)"))
