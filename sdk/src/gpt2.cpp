// GPT-2's Hugging Face files (gpt2.hpp): config.json through nlohmann/json, the weights through
// map_safetensors. Both inside libloom_sdk, so plugins need neither JSON nor a safetensors reader.
#include <loom/sdk/gpt2.hpp>

#include <loom/sdk/files.hpp>

#include <nlohmann/json.hpp>

#include <ATen/ops/equal.h>
#include <ATen/ops/isfinite.h>

#include <cmath>

namespace loom::sdk::gpt2 {

namespace {
constexpr double kMostParameters = 2e10;
}  // namespace

/// The model's sizes from `dir`/config.json; refuses a model that is not GPT-2 as built here.
Config hf_config(const std::filesystem::path& dir, Head head) {
  if (std::error_code ec; !std::filesystem::is_directory(dir, ec)) {  // ("/etc/passwd/config.json: Not a directory")
    const std::string what = sdk::what_is_at(dir);
    throw sdk::Error("model.pretrained = " + dir.string() +
                     (what == "no such file"             ? ": no such folder"
                      : what.rfind("cannot", 0) == 0 ? " " + what
                                                     : " is " + (what.empty() ? std::string("a file") : what) + ", not a folder") +
                     "; name a Hugging Face GPT-2 folder (config.json, model.safetensors, vocab.json, merges.txt). A "
                     "run started from one reads its sizes and tokenizer there again to evaluate or resume, the weights "
                     "coming from the checkpoint: put the folder back where the run had it, or name its copy");
  }
  const auto path = dir / "config.json";
  const std::string text = sdk::read_regular_file(path, int64_t{16} << 20, "model.pretrained: ",
                                                  "a Hugging Face model folder has config.json and model.safetensors; a run "
                                                  "started from one reads its sizes and tokenizer there again to evaluate or "
                                                  "resume, the weights coming from the checkpoint");
  nlohmann::json j;
  try {
    // (nested deep, a value printed in a message below crashed the process: printing recurses)
    j = nlohmann::json::parse(text, [&](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
      if (depth > 64) throw sdk::Error(path.string() + " nests values more than 64 levels deep; it is no GPT-2 config");
      return true;
    });
  } catch (const sdk::Error&) {
    throw;
  } catch (const std::exception& e) {
    throw sdk::Error(path.string() + " is not JSON: " + e.what());
  }
  if (!j.is_object())
    throw sdk::Error(path.string() + " is a JSON " + j.type_name() + ", not a GPT-2 config (an object with vocab_size, " +
                     "n_positions, n_layer, n_head, n_embd)");
  Config c;
  try {
    if (j.contains("model_type") && j.at("model_type").get<std::string>() != "gpt2")
      throw sdk::Error(path.string() + " describes a '" + j.at("model_type").get<std::string>() + "' model; this is GPT-2");
    const std::string activation = j.value("activation_function", std::string("gelu_new"));
    if (activation != "gelu_new" && activation != "gelu_pytorch_tanh")
      throw sdk::Error(path.string() + ": activation_function '" + activation +
                       "' (this GPT-2 computes GELU with the tanh approximation, gelu_new)");
    // A count is a whole number: nlohmann's get<int64_t>() would take 1.5 for 1 and "12" not at all.
    // Bounded far above any GPT-2 (1.5B: 48 layers, 1600 wide, 25 heads, 1024 positions), so that a
    // damaged number is refused here, not by a set-up that builds 100000 layers for minutes.
    auto count = [&](const char* key, int64_t most) {
      if (!j.contains(key)) throw sdk::Error(path.string() + " has no " + key + "; a GPT-2 config has it");
      const nlohmann::json& v = j.at(key);
      if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > most)
        throw sdk::Error(path.string() + ": " + key + " is " + v.dump() + "; it is a whole number from 1 to " +
                         std::to_string(most));
      return v.get<int64_t>();
    };
    c.vocab_size = count("vocab_size", int64_t{1} << 24);
    c.n_ctx = count(j.contains("n_ctx") && !j.contains("n_positions") ? "n_ctx" : "n_positions", int64_t{1} << 20);
    c.n_layer = count("n_layer", 1024);
    c.n_head = count("n_head", 1024);
    c.n_embd = count("n_embd", int64_t{1} << 16);
    if (c.n_embd % c.n_head != 0)
      throw sdk::Error(path.string() + ": n_head " + std::to_string(c.n_head) + " does not divide n_embd " +
                       std::to_string(c.n_embd) + "; each head takes n_embd / n_head of the width");
    // Each count may be in range and the model still absurd (a vocabulary of 16M x 65536 wide):
    // refused before a set-up allocates and fills it for minutes. GPT-2's largest has 1.6e9.
    if (const double parameters = static_cast<double>(c.parameters()); parameters > kMostParameters)
      throw sdk::Error(path.string() + ": these sizes make a GPT-2 of " + std::to_string(std::llround(parameters / 1e9)) +
                       " billion parameters (more than " + std::to_string(std::llround(kMostParameters / 1e9)) +
                       " billion); the file is damaged or is not a GPT-2's");
    // Fields of Hugging Face's GPT2Config that build another model than this one: taken in silence,
    // the weights loaded and the model computed something else. (reorder_and_upcast_attn computes
    // the same attention in float32, only rounding otherwise: taken.)
    auto refuse = [&](const char* key, const std::string& what) {
      throw sdk::Error(path.string() + ": " + key + " is " + j.at(key).dump().substr(0, 200) + ": " + what +
                       "; this GPT-2 is the released one (a GPT2Model or GPT2LMHeadModel of the default config)");
    };
    auto refuse_unless = [&](const char* key, bool wanted, const std::string& what) {
      if (!j.contains(key) || j.at(key) == wanted) return;
      refuse(key, j.at(key).is_boolean() ? what : "it is true or false");
    };
    refuse_unless("scale_attn_weights", true, "attention without the 1/sqrt(head width) scale is another model");
    refuse_unless("scale_attn_by_inverse_layer_idx", false, "attention scaled by 1/(layer + 1) as well is another model");
    if (head == Head::kTied)  // (a model that reads hidden states only has no head to tie)
      refuse_unless("tie_word_embeddings", true, "an output head apart from wte is not built here (the head is wte, tied)");
    refuse_unless("add_cross_attention", false, "cross-attention blocks are not built here");
    if (j.contains("n_inner") && !j.at("n_inner").is_null() &&
        !(j.at("n_inner").is_number_integer() && j.at("n_inner").get<int64_t>() == 4 * c.n_embd))
      refuse("n_inner", "this GPT-2's MLP is 4 x n_embd = " + std::to_string(4 * c.n_embd) + " wide (n_inner null or that width)");
    c.layer_norm_epsilon = j.value("layer_norm_epsilon", 1e-5);
    if (!(c.layer_norm_epsilon > 0 && c.layer_norm_epsilon < 1))
      throw sdk::Error(path.string() + ": layer_norm_epsilon is " + j.at("layer_norm_epsilon").dump() +
                       "; it is a small positive number (GPT-2's: 1e-05)");
  } catch (const nlohmann::json::exception& e) {  // a field of another type: its words, less "[json.exception...] "
    std::string what = e.what();
    if (const size_t cut = what.find("] "); what.rfind("[json.exception", 0) == 0 && cut != std::string::npos)
      what.erase(0, cut + 2);
    throw sdk::Error(path.string() + ": " + what + " (a GPT-2 config has vocab_size, n_positions, n_layer, n_head, n_embd)");
  }
  return c;
}

