// Text helpers for messages.
#include <loom/core/error.hpp>
#include <loom/core/text.hpp>
#include <loom/sdk/files.hpp>
#include <loom/sdk/helpers.hpp>
#include <loom/sdk/options.hpp>

#include <c10/util/Exception.h>

#include <algorithm>
#include <string_view>
#include <cctype>
#include <charconv>
#include <cstdio>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <numeric>
#include <sys/statvfs.h>

namespace loom::core {

std::string join(const std::vector<std::string>& items, std::string_view separator) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += separator;
    out += items[i];
  }
  return out;
}

size_t edit_distance(std::string_view a, std::string_view b) {
  // Optimal string alignment distance, three rows.
  std::vector<size_t> prev2(b.size() + 1), prev(b.size() + 1), cur(b.size() + 1);
  std::iota(prev.begin(), prev.end(), 0);
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        cur[j] = std::min(cur[j], prev2[j - 2] + 1);
    }
    prev2 = prev;
    prev = cur;
  }
  return prev[b.size()];
}

std::string without_controls(std::string text, char with, bool keep_breaks) {
  const std::string by(1, with);
  for (size_t i = 0; i < text.size(); ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if ((c < 0x20 && !(keep_breaks && (c == '\n' || c == '\t'))) || c == 0x7f)
      text[i] = with;
    else if (c == 0xc2 && i + 1 < text.size() && static_cast<unsigned char>(text[i + 1]) >= 0x80 &&
             static_cast<unsigned char>(text[i + 1]) <= 0x9f)
      text.replace(i, 2, by);
    else if (c == 0xe2 && i + 2 < text.size()) {  // (the line and paragraph separators, U+2028-9, break a line;
      // the bidirectional overrides and isolates, U+202A-E and U+2066-9, reorder one)
      const auto b1 = static_cast<unsigned char>(text[i + 1]), b2 = static_cast<unsigned char>(text[i + 2]);
      if ((b1 == 0x80 && b2 >= 0xa8 && b2 <= 0xae) || (b1 == 0x81 && b2 >= 0xa6 && b2 <= 0xa9)) text.replace(i, 3, by);
    }
  }
  return text;
}

std::string printable(std::string_view text, size_t max) {
  std::string out = without_controls(std::string(text.substr(0, max)), ' ', false);
  // (bytes that are no UTF-8, or a character the cut at `max` split: '?', so JSON can hold the text)
  for (size_t from = 0; const auto bad = invalid_utf8(std::string_view(out).substr(from));) {
    out[from + *bad] = '?';
    from += *bad + 1;
  }
  return out;
}

std::optional<size_t> invalid_utf8(std::string_view text) {
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(text[i]); };
  for (size_t i = 0; i < text.size();) {
    const unsigned char c = byte(i);
    size_t length = 0;
    unsigned char low = 0x80, high = 0xbf;  // the second byte's range
    if (c < 0x80) length = 1;
    else if (c >= 0xc2 && c <= 0xdf) length = 2;
    else if (c == 0xe0) length = 3, low = 0xa0;
    else if (c >= 0xe1 && c <= 0xef) length = 3, high = c == 0xed ? 0x9f : 0xbf;
    else if (c == 0xf0) length = 4, low = 0x90;
    else if (c >= 0xf1 && c <= 0xf3) length = 4;
    else if (c == 0xf4) length = 4, high = 0x8f;
    else return i;
    if (i + length > text.size()) return i;
    for (size_t k = 1; k < length; ++k) {
      const unsigned char next = byte(i + k);
      if (k == 1 ? (next < low || next > high) : (next < 0x80 || next > 0xbf)) return i;
    }
    i += length;
  }
  return std::nullopt;
}

