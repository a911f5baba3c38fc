// GPT-2 (sdk/include/loom/sdk/gpt2.hpp) and its language-model plugin: the sizes and names users load
// Hugging Face weights by, causal attention, and a run that learns synthetic_tokens' rule.
#include <loom/sdk/gpt2.hpp>
#include <loom/sdk/gpt2_text.hpp>
#include <loom/sdk/gpt2_tokenizer.hpp>

#include "byte_vocabulary.hpp"
#include "trainer_testing.hpp"

#include <loom/core/error.hpp>
#include <loom/core/files.hpp>
#include <loom/core/safetensors.hpp>
#include <loom/sdk/safetensors.hpp>

#include <nlohmann/json.hpp>

#include <ATen/ops/allclose.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/randint.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

namespace {

namespace gpt2 = loom::sdk::gpt2;
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

/// Runs tests/support/`script` with the venv's Python into a fresh folder, once per process per
/// script; an empty path when the script exits 77 (its Python package is not installed). The
/// folders go when the process ends (each test process left 0.5 MB in /tmp).
std::filesystem::path python_fixture(const std::string& script) {
  struct Made : std::map<std::string, std::filesystem::path> {
    ~Made() {
      std::error_code ignored;
      for (const auto& [name, dir] : *this)
        if (!dir.empty()) std::filesystem::remove_all(dir, ignored);
    }
  };
  static Made made;
  if (auto it = made.find(script); it != made.end()) return it->second;
  const auto d = std::filesystem::temp_directory_path() /
                 ("loom_" + script.substr(0, script.find('.')) + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(d);
  const std::string command = std::string("\"") + LOOM_TEST_PYTHON + "\" \"" + LOOM_SOURCE_DIR + "/tests/support/" +
                              script + "\" \"" + d.string() + "\"";
  const int status = std::system(command.c_str());
  if (WIFEXITED(status) && WEXITSTATUS(status) == 77) return made[script] = std::filesystem::path();
  if (status != 0) throw std::runtime_error(script + " failed: " + command);
  return made[script] = d;
}

/// Tiny random GPT-2 folders written by transformers (make_hf_gpt2.py).
std::filesystem::path hf_models() { return python_fixture("make_hf_gpt2.py"); }

#define LOOM_REQUIRE_TRANSFORMERS() \
  if (hf_models().empty()) GTEST_SKIP() << "transformers is not installed in " LOOM_TEST_PYTHON " (scripts/setup.sh)"

TEST(Gpt2, HuggingFaceWeightsGiveTransformersHiddenStates) {
  // GPT2LMHeadModel's files ("transformer." names, no head) and GPT2Model's (no prefix) load into
  // the same module, whose hidden states are transformers' within 1e-5 (fp32).
  LOOM_REQUIRE_TRANSFORMERS();
  const auto expected = loom::sdk::map_safetensors(hf_models() / "expected.safetensors");
  for (const char* folder : {"lm", "base"}) {
    SCOPED_TRACE(folder);
    const auto dir = hf_models() / folder;
    const gpt2::Config c = gpt2::hf_config(dir);
    EXPECT_EQ(c.n_layer, 2);
    EXPECT_EQ(c.n_embd, 32);
    EXPECT_EQ(c.vocab_size, 97);
    gpt2::Model model(c);
    gpt2::load_hf_weights(*model, dir);
    model->eval();
    torch::NoGradGuard no_grad;
    const at::Tensor hidden = model->forward(expected.at("input_ids"));
    EXPECT_LT((hidden - expected.at("hidden")).abs().max().item<double>(), 1e-5);
  }
}

TEST(Gpt2, TextVectorsOfPaddedTextsAreTransformersOfTheTextsAlone) {
  // The recommender's item vectors: texts right-padded to one length, GPT-2 over the batch, then
  // the mean over each text's tokens or its last token; transformers ran each text unpadded.
  LOOM_REQUIRE_TRANSFORMERS();
  const auto expected = loom::sdk::map_safetensors(hf_models() / "expected.safetensors");
  gpt2::Model model(gpt2::hf_config(hf_models() / "lm"));
  gpt2::load_hf_weights(*model, hf_models() / "lm");
  model->eval();
  torch::NoGradGuard no_grad;
  const at::Tensor& ids = expected.at("text_ids");
  const at::Tensor& lengths = expected.at("text_lengths");
  const at::Tensor mean = gpt2::encode_texts(*model, ids, lengths, gpt2::Pooling::kMean);
  const at::Tensor last = gpt2::encode_texts(*model, ids, lengths, gpt2::Pooling::kLast);
  EXPECT_LT((mean - expected.at("text_mean")).abs().max().item<double>(), 1e-5);
  EXPECT_LT((last - expected.at("text_last")).abs().max().item<double>(), 1e-5);
}

TEST(Gpt2, AFolderThatDoesNotFitIsOneErrorNamingEveryTensor) {
  LOOM_REQUIRE_TRANSFORMERS();
  const auto broken = hf_models() / "broken";
  gpt2::Model model(gpt2::hf_config(broken));
  try {
    gpt2::load_hf_weights(*model, broken);
    FAIL() << "expected an error";
  } catch (const loom::sdk::Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("missing: h.1.mlp.c_fc.bias"), std::string::npos) << message;
    EXPECT_NE(message.find("unexpected: extra"), std::string::npos) << message;
  }
  gpt2::Config small = gpt2::hf_config(hf_models() / "lm");
  small.n_embd = 16;
  small.n_head = 2;
  gpt2::Model narrower(small);
  try {
    gpt2::load_hf_weights(*narrower, hf_models() / "lm");
    FAIL() << "expected an error";
  } catch (const loom::sdk::Error& e) {
    EXPECT_NE(std::string(e.what()).find("other shape, type or values: "), std::string::npos) << e.what();
  }
  const auto fifo = loom::testing::fresh_test_dir("loom_hf_fifo");
  ASSERT_EQ(::mkfifo((fifo / "config.json").c_str(), 0600), 0);
  EXPECT_THROW(gpt2::hf_config(fifo), loom::sdk::Error);  // named, not waited on
  ASSERT_EQ(::mkfifo((fifo / "model.safetensors").c_str(), 0600), 0);
  EXPECT_THROW(gpt2::load_hf_weights(*model, fifo), loom::sdk::Error);
  std::filesystem::remove_all(fifo);
  try {
    gpt2::load_hf_weights(*model, hf_models() / "pickle");
    FAIL() << "expected an error";
  } catch (const loom::sdk::Error& e) {
    EXPECT_NE(std::string(e.what()).find("pytorch_model.bin, a pickle"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("safe_serialization=True"), std::string::npos) << e.what();
  }
}

/// A fresh folder with a 1-layer GPT-2's config.json, and the model it builds.
std::pair<std::filesystem::path, gpt2::Model> tiny_folder(const std::string& name) {
  const auto dir = loom::testing::fresh_test_dir(name);
  std::ofstream(dir / "config.json")
      << R"({"model_type": "gpt2", "vocab_size": 50, "n_positions": 16, "n_layer": 1, "n_head": 2, "n_embd": 8})";
  return {dir, gpt2::Model(gpt2::hf_config(dir))};
}

/// `model`'s weights as save_pretrained writes them (Conv1D weights stored [in, out]), each name
/// after `prefix` ("transformer." for GPT2LMHeadModel's).
loom::sdk::TensorMap as_saved(const gpt2::Model& model, const std::string& prefix) {
  loom::sdk::TensorMap tensors;
  for (const auto& item : model->named_parameters()) {
    const bool conv1d = item.key().find("c_attn.weight") != std::string::npos || item.key().find("c_proj.weight") != std::string::npos ||
                        item.key().find("c_fc.weight") != std::string::npos;
    tensors[prefix + item.key()] = conv1d ? item.value().detach().t().contiguous() : item.value().detach().clone();
  }
  return tensors;
}

TEST(Gpt2, AWeightOfAnotherRankOrOfIntegersIsNamedNotCopied) {
  // model.safetensors as save_pretrained writes it (Conv1D weights stored [in, out]), then one
  // weight given a third dimension (t() would throw LibTorch's error), one stored as integers, one of NaN.
  auto [dir, model] = tiny_folder("loom_hf_types");
  loom::sdk::TensorMap tensors = as_saved(model, "");
  loom::core::save_safetensors(dir / "model.safetensors", tensors);
  gpt2::load_hf_weights(*model, dir);  // the file as written fits
  tensors["h.0.attn.c_attn.weight"] = tensors["h.0.attn.c_attn.weight"].unsqueeze(2);
  tensors["wpe.weight"] = at::zeros({16, 8}, at::kLong);
  tensors["ln_f.weight"] = at::full({8}, std::nan(""));  // every step of a run would be skipped
  loom::core::save_safetensors(dir / "model.safetensors", tensors);
  try {
    gpt2::load_hf_weights(*model, dir);
    FAIL() << "expected an error";
  } catch (const loom::sdk::Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("other shape, type or values: "), std::string::npos) << message;
    EXPECT_NE(message.find("h.0.attn.c_attn.weight (file [8, 24, 1], needs [8, 24]: a Conv1D weight, stored [in, out])"),
              std::string::npos) << message;
    EXPECT_NE(message.find("ln_f.weight (holds NaN or infinite values)"), std::string::npos) << message;
    EXPECT_NE(message.find("wpe.weight (file Long, not a floating-point weight)"), std::string::npos) << message;
  }
  std::filesystem::remove_all(dir);
}

TEST(Gpt2, AWeightTwiceOrAnUntiedHeadIsRefusedNotOneOfThemLoaded) {
  // (a file with wte.weight and transformer.wte.weight loaded one of them; an lm_head.weight of
  // other values than wte's was left out, and the model computed another output)
  auto [dir, model] = tiny_folder("loom_hf_twice");
  loom::sdk::TensorMap tensors = as_saved(model, "transformer.");
  tensors["lm_head.weight"] = tensors["transformer.wte.weight"].clone();  // tied: the same values
  loom::core::save_safetensors(dir / "model.safetensors", tensors);
  gpt2::load_hf_weights(*model, dir);
  auto error = [&] {
    loom::core::save_safetensors(dir / "model.safetensors", tensors);
    try {
      gpt2::load_hf_weights(*model, dir);
    } catch (const loom::sdk::Error& e) {
      return std::string(e.what());
    }
    return std::string("loaded");
  };
  tensors["lm_head.weight"] = tensors["transformer.wte.weight"] * 2;
  EXPECT_CONTAINS(error(), "holds an lm_head.weight other than wte.weight: its output head is not tied to the embedding");
  // A model that reads hidden states only (gpt2_recommender) loads it: the head is not its business
  gpt2::load_hf_weights(*model, dir, gpt2::Head::kUnused);
  EXPECT_TRUE(at::equal(model->wte->weight, tensors["transformer.wte.weight"]));
  tensors.erase("lm_head.weight");
  tensors["wte.weight"] = tensors["transformer.wte.weight"] * 2;
  tensors["ln_f.bias"] = tensors["transformer.ln_f.bias"].clone();
  EXPECT_CONTAINS(error(), "holds 2 weight(s) twice, with and without the prefix 'transformer.' (ln_f.bias and "
                           "transformer.ln_f.bias; wte.weight and transformer.wte.weight)");
  std::filesystem::remove_all(dir);
}

TEST(Gpt2, AConfigWithAFractionalOrMissingSizeIsOneErrorNamingTheKey) {
  // nlohmann's get<int64_t>() takes 1.5 for 1: a damaged config.json would build another model.
  const auto dir = loom::testing::fresh_test_dir("loom_hf_sizes");
  auto error_with = [&](const std::string& key, const std::string& value) -> std::string {
    nlohmann::json j = {{"model_type", "gpt2"}, {"vocab_size", 50257}, {"n_positions", 1024},
                        {"n_layer", 12},        {"n_head", 12},        {"n_embd", 768}};
    j[key] = nlohmann::json::parse(value);
    std::ofstream(dir / "config.json") << j.dump();
    try {
      gpt2::hf_config(dir);
    } catch (const loom::sdk::Error& e) {
      return e.what();
    }
    return "accepted";
  };
  EXPECT_NE(error_with("n_layer", "1.5").find("config.json: n_layer is 1.5; it is a whole number from 1 to 1024"),
            std::string::npos);
  EXPECT_NE(error_with("n_head", "\"12\"").find("n_head is \"12\"; it is a whole number"), std::string::npos);
  EXPECT_NE(error_with("n_embd", "0").find("n_embd is 0;"), std::string::npos);
  EXPECT_NE(error_with("layer_norm_epsilon", "-1").find("layer_norm_epsilon is -1; it is a small positive number"),
            std::string::npos);
  EXPECT_NE(error_with("n_layer", "100000").find("n_layer is 100000; it is a whole number from 1 to 1024"),
            std::string::npos);  // it built 100000 layers for minutes
  EXPECT_EQ(error_with("n_layer", "6"), "accepted");
  // Hugging Face's fields that build another model: refused, not loaded into this one in silence
  EXPECT_CONTAINS(error_with("scale_attn_weights", "false"),
                  "config.json: scale_attn_weights is false: attention without the 1/sqrt(head width) scale is another model");
  EXPECT_CONTAINS(error_with("scale_attn_by_inverse_layer_idx", "true"), "scale_attn_by_inverse_layer_idx is true: attention");
  EXPECT_CONTAINS(error_with("tie_word_embeddings", "false"), "tie_word_embeddings is false: an output head apart");
  EXPECT_CONTAINS(error_with("tie_word_embeddings", "\"no\""), "tie_word_embeddings is \"no\": it is true or false");
  error_with("tie_word_embeddings", "false");  // (and for a model without the head, gpt2_recommender: taken)
  EXPECT_EQ(gpt2::hf_config(dir, gpt2::Head::kUnused).n_embd, 768);
  EXPECT_CONTAINS(error_with("n_inner", "64"), "n_inner is 64: this GPT-2's MLP is 4 x n_embd = 3072 wide");
  EXPECT_CONTAINS(error_with("n_inner", "3072.5"), "n_inner is 3072.5:");
  for (const auto& [key, value] : std::vector<std::pair<std::string, std::string>>{
           {"n_inner", "null"}, {"n_inner", "3072"}, {"scale_attn_weights", "true"}, {"reorder_and_upcast_attn", "true"}})
    EXPECT_EQ(error_with(key, value), "accepted") << key << " " << value;
  // each count in range, together impossible: refused before anything is allocated
  EXPECT_NE(error_with("n_head", "5").find("config.json: n_head 5 does not divide n_embd 768"), std::string::npos);
  EXPECT_NE(error_with("n_embd", "65532").find("billion parameters (more than 20 billion); the file is damaged"),
            std::string::npos);
  std::ofstream(dir / "config.json") << "{\"n_positions\": 1024}";
  EXPECT_THROW(
      {
        try {
          gpt2::hf_config(dir);
        } catch (const loom::sdk::Error& e) {
          EXPECT_NE(std::string(e.what()).find("config.json has no vocab_size; a GPT-2 config has it"),
                    std::string::npos) << e.what();
          throw;
        }
      },
      loom::sdk::Error);
  std::ofstream(dir / "config.json") << "[]";
  EXPECT_THROW(gpt2::hf_config(dir), loom::sdk::Error);
  // A value nested 200,000 deep (400 KB) crashed the process printing it in the message (SIGSEGV).
  std::ofstream(dir / "config.json", std::ios::trunc) << "{\"vocab_size\": " << std::string(200000, '[')
                                                      << std::string(200000, ']') << "}";
  std::string deep = "(no error)";
  try {
    gpt2::hf_config(dir);
  } catch (const loom::sdk::Error& e) {
    deep = e.what();
  }
  EXPECT_CONTAINS(deep, "config.json nests values more than 64 levels deep; it is no GPT-2 config");
  std::filesystem::remove_all(dir);
}

TEST(SafetensorsMapped, TensorsViewTheFileAndOutliveTheirMap) {
  // map_safetensors: the tensors read the file's bytes without a copy, stay valid after the map
  // that returned them is gone, and an in-place change touches neither the file nor a new map.
  const auto dir = loom::testing::fresh_test_dir("loom_mapped");
  const auto file = dir / "t.safetensors";
  loom::sdk::TensorMap written{{"a", at::arange(12, at::TensorOptions().dtype(at::kFloat)).reshape({3, 4})},
                               {"b", at::ones({2}, at::TensorOptions().dtype(at::kLong))}};
  {
    // the writer of Loom's checkpoints; the reader under test is the SDK's
    std::ofstream out(file, std::ios::binary);
    const std::string header = R"({"a":{"dtype":"F32","shape":[3,4],"data_offsets":[0,48]},"b":{"dtype":"I64","shape":[2],"data_offsets":[48,64]}})";
    const uint64_t n = header.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << header;
    out.write(static_cast<const char*>(written["a"].data_ptr()), 48);
    out.write(static_cast<const char*>(written["b"].data_ptr()), 16);
  }
  at::Tensor a;
  {
    const auto mapped = loom::sdk::map_safetensors(file);
    a = mapped.at("a");
    EXPECT_TRUE(at::equal(mapped.at("b"), written["b"]));
  }
  EXPECT_TRUE(at::equal(a, written["a"]));
  a.mul_(2);
  EXPECT_TRUE(at::equal(loom::sdk::map_safetensors(file).at("a"), written["a"]));
  // A shape or an offset that is no whole number is damage (a shape of 3.5 was read as 3).
  for (const auto& [entry, said] : std::vector<std::pair<std::string, std::string>>{
           {R"("shape":[3.5,4],"data_offsets":[0,48])", "tensor 'a' has shape [3.5,4]: each is a whole number"},
           {R"("shape":[3,4],"data_offsets":[0.0,48])", "tensor 'a' has data_offsets [0.0,48]: each is a whole number"},
           {R"("shape":12,"data_offsets":[0,48])", "tensor 'a' has a shape that is not a list: 12"},
           {R"("shape":[3,4],"data_offsets":[-16,32])", "tensor 'a' has a negative data offset -16"}}) {
    const auto damaged = dir / "damaged.safetensors";
    std::ofstream out(damaged, std::ios::binary);
    const std::string header = R"({"a":{"dtype":"F32",)" + entry + "}}";
    const uint64_t n = header.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << header;
    out.write(static_cast<const char*>(written["a"].data_ptr()), 48);
    out.close();
    try {
      loom::sdk::map_safetensors(damaged);
      ADD_FAILURE() << "read: " << entry;
    } catch (const loom::sdk::Error& e) {
      EXPECT_CONTAINS(std::string(e.what()), said);
    }
  }
  std::filesystem::resize_file(file, 40);  // truncated inside b's data
  EXPECT_THROW(loom::sdk::map_safetensors(file), loom::sdk::Error);
  EXPECT_THROW(loom::sdk::map_safetensors(dir), loom::sdk::Error);  // a folder: named, no hang
  std::filesystem::remove_all(dir);
}

/// A byte-level BPE vocabulary trained by Hugging Face `tokenizers`, and the ids it gives 1,200
/// varied strings (make_bpe_corpus.py).
std::filesystem::path bpe_corpus() { return python_fixture("make_bpe_corpus.py"); }

TEST(Gpt2Tokenizer, IdsEqualHuggingFaceTokenizersOnVariedText) {
  // Accents, combining marks, CJK, emoji with joiners, digits, punctuation, contractions, runs of
  // spaces and newlines, NBSP and other Unicode spaces: the ids of `tokenizers`' ByteLevel BPE
  // for the same vocab.json and merges.txt, and decode gives the text back.
  if (bpe_corpus().empty()) GTEST_SKIP() << "tokenizers is not installed in " LOOM_TEST_PYTHON " (scripts/setup.sh)";
  const gpt2::Tokenizer tokenizer(bpe_corpus());
  std::ifstream in(bpe_corpus() / "corpus.json");
  const nlohmann::json corpus = nlohmann::json::parse(in);
  ASSERT_GE(corpus.size(), 1000u);
  int differ = 0;
  for (const auto& item : corpus) {
    const std::string text = item.at("text").get<std::string>();
    const std::vector<int64_t> ids = tokenizer.encode(text);
    if (ids != item.at("ids").get<std::vector<int64_t>>() && ++differ <= 5)
      ADD_FAILURE() << "ids differ for " << nlohmann::json(text).dump() << ": tokenizers " << item.at("ids").dump()
                    << ", Loom " << nlohmann::json(ids).dump();
    EXPECT_EQ(tokenizer.decode(ids), text);
  }
  EXPECT_EQ(differ, 0) << "of " << corpus.size() << " strings";
}

// What reading the tokenizer in `dir` says: its error, or "(no error)".
std::string tokenizer_error(const std::filesystem::path& dir) {
  try {
    gpt2::Tokenizer tokenizer(dir);
  } catch (const loom::sdk::Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Gpt2Tokenizer, BadTextAndBadFilesAreNamed) {
  if (bpe_corpus().empty()) GTEST_SKIP() << "tokenizers is not installed in " LOOM_TEST_PYTHON " (scripts/setup.sh)";
  const gpt2::Tokenizer tokenizer(bpe_corpus());
  try {
    tokenizer.encode("ok \xff\xfe bytes");
    FAIL() << "expected an error";
  } catch (const loom::sdk::Error& e) {
    EXPECT_NE(std::string(e.what()).find("UTF-8"), std::string::npos) << e.what();
  }
  const auto dir = loom::testing::fresh_test_dir("loom_bpe_bad");
  std::filesystem::copy_file(bpe_corpus() / "vocab.json", dir / "vocab.json");
  std::ofstream(dir / "merges.txt") << "#version: 0.2\nnot-a-merge\n";
  try {
    gpt2::Tokenizer bad(dir);
    FAIL() << "expected an error";
  } catch (const loom::sdk::Error& e) {
    EXPECT_NE(std::string(e.what()).find("merges.txt:2"), std::string::npos) << e.what();
  }
  const auto error_of = [&] { return tokenizer_error(dir); };
  // A byte order mark before "#version" was "the merge '\xEF\xBB\xBF#version: 0.2' makes ...", the
  // mark unseen; a NUL cut the message short; UTF-16 was "syntax error ... last read: '\xFF'".
  std::string merges;
  {
    std::ifstream in(bpe_corpus() / "merges.txt", std::ios::binary);
    merges.assign((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  std::ofstream(dir / "merges.txt", std::ios::binary | std::ios::trunc) << "\xEF\xBB\xBF" + merges;
  EXPECT_EQ(error_of(), "(no error)");
  std::ofstream(dir / "merges.txt", std::ios::binary | std::ios::trunc) << std::string("#version: 0.2\nMo\0x ab\n", 19);
  EXPECT_NE(error_of().find("merges.txt:2: a NUL byte; merges.txt is text"), std::string::npos) << error_of();
  std::ofstream(dir / "merges.txt", std::ios::binary | std::ios::trunc) << merges;
  std::ofstream(dir / "vocab.json", std::ios::binary | std::ios::trunc) << std::string("\xFF\xFE{\0}\0", 6);
  EXPECT_NE(error_of().find("vocab.json is UTF-16 text (Windows' \"Unicode\"); save it as UTF-8"), std::string::npos)
      << error_of();
  std::filesystem::remove(dir / "vocab.json");
  EXPECT_THROW(gpt2::Tokenizer missing(dir), loom::sdk::Error);
  ASSERT_EQ(::mkfifo((dir / "vocab.json").c_str(), 0600), 0);  // named, not waited on
  try {
    gpt2::Tokenizer fifo(dir);
    FAIL() << "expected an error";
  } catch (const loom::sdk::Error& e) {
    EXPECT_NE(std::string(e.what()).find("not a regular file"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

TEST(Gpt2Tokenizer, MergesAreGpt2sOnOverlapsAndTiesAndALongWordIsTokenizedWhole) {
  // GPT-2's merge loop, as its reference rescans the piece: the lowest-ranked pair, all of its
  // occurrences left to right, until none has a rank. Loom's heap of pairs must give the same
  // ids where occurrences overlap ("aaa") and a merge forms a pair of lower rank ("abab").
  const auto dir = loom::testing::fresh_test_dir("loom_bpe_merges");
  nlohmann::json vocab = loom::testing::byte_vocabulary([](int b) { return b; });
  const std::vector<std::pair<std::string, std::string>> merges = {
      {"a", "a"}, {"a", "b"}, {"ab", "a"}, {"aa", "a"}, {"aa", "aa"}, {"b", "a"}, {"ab", "ab"}, {"b", "b"}, {"aba", "b"}};
  std::ofstream(dir / "merges.txt", std::ios::trunc) << "#version: 0.2\n";
  for (size_t i = 0; i < merges.size(); ++i) {
    vocab[merges[i].first + merges[i].second] = 256 + static_cast<int64_t>(i);
    std::ofstream(dir / "merges.txt", std::ios::app) << merges[i].first << " " << merges[i].second << "\n";
  }
  std::ofstream(dir / "vocab.json", std::ios::trunc) << vocab.dump();
  const gpt2::Tokenizer tokenizer(dir);
  const auto reference = [&](const std::string& word) {
    std::vector<std::string> symbols;
    for (char c : word) symbols.emplace_back(1, c);
    while (symbols.size() > 1) {
      size_t best = merges.size(), at = 0;
      for (size_t i = 0; i + 1 < symbols.size(); ++i)
        for (size_t r = 0; r < best; ++r)
          if (merges[r].first == symbols[i] && merges[r].second == symbols[i + 1]) best = r, at = i;
      if (best == merges.size()) break;
      (void)at;
      std::vector<std::string> merged;
      for (size_t i = 0; i < symbols.size();)
        if (i + 1 < symbols.size() && symbols[i] == merges[best].first && symbols[i + 1] == merges[best].second) {
          merged.push_back(symbols[i] + symbols[i + 1]);
          i += 2;
        } else {
          merged.push_back(symbols[i++]);
        }
      symbols = std::move(merged);
    }
    std::vector<int64_t> ids;
    for (const auto& s : symbols) ids.push_back(vocab.at(s).get<int64_t>());
    return ids;
  };
  std::srand(7);
  for (int t = 0; t < 2000; ++t) {
    std::string word;
    for (int i = 0, n = 1 + std::rand() % 24; i < n; ++i) word += "ab"[std::rand() % 2];
    EXPECT_EQ(tokenizer.encode(word), reference(word)) << word;
  }
  // A word of 200000 letters (an item's title within the 1 MiB record): tokenized whole, and back.
  std::string long_word;
  for (int i = 0; i < 200000; ++i) long_word += "ab"[std::rand() % 2];
  EXPECT_EQ(tokenizer.decode(tokenizer.encode(long_word)), long_word);
  std::filesystem::remove_all(dir);
}

TEST(Gpt2Tokenizer, VocabularySizeIsTheLargestIdPlusOneAndBadIdsAreRefused) {
  // The vocabulary's size sizes the model's embedding: a trimmed vocab.json that keeps its ids
  // (gaps) must not give ids past it, and an id that is no whole number in range is named.
  const auto dir = loom::testing::fresh_test_dir("loom_bpe_ids");
  const nlohmann::json vocab = loom::testing::byte_vocabulary([](int b) { return b == 'z' ? 1000 : b; });  // 'z' far past
  const auto write_vocab = [&](const nlohmann::json& v) { loom::testing::write_tokenizer(dir, v); };
  write_vocab(vocab);
  const gpt2::Tokenizer tokenizer(dir);
  EXPECT_EQ(tokenizer.vocab_size(), 1001);
  EXPECT_EQ(tokenizer.token_count(), 256);
  EXPECT_EQ(tokenizer.encode("z"), (std::vector<int64_t>{1000}));
  for (const int64_t id : tokenizer.encode("zz az")) EXPECT_LT(id, tokenizer.vocab_size());
  const auto refused = [&](const nlohmann::json& id, const std::string& says) {
    nlohmann::json v = vocab;
    v["a"] = id;
    write_vocab(v);
    try {
      gpt2::Tokenizer bad(dir);
      ADD_FAILURE() << "id " << id.dump() << " was accepted";
    } catch (const loom::sdk::Error& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  refused(-1, "token 'a' has id -1; vocab.json maps each token to a whole number in [0, 16777216)");
  refused(1.5, "token 'a' has id 1.5");
  refused("7", "token 'a' has id \"7\"");
  refused(int64_t{1} << 40, "token 'a' has id 1099511627776");
  refused(98, "have the same id 98; each token needs an id of its own");  // 'b''s id
  // A token given twice (the last id was kept in silence), an empty file (nlohmann's parse error
  // text), a merge whose result has no id (blamed on the bytes at the first text that made it).
  const auto error_of = [&] { return tokenizer_error(dir); };
  std::string twice = vocab.dump();
  twice.insert(twice.size() - 1, ",\"a\":300");
  std::ofstream(dir / "vocab.json", std::ios::trunc) << twice;
  EXPECT_CONTAINS(error_of(), "vocab.json: the token 'a' is given twice; each token has one id");
  std::ofstream(dir / "vocab.json", std::ios::trunc) << "\n";
  EXPECT_CONTAINS(error_of(), "vocab.json is empty");
  std::ofstream(dir / "vocab.json", std::ios::trunc) << "{}";
  EXPECT_CONTAINS(error_of(), "vocab.json has no tokens");
  std::ofstream(dir / "vocab.json", std::ios::trunc) << "{\"a\": " << std::string(200000, '[') << std::string(200000, ']') << "}";
  EXPECT_CONTAINS(error_of(), "vocab.json nests values in values");  // (printing the value crashed the process)
  std::ofstream(dir / "vocab.json", std::ios::trunc) << "{\"a\": 1,";
  const std::string cut = error_of();
  EXPECT_CONTAINS(cut, "vocab.json: parse error at line 1, column 9");
  EXPECT_EQ(cut.find("json.exception"), std::string::npos) << cut;
  write_vocab(vocab);
  std::ofstream(dir / "merges.txt", std::ios::trunc) << "#version: 0.2\nT h\n";
  EXPECT_CONTAINS(error_of(), "merges.txt:2: the merge 'T h' makes 'Th', which vocab.json does not have");
  std::filesystem::remove_all(dir);
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
  const auto first = t->train_step();
  EXPECT_NEAR(first.loss, std::log(64.0), 0.5);
  // Samples are sequences; the loss averages over their tokens, logged as loss terms.
  EXPECT_EQ(first.samples, 32);
  EXPECT_EQ(first.terms, 32 * 32);
  const auto summary = t->train();
  ASSERT_TRUE(summary.final_eval.has_value());
  EXPECT_GT(summary.final_eval->metrics.at("accuracy"), 0.8);
  EXPECT_LT(summary.final_eval->loss, 1.5);
  EXPECT_EQ(summary.final_eval->samples, 32) << "the test split's sequences, not its tokens";
  std::ifstream metrics(summary.run_dir / "metrics.jsonl");
  int windows = 0;
  for (std::string line; std::getline(metrics, line);) {
    const auto values = nlohmann::json::parse(line);
    if (!values.contains("train/samples_per_s")) continue;
    ++windows;
    EXPECT_NEAR(values["train/loss_terms_per_s"].get<double>() / values["train/samples_per_s"].get<double>(), 32.0, 1e-9)
        << line;
  }
  EXPECT_GT(windows, 0);
}

TEST_F(Gpt2LmTest, AnIgnoredTargetIsLeftOutOfTheLossTheAccuracyAndTheCount) {
  // Padding (-100) counted as a loss term made the loss and the accuracy smaller by its share, and
  // the gradient with them, where PyTorch's mean over the tokens leaves it out (a probe: half of
  // the targets padding gave 2.10 for a fresh model's ln 64 = 4.16).
  auto t = make_trainer(config_of({"model.name=gpt2_lm", "model.size=debug", "data.name=synthetic_tokens",
                                   "data.vocab_size=64", "data.seq_len=16", "data.train_size=64", "data.test_size=8",
                                   "data.num_workers=0", "trainer.batch_size=4"},
                                  dir_, "ignored"));
  at::manual_seed(3);
  const at::Tensor input = at::randint(64, {4, 16}, at::kLong);
  const at::Tensor target = at::randint(64, {4, 16}, at::kLong);
  const at::Tensor padded = target.clone();
  padded.narrow(1, 8, 8).fill_(-100);
  auto& model = t->model();
  at::NoGradGuard no_grad;
  const auto whole = model.forward({{"input", input}, {"target", target}}, false);
  const auto half = model.forward({{"input", input}, {"target", padded}}, false);
  EXPECT_EQ(whole.count.item<double>(), 64.0);
  EXPECT_EQ(half.count.item<double>(), 32.0) << "the 32 padded targets are no loss terms";
  // The mean over the real tokens is PyTorch's cross_entropy with ignore_index's, about ln 64.
  const double mean = half.loss_sum.item<double>() / half.count.item<double>();
  EXPECT_NEAR(mean, std::log(64.0), 0.5);
  EXPECT_LE(half.metrics.at("accuracy").sum.item<double>(), 32.0);
}

TEST_F(Gpt2LmTest, PretrainedWeightsArePaddedToTheVocabularyAsked) {
  // model.pretrained: config.json's sizes and the file's weights; model.vocab_size = 128 pads the
  // 97 stored token embeddings, whose rows stay the file's.
  LOOM_REQUIRE_TRANSFORMERS();
  const auto dir = hf_models() / "lm";
  loom::core::Config c = config_of({"model.name=gpt2_lm", "model.vocab_size=128", "data.name=synthetic_tokens",
                                    "data.vocab_size=97", "data.seq_len=16", "data.train_size=64", "data.test_size=8",
                                    "data.num_workers=0", "trainer.batch_size=8"},
                                   dir_, "pretrained");
  c.set_assignment("model.pretrained=" + dir.string());
  auto t = make_trainer(c);
  const auto file = loom::sdk::map_safetensors(dir / "model.safetensors");
  const auto params = t->model().module().named_parameters();
  const at::Tensor wte = params["wte.weight"];
  ASSERT_EQ(wte.size(0), 128);
  EXPECT_TRUE(at::equal(wte.narrow(0, 0, 97), file.at("transformer.wte.weight")));
  EXPECT_TRUE(at::equal(params["h.1.attn.c_attn.weight"], file.at("transformer.h.1.attn.c_attn.weight").t()));
  EXPECT_TRUE(std::isfinite(t->train_step().loss));
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

TEST_F(Gpt2LmTest, APretrainedThatIsNoFolderIsNamedAsWhatItIs) {
  // (a file was "/etc/hosts/config.json: Not a directory" here, and "has no vocab.json" in the recommender)
  std::ofstream(dir_ / "weights.bin") << "not a folder";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {(dir_ / "weights.bin").string(), " is a file, not a folder; name a Hugging Face GPT-2 folder"},
      {(dir_ / "nowhere").string(), ": no such folder; name a Hugging Face GPT-2 folder"},
      {"/dev/null", " is a character device, not a folder"}};
  for (const auto& [pretrained, said] : cases) {
    loom::core::Config c = config_of({"model.name=gpt2_lm", "data.name=synthetic_tokens", "data.vocab_size=64",
                                      "data.seq_len=16", "data.train_size=64", "data.test_size=8"},
                                     dir_, "not_a_folder");
    c.set_assignment("model.pretrained=" + pretrained);
    try {
      make_trainer(c);
      FAIL() << pretrained << " was taken for a pretrained model";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("model.pretrained = " + pretrained + said), std::string::npos) << e.what();
    }
  }
}

TEST_F(Gpt2LmTest, AStringOptionYoungerThanTheCheckpointResumesAtItsEmptyDefault) {
  // A checkpoint written before the plugin had `model.pretrained` does not name it. Its empty
  // default is the empty text, not "required": a resume that leaves it unset is the same model
  // (it was refused: "model.pretrained: not in the checkpoint, this run ").
  const auto config = [&] {
    return config_of({"model.name=gpt2_lm", "model.size=debug", "data.name=synthetic_tokens", "data.vocab_size=64",
                      "data.seq_len=16", "data.train_size=64", "data.test_size=8", "data.num_workers=0",
                      "trainer.batch_size=8", "trainer.checkpoint_every=2", "trainer.eval_every=100"},
                     dir_, "younger");
  };
  auto trained = config();
  trained.set_assignment("trainer.max_steps=2");
  make_trainer(trained)->train();
  const auto step = dir_ / "younger" / "checkpoints" / "step_00000002";
  ASSERT_TRUE(std::filesystem::exists(step / "state.json")) << step;
  // state.json as that older checkpoint had it, with the checksum its weight files record of it
  nlohmann::json json = nlohmann::json::parse(std::ifstream(step / "state.json"));
  ASSERT_EQ(json["model"]["config"].erase("pretrained"), 1u);
  const std::string text = json.dump(2);
  std::ofstream(step / "state.json", std::ios::trunc) << text;
  for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
    loom::sdk::TextMap metadata;
    const auto tensors = loom::core::load_safetensors(step / file, &metadata);
    metadata.erase("loom_crc32");
    metadata["state_json_crc32"] = loom::core::crc32_hex(text);
    loom::core::save_safetensors(step / file, tensors, metadata);
  }
  auto resumed = config();
  resumed.set_assignment("trainer.max_steps=4");
  resumed.set_assignment("trainer.resume=auto");
  EXPECT_EQ(make_trainer(resumed)->step(), 2);
}

}  // namespace