/// Copies `dir`/model.safetensors into `model` (built with hf_config(dir)), memory-mapped. Every
/// parameter must be in the file with its shape and nothing else may be: one error names every
/// missing, unexpected and mis-shaped tensor.
void load_hf_weights(ModelImpl& model, const std::filesystem::path& dir, Head head) {
  const auto file = dir / "model.safetensors";
  if (!std::filesystem::exists(file)) {
    if (std::filesystem::exists(dir / "pytorch_model.bin"))
      throw sdk::Error("model.pretrained: " + dir.string() + " has pytorch_model.bin, a pickle, which Loom does not load "
                       "(unpickling runs code). Convert it once: python -c \"from transformers import GPT2Model; "
                       "GPT2Model.from_pretrained('" + dir.string() + "').save_pretrained('" + dir.string() +
                       "', safe_serialization=True)\"");
    throw sdk::Error("model.pretrained: no " + file.string());
  }
  sdk::TensorMap tensors = sdk::map_safetensors(file);
  // "h.<N>.<rest>" -> "<rest>", else "".
  auto in_block = [](const std::string& key) -> std::string {
    if (key.rfind("h.", 0) != 0) return {};
    size_t i = 2;
    while (i < key.size() && key[i] >= '0' && key[i] <= '9') ++i;
    return i > 2 && i < key.size() && key[i] == '.' ? key.substr(i + 1) : std::string();
  };
  std::map<std::string, at::Tensor> by_name;
  std::vector<std::string> twice;  // "wte.weight" and "transformer.wte.weight": which one is the weight?
  at::Tensor lm_head;
  for (auto& [name, t] : tensors) {
    std::string key = name.rfind("transformer.", 0) == 0 ? name.substr(12) : name;
    const std::string rest = in_block(key);
    if (key == "lm_head.weight") lm_head = t;  // the tied head: wte's values, or the file is another model
    if (key == "lm_head.weight" || rest == "attn.bias" || rest == "attn.masked_bias") continue;  // causal masks
    if (!by_name.emplace(key, t).second) twice.push_back(key + " and transformer." + key);
  }
  if (!twice.empty()) {
    std::string names;
    for (size_t i = 0; i < twice.size() && i < 4; ++i) names += (i ? "; " : "") + twice[i].substr(0, 400);
    throw sdk::Error("model.pretrained: " + file.string() + " holds " + std::to_string(twice.size()) +
                     " weight(s) twice, with and without the prefix 'transformer.' (" + names +
                     "); one of them is not the model's: save the model again with save_pretrained");
  }
  if (lm_head.defined() && head == Head::kTied) {
    const auto wte = by_name.find("wte.weight");
    if (wte != by_name.end() && (lm_head.sizes() != wte->second.sizes() ||
                                 lm_head.scalar_type() != wte->second.scalar_type() || !at::equal(lm_head, wte->second)))
      throw sdk::Error("model.pretrained: " + file.string() + " holds an lm_head.weight other than wte.weight: its output "
                       "head is not tied to the embedding, which this GPT-2's is (config.json's tie_word_embeddings)");
  }
  auto conv1d = [&](const std::string& key) {
    const std::string rest = in_block(key);
    return rest == "attn.c_attn.weight" || rest == "attn.c_proj.weight" || rest == "mlp.c_fc.weight" ||
           rest == "mlp.c_proj.weight";
  };
  std::vector<std::string> missing, misshaped;
  torch::NoGradGuard no_grad;
  for (auto& item : model.named_parameters()) {
    auto it = by_name.find(item.key());
    if (it == by_name.end()) {
      missing.push_back(item.key());
      continue;
    }
    // A tensor of another rank (t() needs at most 2 dimensions) or of integers is no weight.
    if (!at::isFloatingType(it->second.scalar_type())) {
      misshaped.push_back(item.key() + " (file " + c10::toString(it->second.scalar_type()) + ", not a floating-point weight)");
      by_name.erase(it);
      continue;
    }
    const bool transposed = conv1d(item.key()) && it->second.dim() == 2;
    at::Tensor source = transposed ? it->second.t() : it->second;
    if (source.sizes() != item.value().sizes()) {
      // (a Conv1D weight is stored [in, out]: the shape the file needs is the model's reversed)
      const std::vector<int64_t> wanted = conv1d(item.key()) ? item.value().t().sizes().vec() : item.value().sizes().vec();
      misshaped.push_back(item.key() + " (file " + c10::str(it->second.sizes()) + ", needs " + c10::str(c10::IntArrayRef(wanted)) +
                          (conv1d(item.key()) ? ": a Conv1D weight, stored [in, out]" : "") + ")");
    } else if (!at::isfinite(source).all().item<bool>()) {  // every step of a run would be skipped
      misshaped.push_back(item.key() + " (holds NaN or infinite values)");
    } else {
      item.value().copy_(source);
    }
    by_name.erase(it);
  }
  if (missing.empty() && misshaped.empty() && by_name.empty()) return;
  auto list = [](const std::vector<std::string>& names) {
    std::string out;
    // (each name cut at 200 bytes: 12 names of 5 MB made a 60 MB message)
    for (size_t i = 0; i < names.size() && i < 12; ++i)
      out += (i ? ", " : "") + (names[i].size() > 200 ? names[i].substr(0, 200) + "..." : names[i]);
    if (names.size() > 12) out += " and " + std::to_string(names.size() - 12) + " more";
    return out;
  };
  std::vector<std::string> unexpected;
  for (const auto& [name, t] : by_name) unexpected.push_back(name);
  std::string message = "model.pretrained: " + file.string() + " does not fit a GPT-2 of config.json's sizes:";
  if (!missing.empty()) message += "\n  missing: " + list(missing);
  if (!unexpected.empty()) message += "\n  unexpected: " + list(unexpected);
  if (!misshaped.empty()) message += "\n  other shape, type or values: " + list(misshaped);
  throw sdk::Error(message + "\n(a GPT2Model or GPT2LMHeadModel saved with save_pretrained fits)");
}

Config hf_config(const std::filesystem::path& dir) { return hf_config(dir, Head::kTied); }

void load_hf_weights(ModelImpl& model, const std::filesystem::path& dir) { load_hf_weights(model, dir, Head::kTied); }

}  // namespace loom::sdk::gpt2
