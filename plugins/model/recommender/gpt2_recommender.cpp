// gpt2_recommender: seed 002's GPT2RecommenderEnhanced (docs/recommender.md). An item is its id
// embedding plus a projection of its text's GPT-2 vector (<loom/sdk/gpt2_text.hpp>); a user is an id
// embedding; an MLP over [user, item, user * item] scores the pair. Task `rating` predicts the
// rating (MSE; RMSE and MAE), task `ranking` scores an interaction above sampled negatives (BCE or
// sampled softmax) and is evaluated against the full catalogue with the user's known items
// masked (HR@K, NDCG@K, MRR). GPT-2 is frozen (no gradient, no optimizer state) or tuned at its
// own learning-rate scale; its text vectors are cached (frozen only) or computed per batch.
//
// The plugin also holds the two interaction datasets (datasets.hpp), so `loom plugins check`
// shapes the model with its own data.
#include "datasets.hpp"

#include <loom/sdk/files.hpp>
#include <loom/sdk/attributes.hpp>
#include <loom/sdk/gpt2_text.hpp>

#include <loom/sdk/sdk.hpp>
#include <loom/sdk/stop.hpp>

#include <ATen/ops/_unique2.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/log2.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/remainder.h>
#include <ATen/ops/repeat_interleave.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/softplus.h>
#include <ATen/ops/where.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <tuple>
#include <cstdio>
#include <limits>
#include <optional>

namespace loom::plugins::recommender {

namespace {

namespace gpt2 = sdk::gpt2;
using sdk::Error;

std::string attribute(const sdk::DataSpec& data, const std::string& key) {
  auto it = data.attributes.find(key);
  if (it == data.attributes.end())
    throw Error("gpt2_recommender: the dataset does not give '" + key + "'; use an interaction dataset (interactions, "
                "synthetic_interactions)");
  return it->second;
}

/// A numeric attribute; a text that is not a number is one error naming the key.
double number_attribute(const sdk::DataSpec& data, const std::string& key) {
  const std::string text = attribute(data, key);
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (text.empty() || end == nullptr || *end != '\0' || !std::isfinite(value))
    throw Error("gpt2_recommender: the dataset's attribute '" + key + "' is '" + text + "', not a number");
  return value;
}

/// The network: GPT-2 for the text, id embeddings, the MLP. Parameter names: gpt2.*, user.*,
/// item.*, text_proj.*, mlp_in.*, mlp_hidden.*, mlp_out.*.
class NetImpl : public torch::nn::Module {
 public:
  NetImpl(const gpt2::Config& c, int64_t users, int64_t items, int64_t dim, int64_t hidden)
      : dim_(dim),
        gpt2(register_module("gpt2", gpt2::Model(c))),
        user(register_module("user", torch::nn::Embedding(users, dim))),
        item(register_module("item", torch::nn::Embedding(items, dim))),
        text_proj(register_module("text_proj", torch::nn::Linear(c.n_embd, dim))),
        mlp_in(register_module("mlp_in", torch::nn::Linear(3 * dim, hidden))),
        mlp_hidden(register_module("mlp_hidden", torch::nn::Linear(hidden, hidden / 2))),
        mlp_out(register_module("mlp_out", torch::nn::Linear(hidden / 2, 1))),
        user_ids(register_buffer("user_ids", at::zeros({users}, at::kLong))),
        item_ids(register_buffer("item_ids", at::zeros({items}, at::kLong))) {
    torch::NoGradGuard no_grad;
    user->weight.normal_(0.0, 0.1);
    item->weight.normal_(0.0, 0.1);
  }

  /// Scores of pairs: users [P, d] with items [P, d] -> [P].
  at::Tensor score_pairs(const at::Tensor& u, const at::Tensor& v) { return head(first_layer(u, v, false)).squeeze(-1); }

  /// Scores of every user with every item: [B, d] x [C, d] -> [B, C].
  at::Tensor score_grid(const at::Tensor& u, const at::Tensor& v) { return head(first_layer(u, v, true)).squeeze(-1); }

 private:
  // mlp_in over [u, v, u * v] as three products (the grid never materialises [B, C, 3d]).
  at::Tensor first_layer(const at::Tensor& u, const at::Tensor& v, bool grid) {
    const at::Tensor& w = mlp_in->weight;
    const at::Tensor a = at::linear(u, w.narrow(1, 0, dim_), mlp_in->bias);
    const at::Tensor b = at::linear(v, w.narrow(1, dim_, dim_));
    if (!grid) return at::relu(a + b + at::linear(u * v, w.narrow(1, 2 * dim_, dim_)));
    const at::Tensor c = at::linear(u.unsqueeze(1) * v.unsqueeze(0), w.narrow(1, 2 * dim_, dim_));
    return at::relu(a.unsqueeze(1) + b.unsqueeze(0) + c);
  }
  at::Tensor head(const at::Tensor& h) { return mlp_out->forward(at::relu(mlp_hidden->forward(h))); }

