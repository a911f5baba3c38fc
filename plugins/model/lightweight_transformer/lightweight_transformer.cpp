// lightweight_transformer: a small ViT-style encoder. Images are cut into patches (a strided
// convolution), feature sequences are projected token by token; then pre-norm encoder blocks
// (multi-head self-attention through at::scaled_dot_product_attention, and a GELU MLP), mean
// pooling (or a class token) and a linear head. Options follow the seeds' flags: num_layers,
// d_model, image_size (resize, as `--image_size 160`).
#include <loom/sdk/nn.hpp>
#include <loom/sdk/sdk.hpp>

#include <ATen/ops/argmax.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/dropout.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/upsample_bilinear2d.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

namespace {

using loom::sdk::Error;

enum class AttentionKernel { kAuto, kSdpa, kMath };
enum class PatchKernel { kAuto, kConv, kMatmul };
enum class Activation { kGelu, kRelu };

// The stem's and the MLPs' nonlinearity. ReLU's backward reads its output, which the next layer
// keeps anyway; GELU's reads its input, kept for it alone: ReLU keeps fewer activations (18 % of
// the default job's peak) and runs about 5 % faster on CPU (docs/performance.md). GELU stays the
// default: a checkpoint without the key was written by a GELU model.
at::Tensor activate(const at::Tensor& x, Activation activation) {
  return activation == Activation::kRelu ? at::relu(x) : at::gelu(x);
}

// Note [Attention kernel on CPU]
// On CPU, scaled_dot_product_attention picks its flash kernel for float32, which works per
// (batch, head) and pays that overhead on every short sequence. Forward and backward on the
// 2-core CI machine (bench/attention_kernels.py, 4 heads): at batch 128 x 16 tokens x 24, 4.3 ms
// with it and 0.9 ms as three batched operations (Q K^T, softmax, times V); 6.8 against 9.5 ms
// at 100 tokens; from 128 tokens on flash ties or wins (13.3 against 12.1 ms), and the math
// form's N x N scores grow. `auto` takes the math form on CPU up to kMathMaxTokens tokens and
// SDPA everywhere else (on CUDA its fused kernels win).
constexpr int64_t kMathMaxTokens = 100;

/// The label a row without one carries (cross-entropy's default ignore_index).
constexpr int64_t kIgnoredLabel = -100;

class AttentionImpl : public torch::nn::Module {
 public:
  AttentionImpl(int64_t d_model, int64_t heads, double dropout, AttentionKernel kernel)
      : heads_(heads), dropout_(dropout), kernel_(kernel),
        qkv_(register_module("qkv", torch::nn::Linear(d_model, 3 * d_model))),
        proj_(register_module("proj", torch::nn::Linear(d_model, d_model))) {}

  at::Tensor forward(const at::Tensor& x) {
    const int64_t b = x.size(0), n = x.size(1), d = x.size(2);
    // [B, N, 3, H, hd] -> q, k, v of [B, H, N, hd]. unbind, not select: its backward stacks the
    // three gradients into one tensor, where three selects would each zero and fill a full-size
    // one and the view would copy the sum again.
    std::vector<at::Tensor> qkv = loom::sdk::nn::linear(qkv_, x).view({b, n, 3, heads_, d / heads_}).unbind(2);
    for (auto& t : qkv) t = t.transpose(1, 2);
    const double p = is_training() ? dropout_ : 0.0;
    const bool math = kernel_ == AttentionKernel::kMath ||
                      (kernel_ == AttentionKernel::kAuto && x.is_cpu() && n <= kMathMaxTokens);
    at::Tensor out;
    if (math) {
      const double scale = 1.0 / std::sqrt(static_cast<double>(d / heads_));
      at::Tensor weights = at::softmax(at::matmul(qkv[0] * scale, qkv[1].transpose(-2, -1)), -1);
      if (p > 0) weights = at::dropout(weights, p, /*train=*/true);
      out = at::matmul(weights, qkv[2]);
    } else {
      out = at::scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], /*attn_mask=*/{}, p);
    }
    return loom::sdk::nn::linear(proj_, out.transpose(1, 2).reshape({b, n, d}));
  }

 private:
  int64_t heads_;
  double dropout_;
  AttentionKernel kernel_;
  torch::nn::Linear qkv_, proj_;
};
TORCH_MODULE(Attention);

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(int64_t d_model, int64_t heads, int64_t hidden, double dropout, AttentionKernel kernel,
            Activation activation)
      : dropout_(dropout), activation_(activation),
        norm1_(register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})))),
        attn_(register_module("attn", Attention(d_model, heads, dropout, kernel))),
        norm2_(register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})))),
        fc1_(register_module("fc1", torch::nn::Linear(d_model, hidden))),
        fc2_(register_module("fc2", torch::nn::Linear(hidden, d_model))) {}

  at::Tensor forward(at::Tensor x) {
    const bool train = is_training();
    x = x + at::dropout(attn_->forward(norm1_->forward(x)), dropout_, train);
    at::Tensor h = activate(loom::sdk::nn::linear(fc1_, norm2_->forward(x)), activation_);
    return x + at::dropout(loom::sdk::nn::linear(fc2_, at::dropout(h, dropout_, train)), dropout_, train);
  }

 private:
  double dropout_;
  Activation activation_;
  torch::nn::LayerNorm norm1_;
  Attention attn_;
  torch::nn::LayerNorm norm2_;
  torch::nn::Linear fc1_, fc2_;
};
TORCH_MODULE(Block);

