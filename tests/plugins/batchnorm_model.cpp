// A model with BatchNorm, as a user's CNN has: its running statistics are buffers that every
// training forward changes, each rank from its own shard of the batch.
//   x -> mean over the sequence -> linear -> BatchNorm1d -> relu -> head -> logits
#include <loom/sdk/sdk.hpp>

#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>

namespace {

class BatchNormModel final : public loom::sdk::Model {
 public:
  explicit BatchNormModel(const loom::sdk::Options&) {}

  void setup(const loom::sdk::DataSpec& data) override {
    const int64_t features = data.fields.at(data.input_key).shape.back();
    input_key_ = data.input_key;
    target_key_ = data.target_key;
    hidden_ = root_->register_module("hidden", torch::nn::Linear(features, 32));
    norm_ = root_->register_module("norm", torch::nn::BatchNorm1d(32));
    head_ = root_->register_module("head", torch::nn::Linear(32, data.num_classes));
  }

  torch::nn::Module& module() override { return *root_; }

  loom::sdk::ModelOutput forward(const loom::sdk::Batch& batch, bool) override {
    at::Tensor x = batch.at(input_key_).to(at::kFloat);
    if (x.dim() > 2) x = x.flatten(1, -2).mean(1);
    const at::Tensor logits = head_->forward(at::relu(norm_->forward(hidden_->forward(x))));
    const at::Tensor target = batch.at(target_key_);
    return {at::cross_entropy_loss(logits, target, {}, at::Reduction::Sum),
            at::scalar_tensor(static_cast<double>(target.size(0)), logits.options()), {}};
  }

 private:
  std::string input_key_, target_key_;
  std::shared_ptr<torch::nn::Module> root_ = std::make_shared<torch::nn::Module>("BatchNormModel");
  torch::nn::Linear hidden_{nullptr}, head_{nullptr};
  torch::nn::BatchNorm1d norm_{nullptr};
};

}  // namespace

LOOM_PLUGIN("batchnorm_model", "1.0.0",
            loom::sdk::component<BatchNormModel>("batchnorm_model", "test: BatchNorm's running statistics as buffers"))