std::optional<std::string> closest(const std::string& word, const std::vector<std::string>& candidates) {
  std::optional<std::string> best;
  size_t best_distance = 0;
  // Case aside: trainer.MAX_STEPS is trainer.max_steps mistyped, not seven letters off.
  const auto lower = [](std::string s) {
    for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    return s;
  };
  for (const auto& c : candidates) {
    const size_t d = edit_distance(lower(word), lower(c));
    if (!best || d < best_distance) {
      best = c;
      best_distance = d;
    }
  }
  if (!best) return std::nullopt;
  // What Python scripts, PyTorch Lightning and Hugging Face call an option: no typo of its name here.
  static const std::pair<std::string_view, std::string_view> kOtherNames[] = {
      {"learning_rate", "lr"}, {"num_epochs", "epochs"}, {"num_train_epochs", "epochs"}, {"max_epochs", "epochs"},
      {"max_grad_norm", "clip_grad_norm"}, {"gradient_clip_val", "clip_grad_norm"}, {"grad_clip", "clip_grad_norm"},
      {"accumulate_grad_batches", "gradient_accumulation_steps"}, {"output_dir", "work_dir"},
      {"save_total_limit", "keep_last"}, {"logging_steps", "log_every"}, {"save_steps", "checkpoint_every"},
      {"eval_steps", "eval_every"}, {"wd", "weight_decay"}};
  const auto last = [](const std::string& key) { return std::string_view(key).substr(key.rfind('.') + 1); };
  const std::string lowered = lower(word);  // (LEARNING_RATE, as an environment variable would name it)
  for (const auto& [theirs, ours] : kOtherNames)
    if (last(lowered) == theirs)
      for (const auto& c : candidates)
        if (last(c) == ours && std::string_view(c).substr(0, c.size() - ours.size()) ==
                                   std::string_view(lowered).substr(0, lowered.size() - theirs.size()))
          return c;
  const bool prefix = !word.empty() && (best->rfind(word, 0) == 0 || word.rfind(*best, 0) == 0);
  // (of the key's own name: a long section's name, model.lightweight_transformer., made any key close)
  const size_t allowed = std::max<size_t>(1, (word.size() - word.rfind('.') - 1) / 3);
  if (best_distance <= allowed || prefix) return best;
  return std::nullopt;
}

std::string format_bytes(int64_t bytes) { return sdk::format_bytes(bytes); }

bool same_value(const std::string& a, const std::string& b) {
  if (a == b) return true;
  double x = 0, y = 0;
  const auto [xe, xr] = std::from_chars(a.data(), a.data() + a.size(), x);
  const auto [ye, yr] = std::from_chars(b.data(), b.data() + b.size(), y);
  if (xr == std::errc() && yr == std::errc() && xe == a.data() + a.size() && ye == b.data() + b.size()) return x == y;
  return sdk::parse_list(a) == sdk::parse_list(b);
}

/// `word` as one word of a POSIX shell's command line.
std::string shell_word(const std::string& word) {
  if (!word.empty() && word.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
                                              "_-./=:,+@%") == std::string::npos)
    return word;
  std::string out(1, '\'');
  for (const char c : word) {
    if (c == '\'') out.append("'\\''");  // close, an escaped quote, open again
    else out.push_back(c);
  }
  out.push_back('\'');
  return out;
}

}  // namespace loom::core

