// GPT-2's byte-level BPE tokenizer (gpt2_tokenizer.hpp): PCRE2 and nlohmann/json stay inside
// libloom_sdk, so a plugin that tokenizes needs neither.
#include <loom/sdk/gpt2_tokenizer.hpp>

#include <loom/sdk/files.hpp>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdint>
#include <set>
#include <sstream>
#include <map>
#include <functional>
#include <memory>
#include <queue>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace loom::sdk::gpt2 {

namespace {

class TokenizerImpl {
 public:
  /// Reads `dir`/vocab.json and `dir`/merges.txt; throws sdk::Error naming the file and line of
  /// anything malformed.
  explicit TokenizerImpl(const std::filesystem::path& dir) {
    build_byte_table();
    read_vocab(dir / "vocab.json");
    read_merges(dir / "merges.txt");
    int error = 0;
    PCRE2_SIZE offset = 0;
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kPattern), PCRE2_ZERO_TERMINATED,
                                     PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
    if (code == nullptr) throw sdk::Error("gpt2 tokenizer: the pre-tokenizer pattern does not compile: " + pcre2_message(error));
    pattern_.reset(code);
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // where JIT is unavailable, matching still works
  }

  /// The ids of `text` (UTF-8). Throws sdk::Error on text that is not valid UTF-8.
  std::vector<int64_t> encode(const std::string& text) const {
    std::vector<int64_t> ids;
    std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> match(
        pcre2_match_data_create_from_pattern(pattern_.get(), nullptr), &pcre2_match_data_free);
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    PCRE2_SIZE start = 0;
    uint32_t options = 0;  // the UTF check once, on the first match
    while (start < text.size()) {
      const int rc = pcre2_match(pattern_.get(), subject, text.size(), start, options, match.get(), nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;  // the pattern's last branch takes any whitespace, the others the rest
      if (rc < 0) {
        const PCRE2_SIZE at = pcre2_get_startchar(match.get());
        throw sdk::Error("gpt2 tokenizer: " + pcre2_message(rc) + " (byte " + std::to_string(at) +
                         " of a text of " + std::to_string(text.size()) + " bytes); texts must be UTF-8");
      }
      options = PCRE2_NO_UTF_CHECK;
      const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match.get());
      if (ovector[1] == ovector[0]) {  // cannot happen with this pattern; never loop on it
        ++start;
        continue;
      }
      for (int64_t id : bpe(text.substr(ovector[0], ovector[1] - ovector[0]))) ids.push_back(id);
      start = ovector[1];
    }
    return ids;
  }

  /// The text of `ids` (the inverse of encode for ids it made).
  std::string decode(const std::vector<int64_t>& ids) const {
    std::string out;
    for (int64_t id : ids) {
      auto it = token_of_.find(id);
      if (it == token_of_.end()) throw sdk::Error("gpt2 tokenizer: id " + std::to_string(id) + " is not in the vocabulary");
      const std::string& token = it->second;
      for (size_t i = 0; i < token.size();) {
        const size_t n = utf8_length(static_cast<unsigned char>(token[i]));
        auto byte = byte_of_char_.find(token.substr(i, n));
        if (byte == byte_of_char_.end()) throw sdk::Error("gpt2 tokenizer: token '" + token + "' is not byte-level");
        out.push_back(static_cast<char>(byte->second));
        i += n;
      }
    }
    return out;
  }

  int64_t vocab_size() const { return size_; }  ///< every id is below it
  int64_t token_count() const { return static_cast<int64_t>(token_of_.size()); }

 private:
  static constexpr const char* kPattern =
      R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

  struct PatternFree {
    void operator()(pcre2_code* code) const { pcre2_code_free(code); }
  };

  static std::string pcre2_message(int code) {
    PCRE2_UCHAR buffer[256];
    pcre2_get_error_message(code, buffer, sizeof buffer);
    return reinterpret_cast<const char*>(buffer);
  }

  static size_t utf8_length(unsigned char lead) {
    return lead < 0x80 ? 1 : (lead >> 5) == 0x6 ? 2 : (lead >> 4) == 0xe ? 3 : 4;
  }

  static std::string utf8(uint32_t cp) {
    std::string s;
    if (cp < 0x80) {
      s.push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      s.push_back(static_cast<char>(0xc0 | (cp >> 6)));
      s.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    } else {
      s.push_back(static_cast<char>(0xe0 | (cp >> 12)));
      s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
      s.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    }
    return s;
  }

