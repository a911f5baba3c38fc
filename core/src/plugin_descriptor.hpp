#pragma once
// Stage 4 of plugin loading, the descriptor (plugin_registry.cpp), apart from the loader so that
// the fuzz target fuzz/descriptor_fuzz.cpp reads descriptors the way the loader does.

#include <loom/core/plugin_registry.hpp>
#include <loom/sdk/abi.h>

#include <loom/sdk/options.hpp>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace loom::core {

/// Thrown by a loading stage to refuse a plugin file: the stage, what is wrong, what to do.
struct PluginRefused {
  std::string stage, reason, hint;
};

/// Checks every field of the descriptor a plugin's entry point returned (magic, sizes, ABI
/// version, names, components, option tables, defaults) and fills report's plugin name, version,
/// fingerprint fields and components. Throws PluginRefused (stage "descriptor") for anything a
/// loader must not trust; reads no string beyond its bound and no table beyond its count.
void read_descriptor(const loom_plugin_descriptor* d, LoadReport& report);

/// A bound of an int option's range ("lo..hi", either absent) that a 64-bit integer can be: one past it,
/// "0..1e30", bounds nothing a value can be. 2^63 is allowed: it is the double "9223372036854775807" reads as.
inline bool within_int64(const std::optional<double>& bound) {
  return !bound || (*bound >= -9223372036854775808.0 && *bound <= 9223372036854775808.0);
}

/// Whether the integer `value` is outside an int option's range, compared as integers: through a
/// double, 2^53 + 1 passed a range ending at 2^53 (probe). The bounds as written ("lo..hi", a
/// plugin's) where there is such a text, else `min` and `max` (the core's keys).
inline bool int_outside_range(const std::string& choices, const std::optional<double>& min,
                              const std::optional<double>& max, int64_t value) {
  const auto past = [&](std::string_view text, std::optional<double> d, bool low) {
    if (const auto exact = sdk::parse_int(sdk::trim(text))) return low ? value < *exact : value > *exact;
    if (!d) return false;
    const double edge = low ? std::ceil(*d) : std::floor(*d);  // (exactly: an integer below 2^63 is a double's)
    if (edge >= 9223372036854775808.0) return low;
    if (edge < -9223372036854775808.0) return !low;
    return low ? value < static_cast<int64_t>(edge) : value > static_cast<int64_t>(edge);
  };
  const std::string_view text(choices);
  const auto dots = text.find("..");
  const std::string_view lo = dots == std::string_view::npos ? "" : text.substr(0, dots),
                         hi = dots == std::string_view::npos ? "" : text.substr(dots + 2);
  return past(lo, min, true) || past(hi, max, false);
}

}  // namespace loom::core
