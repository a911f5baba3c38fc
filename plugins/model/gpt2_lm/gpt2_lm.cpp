// gpt2_lm: GPT-2 as a language model (<loom/sdk/gpt2.hpp>), the logits tied to the token embedding:
// next-token cross-entropy summed over the tokens, and the share of tokens predicted right, both
// from one pass over the logits in their own dtype on CUDA (<loom/sdk/cross_entropy.hpp>).
// The model of the GPT-2 benchmark (bench/compare_gpt2.py) and the encoder the recommender of
// issue 12 builds on.
#include <loom/sdk/cross_entropy.hpp>
#include <loom/sdk/files.hpp>
#include <loom/sdk/gpt2.hpp>
#include <loom/sdk/sdk.hpp>

#include <ATen/ops/scalar_tensor.h>

#include <algorithm>
#include <cstdio>

namespace {

using loom::sdk::Error;
namespace gpt2 = loom::sdk::gpt2;

/// A target that is no token's (padding): PyTorch's and cross_entropy_sum's ignore_index.
constexpr int64_t kIgnoreIndex = -100;

class Gpt2Lm final : public loom::sdk::Model {
 public:
  static constexpr loom_option_spec kOptions[] = {
      loom::sdk::option_enum("size", "gpt2", "gpt2|gpt2-medium|debug",
                             "gpt2: 124M (12 layers, 12 heads, 768); gpt2-medium: 350M (24, 16, 1024); debug: 2, 2, 64"),
      loom::sdk::option_int("vocab_size", "0",
                            "token embeddings (0: the data's vocabulary; larger pads it, e.g. 50304 for faster kernels)",
                            "0..10000000"),
      loom::sdk::option_int("n_ctx", "0", "positions (0: the size's, 1024; debug 256)", "0..1048576"),
      loom::sdk::option_float("dropout", "0.0", "dropout on embeddings, attention and MLP outputs", "0..0.99"),
      loom::sdk::option_string("pretrained", "",
                               "a Hugging Face GPT-2 folder (config.json, model.safetensors): its sizes and weights "
                               "replace size, n_ctx and the random start; vocab_size may pad its vocabulary"),
  };

  explicit Gpt2Lm(const loom::sdk::Options& o)
      : size_(o.get_string("size")), vocab_(o.get_int("vocab_size")), n_ctx_(o.get_int("n_ctx")),
        dropout_(o.get_float("dropout")), pretrained_(o.get_string("pretrained")) {
    if (vocab_ < 0 || n_ctx_ < 0) throw Error("gpt2_lm: vocab_size and n_ctx must be >= 0");
    if (dropout_ < 0 || dropout_ >= 1) throw Error("gpt2_lm: dropout must be in [0, 1)");
  }

