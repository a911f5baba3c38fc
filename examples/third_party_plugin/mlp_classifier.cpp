// mlp_classifier: a multi-layer perceptron over any fixed-size input, as a Loom model plugin.
// It is what a user's first plugin looks like: one class deriving from loom::sdk::Model, its
// options as a schema, and LOOM_PLUGIN at the end.
#include <loom/sdk/sdk.hpp>

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>

#include <ATen/ops/argmax.h>
#include <ATen/ops/scalar_tensor.h>

#include <numeric>

namespace {

class MlpClassifier final : public loom::sdk::Model {
 public:
  static constexpr loom_option_spec kOptions[] = {
      loom::sdk::option_int("hidden", "256", "units of each hidden layer", "1..65536"),
      loom::sdk::option_int("layers", "2", "hidden layers", "1..64"),
      loom::sdk::option_float("dropout", "0.1", "dropout after each hidden layer", "0..0.99"),
  };

  explicit MlpClassifier(const loom::sdk::Options& options)
      : hidden_(options.get_int("hidden")),
        layers_(options.get_int("layers")),
        dropout_(options.get_float("dropout")) {
    if (hidden_ < 1 || layers_ < 1)
      throw loom::sdk::Error("mlp_classifier: hidden and layers must be at least 1");
    if (dropout_ < 0 || dropout_ >= 1)
      throw loom::sdk::Error("mlp_classifier: dropout must be in [0, 1), got " + std::to_string(dropout_));
  }

  void setup(const loom::sdk::DataSpec& data) override {
    auto input = data.fields.find(data.input_key);
    if (input == data.fields.end() || data.num_classes < 2)
      throw loom::sdk::Error("mlp_classifier needs a classification dataset with an input field");
    input_key_ = data.input_key;
    target_key_ = data.target_key;
    const auto& shape = input->second.shape;
    const int64_t features = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
    torch::nn::Sequential net;
    net->push_back(torch::nn::Flatten());
    int64_t width = features;
    for (int64_t i = 0; i < layers_; ++i) {
      net->push_back(torch::nn::Linear(width, hidden_));
      net->push_back(torch::nn::GELU());
      net->push_back(torch::nn::Dropout(dropout_));
      width = hidden_;
    }
    net->push_back(torch::nn::Linear(width, data.num_classes));
    net_ = root_->register_module("net", net);
  }

  torch::nn::Module& module() override { return *root_; }

  loom::sdk::ModelOutput forward(const loom::sdk::Batch& batch, bool /*train*/) override {
    at::Tensor x = batch.at(input_key_);
    x = x.scalar_type() == at::kByte ? x.to(at::kFloat).div(255.0) : x.to(at::kFloat);
    const at::Tensor logits = net_->forward(x);
    const at::Tensor target = batch.at(target_key_);
    namespace F = torch::nn::functional;
    const at::Tensor loss_sum =
        F::cross_entropy(logits.to(at::kFloat), target, F::CrossEntropyFuncOptions().reduction(torch::kSum));
    // Accuracy as a (sum, count) pair: correct predictions over the samples (the output's count).
    const at::Tensor correct = at::argmax(logits, 1).eq(target).sum();
    return {loss_sum, at::scalar_tensor(static_cast<double>(target.size(0)), x.options()), {{"accuracy", {correct, {}}}}};
  }

  std::vector<loom::sdk::MetricSpec> metrics() const override {
    return {{"accuracy", "accuracy", loom::sdk::Direction::kMaximize, /*percent=*/true}};
  }

  std::string describe() const override {
    return "MLP " + std::to_string(layers_) + "x" + std::to_string(hidden_);
  }

 private:
  int64_t hidden_, layers_;
  double dropout_;
  std::string input_key_, target_key_;
  std::shared_ptr<torch::nn::Module> root_ = std::make_shared<torch::nn::Module>("MlpClassifier");
  torch::nn::Sequential net_{nullptr};
};

}  // namespace

LOOM_PLUGIN("mlp_classifier", "1.0.0",
            loom::sdk::component<MlpClassifier>("mlp_classifier", "multi-layer perceptron classifier"))
