// GPT-2 (plugins/model/gpt2.hpp) and its language-model plugin: the sizes and names users load
// Hugging Face weights by, causal attention, and a run that learns synthetic_tokens' rule.
#include "gpt2.hpp"

#include "trainer_testing.hpp"

#include <loom/core/error.hpp>

#include <ATen/ops/allclose.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/randint.h>
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <string>

namespace {

namespace gpt2 = loom::plugins::gpt2;
using loom::testing::config_of;
using loom::testing::make_trainer;

int64_t parameter_count(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

TEST(Gpt2, SizesHaveGpt2sParameterCountsAndHuggingFacesNames) {
  // 124,439,808: GPT-2 small with its 50257 tokens and 1024 positions, the head tied (Hugging
  // Face's GPT2Model.num_parameters()); 354,823,168 for gpt2-medium.
  EXPECT_EQ(gpt2::Config::of_size("gpt2").parameters(), 124439808);
  EXPECT_EQ(gpt2::Config::of_size("gpt2-medium").parameters(), 354823168);
  gpt2::Config c = gpt2::Config::of_size("debug");
  c.vocab_size = 97;
  gpt2::Model model(c);
  EXPECT_EQ(parameter_count(*model), c.parameters());
  std::set<std::string> names;
  for (const auto& item : model->named_parameters()) names.insert(item.key());
  for (const char* name : {"wte.weight", "wpe.weight", "h.0.ln_1.weight", "h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias",
                           "h.0.attn.c_proj.weight", "h.1.ln_2.bias", "h.1.mlp.c_fc.weight", "h.1.mlp.c_proj.bias",
                           "ln_f.weight", "ln_f.bias"})
    EXPECT_TRUE(names.count(name)) << name;
  EXPECT_THROW(gpt2::Config::of_size("gpt5"), loom::sdk::Error);
}

TEST(Gpt2, APositionSeesOnlyTheTokensBeforeIt) {
  gpt2::Config c = gpt2::Config::of_size("debug");
  c.vocab_size = 50;
  gpt2::Model model(c);
  model->eval();
  torch::NoGradGuard no_grad;
  const at::Tensor tokens = at::randint(50, {2, 16}, at::TensorOptions().dtype(at::kLong));
  at::Tensor changed = tokens.clone();
  changed.select(1, 10).add_(1).remainder_(50);
  const at::Tensor a = model->forward(tokens), b = model->forward(changed);
  EXPECT_TRUE(at::equal(a.narrow(1, 0, 10), b.narrow(1, 0, 10)));  // before the change: untouched
  EXPECT_FALSE(at::allclose(a.narrow(1, 10, 1), b.narrow(1, 10, 1)));
  EXPECT_THROW(model->forward(at::zeros({1, c.n_ctx + 1}, at::TensorOptions().dtype(at::kLong))), loom::sdk::Error);
}

class Gpt2LmTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = loom::testing::fresh_test_dir("loom_gpt2"); }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::filesystem::path dir_;
};

TEST_F(Gpt2LmTest, LearnsThePlantedNextTokenRule) {
  // synthetic_tokens: the next token follows a fixed permutation 90 % of the time. At the start
  // the model guesses (loss about ln 64 = 4.16, accuracy about 1/64); after 80 steps it has
  // learned most of the rule.
  auto t = make_trainer(config_of({"model.name=gpt2_lm", "model.size=debug", "data.name=synthetic_tokens",
                                   "data.vocab_size=64", "data.seq_len=32", "data.train_size=512", "data.test_size=32",
                                   "data.validation_fraction=0", "data.num_workers=0", "trainer.batch_size=32",
                                   "trainer.max_steps=80", "trainer.lr=3e-3"},
                                  dir_, "learns"));
  const double first = t->train_step().loss;
  EXPECT_NEAR(first, std::log(64.0), 0.5);
  const auto summary = t->train();
  ASSERT_TRUE(summary.final_eval.has_value());
  EXPECT_GT(summary.final_eval->metrics.at("accuracy"), 0.8);
  EXPECT_LT(summary.final_eval->loss, 1.5);
}

TEST_F(Gpt2LmTest, SequencesLongerThanThePositionsAreRefusedWithTheFix) {
  try {
    make_trainer(config_of({"model.name=gpt2_lm", "model.size=debug", "data.name=synthetic_tokens",
                            "data.vocab_size=64", "data.seq_len=300", "data.train_size=64", "data.test_size=8"},
                           dir_, "long"));
    FAIL() << "expected a refusal";
  } catch (const std::exception& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("300 tokens"), std::string::npos) << message;
    EXPECT_NE(message.find("model.n_ctx >= 300"), std::string::npos) << message;
  }
  try {
    make_trainer(config_of({"model.name=gpt2_lm", "model.size=debug", "model.vocab_size=32", "data.name=synthetic_tokens",
                            "data.vocab_size=64", "data.seq_len=16", "data.train_size=64", "data.test_size=8"},
                           dir_, "small_vocab"));
    FAIL() << "expected a refusal";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("smaller than the data's vocabulary of 64"), std::string::npos) << e.what();
  }
}

}  // namespace