  void setup(const loom::sdk::DataSpec& data) override {
    input_key_ = data.input_key;
    target_key_ = data.target_key;
    for (const std::string& key : {input_key_, target_key_}) {
      auto field = data.fields.find(key);
      if (field == data.fields.end())
        throw Error("gpt2_lm: the dataset has no field '" + key + "' (it needs token ids: input and target)");
      if (field->second.shape.size() != 1 || field->second.dtype != c10::ScalarType::Long)
        throw Error("gpt2_lm: field '" + key + "' must be a sequence of token ids (shape [T], int64); the dataset " +
                    "gives " + std::to_string(field->second.shape.size()) + " dimensions of " +
                    c10::toString(field->second.dtype));
    }
    seq_len_ = data.fields.at(input_key_).shape[0];
    gpt2::Config c = pretrained_.empty() ? gpt2::Config::of_size(size_) : gpt2::hf_config(pretrained_);
    // (config.json sizes the model and sets its epsilon; its weights come from the checkpoint)
    if (!pretrained_.empty())
      fingerprints_["pretrained.config"] = loom::sdk::files_fingerprint({std::filesystem::path(pretrained_) / "config.json"});
    const int64_t stored_vocab = c.vocab_size;
    if (data.num_classes < 2)
      throw Error("gpt2_lm: the dataset does not say its vocabulary (DataSpec::num_classes); a token dataset does");
    if (vocab_ > 0 && vocab_ < data.num_classes)
      throw Error("gpt2_lm: model.vocab_size " + std::to_string(vocab_) + " is smaller than the data's vocabulary of " +
                  std::to_string(data.num_classes) + " tokens; set it to 0 or at least " + std::to_string(data.num_classes));
    if (!pretrained_.empty() && std::max(vocab_, data.num_classes) > stored_vocab && vocab_ == 0)
      throw Error("gpt2_lm: the data has " + std::to_string(data.num_classes) + " tokens, the pretrained model " +
                  std::to_string(stored_vocab) + " (" + pretrained_ + "/config.json); use the model's tokenizer");
    c.vocab_size = vocab_ > 0 ? vocab_ : pretrained_.empty() ? data.num_classes : stored_vocab;
    if (!pretrained_.empty() && c.vocab_size < stored_vocab)
      throw Error("gpt2_lm: model.vocab_size " + std::to_string(c.vocab_size) + " is smaller than the pretrained model's " +
                  std::to_string(stored_vocab) + " tokens");
    if (n_ctx_ > 0 && !pretrained_.empty() && n_ctx_ != c.n_ctx)
      throw Error("gpt2_lm: model.n_ctx " + std::to_string(n_ctx_) + " differs from the pretrained model's " +
                  std::to_string(c.n_ctx) + " positions; leave it at 0");
    if (n_ctx_ > 0) c.n_ctx = n_ctx_;
    if (seq_len_ > c.n_ctx)  // a pretrained model's positions are fixed: only the data's length can change
      throw Error("gpt2_lm: the data's sequences have " + std::to_string(seq_len_) + " tokens, the model " +
                  std::to_string(c.n_ctx) + " positions; " +
                  (pretrained_.empty() ? "set model.n_ctx >= " + std::to_string(seq_len_) + " or " : std::string()) +
                  "data.seq_len <= " + std::to_string(c.n_ctx));
    c.dropout = dropout_;
    if (pretrained_.empty()) {
      net_ = gpt2::Model(c);
      return;
    }
    // Padding rows past the stored vocabulary keep their random start (no data token uses them).
    gpt2::Config stored = c;
    stored.vocab_size = stored_vocab;
    gpt2::Model loaded(stored);
    gpt2::load_hf_weights(*loaded, pretrained_);
    net_ = gpt2::Model(c);
    torch::NoGradGuard no_grad;
    const auto stored_parameters = loaded->named_parameters();  // (a reference into a temporary would dangle)
    for (auto& item : net_->named_parameters()) {
      const at::Tensor from = stored_parameters[item.key()];
      if (item.key() == "wte.weight") item.value().narrow(0, 0, stored_vocab).copy_(from);
      else item.value().copy_(from);
    }
    loom::sdk::log::info("gpt2_lm: weights from ", pretrained_);
  }

  torch::nn::Module& module() override { return *net_; }

