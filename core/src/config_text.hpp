// What a configuration file's text must be before it is read as INI (config_text.cpp).
#pragma once

#include <loom/core/config.hpp>

#include <string>
#include <utility>
#include <vector>

namespace loom::core {

/// Refuses, naming the file (`shown`) and line, what the INI reader would misread in silence or
/// call "not a key = value line": UTF-16 text, lines ended by a carriage return alone, a '#' inside
/// a value, a value in quotes.
void check_config_text(const std::string& text, const std::string& shown);

/// The line of each `key = value` entry, in file order, as Program_options' config parser reads
/// them ('#' starts a comment anywhere; `[section]` sets a prefix); a line that is none of these
/// has its number negated. Program_options does the parsing; this only recovers line numbers.
std::vector<std::pair<std::string, int>> entry_lines(const std::string& text);

/// One value as `loom config show` writes it, so that the file reads back as this configuration:
/// the `name = value` line (commented out where a file would misread the value, or where it is no
/// setting of a run) and its comment (the origin, and why a line is as it is).
struct ShownLine {
  std::string line, comment;
};
ShownLine shown_line(const std::string& key, const std::string& name, const std::string& value, const Origin& origin);

}  // namespace loom::core
