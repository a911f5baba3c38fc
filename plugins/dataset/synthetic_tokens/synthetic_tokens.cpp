// synthetic_tokens: token sequences with a planted rule, for language-model tests and the GPT-2
// benchmark: the next token is a fixed random permutation of the current one, except with
// probability `noise`, where it is drawn uniformly. A model that learns the permutation predicts
// a share of about 1 - noise of the tokens right, and its loss falls from ln(vocabulary). Each
// sample is seq_len + 1 tokens: input the first seq_len, target the last seq_len. The whole
// dataset follows from `seed`.
#include <loom/sdk/sdk.hpp>
#include <loom/sdk/tensor_dataset.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randperm.h>
#include <ATen/ops/where.h>

namespace {

class SyntheticTokens final : public loom::sdk::TensorDataset {
 public:
  static constexpr loom_option_spec kOptions[] = {
      loom::sdk::option_int("vocab_size", "50257", "tokens in the vocabulary (GPT-2's 50257)", "2..10000000"),
      loom::sdk::option_int("seq_len", "128", "tokens per sample", "1..1048576"),
      loom::sdk::option_int("train_size", "512", "training sequences", "1..100000000"),
      loom::sdk::option_int("test_size", "64", "test sequences", "1..100000000"),
      loom::sdk::option_float("noise", "0.1", "probability that a token does not follow the rule", "0..1"),
      loom::sdk::option_int("seed", "1234", "seed of the data (independent of the trainer's seed)", "0.."),
  };

  explicit SyntheticTokens(const loom::sdk::Options& o)
      : TensorDataset("synthetic_tokens"),
        vocab_(o.get_int("vocab_size")),
        seq_len_(o.get_int("seq_len")),
        train_size_(o.get_int("train_size")),
        test_size_(o.get_int("test_size")),
        noise_(o.get_float("noise")),
        seed_(static_cast<uint64_t>(o.get_int("seed"))) {
    if (vocab_ < 2 || seq_len_ < 1 || train_size_ < 1 || test_size_ < 1)
      throw loom::sdk::Error("synthetic_tokens: vocab_size must be >= 2, seq_len and the split sizes >= 1");
    if (noise_ < 0 || noise_ > 1) throw loom::sdk::Error("synthetic_tokens: noise must be in [0, 1]");
    // The samples are held in memory (int64): refuse what would not fit rather than fail later.
    constexpr double kMaxBytes = 8.0 * (1LL << 30);
    const double bytes = 8.0 * static_cast<double>(train_size_ + test_size_) * static_cast<double>(seq_len_ + 1) * 2;
    if (bytes > kMaxBytes)
      throw loom::sdk::Error("synthetic_tokens: " + std::to_string(train_size_ + test_size_) + " sequences of " +
                             std::to_string(seq_len_) + " tokens would take more than 8 GiB of memory; lower "
                             "data.train_size or data.seq_len");
  }

  void setup() override {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed_);
    const auto longs = at::TensorOptions().dtype(at::kLong);
    const at::Tensor rule = at::randperm(vocab_, gen, longs);
    auto make = [&](int64_t n) -> loom::sdk::Batch {
      at::Tensor seq = at::empty({n, seq_len_ + 1}, longs);
      at::Tensor current = at::randint(vocab_, {n}, gen, longs);
      seq.select(1, 0).copy_(current);
      for (int64_t t = 1; t <= seq_len_; ++t) {
        const at::Tensor follows = at::index_select(rule, 0, current);
        const at::Tensor random = at::randint(vocab_, {n}, gen, longs);
        current = at::where(at::rand({n}, gen).lt(noise_), random, follows);
        seq.select(1, t).copy_(current);
      }
      return {{"input", seq.narrow(1, 0, seq_len_).contiguous()}, {"target", seq.narrow(1, 1, seq_len_).contiguous()}};
    };
    set_split(loom::sdk::Split::kTrain, make(train_size_));
    set_split(loom::sdk::Split::kTest, make(test_size_));
  }

  loom::sdk::DataSpec spec() const override {
    loom::sdk::DataSpec spec;
    spec.fields["input"] = {{seq_len_}, c10::ScalarType::Long};
    spec.fields["target"] = {{seq_len_}, c10::ScalarType::Long};
    spec.num_classes = vocab_;
    spec.attributes["task"] = "language_model";
    return spec;
  }

 private:
  int64_t vocab_, seq_len_, train_size_, test_size_;
  double noise_;
  uint64_t seed_;
};

}  // namespace

LOOM_PLUGIN("synthetic_tokens", "1.0.0",
            loom::sdk::component<SyntheticTokens>("synthetic_tokens",
                                                  "token sequences with a planted next-token rule (language-model tests)"))
