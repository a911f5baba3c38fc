// GPT-2's byte-level BPE tokenizer (Radford et al. 2019; the algorithm of openai/gpt-2's
// encoder.py, whose ids Hugging Face `tokenizers`' ByteLevel BPE also gives), from a Hugging Face
// folder's vocab.json and merges.txt:
//   1. the text is cut into pieces by GPT-2's pattern (contractions, runs of letters, of digits,
//      of other symbols, each with at most one leading space; runs of whitespace), with PCRE2's
//      Unicode classes (std::regex has no \p{L});
//   2. each piece's UTF-8 bytes become characters through GPT-2's byte-to-unicode table, so that
//      every byte has a printable stand-in and no byte is unknown;
//   3. the piece's characters are merged pairwise, the pair ranked first in merges.txt first,
//      every occurrence of it left to right, until no ranked pair is left;
//   4. each symbol is looked up in vocab.json.
// The implementation (PCRE2, nlohmann/json) lives in libloom_sdk: a plugin links nothing more.
#pragma once

#include <loom/sdk/error.hpp>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace loom::sdk::gpt2 {

class LOOM_SDK_API Tokenizer {
 public:
  /// Reads `dir`/vocab.json and `dir`/merges.txt; throws sdk::Error naming the file and line of
  /// anything malformed, or a file that is not a regular file (a FIFO is not waited on).
  explicit Tokenizer(const std::filesystem::path& dir);
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  /// The ids of `text` (UTF-8). Throws sdk::Error on text that is not valid UTF-8. Not
  /// thread-safe (a cache of pieces): one tokenizer per thread.
  std::vector<int64_t> encode(const std::string& text) const;
  /// The text of `ids` (the inverse of encode for ids it made).
  std::string decode(const std::vector<int64_t>& ids) const;
  int64_t vocab_size() const;  ///< the largest id + 1: every id encode gives is below it
  int64_t token_count() const;  ///< the tokens in vocab.json: below vocab_size() where its ids leave gaps

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::sdk::gpt2
