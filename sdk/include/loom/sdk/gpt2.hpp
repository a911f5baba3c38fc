// GPT-2 (Radford et al. 2019) as a LibTorch module, for any model plugin (in the tree: gpt2_lm,
// and gpt2_recommender, which encodes item text with it): learned token and
// position embeddings, pre-LayerNorm blocks of causal self-attention (scaled_dot_product_attention
// with is_causal, so CUDA takes its flash or memory-efficient kernels) and a GELU (tanh) MLP of
// 4 x the width, a final LayerNorm. The LayerNorms run through nn::layer_norm (<loom/sdk/layer_norm.hpp>):
// on CUDA under autocast their output, the hidden states included, comes in autocast's dtype, and
// each residual add happens in the LayerNorm after it (nn::add_layer_norm). Module names follow Hugging Face's GPT2Model (wte, wpe,
// h.N.ln_1, h.N.attn.c_attn, h.N.attn.c_proj, h.N.ln_2, h.N.mlp.c_fc, h.N.mlp.c_proj, ln_f), so
// that its safetensors files map onto it by name (their Conv1D weights transposed).
#pragma once

#include <loom/sdk/error.hpp>
#include <loom/sdk/layer_norm.hpp>
#include <loom/sdk/nn.hpp>
#include <loom/sdk/safetensors.hpp>

#include <ATen/ops/arange.h>
#include <ATen/ops/dropout.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace loom::sdk::gpt2 {

struct Config {
  int64_t vocab_size = 50257;
  int64_t n_ctx = 1024;  ///< positions
  int64_t n_layer = 12, n_head = 12, n_embd = 768;
  double dropout = 0.0;
  double layer_norm_epsilon = 1e-5;

  /// The sizes GPT-2 was released in, and `debug` (a few layers, for tests).
  static Config of_size(const std::string& size) {
    Config c;
    if (size == "gpt2") return c;
    if (size == "gpt2-medium") {
      c.n_layer = 24, c.n_head = 16, c.n_embd = 1024;
      return c;
    }
    if (size == "debug") {
      c.n_layer = 2, c.n_head = 2, c.n_embd = 64, c.n_ctx = 256;
      return c;
    }
    throw sdk::Error("gpt2: unknown size '" + size + "' (gpt2, gpt2-medium, debug)");
  }

  /// Parameters of the module (the head tied to wte adds none).
  int64_t parameters() const {
    const int64_t d = n_embd;
    const int64_t block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d);
    return vocab_size * d + n_ctx * d + n_layer * block + 2 * d;
  }
};

class AttentionImpl : public torch::nn::Module {
 public:
  explicit AttentionImpl(const Config& c)
      : heads_(c.n_head), dropout_(c.dropout),
        c_attn(register_module("c_attn", torch::nn::Linear(c.n_embd, 3 * c.n_embd))),
        c_proj(register_module("c_proj", torch::nn::Linear(c.n_embd, c.n_embd))) {}

  at::Tensor forward(const at::Tensor& x) {
    const int64_t b = x.size(0), t = x.size(1), d = x.size(2);
    std::vector<at::Tensor> qkv = nn::linear(c_attn, x).view({b, t, 3, heads_, d / heads_}).unbind(2);
    for (auto& part : qkv) part = part.transpose(1, 2);  // [B, H, T, hd]
    const at::Tensor y = at::scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], /*attn_mask=*/{},
                                                          is_training() ? dropout_ : 0.0, /*is_causal=*/true);
    return nn::linear(c_proj, y.transpose(1, 2).reshape({b, t, d}));
  }

 private:
  int64_t heads_;
  double dropout_;

 public:
  torch::nn::Linear c_attn, c_proj;
};
TORCH_MODULE(Attention);

class MlpImpl : public torch::nn::Module {
 public:
  explicit MlpImpl(const Config& c)
      : c_fc(register_module("c_fc", torch::nn::Linear(c.n_embd, 4 * c.n_embd))),
        c_proj(register_module("c_proj", torch::nn::Linear(4 * c.n_embd, c.n_embd))) {}

  at::Tensor forward(const at::Tensor& x) {
    return nn::mlp_gelu_tanh(x, c_fc->weight, c_fc->bias, c_proj->weight, c_proj->bias);
  }

  torch::nn::Linear c_fc, c_proj;
};
TORCH_MODULE(Mlp);