  int64_t dim_;

 public:
  gpt2::Model gpt2;
  torch::nn::Embedding user, item;
  torch::nn::Linear text_proj, mlp_in, mlp_hidden, mlp_out;
  /// The data's own user and item ids by index, saved with every checkpoint: the dense indices
  /// mean these ids and no others (a checkpoint of other data is refused, `loom recommend`
  /// prints them). Ids that are not integers are stored as -1.
  at::Tensor user_ids, item_ids;
};
TORCH_MODULE(Net);

/// The data's ids (one per line) as integers; -1 for one that is not.
at::Tensor ids_tensor(const std::vector<std::string>& ids) {
  at::Tensor out = at::empty({static_cast<int64_t>(ids.size())}, at::kLong);
  int64_t* p = out.data_ptr<int64_t>();
  for (size_t i = 0; i < ids.size(); ++i) {
    char* end = nullptr;
    const long long v = std::strtoll(ids[i].c_str(), &end, 10);
    p[i] = !ids[i].empty() && end != nullptr && *end == '\0' ? v : -1;
  }
  return out;
}

class Gpt2Recommender final : public sdk::Model {
 public:
  static constexpr loom_option_spec kOptions[] = {
      sdk::option_enum("size", "gpt2", "gpt2|gpt2-medium|debug",
                       "GPT-2's size without `pretrained`: gpt2 124M, gpt2-medium 350M, debug (2 layers x 64)"),
      sdk::option_string("pretrained", "",
                         "a Hugging Face GPT-2 folder (config.json, model.safetensors, vocab.json, merges.txt): "
                         "its sizes, weights and tokenizer"),
      sdk::option_string("tokenizer", "",
                         "without `pretrained`: a folder with vocab.json and merges.txt (none: the text's UTF-8 bytes)"),
      sdk::option_int("vocab_size", "0",
                      "GPT-2's token embeddings (0: the tokenizer's; 50257 gives GPT-2's size with a byte tokenizer)",
                      "0..10000000"),
      sdk::option_int("text_tokens", "32", "tokens of an item's text GPT-2 reads (longer texts are cut)", "1..1024"),
      sdk::option_enum("pooling", "mean", "mean|last", "one vector per text: the mean over its tokens, or the last token"),
      sdk::option_bool("use_cache", "true",
                       "compute the text vectors once and keep them on the device (faster, more memory; needs "
                       "freeze_gpt2); false: per batch (less memory)"),
      sdk::option_bool("freeze_gpt2", "true", "GPT-2 gets no gradients and no optimizer state"),
      sdk::option_float("gpt2_lr_scale", "0.1", "GPT-2's learning rate as a share of the run's (when it trains)", "0..1000"),
      sdk::option_enum("task", "auto", "auto|rating|ranking", "auto: the data's"),
      sdk::option_int("embedding_dim", "64", "user and item embeddings, and the text's projection", "1..65536"),
      sdk::option_int("hidden", "256", "the MLP's first layer (its second has half)", "2..65536"),
      sdk::option_int("negatives", "4", "ranking: sampled negatives per interaction", "1..10000"),
      sdk::option_enum("loss", "bce", "bce|softmax", "ranking: binary cross-entropy, or softmax over the positive and its negatives"),
      sdk::option_int("top_k", "10", "ranking: K of HR@K and NDCG@K", "1..10000"),
  };

  explicit Gpt2Recommender(const sdk::Options& o)
      : size_(o.get_string("size")), pretrained_(o.get_string("pretrained")), tokenizer_dir_(o.get_string("tokenizer")),
        vocab_size_(o.get_int("vocab_size")), text_tokens_(o.get_int("text_tokens")), pooling_(gpt2::parse_pooling(o.get_string("pooling"))),
        use_cache_(o.get_bool("use_cache")), freeze_(o.get_bool("freeze_gpt2")), gpt2_lr_scale_(o.get_float("gpt2_lr_scale")),
        task_option_(o.get_string("task")), dim_(o.get_int("embedding_dim")), hidden_(o.get_int("hidden")),
        negatives_(o.get_int("negatives")), softmax_(o.get_string("loss") == "softmax"), top_k_(o.get_int("top_k")) {
    if (use_cache_ && !freeze_)
      throw Error("gpt2_recommender: use_cache = true needs freeze_gpt2 = true: a GPT-2 that trains changes every item's "
                  "text vector at every step, so a cache would be stale. Set model.use_cache = false to tune GPT-2, or "
                  "model.freeze_gpt2 = true");
  }

