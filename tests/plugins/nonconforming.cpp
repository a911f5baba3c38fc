// A plugin that breaks two contracts on purpose, for the conformance tests and
// `loom plugins check`: a model whose loss is a mean instead of a sum (gradient accumulation
// would be wrong), and a callback whose state does not survive a resume.
#include <loom/sdk/sdk.hpp>

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>

#include <numeric>

namespace {

class MeanLossModel final : public loom::sdk::Model {
 public:
  explicit MeanLossModel(const loom::sdk::Options&) {}

  void setup(const loom::sdk::DataSpec& data) override {
    const auto& shape = data.fields.at(data.input_key).shape;
    const int64_t features = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
    input_key_ = data.input_key;
    target_key_ = data.target_key;
    linear_ = root_->register_module("linear", torch::nn::Linear(features, std::max<int64_t>(2, data.num_classes)));
  }
  torch::nn::Module& module() override { return *root_; }

  loom::sdk::ModelOutput forward(const loom::sdk::Batch& batch, bool) override {
    const at::Tensor x = batch.at(input_key_).to(at::kFloat).flatten(1);
    const at::Tensor target = batch.at(target_key_);
    // The bug under test: a mean, as a Python training script would write it.
    const at::Tensor loss = torch::nn::functional::cross_entropy(linear_->forward(x), target);
    return {loss, at::scalar_tensor(static_cast<double>(target.size(0)), x.options()), {}};
  }

 private:
  std::shared_ptr<torch::nn::Module> root_ = std::make_shared<torch::nn::Module>();
  torch::nn::Linear linear_{nullptr};
  std::string input_key_, target_key_;
};

class ForgetfulCallback final : public loom::sdk::Callback {
 public:
  explicit ForgetfulCallback(const loom::sdk::Options&) {}
  void on_step_end(loom::sdk::RunContext&, const loom::sdk::StepReport&) override { ++steps_; }
  loom::sdk::State state_dict() const override { return {{}, {{"steps", std::to_string(steps_)}}}; }
  void load_state_dict(const loom::sdk::State&) override {}  // the bug: the count starts over

 private:
  int64_t steps_ = 0;
};

// Saves a checkpoint after backward: a resume from it would skip a batch (the trainer refuses it).
class MidStepSaver final : public loom::sdk::Callback {
 public:
  explicit MidStepSaver(const loom::sdk::Options&) {}
  void on_after_backward(loom::sdk::RunContext& run, const std::vector<at::Tensor>&) override { run.save_checkpoint(); }
};

}  // namespace

LOOM_PLUGIN("nonconforming", "1.0.0",
            loom::sdk::component<MeanLossModel>("mean_loss_model", "test: returns a mean loss (non-conforming)"),
            loom::sdk::component<ForgetfulCallback>("forgetful", "test: forgets its state (non-conforming)"),
            loom::sdk::component<MidStepSaver>("mid_step_saver", "test: saves a checkpoint mid-step (non-conforming)"))
