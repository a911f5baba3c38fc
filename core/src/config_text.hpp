// What a configuration file's text must be before it is read as INI (config_text.cpp).
#pragma once

#include <string>

namespace loom::core {

/// Refuses, naming the file (`shown`) and line, what the INI reader would misread in silence or
/// call "not a key = value line": UTF-16 text, lines ended by a carriage return alone, a '#' inside
/// a value, a value in quotes.
void check_config_text(const std::string& text, const std::string& shown);

}  // namespace loom::core
