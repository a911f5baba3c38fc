// A well-formed test plugin: a small dataset (sample i is the vector [i, i+1, i+2] with label
// i % 3) and a model that sums its input. Loads next to the broken plugins of this folder and
// must be accepted; the loader tests create its components and call them across the boundary.
#include <loom/sdk/sdk.hpp>

#include <ATen/ops/arange.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tensor.h>

#include <cstdio>
#include <cstdlib>

namespace {

// A static initializer with a visible effect, for tests/unit/plugins/abi_test.cpp: loading this
// plugin writes the file LOOM_TEST_INITIALIZER_MARKER names (when it names one), which shows the
// test's way of seeing whether a plugin's initializers ran.
const int kInitializerRan = [] {
  if (const char* path = std::getenv("LOOM_TEST_INITIALIZER_MARKER"))
    if (std::FILE* f = std::fopen(path, "w")) {
      std::fputs("basic_counting\n", f);
      std::fclose(f);
    }
  return 1;
}();

class CountingDataset final : public loom::sdk::Dataset {
 public:
  static constexpr loom_option_spec kOptions[] = {
      loom::sdk::option_int("size", "10", "number of samples"),
      loom::sdk::option_enum("layout", "flat", "flat|square", "how a sample is shaped"),
      loom::sdk::option_bytes("budget", "1MiB", "an unused size, to exercise the bytes type"),
  };
  explicit CountingDataset(const loom::sdk::Options& options) : size_(options.get_int("size")) {
    if (size_ <= 0) throw loom::sdk::Error("dataset 'counting': size must be positive, got " + std::to_string(size_));
    loom::sdk::log::info("counting dataset of ", size_, " samples");
  }
  void setup() override {}
  loom::sdk::DataSpec spec() const override {
    loom::sdk::DataSpec spec;
    spec.fields["input"] = {{3}, c10::ScalarType::Float};
    spec.fields["target"] = {{}, c10::ScalarType::Long};
    spec.num_classes = 3;
    return spec;
  }
  int64_t size(loom::sdk::Split split) const override { return split == loom::sdk::Split::kTrain ? size_ : 0; }
  loom::sdk::Batch get_batch(loom::sdk::Split, const std::vector<int64_t>& indices) const override {
    std::vector<at::Tensor> inputs;
    std::vector<int64_t> labels;
    for (int64_t i : indices) {
      if (i < 0 || i >= size_) throw loom::sdk::Error("index " + std::to_string(i) + " out of range");
      inputs.push_back(at::arange(i, i + 3, at::TensorOptions().dtype(at::kFloat)));
      labels.push_back(i % 3);
    }
    return {{"input", at::stack(inputs)}, {"target", at::tensor(labels, at::TensorOptions().dtype(at::kLong))}};
  }

 private:
  int64_t size_;
};

}  // namespace

LOOM_PLUGIN("basic_counting", "1.2.3",
            loom::sdk::component<CountingDataset>("counting", "samples [i, i+1, i+2], label i % 3"))