class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const Config& c)
      : dropout_(c.dropout),
        ln_1(register_module("ln_1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd}).eps(c.layer_norm_epsilon)))),
        attn(register_module("attn", Attention(c))),
        ln_2(register_module("ln_2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd}).eps(c.layer_norm_epsilon)))),
        mlp(register_module("mlp", Mlp(c))) {}

  at::Tensor forward(at::Tensor x) {
    auto [sum, branch] = forward_pending(std::move(x), at::Tensor());
    return sum + branch;
  }

  /// The block on the residual stream `x` with the previous block's last branch not yet added
  /// (`pending`, undefined for none): {the stream, this block's last branch, not yet added}.
  /// Each add happens inside the LayerNorm that follows it (nn::add_layer_norm); the model's
  /// last one in ln_f.
  std::pair<at::Tensor, at::Tensor> forward_pending(at::Tensor x, const at::Tensor& pending) {
    const bool train = is_training();
    at::Tensor y;
    std::tie(x, y) = nn::add_layer_norm(ln_1, x, pending);
    std::tie(x, y) = nn::add_layer_norm(ln_2, x, at::dropout(attn->forward(y), dropout_, train));
    return {x, at::dropout(mlp->forward(y), dropout_, train)};
  }

 private:
  double dropout_;

 public:
  torch::nn::LayerNorm ln_1;
  Attention attn;
  torch::nn::LayerNorm ln_2;
  Mlp mlp;
};
TORCH_MODULE(Block);

/// Token ids [B, T] -> hidden states [B, T, n_embd] (after ln_f; bf16 or fp16 under autocast on CUDA).
class ModelImpl : public torch::nn::Module {
 public:
  explicit ModelImpl(const Config& c)
      : config_(checked(c)),  // (config_ is declared first: no embedding is allocated for sizes refused)
        wte(register_module("wte", torch::nn::Embedding(c.vocab_size, c.n_embd))),
        wpe(register_module("wpe", torch::nn::Embedding(c.n_ctx, c.n_embd))),
        h(register_module("h", torch::nn::ModuleList())),
        ln_f(register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd}).eps(c.layer_norm_epsilon)))) {
    for (int64_t i = 0; i < c.n_layer; ++i) h->push_back(Block(c));
    reset_parameters();
  }

  /// GPT-2's initialisation: N(0, 0.02) for weights and embeddings, zero biases, and the
  /// residual projections (attn.c_proj, mlp.c_proj) scaled by 1 / sqrt(2 x layers).
  void reset_parameters() {
    torch::NoGradGuard no_grad;
    const double residual = 0.02 / std::sqrt(2.0 * static_cast<double>(config_.n_layer));
    for (const auto& item : named_parameters()) {
      const std::string& name = item.key();
      at::Tensor p = item.value();
      if (name.find("ln_") != std::string::npos) continue;  // LayerNorm: ones and zeros already
      if (name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0) p.zero_();
      else if (name.find("c_proj.weight") != std::string::npos) p.normal_(0.0, residual);
      else p.normal_(0.0, 0.02);
    }
  }

  at::Tensor forward(const at::Tensor& tokens) {
    const int64_t t = tokens.size(1);
    if (t > config_.n_ctx)
      throw sdk::Error("gpt2: a sequence of " + std::to_string(t) + " tokens is longer than the model's " +
                       std::to_string(config_.n_ctx) + " positions");
    const at::Tensor positions = at::arange(t, tokens.options().dtype(at::kLong));
    at::Tensor x = at::dropout(nn::embedding(*wte, tokens) + nn::embedding(*wpe, positions), config_.dropout, is_training());
    at::Tensor pending;
    for (const auto& block : *h) std::tie(x, pending) = block->as<BlockImpl>()->forward_pending(x, pending);
    return nn::add_layer_norm(ln_f, x, pending).second;
  }

  const Config& config() const { return config_; }

 private:
  static const Config& checked(const Config& c) {
    if (c.n_layer < 1 || c.n_head < 1 || c.n_embd < 1 || c.vocab_size < 1 || c.n_ctx < 1)
      throw sdk::Error("gpt2: layers, heads, width, vocabulary and positions must be positive");
    if (c.n_embd % c.n_head != 0)
      throw sdk::Error("gpt2: " + std::to_string(c.n_head) + " heads do not divide the width " + std::to_string(c.n_embd));
    return c;
  }

  Config config_;

 public:
  torch::nn::Embedding wte, wpe;
  torch::nn::ModuleList h;
  torch::nn::LayerNorm ln_f;
};
TORCH_MODULE(Model);

// ---- Hugging Face GPT-2 files (src/gpt2.cpp) -------------------------------------------------
// A folder as `save_pretrained` writes it: config.json and model.safetensors (vocab.json and
// merges.txt are the tokenizer's, gpt2_tokenizer.hpp). Weights saved from GPT2LMHeadModel carry a
// "transformer." prefix and may hold lm_head.weight (the tied head, equal to wte); older files hold
// the causal masks as h.N.attn.bias and h.N.attn.masked_bias. GPT-2's Conv1D layers store their
// weights as [in, out], the transpose of a Linear's.

/// What the model built on a GPT-2 folder does with GPT-2's output head (lm_head: the tied head, wte
/// itself, in the released model).
enum class Head {
  kTied,    ///< it predicts tokens through wte (gpt2_lm): a folder whose head is another is refused
  kUnused,  ///< it reads hidden states only (gpt2_recommender): the folder's head, tied or not, is not its business
};

/// The model's sizes from `dir`/config.json; refuses a model that is not GPT-2 as built here
/// (with Head::kTied, also one whose config.json unties the head: tie_word_embeddings false).
LOOM_SDK_API Config hf_config(const std::filesystem::path& dir, Head head);
/// hf_config(dir, Head::kTied).
LOOM_SDK_API Config hf_config(const std::filesystem::path& dir);

/// Copies `dir`/model.safetensors into `model` (built with hf_config(dir)), memory-mapped
/// (map_safetensors). Every parameter must be in the file with its shape and nothing else may be:
/// one error names every missing, unexpected and mis-shaped tensor. pytorch_model.bin (a pickle)
/// is refused with the command that converts it. lm_head.weight is the head's: with Head::kTied
/// it must equal wte.weight, with Head::kUnused it is passed over.
LOOM_SDK_API void load_hf_weights(ModelImpl& model, const std::filesystem::path& dir, Head head);
/// load_hf_weights(model, dir, Head::kTied).
LOOM_SDK_API void load_hf_weights(ModelImpl& model, const std::filesystem::path& dir);

}  // namespace loom::sdk::gpt2
