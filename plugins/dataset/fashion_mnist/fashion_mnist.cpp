// fashion_mnist: the Fashion-MNIST images (28x28 grey, 10 classes; 60,000 train, 10,000 test)
// read from the IDX files, gzipped or not, of Debian's dataset-fashion-mnist package or of
// `path`. Every file is checked (magic number, counts, sizes, labels in range, no truncated or
// trailing bytes); a bad one is one error that names the file and what is wrong. Each split's
// images and labels give a fingerprint (spec attributes "train split.fingerprint", "test
// split.fingerprint"): a checkpoint records them, and a resume or an evaluation names the files
// changed in place since (the same counts, other images: figures of other data said as the run's).
#include "idx.hpp"

#include <loom/sdk/sdk.hpp>
#include <loom/sdk/tensor_dataset.hpp>

#include <ATen/ops/index_select.h>
#include <ATen/ops/tensor.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

using namespace loom::fashion_mnist;

/// A 64-bit hash of the bytes of a split's images and labels, as 16 hex digits: FNV-1a over
/// 8-byte words (the pixels are 47 MB; a word at a time takes milliseconds), then the tail and the
/// size. The decoded bytes, not the files: a file gunzipped in place is the same data.
std::string fingerprint(const at::Tensor& images, const at::Tensor& labels) {
  uint64_t hash = 0xcbf29ce484222325ull;
  const auto mix = [&hash](const at::Tensor& t) {
    const at::Tensor c = t.contiguous();
    const auto* bytes = static_cast<const unsigned char*>(c.data_ptr());
    const size_t n = static_cast<size_t>(c.numel()) * c.element_size();
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      uint64_t word = 0;
      std::memcpy(&word, bytes + i, 8);
      hash = (hash ^ word) * 0x100000001b3ull;
      hash ^= hash >> 29;
    }
    for (; i < n; ++i) hash = (hash ^ bytes[i]) * 0x100000001b3ull;
    hash = (hash ^ n) * 0x100000001b3ull;
  };
  mix(images);
  mix(labels);
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(hash));
  return hex;
}

class FashionMnist final : public loom::sdk::TensorDataset {
 public:
  static constexpr loom_option_spec kOptions[] = {
      loom::sdk::option_string("path", "/usr/share/datasets/fashion-mnist",
                               "folder with train-images-idx3-ubyte[.gz] and the three other IDX files"),
      loom::sdk::option_int("limit_train", "0", "use only the first N training images (0: all)", "0.."),
      loom::sdk::option_int("limit_test", "0", "use only the first N test images (0: all)", "0.."),
  };

  explicit FashionMnist(const loom::sdk::Options& options)
      : TensorDataset("fashion_mnist"),
        folder_(options.get_string("path")),
        limit_train_(options.get_int("limit_train")),
        limit_test_(options.get_int("limit_test")) {
    if (limit_train_ < 0 || limit_test_ < 0) throw loom::sdk::Error("fashion_mnist: limits must be >= 0");
    // (an empty path read the working folder, and its error named none: "train-images-idx3-ubyte not found")
    if (folder_.empty())
      throw loom::sdk::Error("fashion_mnist: data.path is empty; set it to the folder with the four IDX files (its "
                             "default, /usr/share/datasets/fashion-mnist, is where Debian's dataset-fashion-mnist puts "
                             "them; data.path=. for the working folder)");
  }

  void setup() override {
    const auto [train_images, train_labels] = read_split("train", limit_train_);
    const auto [test_images, test_labels] = read_split("t10k", limit_test_);
    set_split(loom::sdk::Split::kTrain, {{"image", train_images}, {"label", train_labels}});
    set_split(loom::sdk::Split::kTest, {{"image", test_images}, {"label", test_labels}});
    train_fingerprint_ = fingerprint(train_images, train_labels);
    test_fingerprint_ = fingerprint(test_images, test_labels);
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
    if (!train_fingerprint_.empty()) {  // (after setup)
      spec.attributes["train split.fingerprint"] = train_fingerprint_;
      spec.attributes["test split.fingerprint"] = test_fingerprint_;
    }
    return spec;
  }

 private:
  fs::path find(const std::string& stem) const {
    // (a folder that does not exist is the package not installed, said below)
    if (const std::string what = loom::sdk::what_is_at(folder_); what != "a folder" && what != "no such file")
      throw loom::sdk::Error("fashion_mnist: data.path = " + folder_.string() +
                             (what.rfind("cannot", 0) == 0 ? " " + what
                                                           : " is " + (what.empty() ? std::string("a file") : what) +
                                                                 ", not a folder") +
                             "; set data.path to the folder with the four IDX files");
    std::vector<fs::path> found;
    for (const char* suffix : {".gz", ""}) {
      const fs::path p = folder_ / (stem + suffix);
      // Something of that name that is not a file is named as what it is, not taken for a missing
      // file (nor passed over for the other name): a FIFO, a folder, a device, a broken link.
      const std::string what = loom::sdk::what_is_at(p);
      if (what.empty()) {
        found.push_back(p);
        continue;
      }
      if (what != "no such file") {
        const bool unreadable = what.rfind("cannot", 0) == 0;
        throw loom::sdk::Error("fashion_mnist: " + p.string() +
                               (unreadable ? " " + what : " is " + what + ", not an IDX file") +
                               "; put the file there, or set data.path to a folder with the four IDX files");
      }
    }
    // Both X.gz and X: which is current is not guessed (the .gz always won: a plain file written
    // over to fix it was never read, and a stale .gz trained in silence; their times tie after
    // gunzip -k, and are the server's after wget).
    if (found.size() == 2)
      throw loom::sdk::Error("fashion_mnist: both " + found[0].string() + " and " + found[1].filename().string() +
                             " are there, and either may be the current one; remove the other");
    if (found.size() == 1) return found[0];
    std::error_code ec;  // (the folder itself missing was said as one file)
    const fs::file_status status = fs::status(folder_, ec);
    const std::string folder = ec == std::errc::no_such_file_or_directory ? " (there is no folder " + folder_.string() + ")"
                               : ec                        ? " (" + folder_.string() + ": " + ec.message() + ")"
                               : !fs::is_directory(status) ? " (" + folder_.string() + " is not a folder)"
                                                           : std::string();
    throw loom::sdk::Error("fashion_mnist: " + (folder_ / stem).string() + "[.gz] not found" + folder +
                           "; install Debian's dataset-fashion-mnist package (scripts/setup.sh does) or set data.path to a "
                           "folder with the four IDX files");
  }

  std::pair<at::Tensor, at::Tensor> read_split(const std::string& prefix, int64_t limit) const {
    const fs::path image_path = find(prefix + "-images-idx3-ubyte");
    const fs::path label_path = find(prefix + "-labels-idx1-ubyte");

    at::Tensor pixels = read_images(image_path);
    at::Tensor labels = read_labels(label_path, pixels.size(0), image_path.filename().string());
    if (limit > 0 && limit < pixels.size(0)) {
      pixels = pixels.narrow(0, 0, limit).clone();
      labels = labels.narrow(0, 0, limit).clone();
    }
    return {pixels, labels};
  }

  fs::path folder_;
  int64_t limit_train_, limit_test_;
  std::string train_fingerprint_, test_fingerprint_;
};

}  // namespace

LOOM_PLUGIN("fashion_mnist", "1.0.0",
            loom::sdk::component<FashionMnist>("fashion_mnist", "Fashion-MNIST images (IDX files, gzipped or not)"))
