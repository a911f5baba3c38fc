// Component options: how a plugin declares its keys (the schema in its descriptor) and reads
// the values the host hands its factory.
//
// Values travel as text. The host validates every value against the key's type with the same
// parse functions below before a factory runs, so a factory's `Options::get_*` fails only on a
// programming error (asking for a key that is not in the schema).
#pragma once

#include <loom/sdk/abi.h>
#include <loom/sdk/error.hpp>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace loom::sdk {

// ---- schema entries --------------------------------------------------------------------------
// constexpr helpers that fill a loom_option_spec, for a component's `kOptions` table:
//   static constexpr loom_option_spec kOptions[] = {
//       option_int("num_layers", "6", "encoder layers"),
//       option_enum("norm", "pre", "pre|post", "where layer norm sits"), ...};

constexpr loom_option_spec option(loom_option_type type, const char* key, const char* default_value,
                                  const char* help, const char* choices = nullptr) {
  return loom_option_spec{sizeof(loom_option_spec), static_cast<uint32_t>(type), key,
                          default_value, help, choices};
}
constexpr loom_option_spec option_bool(const char* key, const char* def, const char* help) {
  return option(LOOM_OPTION_BOOL, key, def, help);
}
/// An int or a float option, optionally with its valid range "lo..hi" (inclusive; either side may
/// be empty: "1..", "0..1"). The host checks a value against the range where it reads it (a config
/// file's line, --set) before the component is created (ABI 1.3).
constexpr loom_option_spec option_int(const char* key, const char* def, const char* help,
                                      const char* range = nullptr) {
  return option(LOOM_OPTION_INT, key, def, help, range);
}
constexpr loom_option_spec option_float(const char* key, const char* def, const char* help,
                                        const char* range = nullptr) {
  return option(LOOM_OPTION_FLOAT, key, def, help, range);
}
constexpr loom_option_spec option_string(const char* key, const char* def, const char* help) {
  return option(LOOM_OPTION_STRING, key, def, help);
}
constexpr loom_option_spec option_bytes(const char* key, const char* def, const char* help) {
  return option(LOOM_OPTION_BYTES, key, def, help);
}
constexpr loom_option_spec option_enum(const char* key, const char* def, const char* choices,
                                       const char* help) {
  return option(LOOM_OPTION_ENUM, key, def, help, choices);
}
constexpr loom_option_spec option_list(const char* key, const char* def, const char* help) {
  return option(LOOM_OPTION_LIST, key, def, help);
}

// ---- parsing ---------------------------------------------------------------------------------
// Each returns std::nullopt when the text is not a value of the type.

inline std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

inline std::string to_lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

inline std::optional<bool> parse_bool(std::string_view text) {
  const std::string s = to_lower(trim(text));
  if (s == "true" || s == "yes" || s == "on" || s == "1") return true;
  if (s == "false" || s == "no" || s == "off" || s == "0") return false;
  return std::nullopt;
}

inline std::optional<int64_t> parse_int(std::string_view text) {
  const std::string_view s = trim(text);
  if (s.empty()) return std::nullopt;
  int64_t value = 0;
  const char* begin = s.data();
  if (*begin == '+') ++begin;
  auto [end, ec] = std::from_chars(begin, s.data() + s.size(), value);
  if (ec != std::errc() || end != s.data() + s.size()) return std::nullopt;
  return value;
}

inline std::optional<double> parse_float(std::string_view text) {
  const std::string s(trim(text));
  if (s.empty()) return std::nullopt;
  if (s.find_first_of("xX") != std::string::npos) return std::nullopt;  // strtod's hexadecimal (0x10) is not a setting's number
  char* end = nullptr;
  errno = 0;
  const double value = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size() || !std::isfinite(value)) return std::nullopt;
  // A number too small for a double (1e-400) came back as 0 (errno ERANGE), or as a subnormal
  // (1e-320), whose reciprocal overflows: trainer.clip_grad_norm=1e-400 turned clipping off, and
  // trainer.peak_tflops=1e-320 gave an MFU of inf (probe). Neither is a setting's number.
  if (errno == ERANGE || std::fpclassify(value) == FP_SUBNORMAL) return std::nullopt;
  return value;
}