  void setup(const sdk::DataSpec& data) override {
    for (const char* key : {"user", "item"}) {
      auto f = data.fields.find(key);
      if (f == data.fields.end() || !f->second.shape.empty() || f->second.dtype != c10::ScalarType::Long)
        throw Error(std::string("gpt2_recommender: the dataset needs a field '") + key +
                    "' of int64 scalars (an interaction dataset: interactions, synthetic_interactions)");
    }
    auto r = data.fields.find("rating");
    if (r == data.fields.end() || !r->second.shape.empty())
      throw Error("gpt2_recommender: the dataset needs a field 'rating' of scalars");
    task_ = parse_task(task_option_ == "auto" ? attribute(data, "task") : task_option_);
    if (const auto given = data.attributes.find("task");  // (its ratings are 1: a constant would fit them)
        task_ == Task::kRating && given != data.attributes.end() && given->second == "ranking")
      throw Error("gpt2_recommender: model.task = rating on data made for ranking, whose ratings are all 1 (an interaction "
                  "happened); predicting a rating needs the data's ratings: set data.task = rating, or model.task = auto");
    users_ = static_cast<int64_t>(number_attribute(data, "users.count"));
    items_ = static_cast<int64_t>(number_attribute(data, "items.count"));
    rating_mean_ = number_attribute(data, "rating.mean");
    if (users_ < 1 || items_ < 1)
      throw Error("gpt2_recommender: the dataset has " + std::to_string(users_) + " users and " + std::to_string(items_) +
                  " items; it needs at least one of each");
    const std::vector<std::string> texts = sdk::attribute_lines(attribute(data, "items.text"));
    if (static_cast<int64_t>(texts.size()) != items_)
      throw Error("gpt2_recommender: the dataset gives " + std::to_string(texts.size()) + " item texts for " +
                  std::to_string(items_) + " items");
    if (task_ == Task::kRanking && top_k_ >= items_)  // every target in the top K: HR@K would be 1.0 whatever the model
      throw Error("gpt2_recommender: model.top_k " + std::to_string(top_k_) + " is not below the " + std::to_string(items_) +
                  " items: every item is in the top " + std::to_string(top_k_) + ", so HR@" + std::to_string(top_k_) +
                  " would be 1 for any model; lower model.top_k");
    if (task_ == Task::kRanking && negatives_ >= items_)
      throw Error("gpt2_recommender: model.negatives " + std::to_string(negatives_) + " is not below the " +
                  std::to_string(items_) + " items");

    std::optional<gpt2::Tokenizer> tokenizer;
    namespace fs = std::filesystem;
    if (std::error_code ec; !pretrained_.empty() && !fs::is_directory(pretrained_, ec)) {  // (it said "has no vocab.json")
      const std::string what = sdk::what_is_at(pretrained_);
      throw Error("gpt2_recommender: model.pretrained = " + pretrained_ +
                  (what == "no such file"             ? ": no such folder"
                      : what.rfind("cannot", 0) == 0 ? " " + what
                                                     : " is " + (what.empty() ? std::string("a file") : what) + ", not a folder") +
                  "; name a Hugging Face GPT-2 folder (config.json, model.safetensors, vocab.json, merges.txt)");
    }
    const fs::path vocab_dir = !pretrained_.empty() && fs::exists(fs::path(pretrained_) / "vocab.json") ? fs::path(pretrained_)
                                                                                                        : fs::path(tokenizer_dir_);
    // (pretrained embeddings read BPE ids: bytes fed to them gave meaningless text vectors, trained in silence)
    if (!pretrained_.empty() && vocab_dir.empty())
      throw Error("gpt2_recommender: model.pretrained = " + pretrained_ + " has no vocab.json: its GPT-2 reads the ids of "
                  "its tokenizer, and text read as bytes would mean nothing to it. Put the tokenizer's vocab.json and "
                  "merges.txt there (as Hugging Face saves them), or name their folder with model.tokenizer");
    if (!vocab_dir.empty()) tokenizer.emplace(vocab_dir);
    else
      sdk::log::warn("gpt2_recommender: no tokenizer (model.tokenizer, or model.pretrained with a vocab.json): item text ",
                     "is read as UTF-8 bytes, a vocabulary of 256");
    // (the files read besides the weights: one edited in place changed an evaluation's figures in silence)
    if (!vocab_dir.empty()) fingerprints_["tokenizer"] = sdk::files_fingerprint({vocab_dir / "vocab.json", vocab_dir / "merges.txt"});
    if (!pretrained_.empty()) fingerprints_["pretrained.config"] = sdk::files_fingerprint({fs::path(pretrained_) / "config.json"});
    tokens_ = gpt2::tokenize(texts, tokenizer ? &*tokenizer : nullptr, text_tokens_);

    gpt2::Config c = pretrained_.empty() ? gpt2::Config::of_size(size_) : gpt2::hf_config(pretrained_, gpt2::Head::kUnused);
    if (vocab_size_ > 0 && vocab_size_ < tokens_.vocab_size)
      throw Error("gpt2_recommender: model.vocab_size " + std::to_string(vocab_size_) + " is below the tokenizer's ids (up to " +
                  std::to_string(tokens_.vocab_size - 1) + ")");
    if (vocab_size_ > 0 && !pretrained_.empty())
      throw Error("gpt2_recommender: model.vocab_size is for a GPT-2 without model.pretrained (whose config.json says it)");
    if (pretrained_.empty()) {
      c.vocab_size = vocab_size_ > 0 ? vocab_size_ : tokens_.vocab_size;
      // A trimmed vocab.json that kept its ids sizes the embedding by its largest id: one token
      // at id 16 000 000 makes a 49 GB table of rows no token uses. Said, with the size.
      if (tokenizer && vocab_size_ == 0 && tokens_.vocab_size - tokenizer->token_count() > std::max<int64_t>(int64_t{1} << 16, tokenizer->token_count()))
        sdk::log::warn("gpt2_recommender: ", vocab_dir.string(), "/vocab.json has ", tokenizer->token_count(),
                       " tokens but ids up to ", tokens_.vocab_size - 1, ": the embedding has a row per id, ",
                       tokens_.vocab_size - tokenizer->token_count(), " of them no token's (",
                       tokens_.vocab_size * c.n_embd * 4 / (int64_t{1} << 20), " MiB in fp32 at n_embd ", c.n_embd,
                       "; three times more where GPT-2 trains: its gradient and AdamW's two states); number the tokens 0..",
                       tokenizer->token_count() - 1, " to keep the table to them");
      c.n_ctx = std::max(c.n_ctx, text_tokens_);
      sdk::log::warn("gpt2_recommender: no model.pretrained: GPT-2 (", size_, ") starts from random weights, so the item ",
                     "text carries little until it trains; point model.pretrained at a Hugging Face GPT-2 folder");
    } else if (tokens_.vocab_size > c.vocab_size) {
      throw Error("gpt2_recommender: the tokenizer of " + vocab_dir.string() + " has ids up to " +
                  std::to_string(tokens_.vocab_size - 1) + ", the model a vocabulary of " + std::to_string(c.vocab_size) +
                  " (" + pretrained_ + "/config.json)");
    }
    if (text_tokens_ > c.n_ctx)
      throw Error("gpt2_recommender: model.text_tokens " + std::to_string(text_tokens_) + " is more than GPT-2's " +
                  std::to_string(c.n_ctx) + " positions");
    net_ = Net(c, users_, items_, dim_, hidden_);
    data_user_ids_ = ids_tensor(sdk::attribute_lines(attribute(data, "users.ids")));
    data_item_ids_ = ids_tensor(sdk::attribute_lines(attribute(data, "items.ids")));
    if (data_user_ids_.numel() != users_ || data_item_ids_.numel() != items_)
      throw Error("gpt2_recommender: the dataset's users.ids or items.ids do not match users.count and items.count");
    {
      torch::NoGradGuard no_grad;
      net_->user_ids.copy_(data_user_ids_);
      net_->item_ids.copy_(data_item_ids_);
    }
    if (!pretrained_.empty()) {
      gpt2::load_hf_weights(*net_->gpt2, pretrained_, gpt2::Head::kUnused);  // (hidden states only)
      sdk::log::info("gpt2_recommender: GPT-2 weights from ", pretrained_);
    }
    if (freeze_)
      for (auto& p : net_->gpt2->parameters()) p.requires_grad_(false);
  }

