// A model for tests of the host's metric handling: a linear classifier on the synthetic data
// that reports metrics with their own names, directions and denominators:
//   correct    correct predictions per sample (higher is better; the host must not rename it)
//   sq_error   squared error of the predicted class index, per *two* terms a sample (lower)
//   per_batch  1 per micro-batch over 1 per micro-batch: exactly 1 however the data is split
// `nan_eval_batches` makes the first evaluation batches' `correct` NaN (a model diverged early).
#include <loom/sdk/sdk.hpp>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <cmath>
#include <csignal>
#include <cstdlib>
#include <limits>

namespace {

class MetricModel final : public loom::sdk::Model {
 public:
  static constexpr loom_option_spec kOptions[] = {
      loom::sdk::option_bool("vector_metric", "false", "report per_batch with a sum of two elements (a broken model)"),
      loom::sdk::option_int("nan_eval_batches", "0", "the first this many evaluation batches report correct as NaN"),
      loom::sdk::option_bool("zero_loss", "false", "a training loss times 0: its gradients are all zero"),
      loom::sdk::option_bool("vector_loss", "false", "loss_sum is each sample's loss, not their sum (a broken model)"),
      loom::sdk::option_bool("nan_training_loss", "false", "a training loss of NaN (every step skipped)"),
      loom::sdk::option_int("nan_training_loss_from", "0", "the training loss is NaN from the n-th training forward on (0: never)"),
      loom::sdk::option_bool("zero_count", "false", "a training count of 0: the loss averages over nothing"),
      loom::sdk::option_enum("odd_count", "none", "none|negative|undefined|negative_metric|infinite",
                             "a training count of -7, none, an evaluation metric count of -5, or a training count of "
                             "infinity (broken models)"),
      loom::sdk::option_int("odd_count_at", "0", "the n-th training forward alone has the odd training count (0: every one)"),
      loom::sdk::option_int("nan_weights_at", "0", "the n-th training forward (0: none) first fills the weight with NaN, "
                                                   "as an optimizer that writes NaN would"),
      loom::sdk::option_int("reshape_weights_at", "0", "the n-th training forward (0: none) first makes the weight of "
                                                       "shape [1], as an optimizer that replaces a tensor would"),
      loom::sdk::option_int("crash_at", "0", "the n-th training forward (0: none) ends the process with SIGSEGV, as a "
                                             "plugin's bad pointer would"),
      loom::sdk::option_int("eval_error_at", "0", "the n-th evaluation forward (0: none) throws a loom::sdk::Error, as a "
                                                  "model's bug or a collective whose rank is gone would"),
      loom::sdk::option_int("held", "0", "bytes it says it holds as 'cache' (held_memory; 0: none)"),
      loom::sdk::option_enum("throws_in", "none", "none|metrics|describe|metric_value|flops",
                             "the call that throws 42 (not an exception): its error must name the model"),
  };

  explicit MetricModel(const loom::sdk::Options& o)
      : vector_metric_(o.get_bool("vector_metric")), nan_eval_batches_(o.get_int("nan_eval_batches")),
        zero_loss_(o.get_bool("zero_loss")), vector_loss_(o.get_bool("vector_loss")),
        nan_training_loss_(o.get_bool("nan_training_loss")), nan_weights_at_(o.get_int("nan_weights_at")),
        nan_loss_from_(o.get_int("nan_training_loss_from")),
        reshape_weights_at_(o.get_int("reshape_weights_at")), zero_count_(o.get_bool("zero_count")),
        odd_count_(o.get_string("odd_count")), odd_count_at_(o.get_int("odd_count_at")), throws_in_(o.get_string("throws_in")), held_(o.get_int("held")),
        crash_at_(o.get_int("crash_at")), eval_error_at_(o.get_int("eval_error_at")) {}

  std::map<std::string, int64_t> held_memory() const override {
    if (held_ == 0) return {};
    return {{"cache", held_}};
  }

  std::string describe() const override {
    if (throws_in_ == "describe") throw 42;
    return {};
  }
  double metric_value(const std::string& name, double mean) const override {
    if (throws_in_ == "metric_value") throw 42;
    return loom::sdk::Model::metric_value(name, mean);
  }
  double flops_per_loss_term() const override {
    if (throws_in_ == "flops") throw 42;
    return 0;
  }

  void setup(const loom::sdk::DataSpec& data) override {
    int64_t features = 1;
    for (int64_t d : data.fields.at(data.input_key).shape) features *= d;
    input_key_ = data.input_key;
    target_key_ = data.target_key;
    linear_ = root_->register_module("linear", torch::nn::Linear(features, data.num_classes));
  }

