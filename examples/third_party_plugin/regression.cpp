// A regression plugin built out of tree: two components in one library.
//
//   dataset sine_regression  y = sin(3 x1) + x2^2 / 2 + noise, float inputs and float targets, made
//                            from a seed (a TensorDataset: the SDK serves size and get_batch)
//   model   mlp_regressor    an MLP with a squared-error loss, reporting "mse" and "mae" per sample
//                            (lower is better: the best checkpoint follows that)
#include <loom/sdk/sdk.hpp>
#include <loom/sdk/tensor_dataset.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/abs.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/sin.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

namespace {

class SineRegression final : public loom::sdk::TensorDataset {
 public:
  static constexpr loom_option_spec kOptions[] = {
      loom::sdk::option_int("train_size", "2048", "training samples", "1..100000000"),
      loom::sdk::option_int("test_size", "512", "test samples", "1..100000000"),
      loom::sdk::option_float("noise", "0.05", "standard deviation of the noise on the target", "0..1000"),
      loom::sdk::option_int("seed", "7", "seed of the data", "0.."),
  };

  explicit SineRegression(const loom::sdk::Options& o)
      : TensorDataset("sine_regression"),
        train_(o.get_int("train_size")),
        test_(o.get_int("test_size")),
        noise_(o.get_float("noise")),
        seed_(static_cast<uint64_t>(o.get_int("seed"))) {
    if (train_ < 1 || test_ < 0) throw loom::sdk::Error("sine_regression: train_size >= 1 and test_size >= 0");
    if (noise_ < 0) throw loom::sdk::Error("sine_regression: noise must be >= 0");
  }

  void setup() override {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed_);
    auto make = [&](int64_t n) -> loom::sdk::Batch {
      const at::Tensor x = at::rand({n, 2}, gen, at::TensorOptions().dtype(at::kFloat)) * 2 - 1;
      const at::Tensor y = at::sin(x.select(1, 0) * 3) + x.select(1, 1).pow(2) / 2 +
                           at::randn({n}, gen, at::TensorOptions().dtype(at::kFloat)) * noise_;
      return {{"x", x}, {"y", y}};
    };
    set_split(loom::sdk::Split::kTrain, make(train_));
    set_split(loom::sdk::Split::kTest, make(test_));
  }

  loom::sdk::DataSpec spec() const override {
    loom::sdk::DataSpec spec;
    spec.fields["x"] = {{2}, c10::ScalarType::Float};
    spec.fields["y"] = {{}, c10::ScalarType::Float};
    spec.input_key = "x";
    spec.target_key = "y";
    return spec;  // num_classes 0: not a classification
  }

 private:
  int64_t train_, test_;
  double noise_;
  uint64_t seed_;
};

class MlpRegressor final : public loom::sdk::Model {
 public:
  static constexpr loom_option_spec kOptions[] = {
      loom::sdk::option_int("hidden", "64", "units of each hidden layer", "1..65536"),
      loom::sdk::option_int("layers", "2", "hidden layers", "1..64"),
  };

  explicit MlpRegressor(const loom::sdk::Options& o) : hidden_(o.get_int("hidden")), layers_(o.get_int("layers")) {
    if (hidden_ < 1 || layers_ < 1) throw loom::sdk::Error("mlp_regressor: hidden and layers must be >= 1");
  }

  void setup(const loom::sdk::DataSpec& data) override {
    const auto& input = data.fields.at(data.input_key);
    if (input.shape.size() != 1)
      throw loom::sdk::Error("mlp_regressor: input '" + data.input_key + "' must be a vector per sample");
    if (!data.fields.at(data.target_key).shape.empty())
      throw loom::sdk::Error("mlp_regressor: target '" + data.target_key + "' must be one number per sample");
    input_key_ = data.input_key;
    target_key_ = data.target_key;
    torch::nn::Sequential net;
    int64_t width = input.shape[0];
    for (int64_t i = 0; i < layers_; ++i) {
      net->push_back(torch::nn::Linear(width, hidden_));
      net->push_back(torch::nn::Tanh());
      width = hidden_;
    }
    net->push_back(torch::nn::Linear(width, 1));
    net_ = root_->register_module("net", net);
  }

  torch::nn::Module& module() override { return *root_; }

  loom::sdk::ModelOutput forward(const loom::sdk::Batch& batch, bool) override {
    const at::Tensor prediction = net_->forward(batch.at(input_key_).to(at::kFloat)).squeeze(1);
    const at::Tensor error = prediction - batch.at(target_key_).to(at::kFloat);
    const at::Tensor squared = error.pow(2).sum();
    const at::Tensor n = at::scalar_tensor(static_cast<double>(error.size(0)), prediction.options());
    // Loss and metrics as (sum, count): the host divides once over the whole batch or evaluation.
    return {squared, n, {{"mse", {squared.detach(), {}}}, {"mae", {at::abs(error).sum().detach(), {}}}}};
  }

  std::vector<loom::sdk::MetricSpec> metrics() const override {
    using loom::sdk::Direction;
    return {{"mse", "MSE", Direction::kMinimize, false}, {"mae", "MAE", Direction::kMinimize, false}};
  }

  std::string describe() const override {
    return "MLP regressor " + std::to_string(layers_) + "x" + std::to_string(hidden_);
  }

 private:
  int64_t hidden_, layers_;
  std::string input_key_, target_key_;
  std::shared_ptr<torch::nn::Module> root_ = std::make_shared<torch::nn::Module>("MlpRegressor");
  torch::nn::Sequential net_{nullptr};
};

}  // namespace

LOOM_PLUGIN("regression", "1.0.0",
            loom::sdk::component<SineRegression>("sine_regression", "noisy sin(3 x1) + x2^2 / 2 from a seed, float targets"),
            loom::sdk::component<MlpRegressor>("mlp_regressor", "MLP with a squared-error loss, MSE and MAE"))
