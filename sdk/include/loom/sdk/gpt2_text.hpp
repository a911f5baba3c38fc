// Texts through GPT-2, one vector each: tokenized once (GPT-2's byte-level BPE, or plain UTF-8
// bytes where no vocabulary is given), truncated and right-padded to a fixed length, encoded by
// gpt2.hpp and pooled over the real tokens (their mean, or the last one). GPT-2 is causal, so a
// real token's hidden state never sees the padding after it: the pooled vector of a padded text
// equals that of the text alone. The recommender encodes its item catalogue with it.
#pragma once

#include <loom/sdk/gpt2.hpp>
#include <loom/sdk/gpt2_tokenizer.hpp>

#include <ATen/ops/arange.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>

#include <string>
#include <vector>

namespace loom::sdk::gpt2 {

/// Token ids of texts, right-padded: ids [N, L] (padding 0) and lengths [N] (each >= 1), int64.
struct TokenizedTexts {
  at::Tensor ids;
  at::Tensor lengths;
  int64_t vocab_size = 0;  ///< ids are below this
};

/// `tokenizer` null: the UTF-8 bytes are the ids (vocabulary 256). Texts longer than
/// `max_tokens` keep their first tokens; an empty text is one token (a space).
inline TokenizedTexts tokenize(const std::vector<std::string>& texts, const Tokenizer* tokenizer, int64_t max_tokens) {
  if (max_tokens < 1) throw sdk::Error("gpt2 text: at least one token per text");
  const auto n = static_cast<int64_t>(texts.size());
  TokenizedTexts out;
  out.ids = at::zeros({n, max_tokens}, at::kLong);
  out.lengths = at::zeros({n}, at::kLong);
  out.vocab_size = tokenizer ? tokenizer->vocab_size() : 256;
  int64_t* ids = out.ids.data_ptr<int64_t>();
  int64_t* lengths = out.lengths.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    std::vector<int64_t> tokens;
    if (tokenizer) tokens = tokenizer->encode(texts[i].empty() ? std::string(" ") : texts[i]);
    else
      for (unsigned char byte : texts[i].empty() ? std::string(" ") : texts[i]) tokens.push_back(byte);
    const int64_t length = std::min<int64_t>(max_tokens, static_cast<int64_t>(tokens.size()));
    for (int64_t t = 0; t < length; ++t) ids[i * max_tokens + t] = tokens[t];
    lengths[i] = std::max<int64_t>(1, length);
  }
  return out;
}

enum class Pooling { kMean, kLast };

inline Pooling parse_pooling(const std::string& name) {
  if (name == "mean") return Pooling::kMean;
  if (name == "last") return Pooling::kLast;
  throw sdk::Error("gpt2 text: pooling '" + name + "' is neither mean nor last");
}

/// One vector per text from hidden states [N, L, E] and lengths [N]: the mean over the first
/// length positions, or the hidden state at position length - 1. Float32 [N, E].
inline at::Tensor pool(const at::Tensor& hidden, const at::Tensor& lengths, Pooling pooling) {
  const at::Tensor h = hidden.to(at::kFloat);
  if (pooling == Pooling::kLast)
    return h.gather(1, (lengths - 1).view({-1, 1, 1}).expand({h.size(0), 1, h.size(2)})).squeeze(1);
  const at::Tensor positions = at::arange(h.size(1), lengths.options());
  const at::Tensor mask = positions.unsqueeze(0).lt(lengths.unsqueeze(1)).to(h.scalar_type()).unsqueeze(2);
  return (h * mask).sum(1) / lengths.to(h.scalar_type()).unsqueeze(1);
}

/// The pooled vectors of token rows `ids` [N, L] with `lengths` [N] through `model`.
inline at::Tensor encode_texts(ModelImpl& model, const at::Tensor& ids, const at::Tensor& lengths, Pooling pooling) {
  return pool(model.forward(ids), lengths, pooling);
}

}  // namespace loom::sdk::gpt2
