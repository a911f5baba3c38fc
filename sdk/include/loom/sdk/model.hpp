// Tier-1 interface of a model plugin: the network, its loss and its metrics.
#pragma once

#include <loom/sdk/abi.h>
#include <loom/sdk/optimizer.hpp>
#include <loom/sdk/types.hpp>

#include <map>
#include <string>
#include <vector>

// Declared, not included: <torch/nn/module.h> costs ~25 s of compile time per translation unit,
// and only code that builds or walks a module needs it (model plugins include it themselves).
namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace loom::sdk {

/// One metric's share of a micro-batch: a sum and what it is divided by. The host adds sums and
/// counts over micro-batches, ranks and a whole evaluation and reports sum / count, so a
/// per-sample mean (count = samples), a per-user mean (count = users in the batch) or a
/// per-token rate is each exact however the data is split.
struct MetricValue {
  at::Tensor sum;    ///< scalar
  at::Tensor count;  ///< scalar; undefined: the output's `count` (per-sample, like the loss)
};

/// What one forward of a micro-batch returns. The loss is a sum over the micro-batch with its
/// count, never a mean: the trainer normalizes once by the global count of the optimizer step,
/// so k micro-batches of b give the same update as one batch of k*b.
struct ModelOutput {
  at::Tensor loss_sum;                          ///< scalar, sum of per-sample (or per-token) losses
  at::Tensor count;                             ///< scalar, how many terms loss_sum adds up
  std::map<std::string, MetricValue> metrics;   ///< by MetricSpec::name; only declared metrics
};

/// A model. Created by its plugin's factory from the [model] options; owned by the host, which
/// destroys it through the plugin before the process ends.
class LOOM_SDK_API Model {
 public:
  using Interface = Model;
  static constexpr uint32_t kKind = LOOM_KIND_MODEL;
  static constexpr uint32_t kInterfaceMajor = 2;
  static constexpr uint32_t kInterfaceMinor = 3;  // 2.1: use_tables, metric_value, held_memory, predict; 2.2: flops_per_loss_term; 2.3: fingerprints

  virtual ~Model();  // defined in libloom_sdk: its type info has one home

  /// Builds the network for the dataset's samples (image size, classes, ...). Called once, on the
  /// main thread, after the dataset's setup and before module(). Throws Error when the data does
  /// not fit the model (naming the field and the shape).
  virtual void setup(const DataSpec& data) = 0;

  /// The trainable module, owned by the model and valid after setup. The host moves it to the
  /// device, hands its parameters to the optimizer and saves and loads its state through it.
  virtual torch::nn::Module& module() = 0;

  /// Forward and loss of one micro-batch whose tensors are already on the module's device.
  /// Called on the main thread inside the precision strategy's forward guard; `train` says
  /// whether a backward follows (the host sets train/eval mode on module() itself).
  virtual ModelOutput forward(const Batch& batch, bool train) = 0;

  /// Whether a parameter gets weight decay. Default: matrices and higher; biases, norms and
  /// scalars do not. Called once, when the optimizer is built, for the parameters that
  /// parameter_groups() leaves out.
  virtual bool decays(const std::string& name, const at::Tensor& parameter) const {
    (void)name;
    return parameter.dim() >= 2;
  }

  /// The model's own parameter groups (learning-rate scale, weight decay, frozen), after setup
  /// and after module() moved to the device. Default: none, and the host groups the parameters
  /// by decays(). Parameters no group names go into the host's groups the same way. See
  /// sdk::ParameterGroup.
  virtual std::vector<ParameterGroup> parameter_groups() { return {}; }

  /// The metrics forward() reports, besides the loss (which the host always reports as "loss",
  /// lower is better). Called after setup; constant afterwards. The host renames nothing: a
  /// metric is written, logged and compared (best checkpoint, early stopping) under its name, in
  /// its declared direction.
  virtual std::vector<MetricSpec> metrics() const { return {}; }

  /// A one-line description for the start-up report ("ViT 6x256, patch 4, 28x28 -> 10").
  virtual std::string describe() const { return {}; }

  // ---- 2.1 -------------------------------------------------------------------------------
  // The host calls these only on models built against 2.1 or newer.

  /// The dataset's shared tables (Dataset::tables, Dataset 1.2), after setup(spec) and before
  /// module() moves to the device; not called when the dataset has none to give. CPU tensors the
  /// model may keep. Default: ignored.
  virtual void use_tables(const TensorMap& tables) { (void)tables; }

  /// The value reported for metric `name` whose mean is `mean`: the sum over its counts for an
  /// evaluation, the mean of the steps' values for a log window. For a metric that is a function
  /// of a mean: RMSE = sqrt(mean squared error), perplexity = exp(mean loss). Default: the mean.
  virtual double metric_value(const std::string& name, double mean) const {
    (void)name;
    return mean;
  }

  /// Memory the model holds on the device besides its parameters and buffers, by what it is, in
  /// bytes: a cache of computed vectors ("cached embeddings"). Called after setup; the memory
  /// estimate shows each as a row. Default: none.
  virtual std::map<std::string, int64_t> held_memory() const { return {}; }

  /// Outputs for inputs, outside training: what `loom recommend` and other inference paths ask
  /// (a recommender: {"user": [B] int64} -> {"scores": [B, items]}). The tensors are on the
  /// module's device; called in evaluation mode under no-grad. Default: the model has none.
  virtual Batch predict(const Batch& inputs) {
    (void)inputs;
    throw Error("this model has no predict path (Model::predict)");
  }

  // ---- 2.2 -------------------------------------------------------------------------------
  // The host calls this only on models built against 2.2 or newer.

  /// Model FLOPs of one term of the loss (what ModelOutput::count counts: a sample, a token),
  /// forward and backward: three times the forward's matrix products, convolutions and
  /// attention products, at 2 FLOPs per multiply-add; an LLM may count 6 per parameter and token
  /// instead, as PaLM (appendix B) and nanoGPT do. The host turns it into model TFLOP/s per device
  /// and MFU against the device's peak in the training log (train/tflops, train/mfu). Called
  /// after setup; constant afterwards. Default 0: not declared, and no MFU is reported.
  virtual double flops_per_loss_term() const { return 0; }

  // ---- 2.3 -------------------------------------------------------------------------------
  // The host calls this only on models built against 2.3 or newer.

  /// Files the model reads besides its weights, which no checkpoint holds (a tokenizer's
  /// vocabulary and merges, a pretrained folder's config.json), each by a fingerprint of its
  /// contents: {"tokenizer": "9f2c..."} (sdk::files_fingerprint). The host records them in every
  /// checkpoint and weights file, and at a resume or an evaluation names any that changed since:
  /// the same weights would read other inputs, in silence. Called after setup. Default: none.
  virtual std::map<std::string, std::string> fingerprints() const { return {}; }
};

}  // namespace loom::sdk