namespace loom {

std::string explained(const c10::Error& e) {
  const std::string text = e.what_without_backtrace();
  const std::string tried = "you tried to allocate ";
  const size_t at = text.find(tried);
  if (text.find("DefaultCPUAllocator") == std::string::npos || at == std::string::npos) return text;
  const long long bytes = std::strtoll(text.c_str() + at + tried.size(), nullptr, 10);
  // (Not "see `loom memory estimate`": it builds the model on this host too, and says this then.)
  return "not enough host memory: a tensor of " + core::format_bytes(bytes) +
         " could not be allocated (more than the host has free, or than the process may have: ulimit -v); make the "
         "model or the batch smaller";
}

namespace {

/// Whether the file system `path` is on (its nearest existing folder's) has no inode left for a new
/// file where it has blocks: ENOSPC then is no full disk.
bool inodes_used_up(std::filesystem::path path) {
  if (path.empty()) return false;  // (no path said: no file system to ask)
  std::error_code ec;
  while (!path.empty() && !std::filesystem::exists(path, ec)) path = path.has_relative_path() ? path.parent_path() : std::filesystem::path();
  if (path.empty()) path = ".";  // (a relative path none of whose folders exists: the current folder's file system)
  struct statvfs fs {};
  return ::statvfs(path.c_str(), &fs) == 0 && fs.f_files > 0 && fs.f_favail == 0 && fs.f_bavail > 0;
}

}  // namespace

std::string explained(const std::filesystem::filesystem_error& e) {
  // libstdc++'s text: "filesystem error: cannot create directories: Not a directory [a/b] [c]"
  std::string what = e.what();
  const std::string prefix = "filesystem error: ";
  if (what.rfind(prefix, 0) == 0) what.erase(0, prefix.size());
  const std::string reason = e.code().message();
  const size_t cut = what.find(": " + reason);
  std::string operation = cut == std::string::npos ? what : what.substr(0, cut);
  std::string text = operation;  // appended: GCC 12's -Wrestrict misreads " " + std::string&& (bug 105329)
  if (!e.path1().empty()) text.append(" ").append(e.path1().string());
  if (!e.path2().empty()) text.append(" -> ").append(e.path2().string());
  text.append(": ").append(reason);
  const int code = e.code().value();
  if (code == ENOTDIR || (code == EEXIST && operation.find("create director") != std::string::npos)) {
    // The part of the path that stands where a folder was to be: named, with what it is.
    std::string blocker, there;
    std::error_code ec;
    namespace fs = std::filesystem;
    for (fs::path p = e.path1(); !p.empty() && blocker.empty(); p = p.has_relative_path() ? p.parent_path() : fs::path()) {
      const auto status = fs::status(p, ec);
      // (a link to nothing: "File exists" of a path where nothing is, said as "a part ... is a file")
      if ((fs::exists(status) && !fs::is_directory(status)) || (!fs::exists(status) && fs::is_symlink(fs::symlink_status(p, ec)))) {
        blocker = p.string();
        there = sdk::what_is_at(p);
      }
    }
    if (!blocker.empty())
      text.append(" (").append(blocker).append(" is ").append(there.empty() ? "a file" : there).append(
          ", not a folder: choose another path, or move it away)");
    else
      text += " (a part of that path is a file, not a folder: choose another path, or move the file away)";
  } else if (code == EACCES || code == EPERM)
    // (said of reads too, a status or a folder's listing: "may write" misled there, probe)
    text += operation.find("status") != std::string::npos || operation.find("directory iterator") != std::string::npos ||
                    operation.find("cannot get") != std::string::npos  // (a file's size or time)
                ? " (this user may not read there: change its permissions, or run as its owner)"
                : " (choose a path this user may write, or change its permissions)";
  else if (code == ELOOP)
    text += " (a symbolic link there points back at itself)";
  else if (code == ENOSPC && inodes_used_up(e.path1()))  // ("the disk is full" beside "3.9 MiB free there", a probe)
    text += " (the file system has no inode left for a new file, though it has space: `df -i` shows it; remove files "
            "there, or choose a path on another file system)";
  else if (code == ENOSPC || code == EDQUOT)
    text += code == ENOSPC ? " (the disk is full)" : " (this user's disk quota is used up)";
  else if (code == EFBIG)
    text += " (the file-size limit of this process, `ulimit -f`: raise it, or lift it with `ulimit -f unlimited`)";
  else if (code == EROFS)
    text += " (a read-only file system: choose a path on one that can be written)";
  else if (code == ENOENT && operation.find("create director") != std::string::npos)
    text += " (no folder can be made there, as in /proc or /sys: choose a path on a file system that can be written)";
  return text;
}

}  // namespace loom