  void use_tables(const sdk::TensorMap& tables) override {
    auto indptr = tables.find("seen.indptr"), items = tables.find("seen.items");
    if (indptr == tables.end() || items == tables.end()) return;
    if (indptr->second.numel() != users_ + 1)
      throw Error("gpt2_recommender: the dataset's seen.indptr has " + std::to_string(indptr->second.numel()) +
                  " entries for " + std::to_string(users_) + " users");
    seen_indptr_ = indptr->second.to(at::kLong);
    seen_items_ = items->second.to(at::kLong);
    if (task_ == Task::kRanking && users_ > 0) check_top_k();
  }

  torch::nn::Module& module() override { return *net_; }

  sdk::ModelOutput forward(const sdk::Batch& batch, bool train) override {
    check_ids();
    if (train) evaluation_vectors_ = at::Tensor();  // an evaluation's catalogue vectors, freed
    const at::Tensor& users = batch.at("user");
    const at::Tensor& items = batch.at("item");
    const at::Tensor rating = batch.at("rating").to(at::kFloat);
    const int64_t b = users.size(0);
    const at::Tensor count = at::scalar_tensor(static_cast<double>(b), rating.options());
    const at::Tensor u = net_->user->forward(users);
    if (task_ == Task::kRating) {
      const at::Tensor error = net_->score_pairs(u, item_vectors(items, train)).to(at::kFloat) + rating_mean_ - rating;
      const at::Tensor squared = error.square().sum();
      return {squared, count, {{"rmse", {squared.detach(), {}}}, {"mae", {error.detach().abs().sum(), {}}}}};
    }
    // Ranking: the interaction against `negatives` items, fresh from the run's generator in
    // training, derived from (user, item) in evaluation (so that an evaluation is deterministic).
    at::Tensor negatives;
    if (train) {
      negatives = at::randint(items_, {b, negatives_}, users.options().dtype(at::kLong));
    } else {
      const at::Tensor j = at::arange(1, negatives_ + 1, users.options().dtype(at::kLong)).unsqueeze(0);
      negatives = at::remainder(users.unsqueeze(1) * 73856093 + items.unsqueeze(1) * 19349663 + j * 83492791, items_);
    }
    const at::Tensor candidates = at::cat({items.unsqueeze(1), negatives}, 1);  // [B, 1 + n]
    const int64_t n = candidates.size(1);
    const at::Tensor v = item_vectors(candidates.reshape({-1}), train);
    const at::Tensor scores =
        net_->score_pairs(u.unsqueeze(1).expand({b, n, dim_}).reshape({-1, dim_}), v).view({b, n}).to(at::kFloat);
    at::Tensor loss;
    if (softmax_)
      loss = at::cross_entropy_loss(scores, at::zeros({b}, users.options().dtype(at::kLong)), {}, at::Reduction::Sum);
    else
      loss = at::softplus(-scores.select(1, 0)).sum() + at::softplus(scores.narrow(1, 1, n - 1)).sum();
    sdk::ModelOutput out{loss, count, {}};
    if (!train) {
      at::NoGradGuard no_grad;
      const at::Tensor rank = full_catalogue_rank(u, users, items);
      const at::Tensor hit = rank.lt(top_k_).to(at::kFloat);
      out.metrics["hr_at_" + std::to_string(top_k_)] = {hit.sum(), {}};
      out.metrics["ndcg_at_" + std::to_string(top_k_)] = {(hit / at::log2(rank.to(at::kFloat) + 2)).sum(), {}};
      out.metrics["mrr"] = {(1.0 / (rank.to(at::kFloat) + 1)).sum(), {}};
    }
    return out;
  }