struct Shape {
  bool image = false;
  int64_t channels = 0, side = 0;       // images
  int64_t tokens = 0, features = 0;     // sequences
};

class VitImpl : public torch::nn::Module {
 public:
  VitImpl(const Shape& shape, int64_t classes, int64_t layers, int64_t d_model, int64_t heads,
          double mlp_ratio, double dropout, int64_t patch, bool cls_token, int64_t stem_channels,
          AttentionKernel kernel, PatchKernel patch_kernel, Activation activation)
      : shape_(shape), dropout_(dropout), cls_(cls_token), patch_(patch), patch_kernel_(patch_kernel),
        activation_(activation) {
    int64_t tokens = 0;
    if (shape.image) {
      int64_t channels = shape.channels;
      if (stem_channels > 0) {
        // Note [Convolutional stem]: one 3x3 convolution before the patches gives the encoder
        // local features a patch embedding alone cannot; on small images and short training it
        // is worth several points of accuracy for little compute (Xiao et al., "Early
        // convolutions help transformers see better", 2021).
        channels = stem_channels;
        stem_ = register_module("stem", torch::nn::Conv2d(torch::nn::Conv2dOptions(shape.channels, channels, 3).padding(1)));
      }
      patch_embed_ = register_module(
          "patch_embed", torch::nn::Conv2d(torch::nn::Conv2dOptions(channels, d_model, patch).stride(patch)));
      tokens = (shape.side / patch) * (shape.side / patch);
    } else {
      token_embed_ = register_module("token_embed", torch::nn::Linear(shape.features, d_model));
      tokens = shape.tokens;
    }
    if (cls_) {
      cls_token_ = register_parameter("cls_token", at::zeros({1, 1, d_model}));
      ++tokens;
    }
    pos_embed_ = register_parameter("pos_embed", at::zeros({1, tokens, d_model}));
    torch::nn::init::normal_(pos_embed_, 0.0, 0.02);
    const auto hidden = static_cast<int64_t>(std::lround(mlp_ratio * static_cast<double>(d_model)));
    blocks_ = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < layers; ++i) blocks_->push_back(Block(d_model, heads, hidden, dropout, kernel, activation));
    norm_ = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
    head_ = register_module("head", torch::nn::Linear(d_model, classes));
  }

  at::Tensor forward(const at::Tensor& input) {
    at::Tensor x;
    if (shape_.image && stem_ && patches_as_matmul(input)) {
      x = stem_and_patches(input);  // [B, N, d]
    } else if (shape_.image) {
      x = stem_ ? activate(stem_->forward(input), activation_) : input;
      x = embed_patches(x);  // [B, N, d]
    } else {
      x = loom::sdk::nn::linear(token_embed_, input);
    }
    if (cls_) x = at::cat({cls_token_.expand({x.size(0), 1, x.size(2)}), x}, 1);
    x = at::dropout(x + pos_embed_, dropout_, is_training());
    for (const auto& block : *blocks_) x = block->as<BlockImpl>()->forward(x);
    x = norm_->forward(x);
    x = cls_ ? x.select(1, 0) : x.mean(1);
    return loom::sdk::nn::linear(head_, x);
  }

 private:
  // Note [Patch embedding as one matrix product]
  // A convolution whose stride equals its kernel sees each pixel once: it is a reshape of the
  // image into patches and one matrix product with the kernel flattened, with the same weights
  // (the checkpoint keeps the convolution's [d, C, p, p] weight). On CPU, oneDNN's convolution
  // backward for this shape is slow: forward and backward of the 16 -> 96, 7x7/7 embedding at
  // batch 128 take 11.4 ms as a convolution and 8.8 ms as a product, 102 against 43 ms for a
  // 224 x 224 image in 16 x 16 patches at batch 32 (bench/attention_kernels.py, 2 cores).
  bool patches_as_matmul(const at::Tensor& x) const {
    return patch_kernel_ == PatchKernel::kMatmul || (patch_kernel_ == PatchKernel::kAuto && x.is_cpu());
  }

  at::Tensor embed_patches(const at::Tensor& x) {
    const int64_t b = x.size(0), c = x.size(1), side = x.size(2), g = side / patch_;
    if (!patches_as_matmul(x)) return patch_embed_->forward(x).flatten(2).transpose(1, 2);
    const at::Tensor patches = x.reshape({b, c, g, patch_, g, patch_})
                                   .permute({0, 2, 4, 1, 3, 5})
                                   .reshape({b, g * g, c * patch_ * patch_});
    return at::linear(patches, patch_embed_->weight.view({patch_embed_->weight.size(0), -1}), patch_embed_->bias);
  }

  // Note [Stem and patches in patch order]
  // With a stem, the patch product above reorders the stem's output, [B, C, H, W], into patches:
  // a strided copy of the largest activation forward and another of its gradient backward (3.4 of
  // the default job's 44.7 ms per step on the 2-core CI machine, `loom profile`). Here the 3x3
  // stem is a product over the input's 3x3 neighbourhoods gathered in patch order (pixel (gy, gx,
  // py, px), each row C x 3 x 3 values: the stem weight's own order), so its output is already
  // [B, patches, p x p x S] and the patch embedding takes it with no copy, against its weight
  // permuted to (p, p, S) order. The input needs no gradient: the gather (one index_select over
  // the padded input, 4x faster than the same copy as a permute) is forward only. The stem's
  // product is batched per sample: as one [B*H*W, 9] x [9, S] matrix product its weight gradient
  // is a reduction over 100k rows that MKL runs 4x slower than B small ones summed. The same
  // weights and parameter shapes as the convolutions: checkpoints load either way.
  at::Tensor stem_and_patches(const at::Tensor& x) {
    const int64_t b = x.size(0), c = x.size(1), side = x.size(2), g = side / patch_, p = patch_;
    const at::Tensor& w = stem_->weight;  // [S, C, 3, 3]
    const int64_t s = w.size(0), d = patch_embed_->weight.size(0), rows = g * g * p * p;
    const at::Tensor padded = at::constant_pad_nd(x, {1, 1, 1, 1}).reshape({b, -1});
    const at::Tensor gathered = padded.index_select(1, gather_index(c, side, x.device())).view({b, rows, c * 9});
    const at::Tensor stem = activate(at::baddbmm(stem_->bias.expand({b, rows, s}), gathered,
                                                 w.view({s, c * 9}).t().expand({b, c * 9, s})),
                                     activation_);  // [B, rows, S]
    const at::Tensor weight = patch_embed_->weight.permute({0, 2, 3, 1}).reshape({d, p * p * s});
    return at::linear(stem.view({b, g * g, p * p * s}), weight, patch_embed_->bias);
  }

  /// Into the padded input ([C, side + 2, side + 2] flattened): for each pixel in patch order
  /// (gy, gx, py, px), its C x 3 x 3 neighbourhood. Made once per input geometry and device.
  const at::Tensor& gather_index(int64_t c, int64_t side, const c10::Device& device) {
    if (gather_.defined() && gather_.device() == device && gather_geometry_ == std::make_pair(c, side)) return gather_;
    const int64_t g = side / patch_, p = patch_, padded = side + 2;
    std::vector<int64_t> index;
    index.reserve(static_cast<size_t>(side * side * c * 9));
    for (int64_t gy = 0; gy < g; ++gy)
      for (int64_t gx = 0; gx < g; ++gx)
        for (int64_t py = 0; py < p; ++py)
          for (int64_t px = 0; px < p; ++px)
            for (int64_t ch = 0; ch < c; ++ch)
              for (int64_t ky = 0; ky < 3; ++ky)
                for (int64_t kx = 0; kx < 3; ++kx)
                  index.push_back(ch * padded * padded + (gy * p + py + ky) * padded + (gx * p + px + kx));
    gather_ = at::tensor(index, at::TensorOptions().dtype(at::kLong)).to(device);
    gather_geometry_ = {c, side};
    return gather_;
  }

  Shape shape_;
  double dropout_;
  bool cls_;
  int64_t patch_;
  PatchKernel patch_kernel_;
  Activation activation_;
  torch::nn::Conv2d stem_{nullptr}, patch_embed_{nullptr};
  at::Tensor gather_;  // Note [Stem and patches in patch order]; not a buffer: no part of the checkpoint
  std::pair<int64_t, int64_t> gather_geometry_{-1, -1};
  torch::nn::Linear token_embed_{nullptr};
  at::Tensor cls_token_, pos_embed_;
  torch::nn::ModuleList blocks_{nullptr};
  torch::nn::LayerNorm norm_{nullptr};
  torch::nn::Linear head_{nullptr};
};
TORCH_MODULE(Vit);

