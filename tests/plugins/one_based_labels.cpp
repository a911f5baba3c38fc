// A dataset that breaks a contract on purpose, for the conformance tests and `loom plugins check`:
// its labels count from 1, so the class num_classes is out of range of a classifier's logits (the
// model's loss fails, far from the dataset that gave it).
#include <loom/sdk/sdk.hpp>

#include <ATen/ops/stack.h>
#include <ATen/ops/tensor.h>

namespace {

class OneBasedLabels final : public loom::sdk::Dataset {
 public:
  // (train_size 0: an empty data folder, which the host refuses before it plans)
  static constexpr loom_option_spec kOptions[] = {
      loom::sdk::option_int("train_size", "30", "training samples", "0..1000"),
      loom::sdk::option_bool("no_target", "false", "batches without the target field its spec() declares")};
  explicit OneBasedLabels(const loom::sdk::Options& options)
      : train_size_(options.get_int("train_size")), no_target_(options.get_bool("no_target")) {}
  void setup() override {}
  loom::sdk::DataSpec spec() const override {
    loom::sdk::DataSpec spec;
    spec.fields["x"] = {{2}, at::kFloat};
    spec.fields["y"] = {{}, at::kLong};
    spec.input_key = "x";
    spec.target_key = "y";
    spec.num_classes = 3;
    return spec;
  }
  int64_t size(loom::sdk::Split split) const override { return split == loom::sdk::Split::kTrain ? train_size_ : 0; }
  loom::sdk::Batch get_batch(loom::sdk::Split, const std::vector<int64_t>& indices) const override {
    const at::Tensor i = at::tensor(indices, at::TensorOptions().dtype(at::kLong));
    if (no_target_) return {{"x", at::stack({i, i}, 1).to(at::kFloat)}};
    return {{"x", at::stack({i, i}, 1).to(at::kFloat)}, {"y", i.remainder(3) + 1}};  // the bug: 1..3, not 0..2
  }

 private:
  int64_t train_size_;
  bool no_target_;
};

}  // namespace

LOOM_PLUGIN("one_based_labels", "1.0.0",
            loom::sdk::component<OneBasedLabels>("one_based_labels", "test: labels 1..3 of 3 classes (non-conforming)"))
