// The text of a configuration file, checked before Boost.Program_options reads it as INI: what
// that reader takes another way than its writer meant is refused here, with the fix.
#include "config_text.hpp"

#include <loom/core/error.hpp>
#include <loom/core/log.hpp>
#include <loom/core/text.hpp>
#include <loom/sdk/options.hpp>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <sstream>

namespace loom::core {

namespace {

/// The start of `line`, at most 80 bytes, control characters shown as '?'.
std::string shown_start(const std::string& line, size_t end) {
  std::string kept(sdk::trim(line.substr(0, std::min<size_t>(end, 80))));
  std::replace_if(kept.begin(), kept.end(), [](char c) { return static_cast<unsigned char>(c) < 0x20 || c == 0x7f; }, '?');
  return kept + (end > 80 ? "..." : "");
}

}  // namespace

void check_config_text(const std::string& text, const std::string& shown) {
  // (Windows' "Unicode" text: every other byte NUL, read as "line 2: not a key = value line")
  // (its mark, or ASCII with a NUL byte before or after each character; other binary is refused later)
  const auto ascii16 = [&](size_t zero) {
    return text.size() >= 4 && text[zero] == '\0' && text[zero + 2] == '\0' && text[1 - zero] != '\0' && text[3 - zero] != '\0';
  };
  if (text.rfind("\xFF\xFE", 0) == 0 || text.rfind("\xFE\xFF", 0) == 0 || ascii16(0) || ascii16(1))
    throw Error("config file " + shown + " is UTF-16 text (Windows' \"Unicode\"); save it as UTF-8");
  if (text.find('\r') != std::string::npos && text.find('\n') == std::string::npos)
    throw Error("config file " + shown + " ends its lines with a carriage return alone (classic Mac OS), which "
                "reads as one line; convert it: tr '\\r' '\\n' < FILE > FILE.new");
  // (a run's config.json given to -c was "config.json:1: not a `key = value` ... line")
  if (const auto first = text.find_first_not_of(" \t\r\n"); first != std::string::npos && text[first] == '{') {
    // (`shown` is relative to this folder: config.json from inside its run folder was name "")
    const std::filesystem::path run = std::filesystem::absolute(shown).lexically_normal().parent_path();
    const std::string which = " --set " + shell_word("trainer.work_dir=" + run.parent_path().string()) + " --set " +
                              shell_word("trainer.name=" + run.filename().string());
    throw Error("config file " + shown + " is JSON, not INI" +
                (text.find("\"origin\"") != std::string::npos
                     ? ": a run's record of its configuration. Continue that run with: loom train --resume auto" + which +
                           "; or save its settings as INI, for a new run like it: loom config show --resume auto" + which +
                           " > run.ini, then loom train -c run.ini --set trainer.name=NEW_NAME"
                     : "; -c takes INI files of `key = value` lines under [section]s"));
  }
  std::istringstream scan(text);
  int number = 0;
  for (std::string line; std::getline(scan, line);) {
    ++number;
    const auto hash = line.find('#'), eq = line.find('=');
    if (eq == std::string::npos || line.find_first_not_of(" \t") == hash) continue;  // (no value; a comment line)
    // '#' starts a comment anywhere on a line (Program_options): `work_dir = exp#2` wrote to exp and
    // `root = set#2` read another folder, in silence. A '#' right after a value's text is refused.
    if (hash != std::string::npos && eq < hash && !std::isspace(static_cast<unsigned char>(line[hash - 1])) &&
        line[hash - 1] != '=')
      throw Error(shown + ":" + std::to_string(number) + ": '#' starts a comment, even inside a value, so `" +
                  shown_start(line, hash) + "` would be all of it. Put a space before a comment's '#'; a value with '#' "
                  "in it goes on the command line (--set KEY=VALUE)");
    // A value in quotes keeps them (`work_dir = "my runs"` made a folder named "my runs" with its
    // quotes; with a '#' inside, the quote opened a folder named `"runs`).
    const size_t value_end = hash == std::string::npos || hash < eq ? std::string::npos : hash - eq - 1;
    const std::string value(sdk::trim(line.substr(eq + 1, value_end)));
    if (value.empty() || (value.front() != '"' && value.front() != '\'')) continue;
    const bool closed = value.size() > 1 && value.back() == value.front();
    throw Error(shown + ":" + std::to_string(number) + ": `" + shown_start(line, line.size()) + "`: a value is read as "
                "written, quotes and all (INI takes none); " +
                (closed ? "write it without them: " + std::string(sdk::trim(line.substr(0, eq))) + " = " +
                              value.substr(1, value.size() - 2)
                        : std::string("a value that starts with a quote goes on the command line (--set KEY=VALUE)")));
  }
}

ShownLine shown_line(const std::string& key, const std::string& name, const std::string& value, const Origin& origin) {
  // (read back, a '#' cut it in silence; a quote at its start is refused, check_config_text)
  const bool hash = value.find('#') != std::string::npos;
  const bool quoted = !value.empty() && (value.front() == '"' || value.front() == '\'');
  if (hash || quoted)
    log::warn(key, " = ", value, hash ? ": a file cuts it at '#'" : ": a file refuses a value that starts with a quote",
              "; its line is written commented out (use --set)");
  // A choice Loom made for `auto` (precision, schedule) is written as auto, the choice beside it: the
  // file, read on a GPU, trained in the CPU's fp32, and ignored --set trainer.use_scheduler=false.
  // Another value auto set (precision.tf32 for --allow-tf32, fraction_cap in the policies for
  // memory.fraction) is set again from the settings written beside it: commented out.
  const bool by_auto = origin.source.rfind("auto (", 0) == 0;
  const bool automatic = by_auto && (key == "precision.name" || key == "trainer.schedule");
  const bool derived = by_auto && !automatic;
  // (--resume says which run this command continues, no setting of a run: a file saved from
  // `config show --resume auto`, "for a new run like it", continued the old run in place)
  const bool which_run = (key == "trainer.resume" || key == "trainer.resume_from") &&
                         (origin.source == "--resume" || origin.source == "--resume-from" || origin.source == "--set");
  ShownLine out;
  out.line = (hash || quoted || which_run || derived ? "# " : "") + name + " = " + (automatic ? "auto" : value);
  out.comment = (automatic ? value + " here: " : "") + origin.describe() +
                (hash     ? ", a value with '#': give it with --set"
                 : quoted ? ", a value that starts with a quote: give it with --set"
                          : "") +
                (which_run ? ": which run this command continues, left out of a file (give it on the command line)" : "") +
                (derived ? ": set again from the other settings when read" : "");
  return out;
}

// (declared in config_text.hpp)
std::vector<std::pair<std::string, int>> entry_lines(const std::string& text) {
  std::vector<std::pair<std::string, int>> out;
  std::istringstream in(text);
  std::string line, prefix;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (auto hash = line.find('#'); hash != std::string::npos) line.resize(hash);
    const std::string s(sdk::trim(line));
    if (s.empty()) continue;
    if (s.front() == '[' && s.back() == ']') {
      prefix = s.substr(1, s.size() - 2);
      if (prefix.empty() || prefix.back() != '.') prefix += '.';
    } else if (auto eq = s.find('='); eq != std::string::npos) {
      // (trimmed of spaces and tabs only, as Program_options trims it: a key ending in \v or \f
      // matched no parsed key, and its errors named line 0)
      std::string key = s.substr(0, eq);
      key.erase(key.find_last_not_of(" \t") + 1);
      out.emplace_back(prefix + key, number);
    } else {
      out.emplace_back("", -number);  // a bad line; Program_options rejects it
    }
  }
  return out;
}

}  // namespace loom::core