  std::vector<sdk::MetricSpec> metrics() const override {
    if (task_ == Task::kRating)
      return {{"rmse", "RMSE", sdk::Direction::kMinimize, false}, {"mae", "MAE", sdk::Direction::kMinimize, false}};
    const std::string k = std::to_string(top_k_);
    return {{"hr_at_" + k, "HR@" + k, sdk::Direction::kMaximize, false},
            {"ndcg_at_" + k, "NDCG@" + k, sdk::Direction::kMaximize, false},
            {"mrr", "MRR", sdk::Direction::kMaximize, false}};
  }

  double metric_value(const std::string& name, double mean) const override {
    return name == "rmse" ? std::sqrt(std::max(0.0, mean)) : mean;
  }

  std::map<std::string, int64_t> held_memory() const override {
    if (!use_cache_) return {};
    return {{"cached embeddings", items_ * net_->gpt2->config().n_embd * static_cast<int64_t>(sizeof(float))}};
  }

  sdk::Batch predict(const sdk::Batch& inputs) override {
    auto it = inputs.find("user");
    if (it == inputs.end()) throw Error("gpt2_recommender: predict needs 'user' (int64 user indices)");
    check_ids();
    at::NoGradGuard no_grad;
    const at::Tensor u = net_->user->forward(it->second);
    at::Tensor scores = score_all(u);
    if (task_ == Task::kRating) scores = scores + rating_mean_;
    return {{"scores", scores}};
  }

  std::vector<sdk::ParameterGroup> parameter_groups() override {
    sdk::ParameterGroup decay{"gpt2", {}, {}, gpt2_lr_scale_, std::nullopt, freeze_};
    sdk::ParameterGroup no_decay{"gpt2_no_decay", {}, {}, gpt2_lr_scale_, 0.0, freeze_};
    for (const auto& item : net_->gpt2->named_parameters()) {
      sdk::ParameterGroup& group = freeze_ || item.value().dim() >= 2 ? decay : no_decay;
      group.names.push_back("gpt2." + item.key());
      group.params.push_back(item.value());
    }
    std::vector<sdk::ParameterGroup> out{decay};
    if (!no_decay.names.empty()) out.push_back(no_decay);
    return out;
  }

  std::map<std::string, std::string> fingerprints() const override { return fingerprints_; }