  torch::nn::Module& module() override { return *root_; }

  loom::sdk::ModelOutput forward(const loom::sdk::Batch& batch, bool train) override {
    const bool nan = !train && nan_eval_batches_ > 0 && nan_eval_batches_-- > 0;
    // (a node lost mid-validation: the rank LOOM_TEST_EVAL_KILL_RANK names ends with SIGKILL in its
    // first evaluation forward after a training one, not set-up's memory probe; a variable, not an option, so that the resume is the same model)
    const char* kill_rank = std::getenv("LOOM_TEST_EVAL_KILL_RANK");
    if (!train && training_calls_ > 0 && kill_rank != nullptr && std::getenv("RANK") != nullptr && std::string(kill_rank) == std::getenv("RANK"))
      std::raise(SIGKILL);
    if (!train && ++evaluation_calls_ == eval_error_at_) throw loom::sdk::Error("evaluation forward " + std::to_string(evaluation_calls_) + " failed on purpose");
    if (train) {
      ++training_calls_;
      if (training_calls_ == crash_at_) std::raise(SIGSEGV);
      at::NoGradGuard no_grad;
      if (training_calls_ == nan_weights_at_) linear_->weight.fill_(std::nan(""));
      if (training_calls_ == reshape_weights_at_) linear_->weight.set_(at::zeros({1}, linear_->weight.options()));
    }
    const at::Tensor x = batch.at(input_key_).flatten(1).to(at::kFloat);
    const at::Tensor target = batch.at(target_key_);
    const at::Tensor logits = linear_->forward(x);
    const at::Tensor loss_sum =
        at::cross_entropy_loss(logits, target, {}, vector_loss_ ? at::Reduction::None : at::Reduction::Sum) *
        (zero_loss_ && train ? 0.0
         : train && (nan_training_loss_ || (nan_loss_from_ > 0 && training_calls_ >= nan_loss_from_)) ? std::nan("")
                                                                                                      : 1.0);
    const at::Tensor predicted = at::argmax(logits, 1);
    const auto f = logits.options();
    const double n = static_cast<double>(target.size(0));
    const bool odd = train && (odd_count_at_ == 0 || training_calls_ == odd_count_at_);
    const at::Tensor count = odd_count_ == "undefined" && odd  ? at::Tensor()
                             : odd_count_ == "negative" && odd ? at::scalar_tensor(-7.0, f)
                             : odd_count_ == "infinite" && odd ? at::scalar_tensor(std::numeric_limits<double>::infinity(), f)
                                                                 : at::scalar_tensor(zero_count_ && train ? 0.0 : n, f);
    const at::Tensor correct_count = odd_count_ == "negative_metric" && !train ? at::scalar_tensor(-5.0, f) : at::Tensor();
    return {loss_sum,
            count,
            {{"correct", {predicted.eq(target).sum().to(at::kFloat) * (nan ? std::nan("") : 1.0), correct_count}},
             {"sq_error", {(predicted - target).pow(2).sum().to(at::kFloat), at::scalar_tensor(2 * n, f)}},
             {"per_batch", {vector_metric_ ? at::ones({2}, f) : at::scalar_tensor(1.0, f), at::scalar_tensor(1.0, f)}}}};
  }

  std::vector<loom::sdk::MetricSpec> metrics() const override {
    if (throws_in_ == "metrics") throw 42;
    using loom::sdk::Direction;
    return {{"correct", "correct", Direction::kMaximize, true},
            {"sq_error", "squared error", Direction::kMinimize, false},
            {"per_batch", "", Direction::kMaximize, false}};
  }

 private:
  bool vector_metric_;
  int64_t nan_eval_batches_;
  bool zero_loss_, vector_loss_, nan_training_loss_;
  int64_t nan_weights_at_, nan_loss_from_, reshape_weights_at_, training_calls_ = 0;
  bool zero_count_;
  std::string odd_count_;
  int64_t odd_count_at_;
  std::string throws_in_;
  int64_t held_;
  int64_t crash_at_, eval_error_at_, evaluation_calls_ = 0;
  std::string input_key_, target_key_;
  std::shared_ptr<torch::nn::Module> root_ = std::make_shared<torch::nn::Module>("MetricModel");
  torch::nn::Linear linear_{nullptr};
};

}  // namespace

LOOM_PLUGIN("metric_model", "1.0.0",
            loom::sdk::component<MetricModel>("metric_model", "test: a linear classifier with its own metrics"))
