// A model for tests of tied parameters: one square matrix registered twice, as the weight of the
// first and of the second layer (as GPT-2 ties its token embedding and its output head):
//   x -> mean over the sequence -> W -> tanh -> W (the same W) -> head -> logits
// named_parameters() lists W as "first.weight" and "second.weight".
#include <loom/sdk/sdk.hpp>

#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/zeros.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <cmath>
#include <optional>

namespace {

class TiedModel final : public loom::sdk::Model {
 public:
  // (odd: a parameter or a parameter group a model should not give, for the host's checks)
  static constexpr loom_option_spec kOptions[] = {loom::sdk::option_enum(
      "odd", "none", "none|expanded|transposed|nan_decay|misnamed|undefined|other_module",
      "a trainable bias that is an expanded view (stride 0) or a transposed one; a group with a NaN weight decay, "
      "its names swapped, or an undefined tensor; module() another module after the first training forward")};
  explicit TiedModel(const loom::sdk::Options& o) : odd_(o.get_string("odd")) {}

  void setup(const loom::sdk::DataSpec& data) override {
    const auto& shape = data.fields.at(data.input_key).shape;
    const int64_t features = shape.back();
    input_key_ = data.input_key;
    target_key_ = data.target_key;
    first_ = root_->register_module("first", std::make_shared<torch::nn::Module>("First"));
    second_ = root_->register_module("second", std::make_shared<torch::nn::Module>("Second"));
    weight_ = first_->register_parameter("weight", at::randn({features, features}) * (1.0 / features));
    second_->register_parameter("weight", weight_);  // the same tensor: tied
    head_ = root_->register_module("head", torch::nn::Linear(features, data.num_classes));
    if (odd_ == "expanded") bias_ = root_->register_parameter("bias", at::zeros({1}).expand({data.num_classes}));
    if (odd_ == "transposed") bias_ = root_->register_parameter("bias", at::zeros({data.num_classes, 2}).t());
  }

  std::vector<loom::sdk::ParameterGroup> parameter_groups() override {
    if (odd_ != "nan_decay" && odd_ != "misnamed" && odd_ != "undefined") return {};
    loom::sdk::ParameterGroup head{"head", {"head.weight", "head.bias"}, {head_->weight, head_->bias}, 1.0, std::nullopt, false};
    if (odd_ == "nan_decay") head.weight_decay = std::nan("");
    if (odd_ == "misnamed") std::swap(head.names[0], head.names[1]);
    if (odd_ == "undefined") head.params[1] = at::Tensor();
    return {head};
  }

  torch::nn::Module& module() override { return odd_ == "other_module" && trained_ ? *other_ : *root_; }

  loom::sdk::ModelOutput forward(const loom::sdk::Batch& batch, bool train) override {
    trained_ = trained_ || train;
    at::Tensor x = batch.at(input_key_).to(at::kFloat);
    if (x.dim() > 2) x = x.flatten(1, -2).mean(1);
    const at::Tensor h = at::linear(at::tanh(at::linear(x, weight_)), weight_);
    at::Tensor logits = head_->forward(h);
    if (bias_.defined()) logits = logits + (bias_.dim() == 1 ? bias_ : bias_.sum(0));
    const at::Tensor target = batch.at(target_key_);
    return {at::cross_entropy_loss(logits, target, {}, at::Reduction::Sum),
            at::scalar_tensor(static_cast<double>(target.size(0)), logits.options()), {}};
  }

 private:
  std::string input_key_, target_key_;
  std::shared_ptr<torch::nn::Module> root_ = std::make_shared<torch::nn::Module>("TiedModel");
  std::shared_ptr<torch::nn::Module> first_, second_;
  at::Tensor weight_, bias_;
  std::string odd_;
  bool trained_ = false;
  std::shared_ptr<torch::nn::Module> other_ = [] {
    auto m = std::make_shared<torch::nn::Module>("Other");
    m->register_parameter("w", at::zeros({1}));
    return m;
  }();
  torch::nn::Linear head_{nullptr};
};

}  // namespace

LOOM_PLUGIN("tied_model", "1.0.0", loom::sdk::component<TiedModel>("tied_model", "test: one weight used by two layers"))