  std::string describe() const override {
    const gpt2::Config& c = net_->gpt2->config();
    char text[400];
    std::snprintf(text, sizeof text,
                  "%s over %lld items and %lld users: GPT-2 %s (%lld x %lld, %s) reads %lld tokens of item text, "
                  "%s pooling, %s, %s; embeddings %lld, MLP %lld-%lld-1",
                  task_name(task_), static_cast<long long>(items_), static_cast<long long>(users_),
                  pretrained_.empty() ? size_.c_str() : pretrained_.c_str(), static_cast<long long>(c.n_layer),
                  static_cast<long long>(c.n_embd), pretrained_.empty() ? "random start" : "pretrained",
                  static_cast<long long>(text_tokens_), pooling_ == gpt2::Pooling::kMean ? "mean" : "last-token",
                  freeze_ ? "frozen" : "trained", use_cache_ ? "text vectors cached" : "text vectors per batch",
                  static_cast<long long>(dim_), static_cast<long long>(hidden_), static_cast<long long>(hidden_ / 2));
    return text;
  }

 private:
  /// Evaluation ranks a user's held-out item among the items they do not know (the known ones, every
  /// split's, are masked, all but the item ranked): a top K that holds all of them is a hit whatever
  /// the model. For every user: one error (HR@K would be 1); for some: a warning with how many.
  /// (Setup's check counts the whole catalogue; a user without a test item of a random split is
  /// counted too.)
  void check_top_k() const {
    const at::Tensor known = seen_indptr_.narrow(0, 1, users_) - seen_indptr_.narrow(0, 0, users_);
    const at::Tensor candidates = items_ - known + 1;  // (the item ranked among them: it is unmasked)
    const int64_t fewest = candidates.min().item<int64_t>(), most = candidates.max().item<int64_t>();
    const int64_t held = candidates.le(top_k_).sum().item<int64_t>();
    if (held == 0) return;
    const std::string k = std::to_string(top_k_);
    const std::string lower = fewest > 1 ? "lower model.top_k below " + std::to_string(fewest)
                                         : "a user knows all " + std::to_string(items_) +
                                               " items, which leaves nothing to rank a held-out one against: give the data more "
                                               "items, or fewer per user";
    if (held == users_)
      throw Error("gpt2_recommender: model.top_k " + k + " holds every item each user does not know (" + std::to_string(most) +
                  " at most, of " + std::to_string(items_) + "; the known ones are masked), so HR@" + k +
                  " would be 1 whatever the model; " + lower);
    sdk::log::warn("gpt2_recommender: model.top_k ", top_k_, " holds every item ", held, " of the ", users_,
                   " users do not know (their known ones are masked): their HR@", top_k_, " is 1 whatever the model; ", lower);
  }

  /// After the id buffers changed (a checkpoint was loaded: copying bumps their version): they
  /// must be the data's, or every index would mean another user or item.
  void check_ids() {
    const int64_t version = net_->user_ids._version() + net_->item_ids._version();
    if (version == checked_ids_version_) return;
    for (const auto& [what, saved, data] : {std::tuple{"user", net_->user_ids, data_user_ids_},
                                           std::tuple{"item", net_->item_ids, data_item_ids_}}) {
      const at::Tensor differs = saved.cpu().ne(data).nonzero();
      if (differs.numel() > 0) {
        const int64_t i = differs[0][0].item<int64_t>();
        const int64_t count = differs.size(0);
        // (the same ids in another order: the ratings' lines reordered; the indices follow the order
        // in which the file first names each, so the weights' rows are others'; probe M)
        if (saved.numel() == data.numel() && at::equal(std::get<0>(saved.cpu().sort()), std::get<0>(data.sort())))
          throw Error(std::string("gpt2_recommender: the data names the run's ") + what + "s in another order (" +
                      std::to_string(count) + " of " + std::to_string(data.numel()) + " at other indices: the " + what +
                      " at index " + std::to_string(i) + " is id " + std::to_string(saved.cpu()[i].item<int64_t>()) +
                      " in the checkpoint, " + std::to_string(data[i].item<int64_t>()) + " in the data). A " + what +
                      "'s index is the order in which the data's files first name it, and each index has its weights: "
                      "give the files in the run's order (a sorted or shuffled copy reorders them)");
        throw Error(std::string("gpt2_recommender: the weights were trained on other data: the ") + what + " at index " +
                    std::to_string(i) + " is id " + std::to_string(saved.cpu()[i].item<int64_t>()) + " in the checkpoint, " +
                    std::to_string(data[i].item<int64_t>()) + " in the data (" + std::to_string(count) + " " + what +
                    (count == 1 ? " differs" : "s differ") +
                    "). Point data.root (and data.min_interactions, data.split) at what it was trained with (with "
                    "trainer.init_from: the data of the run it names), or start from no checkpoint");
      }
    }
    checked_ids_version_ = version;
  }

