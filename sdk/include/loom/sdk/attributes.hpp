// DataSpec::attributes that list one entry per item or user ("items.title", "users.ids", ...):
// the entries joined with '\n', none containing a newline. The interaction datasets write them,
// the recommender and `loom recommend` read them.
#pragma once

#include <string>
#include <vector>

namespace loom::sdk {

/// The entries of a list attribute (an empty text is one empty entry).
inline std::vector<std::string> attribute_lines(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t end = std::min(text.find('\n', start), text.size());
    out.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

}  // namespace loom::sdk