/// The range of an int or float option, "lo..hi" (either side may be empty: unbounded); nullopt
/// when the text is not such a range or lo > hi.
struct Range {
  std::optional<double> lo, hi;
};
inline std::optional<Range> parse_range(std::string_view text) {
  const auto dots = text.find("..");
  if (dots == std::string_view::npos) return std::nullopt;
  Range r;
  const std::string_view lo = trim(text.substr(0, dots)), hi = trim(text.substr(dots + 2));
  if (!lo.empty() && !(r.lo = parse_float(lo))) return std::nullopt;
  if (!hi.empty() && !(r.hi = parse_float(hi))) return std::nullopt;
  if (r.lo && r.hi && *r.lo > *r.hi) return std::nullopt;
  return r;
}

/// A size in bytes below 8 EiB: "4096", "512MiB", "2GiB", "1.5GB", "64k". Binary (KiB, MiB, GiB,
/// TiB, PiB, EiB, and the single letters K, M, G, T, P, E) and decimal (kB, MB, GB, TB, PB, EB)
/// units; case-insensitive except that "b" alone means bytes.
inline std::optional<int64_t> parse_bytes(std::string_view text) {
  const std::string s(trim(text));
  if (s.empty() || s.find_first_of("xX") != std::string::npos) return std::nullopt;  // no hexadecimal (0x10)
  char* end = nullptr;
  const double number = std::strtod(s.c_str(), &end);
  if (end == s.c_str() || !std::isfinite(number) || number < 0) return std::nullopt;
  const std::string unit = to_lower(trim(std::string_view(end)));
  double scale = 0;
  if (unit.empty() || unit == "b") scale = 1;
  else if (unit == "k" || unit == "kib") scale = 1024.0;
  else if (unit == "m" || unit == "mib") scale = 1024.0 * 1024;
  else if (unit == "g" || unit == "gib") scale = 1024.0 * 1024 * 1024;
  else if (unit == "t" || unit == "tib") scale = 1024.0 * 1024 * 1024 * 1024;
  else if (unit == "p" || unit == "pib") scale = 1024.0 * 1024 * 1024 * 1024 * 1024;
  else if (unit == "e" || unit == "eib") scale = 1024.0 * 1024 * 1024 * 1024 * 1024 * 1024;
  else if (unit == "kb") scale = 1e3;
  else if (unit == "mb") scale = 1e6;
  else if (unit == "gb") scale = 1e9;
  else if (unit == "tb") scale = 1e12;
  else if (unit == "pb") scale = 1e15;
  else if (unit == "eb") scale = 1e18;
  else return std::nullopt;
  const double bytes = number * scale;
  if (bytes >= 9223372036854775808.0) return std::nullopt;  // below 2^63 = 8 EiB (7.9EiB was refused at 9e18)
  return static_cast<int64_t>(std::llround(bytes));
}

/// Splits "a, b ,c" into {"a","b","c"}; empty items are dropped.
inline std::vector<std::string> parse_list(std::string_view text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string_view::npos) comma = text.size();
    const std::string_view item = trim(text.substr(start, comma - start));
    if (!item.empty()) out.emplace_back(item);
    start = comma + 1;
  }
  return out;
}

/// Whether a list has an empty item between, before or after its commas ("a,,b", "a,", ",a"):
/// parse_list drops such items, so a stray comma would change what the list means in silence.
/// A blank list ("") has none.
inline bool list_has_empty_item(std::string_view text) {
  if (trim(text).empty()) return false;
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    if (trim(text.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start)).empty()) return true;
    if (comma == std::string_view::npos) return false;
    start = comma + 1;
  }
}

/// The choices of an enum key, from "a|b|c".
inline std::vector<std::string> enum_choices(const char* choices) {
  std::vector<std::string> out;
  if (choices == nullptr) return out;
  std::string_view s(choices);
  size_t start = 0;
  while (start <= s.size()) {
    size_t bar = s.find('|', start);
    if (bar == std::string_view::npos) bar = s.size();
    const std::string_view item = trim(s.substr(start, bar - start));
    if (!item.empty()) out.emplace_back(item);
    start = bar + 1;
  }
  return out;
}