class LightweightTransformer final : public loom::sdk::Model {
 public:
  static constexpr loom_option_spec kOptions[] = {
      loom::sdk::option_enum("flavour", "standard", "standard|debug",
                             "debug: a tiny model for tests (1 layer, d_model 32, 2 heads, patch 7)"),
      loom::sdk::option_int("num_layers", "3", "encoder blocks", "1..256"),
      loom::sdk::option_int("d_model", "96", "width of the tokens", "1..65536"),
      loom::sdk::option_int("num_heads", "4", "attention heads (must divide d_model)", "1..1024"),
      loom::sdk::option_float("mlp_ratio", "2.0", "MLP hidden width / d_model", "0.0625..64"),
      loom::sdk::option_float("dropout", "0.0", "dropout on attention, MLP and embeddings", "0..0.99"),
      loom::sdk::option_int("patch_size", "7", "side of the square image patches", "1..1024"),
      loom::sdk::option_int("image_size", "0", "resize images to this side first (0: keep the data's size)", "0..8192"),
      loom::sdk::option_enum("pool", "mean", "mean|cls", "mean of the tokens, or a class token"),
      loom::sdk::option_enum("attention", "auto", "auto|sdpa|math",
                             "attention kernel: scaled_dot_product_attention, or Q K^T, softmax, times V as three "
                             "batched products; auto: math on CPU up to 100 tokens (faster there), SDPA elsewhere"),
      loom::sdk::option_enum("patch_embedding", "auto", "auto|conv|matmul",
                             "images: the patch embedding as a strided convolution or as one matrix product over "
                             "the patches (the same weights); auto: matmul on CPU (faster there), conv elsewhere"),
      loom::sdk::option_enum("activation", "gelu", "gelu|relu",
                             "the stem's and the MLPs' nonlinearity: exact GELU, or ReLU (about 5 % faster on CPU, "
                             "keeps no pre-activations for backward)"),
      loom::sdk::option_int("stem_channels", "16", "images: channels of a 3x3 convolution before the patch embedding (0: none)", "0..4096"),
      loom::sdk::option_int("num_classes", "0", "output classes (0: from the dataset)", "0..10000000"),
  };