  /// Text vectors [K, E] of items [K] (undefined: all items, in order).
  at::Tensor text_vectors(const at::Tensor& items, bool train) {
    if (use_cache_) {
      refresh_cache();
      return items.defined() ? cache_.index_select(0, items) : cache_;
    }
    if (!items.defined()) return catalogue_vectors();
    // Evaluation: the catalogue's vectors, computed once for the whole evaluation.
    if (!train) return catalogue_vectors().index_select(0, items);
    // GPT-2 training: every candidate's text through it, repeats too, so that a step's memory is
    // the same at every step (b x (1 + negatives) texts), as the memory plan measured it.
    if (!freeze_) return encode(items, true);
    // A frozen GPT-2 without the cache: each distinct item once, without gradients, in chunks.
    const auto [unique, inverse, counts] = at::_unique2(items, /*sorted=*/true, /*return_inverse=*/true);
    return encode(unique, false).index_select(0, inverse);
  }

  at::Tensor item_vectors(const at::Tensor& items, bool train) {
    return net_->item->forward(items) + net_->text_proj->forward(text_vectors(items, train).to(net_->text_proj->weight.dtype()));
  }

  /// Scores of users' embeddings [B, d] against every item: [B, items], in chunks of items that
  /// keep the grid's [B, chunk, hidden] below 2M elements (8 MiB in fp32).
  at::Tensor score_all(const at::Tensor& u) {
    const at::Tensor v = net_->item->weight + net_->text_proj->forward(catalogue_vectors().to(net_->text_proj->weight.dtype()));
    const int64_t chunk = std::max<int64_t>(1, (int64_t{1} << 21) / std::max<int64_t>(1, u.size(0) * hidden_));
    std::vector<at::Tensor> parts;
    for (int64_t start = 0; start < items_; start += chunk)
      parts.push_back(net_->score_grid(u, v.narrow(0, start, std::min(chunk, items_ - start))).to(at::kFloat));
    return at::cat(parts, 1);
  }

  /// Each user's rank of its item among all items (0: first), its other known items masked.
  at::Tensor full_catalogue_rank(const at::Tensor& u, const at::Tensor& users, const at::Tensor& items) {
    at::Tensor scores = score_all(u);  // [B, items]
    const int64_t b = users.size(0);
    const at::Tensor target = scores.gather(1, items.unsqueeze(1));
    if (seen_indptr_.defined()) {
      if (seen_indptr_.device() != users.device()) {
        seen_indptr_ = seen_indptr_.to(users.device());
        seen_items_ = seen_items_.to(users.device());
      }
      const at::Tensor starts = seen_indptr_.index_select(0, users);
      const at::Tensor lengths = seen_indptr_.index_select(0, users + 1) - starts;
      const int64_t total = lengths.sum().item<int64_t>();
      at::Tensor mask = at::zeros({b * items_}, users.options().dtype(at::kBool));
      if (total > 0) {
        const at::Tensor rows = at::repeat_interleave(lengths, std::optional<int64_t>(total));
        const at::Tensor first = lengths.cumsum(0) - lengths;
        const at::Tensor within = at::arange(total, users.options()) - first.index_select(0, rows);
        const at::Tensor cols = seen_items_.index_select(0, starts.index_select(0, rows) + within);
        mask.index_fill_(0, rows * items_ + cols, true);
      }
      mask.index_fill_(0, at::arange(b, users.options()) * items_ + items, false);  // the item ranked is not masked
      scores = scores.masked_fill(mask.view({b, items_}), -std::numeric_limits<float>::infinity());
    }
    // Ties count against the target (a model that scores every item alike ranks each target last,
    // not first), and so does a NaN score; a NaN target is last.
    at::Tensor rank = (scores.gt(target) | scores.eq(target) | scores.isnan()).sum(1) - 1;  // (less the target)
    return at::where(target.squeeze(1).isnan(), at::full_like(rank, items_ - 1), rank);
  }