/// What a value of `type` looks like, for error messages ("expected an integer").
inline const char* describe_type(uint32_t type) {
  switch (type) {
    case LOOM_OPTION_BOOL: return "a boolean (true/false, yes/no, on/off, 1/0)";
    case LOOM_OPTION_INT: return "an integer";
    case LOOM_OPTION_FLOAT: return "a finite number, 0 or of magnitude 2.3e-308 and above";
    case LOOM_OPTION_STRING: return "text";
    case LOOM_OPTION_BYTES: return "a size such as 4096, 512MiB or 2GiB";
    case LOOM_OPTION_ENUM: return "one of the listed choices";
    case LOOM_OPTION_LIST: return "a comma-separated list";
    default: return "a value of an unknown type";
  }
}

inline const char* type_name(uint32_t type) {
  switch (type) {
    case LOOM_OPTION_BOOL: return "bool";
    case LOOM_OPTION_INT: return "int";
    case LOOM_OPTION_FLOAT: return "float";
    case LOOM_OPTION_STRING: return "string";
    case LOOM_OPTION_BYTES: return "bytes";
    case LOOM_OPTION_ENUM: return "enum";
    case LOOM_OPTION_LIST: return "list";
    default: return "?";
  }
}

/// Whether `text` is a valid value for a key of `type` (with `choices` for enums).
inline bool is_valid_value(uint32_t type, std::string_view text, const char* choices = nullptr) {
  switch (type) {
    case LOOM_OPTION_BOOL: return parse_bool(text).has_value();
    case LOOM_OPTION_INT: return parse_int(text).has_value();
    case LOOM_OPTION_FLOAT: return parse_float(text).has_value();
    case LOOM_OPTION_STRING: return true;
    case LOOM_OPTION_BYTES: return parse_bytes(text).has_value();
    case LOOM_OPTION_LIST: return true;
    case LOOM_OPTION_ENUM: {
      const auto c = enum_choices(choices);
      return std::find(c.begin(), c.end(), std::string(trim(text))) != c.end();
    }
    default: return false;
  }
}

// ---- values, as a factory sees them ----------------------------------------------------------

/// The configured values of one component: every key of its schema, validated by the host.
/// Cheap to copy; owns its strings.
class Options {
 public:
  Options() = default;
  explicit Options(const loom_create_args* args) {
    if (args == nullptr) return;
    for (uint32_t i = 0; i < args->value_count; ++i) {
      const loom_option_value& v = args->values[i];
      if (v.key != nullptr) values_[v.key] = v.value != nullptr ? v.value : "";
    }
  }
  explicit Options(std::map<std::string, std::string> values) : values_(std::move(values)) {}

  bool has(const std::string& key) const { return values_.count(key) != 0; }
  const std::string& get_string(const std::string& key) const { return raw(key); }
  bool get_bool(const std::string& key) const { return parsed(key, parse_bool(raw(key)), "bool"); }
  int64_t get_int(const std::string& key) const { return parsed(key, parse_int(raw(key)), "int"); }
  double get_float(const std::string& key) const {
    return parsed(key, parse_float(raw(key)), "float");
  }
  int64_t get_bytes(const std::string& key) const {
    return parsed(key, parse_bytes(raw(key)), "bytes");
  }
  std::vector<std::string> get_list(const std::string& key) const { return parse_list(raw(key)); }
  const std::map<std::string, std::string>& values() const { return values_; }

 private:
  const std::string& raw(const std::string& key) const {
    auto it = values_.find(key);
    if (it == values_.end()) throw Error("option '" + key + "' is not in this component's schema");
    return it->second;
  }
  template <class T>
  T parsed(const std::string& key, const std::optional<T>& v, const char* type) const {
    if (!v) throw Error("option '" + key + "' = '" + raw(key) + "' is not a valid " + type);
    return *v;
  }
  std::map<std::string, std::string> values_;
};

}  // namespace loom::sdk