  explicit LightweightTransformer(const loom::sdk::Options& o)
      : layers_(o.get_int("num_layers")), d_model_(o.get_int("d_model")), heads_(o.get_int("num_heads")),
        mlp_ratio_(o.get_float("mlp_ratio")), dropout_(o.get_float("dropout")), patch_(o.get_int("patch_size")),
        image_size_(o.get_int("image_size")), classes_(o.get_int("num_classes")),
        cls_token_(o.get_string("pool") == "cls"), stem_channels_(o.get_int("stem_channels")),
        attention_(o.get_string("attention") == "math"   ? AttentionKernel::kMath
                   : o.get_string("attention") == "sdpa" ? AttentionKernel::kSdpa
                                                         : AttentionKernel::kAuto),
        patch_kernel_(o.get_string("patch_embedding") == "conv"     ? PatchKernel::kConv
                      : o.get_string("patch_embedding") == "matmul" ? PatchKernel::kMatmul
                                                                    : PatchKernel::kAuto),
        activation_(o.get_string("activation") == "relu" ? Activation::kRelu : Activation::kGelu) {
    if (o.get_string("flavour") == "debug") {
      // The debug flavour fixes the shape: a value the user set for one of these would be ignored
      // without a word, unless it is the debug one. (A value equal to the default cannot be told
      // from an unset one.)
      const std::pair<const char*, int64_t> fixed[] = {
          {"num_layers", 1}, {"d_model", 32}, {"num_heads", 2}, {"patch_size", 7}, {"stem_channels", 0}};
      for (const auto& [key, value] : fixed)
        for (const auto& spec : kOptions)
          if (std::string(spec.key) == key && o.get_string(key) != spec.default_value && o.get_int(key) != value)
            throw Error(std::string("lightweight_transformer: flavour = debug builds num_layers 1, d_model 32, "
                                    "num_heads 2, patch_size 7 and stem_channels 0, so model.") + key + " = " +
                        o.get_string(key) + " would be ignored; drop it, or use flavour = standard");
      layers_ = 1;
      stem_channels_ = 0;
      d_model_ = 32;
      heads_ = 2;
      patch_ = 7;
    }
    if (layers_ < 1 || d_model_ < 1 || heads_ < 1 || patch_ < 1 || mlp_ratio_ <= 0)
      throw Error("lightweight_transformer: num_layers, d_model, num_heads, patch_size and mlp_ratio must be positive");
    if (d_model_ % heads_ != 0)
      throw Error("lightweight_transformer: num_heads " + std::to_string(heads_) + " does not divide d_model " +
                  std::to_string(d_model_) + ": set model.d_model to a multiple of it (" +
                  std::to_string(d_model_ / heads_ * heads_ > 0 ? d_model_ / heads_ * heads_ : heads_) + " or " +
                  std::to_string((d_model_ / heads_ + 1) * heads_) + "), or model.num_heads to a divisor of it");
    if (dropout_ < 0 || dropout_ >= 1) throw Error("lightweight_transformer: dropout must be in [0, 1)");
    if (image_size_ < 0 || classes_ < 0 || stem_channels_ < 0) throw Error("lightweight_transformer: image_size and num_classes must be >= 0");
  }

