// Small text helpers for messages: joining, "did you mean" suggestions, sizes, values compared.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace loom::core {

std::string join(const std::vector<std::string>& items, std::string_view separator);

/// Levenshtein distance (insertions, deletions, substitutions, and swaps of neighbours).
size_t edit_distance(std::string_view a, std::string_view b);

/// `text` with each control character replaced by `with`: C0, DEL, C1 in UTF-8, the line and
/// paragraph separators (U+2028-9) and the bidirectional overrides and isolates, which break or
/// reorder a terminal's line; the line break and the tab kept where `keep_breaks`.
std::string without_controls(std::string text, char with, bool keep_breaks);

/// A plugin's text for people (a summary, an option's help, a callback's describe()): at most
/// `max` bytes, each control character (C0, DEL, C1 in UTF-8) a space. A line break or an escape in
/// it printed lines that looked like Loom's own, or set the terminal's colours.
std::string printable(std::string_view text, size_t max);

/// Where `text` stops being UTF-8 (the first byte of a bad sequence: a stray continuation, an
/// overlong form, a surrogate, past U+10FFFF, cut short), or nullopt where it is all UTF-8. JSON
/// holds UTF-8 only: a plugin's text that is not failed as the checkpoint was written.
std::optional<size_t> invalid_utf8(std::string_view text);

/// The candidate closest to `word`, if it is close enough to be what the user meant (at most a
/// third of the word's letters differ, or one is a prefix of the other).
std::optional<std::string> closest(const std::string& word, const std::vector<std::string>& candidates);

/// `word` as one word of a POSIX shell's command line (quoted where it needs to be).
std::string shell_word(const std::string& word);

/// "1.5 GiB", "512.0 MiB", "12 B".
std::string format_bytes(int64_t bytes);

/// The same configuration value written otherwise: `1` and `1.0`, `2e-3` and `0.002`, `a,b` and `a, b`.
bool same_value(const std::string& a, const std::string& b);

}  // namespace loom::core