  // GPT-2's bytes_to_unicode: the printable bytes stand for themselves, the other 68 for
  // U+0100 onwards, in byte order.
  void build_byte_table() {
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
      char_of_byte_[b] = utf8(printable ? b : next++);
      byte_of_char_[char_of_byte_[b]] = static_cast<uint8_t>(b);
    }
  }

  // GPT-2's vocab.json is 1 MB and merges.txt 0.5 MB; a FIFO or a device is refused, not waited on.
  static std::string read(const std::filesystem::path& path) {
    return sdk::read_regular_file(path, int64_t{256} << 20, "gpt2 tokenizer: ", "the tokenizer's files: vocab.json, merges.txt");
  }

  /// UTF-16 text (Windows' "Unicode": its mark, or a NUL beside each ASCII byte) is said as such:
  /// it was "syntax error ... last read: '<0xFF>'", or a line cut at its first NUL.
  static void refuse_utf16(const std::string& text, const std::filesystem::path& path) {
    if (text.rfind("\xFF\xFE", 0) == 0 || text.rfind("\xFE\xFF", 0) == 0 ||
        (text.size() >= 2 && (text[0] == '\0') != (text[1] == '\0')))
      throw sdk::Error(path.string() + " is UTF-16 text (Windows' \"Unicode\"); save it as UTF-8");
  }

  void read_vocab(const std::filesystem::path& path) {
    std::string text = read(path);
    refuse_utf16(text, path);
    if (text.rfind("\xEF\xBB\xBF", 0) == 0) text.erase(0, 3);  // (a byte order mark, as some editors write)
    if (text.find_first_not_of(" \t\r\n") == std::string::npos)
      throw sdk::Error(path.string() + " is empty; vocab.json maps each token to its id (a Hugging Face tokenizer folder's)");
    try {
      // A token given twice kept its last id in silence, its first lost (nlohmann keeps the last).
      std::set<std::string> keys;
      const auto once = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
        // (a value nested deep, printed in the message below, crashed the process: printing recurses)
        if (depth > 2) throw sdk::Error(path.string() + " nests values in values; vocab.json maps each token to a whole number");
        if (event == nlohmann::json::parse_event_t::key && depth == 1 && !keys.insert(parsed.get<std::string>()).second)
          throw sdk::Error(path.string() + ": the token '" + parsed.get<std::string>() + "' is given twice; each token has one id");
        return true;
      };
      const nlohmann::json j = nlohmann::json::parse(text, once);
      if (!j.is_object()) throw sdk::Error(path.string() + " is not a JSON object of token: id");
      if (j.empty()) throw sdk::Error(path.string() + " has no tokens; vocab.json maps each token to its id");
      // Ids index the model's embedding: each a whole number in [0, 2^24), no two tokens on one
      // id; the vocabulary's size is the largest id + 1 (a trimmed vocabulary may leave gaps).
      for (auto it = j.begin(); it != j.end(); ++it) {
        const nlohmann::json& v = it.value();
        if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= kMaxVocabulary)
          throw sdk::Error(path.string() + ": token '" + it.key() + "' has id " + v.dump() + "; vocab.json maps each token " +
                           "to a whole number in [0, " + std::to_string(kMaxVocabulary) + ")");
        const int64_t id = v.get<int64_t>();
        if (auto [other, fresh] = token_of_.emplace(id, it.key()); !fresh)
          throw sdk::Error(path.string() + ": tokens '" + other->second + "' and '" + it.key() + "' have the same id " +
                           std::to_string(id) + "; each token needs an id of its own");
        id_of_[it.key()] = id;
        size_ = std::max(size_, id + 1);
      }
    } catch (const nlohmann::json::exception& e) {
      std::string what = e.what();  // (nlohmann's "[json.exception.parse_error.101] " is no one's business)
      if (what.rfind("[json.exception.", 0) == 0 && what.find("] ") != std::string::npos) what.erase(0, what.find("] ") + 2);
      throw sdk::Error(path.string() + ": " + what + " (vocab.json maps each token to its id)");
    }
  }

  void read_merges(const std::filesystem::path& path) {
    std::string text = read(path);
    refuse_utf16(text, path);
    // (a byte order mark made the first line "the merge '\xEF\xBB\xBF#version: 0.2' makes ...", the mark unseen)
    if (text.rfind("\xEF\xBB\xBF", 0) == 0) text.erase(0, 3);
    std::istringstream in(text);
    std::string line;
    int line_number = 0;
    int rank = 0;
    while (std::getline(in, line)) {
      ++line_number;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.find('\0') != std::string::npos)  // (a message cut at the NUL lost its explanation)
        throw sdk::Error(path.string() + ":" + std::to_string(line_number) + ": a NUL byte; merges.txt is text, a merge "
                         "(two symbols separated by one space) on each line");
      if (line.empty() || line.rfind("#version", 0) == 0) continue;
      const size_t space = line.find(' ');
      if (space == std::string::npos || space == 0 || space + 1 == line.size() || line.find(' ', space + 1) != std::string::npos)
        throw sdk::Error(path.string() + ":" + std::to_string(line_number) + ": '" + line +
                         "' is not a merge (two symbols separated by one space)");
      // (a merge whose result has no id failed at the first text that made it, blamed on the bytes)
      if (!id_of_.count(line.substr(0, space) + line.substr(space + 1)))
        throw sdk::Error(path.string() + ":" + std::to_string(line_number) + ": the merge '" + line + "' makes '" +
                         line.substr(0, space) + line.substr(space + 1) + "', which vocab.json does not have (each merge's "
                         "result is a token of the vocabulary)");
      rank_.emplace(line.substr(0, space) + " " + line.substr(space + 1), rank++);
    }
  }

  int rank_of(const std::string& a, const std::string& b) const {
    auto it = rank_.find(a + " " + b);
    return it == rank_.end() ? INT_MAX : it->second;
  }

  // GPT-2's merge loop: the pair of lowest rank, every occurrence of it left to right, again until
  // no pair has a rank. Its rescans of the whole piece per merge made a word of 200000 letters (an
  // item's title) take minutes; here a heap of the neighbours' pairs, a list of the symbols, and
  // all of one rank's occurrences merged before the pairs they form are ranked: the same result.
  std::vector<int64_t> bpe(const std::string& piece) const {
    if (auto hit = cache_.find(piece); hit != cache_.end()) return hit->second;
    const size_t n = piece.size();
    std::vector<std::string> symbol(n);
    std::vector<size_t> next(n), prev(n), version(n, 0);
    std::vector<bool> alive(n, true);
    for (size_t i = 0; i < n; ++i) {
      symbol[i] = char_of_byte_[static_cast<unsigned char>(piece[i])];
      next[i] = i + 1;  // (n: none)
      prev[i] = i == 0 ? n : i - 1;
    }
    struct Pair {
      int rank;
      size_t left, right, left_version, right_version;
      bool operator>(const Pair& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
    };
    std::priority_queue<Pair, std::vector<Pair>, std::greater<Pair>> pairs;
    const auto offer = [&](size_t left) {
      if (left >= n || next[left] >= n) return;
      const size_t right = next[left];
      if (const int r = rank_of(symbol[left], symbol[right]); r != INT_MAX) pairs.push({r, left, right, version[left], version[right]});
    };
    for (size_t i = 0; i + 1 < n; ++i) offer(i);
    std::vector<size_t> merged;
    while (!pairs.empty()) {
      const int rank = pairs.top().rank;
      merged.clear();
      while (!pairs.empty() && pairs.top().rank == rank) {  // (in order of position: the heap's ties)
        const Pair p = pairs.top();
        pairs.pop();
        if (!alive[p.left] || !alive[p.right] || next[p.left] != p.right || version[p.left] != p.left_version ||
            version[p.right] != p.right_version)
          continue;  // (a pair one of whose symbols an earlier merge changed)
        symbol[p.left] += symbol[p.right];
        alive[p.right] = false;
        ++version[p.left];
        ++version[p.right];
        next[p.left] = next[p.right];
        if (next[p.left] < n) prev[next[p.left]] = p.left;
        merged.push_back(p.left);
      }
      for (const size_t at : merged)  // (after the rank's every occurrence, as GPT-2's pass)
        if (alive[at]) {
          if (prev[at] < n) offer(prev[at]);
          offer(at);
        }
    }
    std::vector<std::string> symbols;
    for (size_t i = 0; i < n; i = next[i]) symbols.push_back(std::move(symbol[i]));
    std::vector<int64_t> ids;
    for (const auto& s : symbols) {
      auto it = id_of_.find(s);
      if (it == id_of_.end())
        throw sdk::Error("gpt2 tokenizer: the symbol '" + s + "' is not in vocab.json (a byte-level vocabulary has all 256 bytes)");
      ids.push_back(it->second);
    }
    if (cache_.size() < kCacheLimit) cache_.emplace(piece, ids);
    return ids;
  }

  static constexpr size_t kCacheLimit = 1 << 16;  // pieces; item texts repeat their words

  std::array<std::string, 256> char_of_byte_;
  std::unordered_map<std::string, uint8_t> byte_of_char_;
  std::unordered_map<std::string, int64_t> id_of_;
  std::unordered_map<int64_t, std::string> token_of_;
  int64_t size_ = 0;
  static constexpr int64_t kMaxVocabulary = int64_t{1} << 24;  // as config.json's vocab_size (gpt2.cpp)
  std::unordered_map<std::string, int> rank_;
  std::unique_ptr<pcre2_code, PatternFree> pattern_;
  mutable std::unordered_map<std::string, std::vector<int64_t>> cache_;  // not thread-safe: one tokenizer per thread
};


}  // namespace

class Tokenizer::Impl : public TokenizerImpl {
 public:
  using TokenizerImpl::TokenizerImpl;
};

Tokenizer::Tokenizer(const std::filesystem::path& dir) : impl_(std::make_unique<Impl>(dir)) {}
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
std::vector<int64_t> Tokenizer::encode(const std::string& text) const { return impl_->encode(text); }
std::string Tokenizer::decode(const std::vector<int64_t>& ids) const { return impl_->decode(ids); }
int64_t Tokenizer::vocab_size() const { return impl_->vocab_size(); }
int64_t Tokenizer::token_count() const { return impl_->token_count(); }

}  // namespace loom::sdk::gpt2