  void setup(const loom::sdk::DataSpec& data) override {
    auto field = data.fields.find(data.input_key);
    if (field == data.fields.end())
      throw Error("lightweight_transformer: the dataset has no input field '" + data.input_key + "'");
    input_key_ = data.input_key;
    target_key_ = data.target_key;
    const auto& s = field->second.shape;
    Shape shape;
    if (s.size() == 3) {
      if (s[1] != s[2])
        throw Error("lightweight_transformer: images must be square, the data has " + std::to_string(s[1]) + "x" +
                    std::to_string(s[2]));
      shape.image = true;
      shape.channels = s[0];
      shape.side = image_size_ > 0 ? image_size_ : s[1];
      resize_ = image_size_ > 0 && image_size_ != s[1];
      if (shape.side % patch_ != 0)
        throw Error("lightweight_transformer: image side " + std::to_string(shape.side) +
                    " is not a multiple of patch_size " + std::to_string(patch_) +
                    "; choose a patch_size that divides it or set model.image_size");
      if (data.attributes.count("mean") && data.attributes.count("std")) {
        mean_ = std::stod(data.attributes.at("mean"));
        std_ = std::stod(data.attributes.at("std"));
      }
    } else if (s.size() == 2) {
      shape.tokens = s[0];
      shape.features = s[1];
    } else {
      throw Error("lightweight_transformer: input '" + data.input_key +
                  "' must be an image (C x H x W) or a sequence (T x F), got " + std::to_string(s.size()) +
                  " dimensions");
    }
    if (classes_ > 0 && classes_ < data.num_classes)
      throw Error("lightweight_transformer: model.num_classes " + std::to_string(classes_) + " is fewer than the " +
                  std::to_string(data.num_classes) + " classes of the data (its labels up to " +
                  std::to_string(data.num_classes - 1) + " would have no output): set it to 0 (the data's) or at least " +
                  std::to_string(data.num_classes));
    if (classes_ == 0) classes_ = data.num_classes;
    if (classes_ < 2) throw Error("lightweight_transformer: needs at least 2 classes (set model.num_classes)");
    net_ = Vit(shape, classes_, layers_, d_model_, heads_, mlp_ratio_, dropout_, patch_, cls_token_, stem_channels_,
               attention_, patch_kernel_, activation_);
    shape_ = shape;
  }

  torch::nn::Module& module() override { return *net_; }