  loom::sdk::ModelOutput forward(const loom::sdk::Batch& batch, bool) override {
    const at::Tensor& tokens = batch.at(input_key_);
    const at::Tensor& target = batch.at(target_key_);
    const at::Tensor hidden = net_->forward(tokens);
    // the head, tied to the embedding (on CUDA its weight gradient adds into the flat buffer: nn::linear)
    const at::Tensor logits = loom::sdk::nn::linear(hidden, net_->wte->weight, at::Tensor());
    const int64_t vocab = logits.size(-1);
    const at::Tensor flat_logits = logits.reshape({-1, vocab});
    const at::Tensor flat_target = target.reshape({-1});
    if (flat_logits.is_cuda() && !announced_) {
      announced_ = true;
      const std::string why = loom::sdk::nn::fused_cross_entropy_unavailable(flat_logits);
      const std::string gradient = why.empty() ? loom::sdk::nn::fused_cross_entropy_gradient_unavailable(flat_logits) : why;
      if (why.empty() && gradient.empty())
        loom::sdk::log::info("gpt2_lm: the loss, the token accuracy and the logits' gradient in one pass of Loom's fused "
                             "cross-entropy kernel");
      else if (why.empty())
        loom::sdk::log::info("gpt2_lm: the loss and the token accuracy in Loom's fused cross-entropy kernel; the logits' "
                             "gradient in its backward kernel (", gradient, ")");
      else if (why.rfind("LOOM_FUSED_KERNELS", 0) == 0) loom::sdk::log::info("gpt2_lm: the loss through ATen (", why, ")");
      else loom::sdk::log::warn("gpt2_lm: the loss through ATen, slower: the fused cross-entropy kernel is unavailable: ", why);
    }
    const auto sums = loom::sdk::nn::cross_entropy_sum(flat_logits, flat_target, kIgnoreIndex);
    // The loss terms are the tokens with a target: an ignored one (-100, padding) adds nothing to the
    // sums and is not counted (it was: the loss, the accuracy and the gradient came out smaller by
    // the padding's share, where PyTorch's mean leaves it out). Counted on the device: no wait.
    return {sums.loss_sum, flat_target.ne(kIgnoreIndex).sum().to(at::kFloat), {{"accuracy", {sums.correct, {}}}}};
  }

  std::vector<loom::sdk::MetricSpec> metrics() const override {
    return {{"accuracy", "token accuracy", loom::sdk::Direction::kMaximize, /*percent=*/true}};
  }

  // Weight decay on the matrices and embeddings (as nanoGPT), not on biases and LayerNorms.
  bool decays(const std::string&, const at::Tensor& parameter) const override { return parameter.dim() >= 2; }

  // Model 2.2: 6 FLOPs per parameter and token (PaLM, appendix B; nanoGPT's estimate_mfu), every
  // parameter counted, the tied head once, plus the attention's two products over the sequence,
  // forward and backward: 12 n_layer n_embd T. bench/compare_gpt2.py's MFU counts the same;
  // llm.c halves the attention's term for the causal mask.
  double flops_per_loss_term() const override {
    const gpt2::Config& c = net_->config();
    return 6 * static_cast<double>(c.parameters()) +
           12 * static_cast<double>(c.n_layer) * static_cast<double>(c.n_embd) * static_cast<double>(seq_len_);
  }

  std::map<std::string, std::string> fingerprints() const override { return fingerprints_; }

  std::string describe() const override {
    const gpt2::Config& c = net_->config();
    char text[256];
    std::snprintf(text, sizeof text,
                  "GPT-2 %s: %lld layers x %lld, %lld heads, vocabulary %lld, %lld positions, sequences of %lld tokens; "
                  "head tied to the token embedding",
                  size_.c_str(), static_cast<long long>(c.n_layer), static_cast<long long>(c.n_embd),
                  static_cast<long long>(c.n_head), static_cast<long long>(c.vocab_size),
                  static_cast<long long>(c.n_ctx), static_cast<long long>(seq_len_));
    return text + (pretrained_.empty() ? std::string("; random start") : "; weights from " + pretrained_);
  }

 private:
  std::string size_;
  int64_t vocab_, n_ctx_;
  double dropout_;
  std::string pretrained_;
  int64_t seq_len_ = 0;
  std::string input_key_, target_key_;
  gpt2::Model net_{nullptr};
  bool announced_ = false;  // which cross-entropy runs, said once
  std::map<std::string, std::string> fingerprints_;
};

}  // namespace

LOOM_PLUGIN("gpt2_lm", "1.0.0",
            loom::sdk::component<Gpt2Lm>("gpt2_lm", "GPT-2 language model (124M, 350M or debug), tied head"))