  /// GPT-2's vectors of items [K]: with gradients (GPT-2 in the module's mode), or without them
  /// in evaluation mode, in chunks whose [texts, tokens, width] stays near 512K elements (the
  /// transient of encoding a whole catalogue stays below a training step's).
  at::Tensor encode(const at::Tensor& items, bool grad) {
    const at::Tensor ids = tokens_on_device().first.index_select(0, items);
    const at::Tensor lengths = tokens_.lengths.to(ids.device()).index_select(0, items);
    if (grad) return gpt2::encode_texts(*net_->gpt2, ids, lengths, pooling_);
    at::NoGradGuard no_grad;
    const bool was_training = net_->gpt2->is_training();
    net_->gpt2->eval();
    std::vector<at::Tensor> parts;
    const int64_t chunk = std::clamp<int64_t>((int64_t{1} << 19) / (text_tokens_ * net_->gpt2->config().n_embd), 1, 256);
    // (minutes on a CPU: the catalogue's GPT-2 forward says how far it is every 15 s, and nothing where it is quick)
    const auto began = std::chrono::steady_clock::now();
    auto said = began;
    const auto seconds = [](auto from) { return std::chrono::duration<double>(std::chrono::steady_clock::now() - from).count(); };
    for (int64_t start = 0; start < ids.size(0); start += chunk) {
      if (sdk::stop_requested())  // (a run's set-up: a Ctrl-C waited minutes for the rest of the catalogue)
        throw Error("gpt2_recommender: stopped while encoding the items' text, " + std::to_string(start) + " of " +
                    std::to_string(ids.size(0)) + " items done");
      const int64_t n = std::min<int64_t>(chunk, ids.size(0) - start);
      parts.push_back(gpt2::encode_texts(*net_->gpt2, ids.narrow(0, start, n), lengths.narrow(0, start, n), pooling_));
      if (seconds(said) > 15 && start + n < ids.size(0)) {
        said = std::chrono::steady_clock::now();
        sdk::log::info("gpt2_recommender: encoding the items' text through GPT-2: ", start + n, " of ", ids.size(0),
                       " items in ", static_cast<int64_t>(seconds(began)), " s");
      }
    }
    if (said != began)
      sdk::log::info("gpt2_recommender: encoded the text of ", ids.size(0), " items in ", static_cast<int64_t>(seconds(began)), " s");
    net_->gpt2->train(was_training);
    return at::cat(parts);
  }

  /// Every item's text vector, for ranking the whole catalogue. With the cache, the cache.
  /// Without it, computed once per evaluation (while GPT-2's parameters stay as they are) and
  /// dropped at the next training forward: an evaluation of B batches encodes the catalogue once,
  /// not B times, and training holds nothing.
  at::Tensor catalogue_vectors() {
    if (use_cache_) {
      refresh_cache();
      return cache_;
    }
    const int64_t version = gpt2_version();
    if (!evaluation_vectors_.defined() || evaluation_vectors_.device() != net_->user->weight.device() ||
        version != evaluation_version_) {
      evaluation_vectors_ = at::Tensor();  // (freed before the new one is made)
      evaluation_vectors_ = encode(at::arange(items_, device_options()), false);
      evaluation_version_ = version;
    }
    return evaluation_vectors_;
  }

  int64_t gpt2_version() const {
    int64_t version = 0;
    for (const auto& p : net_->gpt2->parameters()) version += p._version();
    return version;
  }

  /// The cache of all items' vectors, rebuilt when GPT-2's parameters changed under it (loading a
  /// checkpoint bumps their version counters) or the module moved.
  void refresh_cache() {
    const int64_t version = gpt2_version();
    const c10::Device device = net_->user->weight.device();
    if (cache_.defined() && cache_.device() == device && version == cache_version_) return;
    cache_ = encode(at::arange(items_, device_options()), false);
    cache_version_ = version;
  }

  std::pair<at::Tensor, at::Tensor> tokens_on_device() {
    const c10::Device device = net_->user->weight.device();
    if (tokens_.ids.device() != device) {
      tokens_.ids = tokens_.ids.to(device);
      tokens_.lengths = tokens_.lengths.to(device);
    }
    return {tokens_.ids, tokens_.lengths};
  }

  at::TensorOptions device_options() const { return at::TensorOptions().dtype(at::kLong).device(net_->user->weight.device()); }

  std::string size_, pretrained_, tokenizer_dir_;
  int64_t vocab_size_, text_tokens_;
  gpt2::Pooling pooling_;
  bool use_cache_, freeze_;
  double gpt2_lr_scale_;
  std::string task_option_;
  int64_t dim_, hidden_, negatives_;
  bool softmax_;
  int64_t top_k_;
  Task task_ = Task::kRanking;
  int64_t users_ = 0, items_ = 0;
  double rating_mean_ = 0;
  gpt2::TokenizedTexts tokens_;
  at::Tensor seen_indptr_, seen_items_;
  at::Tensor cache_;
  int64_t cache_version_ = -1;
  at::Tensor evaluation_vectors_;
  int64_t evaluation_version_ = -1;
  at::Tensor data_user_ids_, data_item_ids_;
  int64_t checked_ids_version_ = -1;
  std::map<std::string, std::string> fingerprints_;
  Net net_{nullptr};
};

}  // namespace

}  // namespace loom::plugins::recommender

LOOM_PLUGIN("recommender", "1.0.0",
            loom::sdk::component<loom::plugins::recommender::Gpt2Recommender>(
                "gpt2_recommender", "GPT-2 over item text + user/item embeddings + MLP: ratings or ranking"),
            loom::sdk::component<loom::plugins::recommender::Interactions>(
                "interactions", "MovieLens (ml-100k, ml-1m, ml-latest) from data.root: users, items, ratings"),
            loom::sdk::component<loom::plugins::recommender::SyntheticInteractions>(
                "synthetic_interactions", "generated users and items with a known best HR@10 and RMSE"))
