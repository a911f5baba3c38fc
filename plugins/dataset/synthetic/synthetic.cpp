// synthetic: classification data with a planted rule, for fast tests and benchmarks. A sample is
// a sequence of `seq_len` feature vectors (or, with `image_size` > 0, a 1-channel image); its
// label is the argmax of a fixed random linear map of the sample's mean feature vector (of its
// pixels' row means, for images), so a model can learn it and accuracy means something. The
// whole dataset follows from `seed`.
#include <loom/sdk/sdk.hpp>
#include <loom/sdk/tensor_dataset.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/tensor.h>

namespace {

class Synthetic final : public loom::sdk::TensorDataset {
 public:
  static constexpr loom_option_spec kOptions[] = {
      loom::sdk::option_int("train_size", "4096", "training samples", "1..100000000"),
      loom::sdk::option_int("test_size", "1024", "test samples", "1..100000000"),
      loom::sdk::option_int("seq_len", "8", "feature vectors per sample", "1..65536"),
      loom::sdk::option_int("features", "16", "size of each feature vector", "1..65536"),
      loom::sdk::option_int("image_size", "0", "if > 0: samples are 1 x N x N images instead of sequences", "0..4096"),
      loom::sdk::option_int("classes", "4", "number of classes", "2..100000"),
      loom::sdk::option_float("noise", "0.5", "standard deviation of the noise around each sample's class signal", "0..1000"),
      loom::sdk::option_int("seed", "1234", "seed of the data (independent of the trainer's seed)", "0.."),
  };

  explicit Synthetic(const loom::sdk::Options& o)
      : TensorDataset("synthetic"),
        train_size_(o.get_int("train_size")),
        test_size_(o.get_int("test_size")),
        seq_len_(o.get_int("seq_len")),
        features_(o.get_int("features")),
        image_size_(o.get_int("image_size")),
        classes_(o.get_int("classes")),
        noise_(o.get_float("noise")),
        seed_(static_cast<uint64_t>(o.get_int("seed"))) {
    if (train_size_ < 1 || test_size_ < 0 || seq_len_ < 1 || features_ < 1 || classes_ < 2 || image_size_ < 0)
      throw loom::sdk::Error("synthetic: sizes must be positive and classes at least 2");
    if (noise_ < 0) throw loom::sdk::Error("synthetic: noise must be >= 0");
    // Before generating: data.seq_len 65536 at its default sizes took 21.6 GB of a 23.5 GB host,
    // and a refusal of a large one named the model and the batch as the fix. The planted rule
    // (features x classes) and the scores it gives a split (samples x classes) count too: 72
    // samples of 65536 features in 36000 classes took 9.7 GB past the check (probe).
    const int64_t per_sample = image_size_ > 0 ? image_size_ * image_size_ : seq_len_ * features_;
    const double cols = static_cast<double>(image_size_ > 0 ? image_size_ : features_);
    const double samples = 4.0 * static_cast<double>(per_sample) * static_cast<double>(train_size_ + test_size_);
    const double rule = 4.0 * cols * static_cast<double>(classes_);
    const double scores = 4.0 * static_cast<double>(std::max(train_size_, test_size_)) * static_cast<double>(classes_);
    if (constexpr double kMost = 8.0 * (int64_t{1} << 30); samples + rule + scores > kMost) {
      const std::string sizes = image_size_ > 0 ? "data.image_size" : "data.seq_len or data.features";
      const std::string fix =
          samples >= rule && samples >= scores ? "lower " + sizes + ", or data.train_size and data.test_size"
          : rule >= scores ? "lower data.classes or " + std::string(image_size_ > 0 ? "data.image_size" : "data.features")
                           : "lower data.classes, or data.train_size and data.test_size";
      throw loom::sdk::Error("synthetic: " + std::to_string(train_size_ + test_size_) + " samples of " +
                             std::to_string(per_sample) + " floats in " + std::to_string(classes_) + " classes would take " +
                             loom::sdk::format_bytes(static_cast<int64_t>(samples + rule + scores)) +
                             " to generate, more than 8 GiB (the samples " +
                             loom::sdk::format_bytes(static_cast<int64_t>(samples)) + ", the planted rule " +
                             loom::sdk::format_bytes(static_cast<int64_t>(rule)) + ", its scores " +
                             loom::sdk::format_bytes(static_cast<int64_t>(scores)) + "); " + fix);
    }
  }

  void setup() override {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed_);
    const bool image = image_size_ > 0;
    const int64_t rows = image ? image_size_ : seq_len_;
    const int64_t cols = image ? image_size_ : features_;
    const at::Tensor rule = at::randn({cols, classes_}, gen, at::TensorOptions().dtype(at::kFloat));
    auto make = [&](int64_t n) -> loom::sdk::Batch {
      // Each sample: a class-free base pattern plus noise; the label follows the planted rule.
      at::Tensor x = at::randn({n, rows, cols}, gen, at::TensorOptions().dtype(at::kFloat)).mul_(noise_);
      const at::Tensor signal = at::randn({n, 1, cols}, gen, at::TensorOptions().dtype(at::kFloat));
      x.add_(signal);
      const at::Tensor y = at::argmax(at::matmul(x.mean(1), rule), 1);
      if (image) x = x.unsqueeze(1);
      return {{"input", x}, {"target", y}};
    };
    set_split(loom::sdk::Split::kTrain, make(train_size_));
    set_split(loom::sdk::Split::kTest, make(test_size_));
  }

  loom::sdk::DataSpec spec() const override {
    loom::sdk::DataSpec spec;
    if (image_size_ > 0) spec.fields["input"] = {{1, image_size_, image_size_}, c10::ScalarType::Float};
    else spec.fields["input"] = {{seq_len_, features_}, c10::ScalarType::Float};
    spec.fields["target"] = {{}, c10::ScalarType::Long};
    spec.num_classes = classes_;
    return spec;
  }

 private:
  int64_t train_size_, test_size_, seq_len_, features_, image_size_, classes_;
  double noise_;
  uint64_t seed_;
};

}  // namespace

LOOM_PLUGIN("synthetic", "1.0.0",
            loom::sdk::component<Synthetic>("synthetic", "classification data with a planted rule (for tests)"))