  loom::sdk::ModelOutput forward(const loom::sdk::Batch& batch, bool) override {
    at::Tensor x = batch.at(input_key_);
    if (shape_.image) {
      if (x.scalar_type() == at::kByte) x = x.to(at::kFloat).mul_(1.0 / 255.0);
      else if (x.scalar_type() != at::kFloat) x = x.to(at::kFloat);
      if (std_ > 0) x = x.sub(mean_).div_(std_);
      if (resize_) x = at::upsample_bilinear2d(x, {shape_.side, shape_.side}, /*align_corners=*/false);
    } else if (x.scalar_type() != at::kFloat) {
      x = x.to(at::kFloat);
    }
    const at::Tensor logits = net_->forward(x);
    const at::Tensor& target = batch.at(target_key_);
    const at::Tensor loss_sum =
        at::cross_entropy_loss(logits.to(at::kFloat), target, /*weight=*/{}, at::Reduction::Sum);
    const at::Tensor correct = at::argmax(logits, 1).eq(target).sum();
    // A row labelled -100 (the index the loss ignores, as in PyTorch) adds nothing to the loss
    // or to the correct count, so it is not counted in either's denominator either.
    const at::Tensor labelled = target.ne(kIgnoredLabel).sum().to(at::kFloat);
    return {loss_sum, labelled, {{"accuracy", {correct, {}}}}};
  }

  std::vector<loom::sdk::MetricSpec> metrics() const override {
    return {{"accuracy", "accuracy", loom::sdk::Direction::kMaximize, /*percent=*/true}};
  }

  bool decays(const std::string& name, const at::Tensor& parameter) const override {
    return parameter.dim() >= 2 && name.find("pos_embed") == std::string::npos &&
           name.find("cls_token") == std::string::npos;
  }

  // Model 2.2: three times the forward's products per sample at 2 FLOPs per multiply-add (the
  // stem's and the patch embedding's convolutions, each block's four products, attention's two over
  // the tokens, the head), whichever kernels compute them; tests/integration/flops_test.py checks
  // it against PyTorch's FlopCounterMode on the same model in bench/pytorch_vit.py.
  double flops_per_loss_term() const override {
    const double d = static_cast<double>(d_model_);
    const double hidden = static_cast<double>(std::lround(mlp_ratio_ * d));
    double forward = 0, tokens = 0;
    if (shape_.image) {
      const double side = static_cast<double>(shape_.side), patch = static_cast<double>(patch_);
      double channels = static_cast<double>(shape_.channels);
      if (stem_channels_ > 0) {
        forward += 2 * side * side * static_cast<double>(stem_channels_) * channels * 9;
        channels = static_cast<double>(stem_channels_);
      }
      tokens = (side / patch) * (side / patch);
      forward += 2 * tokens * d * channels * patch * patch;
    } else {
      tokens = static_cast<double>(shape_.tokens);
      forward += 2 * tokens * static_cast<double>(shape_.features) * d;
    }
    if (cls_token_) ++tokens;
    forward += static_cast<double>(layers_) * (2 * tokens * (4 * d * d + 2 * d * hidden) + 4 * tokens * tokens * d);
    forward += 2 * d * static_cast<double>(classes_);
    return 3 * forward;
  }

  std::string describe() const override {
    std::string what = "ViT " + std::to_string(layers_) + " layers x d_model " + std::to_string(d_model_) + ", " +
                       std::to_string(heads_) + " heads, ";
    if (shape_.image)
      what += (stem_channels_ > 0 ? "3x3 conv stem (" + std::to_string(stem_channels_) + ") + " : std::string()) + "patch " + std::to_string(patch_) + " on " +
              std::to_string(shape_.side) + "x" + std::to_string(shape_.side);
    else
      what += std::to_string(shape_.tokens) + " tokens of " + std::to_string(shape_.features);
    return what + " -> " + std::to_string(classes_) + " classes";
  }

 private:
  int64_t layers_, d_model_, heads_;
  double mlp_ratio_, dropout_;
  int64_t patch_, image_size_, classes_;
  bool cls_token_;
  int64_t stem_channels_;
  AttentionKernel attention_;
  PatchKernel patch_kernel_;
  Activation activation_;
  bool resize_ = false;
  double mean_ = 0, std_ = 0;
  Shape shape_;
  std::string input_key_, target_key_;
  Vit net_{nullptr};
};

}  // namespace

LOOM_PLUGIN("lightweight_transformer", "1.0.0",
            loom::sdk::component<LightweightTransformer>("lightweight_transformer",
                                                         "ViT-style encoder over image patches or feature sequences"))
