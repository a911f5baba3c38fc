#pragma once
// Stage 4 of plugin loading, the descriptor (plugin_registry.cpp), apart from the loader so that
// the fuzz target fuzz/descriptor_fuzz.cpp reads descriptors the way the loader does.

#include <loom/core/plugin_registry.hpp>
#include <loom/sdk/abi.h>

#include <optional>
#include <string>

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

}  // namespace loom::core
