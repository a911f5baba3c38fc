// JSON that Loom reads from files and other processes (a checkpoint's state.json, a run's records,
// the plugin scanner's reports), parsed with its nesting limited: nlohmann's parser is iterative,
// but copying, comparing or printing a value recurses once per level, and a 400 KB state.json of
// 200,000 nested brackets crashed `loom eval` with SIGSEGV. Nothing Loom writes nests past a few levels.
#pragma once

#include <nlohmann/json.hpp>

#include <exception>
#include <string>
#include <string_view>

namespace loom::core::detail {

inline constexpr int kMaxJsonDepth = 64;

/// Json::parse(text), refusing (a json::out_of_range, where callers catch the library's errors)
/// a value nested deeper than kMaxJsonDepth.
template <class Json = nlohmann::json>
Json parse_json(std::string_view text) {
  return Json::parse(text, [](int depth, typename Json::parse_event_t, Json&) {
    if (depth > kMaxJsonDepth)
      throw Json::out_of_range::create(406, "nested more than " + std::to_string(kMaxJsonDepth) + " levels deep: not "
                                       "Loom's, which nests a few", nullptr);
    return true;
  });
}

/// An error's text without nlohmann's "[json.exception.parse_error.101] " before it (a user reads
/// "parse error at line 1, column 5: ...").
inline std::string json_reason(const std::exception& e) {
  const std::string_view text = e.what();
  const size_t end = text.rfind("] ", 64);
  return std::string(text.rfind("[json.exception.", 0) == 0 && end != std::string_view::npos ? text.substr(end + 2) : text);
}

}  // namespace loom::core::detail
