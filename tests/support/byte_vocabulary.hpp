// A byte-level BPE tokenizer folder for tests: GPT-2's 256 byte symbols in vocab.json (with ids a
// test chooses) and a merges.txt without merges, so that each byte is a token.
#pragma once

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

namespace loom::testing {

/// GPT-2's byte symbols: the printable bytes stand for themselves, the others from U+0100 on.
/// `id_of(byte)` gives each one's id.
inline nlohmann::json byte_vocabulary(const std::function<int64_t(int)>& id_of) {
  nlohmann::json vocab;
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    std::string symbol;
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
    const int code = printable ? b : next++;
    if (code < 0x80) symbol = std::string(1, static_cast<char>(code));
    else symbol = {static_cast<char>(0xc0 | (code >> 6)), static_cast<char>(0x80 | (code & 0x3f))};
    vocab[symbol] = id_of(b);
  }
  return vocab;
}

/// Writes `vocab` as `dir`/vocab.json and an empty merges.txt.
inline void write_tokenizer(const std::filesystem::path& dir, const nlohmann::json& vocab) {
  std::ofstream(dir / "merges.txt", std::ios::trunc) << "#version: 0.2\n";
  std::ofstream(dir / "vocab.json", std::ios::trunc) << vocab.dump();
}

}  // namespace loom::testing
