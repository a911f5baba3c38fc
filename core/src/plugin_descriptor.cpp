// Stage 4 of plugin loading: the descriptor a plugin's entry point returned, read as untrusted
// memory (plugin_descriptor.hpp). Apart from the loader for the fuzz target, which reads
// descriptors the way the loader does.
#include "plugin_descriptor.hpp"
#include "plugin_fingerprint.hpp"

#include <loom/core/kinds.hpp>
#include <loom/core/text.hpp>
#include <loom/sdk/options.hpp>

#include <algorithm>
#include <cstring>
#include <optional>
#include <set>
#include <sstream>

namespace loom::core {

namespace {

/// A string from a plugin's memory: non-null, NUL-terminated within `max` bytes.
std::optional<std::string> bounded(const char* s, size_t max) {
  if (s == nullptr) return std::nullopt;
  const size_t n = ::strnlen(s, max + 1);
  if (n > max) return std::nullopt;
  return std::string(s, n);
}

bool is_identifier(const std::string& s) {
  if (s.empty() || !(s[0] >= 'a' && s[0] <= 'z')) return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
  });
}

/// No control characters: no line breaks, no terminal escapes (C0, DEL, and C1 in UTF-8).
bool is_printable(const std::string& s) {
  for (size_t i = 0; i < s.size(); ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7f) return false;
    if (c == 0xc2 && i + 1 < s.size() && static_cast<unsigned char>(s[i + 1]) >= 0x80 &&
        static_cast<unsigned char>(s[i + 1]) <= 0x9f)
      return false;
  }
  return true;
}

std::string printable(const char* s, size_t max) { return s == nullptr ? std::string() : core::printable(std::string_view(s, ::strnlen(s, max)), max); }

/// Both bounds of a range "lo..hi" (either may be absent) are 64-bit integers' values.
bool range_within_int64(const std::string& range) {
  const auto r = sdk::parse_range(range);
  return r && within_int64(r->lo) && within_int64(r->hi);
}

/// A summary or help: a longer one was cut where it stood, though abi.h says it is refused.
std::string text_of(const char* s, const std::string& what) {
  if (s != nullptr && ::strnlen(s, LOOM_MAX_TEXT + 1) > LOOM_MAX_TEXT)
    throw PluginRefused{"descriptor", what + " is longer than " + std::to_string(LOOM_MAX_TEXT) + " bytes (LOOM_MAX_TEXT)",
                        "shorten it to one line in the plugin's source and rebuild the plugin"};
  return printable(s, LOOM_MAX_TEXT);
}

[[noreturn]] void refuse_now(std::string stage, std::string reason, std::string hint = {}) {
  throw PluginRefused{std::move(stage), std::move(reason), std::move(hint)};
}

// An option table Loom refuses is the plugin's source to fix: rebuilding it as it is does not help.
constexpr const char* kOptionsHint = "fix the component's option table in the plugin's source (its key, type, choices, "
                                     "range and default) and rebuild it";

}  // namespace

void read_descriptor(const loom_plugin_descriptor* d, LoadReport& report) {
  if (d == nullptr) refuse_now("descriptor", "the entry point returned no descriptor", kRebuildHint);
  if (d->magic != LOOM_ABI_MAGIC) {
    std::ostringstream m;
    m << "bad magic 0x" << std::hex << d->magic << " (expected 0x" << LOOM_ABI_MAGIC << ")";
    refuse_now("descriptor", m.str(), "the descriptor is not a Loom descriptor; " + std::string(kRebuildHint));
  }
  if (d->abi_major != LOOM_ABI_MAJOR)
    refuse_now("descriptor",
               "plugin ABI " + std::to_string(d->abi_major) + "." + std::to_string(d->abi_minor) +
                   ", host ABI " + std::to_string(LOOM_ABI_MAJOR) + "." + std::to_string(LOOM_ABI_MINOR) +
                   ": the major versions differ",
               d->abi_major > LOOM_ABI_MAJOR ? "the plugin needs a newer Loom: upgrade Loom, or "
                                               "rebuild the plugin against this Loom's SDK"
                                             : kRebuildHint);
  if (d->abi_minor > LOOM_ABI_MINOR)
    refuse_now("descriptor",
               "plugin ABI " + std::to_string(d->abi_major) + "." + std::to_string(d->abi_minor) +
                   " is newer than the host's " + std::to_string(LOOM_ABI_MAJOR) + "." +
                   std::to_string(LOOM_ABI_MINOR),
               "upgrade Loom, or rebuild the plugin against this Loom's SDK");
  // The first four fields are in every minor; the rest is as large as the plugin's minor says.
  const uint32_t minor = d->abi_minor;
  if (d->struct_size < LOOM_MIN_SIZE(loom_plugin_descriptor, minor))
    refuse_now("descriptor",
               "descriptor struct_size " + std::to_string(d->struct_size) + " is smaller than " +
                   std::to_string(LOOM_MIN_SIZE(loom_plugin_descriptor, minor)) + ", its size in ABI " +
                   std::to_string(LOOM_ABI_MAJOR) + "." + std::to_string(minor),
               kRebuildHint);
  const auto name = bounded(d->name, LOOM_MAX_NAME);
  if (!name || !is_identifier(*name))
    refuse_now("descriptor", "the plugin name is missing, too long or not lower_snake_case", kRebuildHint);
  report.plugin_name = *name;
  const auto version = bounded(d->version, LOOM_MAX_NAME);
  if (!version) refuse_now("descriptor", "the plugin version is missing or too long", kRebuildHint);
  if (!is_printable(*version))  // (printed by `loom plugins`: a carriage return or an escape forged its lines)
    refuse_now("descriptor", "the plugin version has control characters", "give the plugin a printable version, e.g. 1.2.0");
  report.plugin_version = *version;
  // Since ABI 1.4 the fingerprint note decides (plugin_fingerprint.hpp); before, the descriptor's.
  if (minor < 4 && d->fingerprint != nullptr && d->fingerprint->struct_size >= LOOM_MIN_SIZE(loom_build_fingerprint, minor))
    report.fingerprint = legacy_fingerprint_fields(*d->fingerprint);
  if (d->component_count == 0 || d->component_count > LOOM_MAX_COMPONENTS || d->components == nullptr)
    refuse_now("descriptor",
               d->components == nullptr && d->component_count != 0
                   ? "component table missing (a null pointer for " + std::to_string(d->component_count) + " entries)"
                   : "component table of " + std::to_string(d->component_count) + " entries (expected 1 to " +
                         std::to_string(LOOM_MAX_COMPONENTS) + ")",
               kRebuildHint);
  std::set<std::pair<uint32_t, std::string>> own;
  for (uint32_t i = 0; i < d->component_count; ++i) {
    const loom_component& c = d->components[i];
    const std::string where = "component #" + std::to_string(i);
    if (c.struct_size < LOOM_MIN_SIZE(loom_component, minor))
      refuse_now("descriptor", where + ": struct_size " + std::to_string(c.struct_size) + " is smaller than " +
                                   std::to_string(LOOM_MIN_SIZE(loom_component, minor)) + ", its size in ABI 1." +
                                   std::to_string(minor), kRebuildHint);
    const auto cname = bounded(c.name, LOOM_MAX_NAME);
    // (each reason apart, with the fix for it: a name is the source's to change, not a rebuild's)
    if (c.name == nullptr) refuse_now("descriptor", where + ": no name (a null pointer)", "give it a name in the plugin's source, and rebuild it");
    if (!cname || !is_identifier(*cname))
      refuse_now("descriptor",
                 where + (!cname ? ": its name is longer than " + std::to_string(LOOM_MAX_NAME) + " bytes"
                                 : ": name '" + printable(*cname, 64) + "' is not lower_snake_case"),
                 "name it with a-z, 0-9 and '_', starting with a letter, in the plugin's source, and rebuild it");
    if (!find_kind(c.kind))
      refuse_now("descriptor", "component '" + *cname + "': unknown kind " + std::to_string(c.kind), kRebuildHint);
    if (!own.insert({c.kind, *cname}).second)
      refuse_now("descriptor", kind_name(c.kind) + " '" + *cname + "' is listed twice in the plugin",
                 "give each component of a plugin its own name");
    if (c.create == nullptr || c.destroy == nullptr)
      refuse_now("descriptor", kind_name(c.kind) + " '" + *cname + "' has no create or destroy function", kRebuildHint);
    ComponentInfo info;
    info.kind = c.kind;
    info.name = *cname;
    info.summary = text_of(c.summary, kind_name(c.kind) + " '" + *cname + "': its summary");
    info.interface_major = c.interface_major;
    info.interface_minor = c.interface_minor;
    info.raw = &c;
    info.flags = minor >= 4 ? c.flags : 0;  // reserved0, always 0, before ABI 1.4
    if ((info.flags & ~LOOM_COMPONENT_C_TIER) != 0)
      refuse_now("descriptor", kind_name(c.kind) + " '" + *cname + "': unknown flags " + std::to_string(info.flags),
                 "upgrade Loom, or " + std::string(kRebuildHint));
    if (c.option_count > LOOM_MAX_OPTIONS || (c.option_count > 0 && c.options == nullptr))
      refuse_now("descriptor",
                 kind_name(c.kind) + " '" + *cname + "': " +
                     (c.option_count > LOOM_MAX_OPTIONS
                          ? std::to_string(c.option_count) + " options, more than " + std::to_string(LOOM_MAX_OPTIONS)
                          : "its options table is a null pointer for " + std::to_string(c.option_count) + " options"),
                 c.option_count > LOOM_MAX_OPTIONS ? kOptionsHint : kRebuildHint);
    std::set<std::string> keys;
    for (uint32_t k = 0; k < c.option_count; ++k) {
      const loom_option_spec& o = c.options[k];
      OptionSpec spec;
      const auto key = bounded(o.key, LOOM_MAX_NAME);
      const std::string owhere = kind_name(c.kind) + " '" + *cname + "' option #" + std::to_string(k);
      if (o.struct_size < LOOM_MIN_SIZE(loom_option_spec, minor))
        refuse_now("descriptor", owhere + ": struct_size " + std::to_string(o.struct_size) + " is smaller than " +
                                     std::to_string(LOOM_MIN_SIZE(loom_option_spec, minor)) + ", its size in ABI 1." +
                                     std::to_string(minor), kRebuildHint);
      if (!key || !is_identifier(*key))
        refuse_now("descriptor",
                   owhere + (o.key == nullptr ? ": no key (a null pointer)"
                             : !key           ? ": its key is longer than " + std::to_string(LOOM_MAX_NAME) + " bytes"
                                              : ": key '" + printable(*key, 64) + "' is not lower_snake_case"),
                   kOptionsHint);
      if (!keys.insert(*key).second)
        refuse_now("descriptor", owhere + ": key '" + *key + "' appears twice", kOptionsHint);
      if (o.type < LOOM_OPTION_BOOL || o.type > LOOM_OPTION_LIST)
        refuse_now("descriptor", owhere + " '" + *key + "': unknown type " + std::to_string(o.type), kRebuildHint);
      spec.key = *key;
      spec.type = o.type;
      // A default past the bound was read as none: a run used '' in its place, said nowhere.
      const auto default_value = bounded(o.default_value, LOOM_MAX_TEXT);
      if (o.default_value != nullptr && !default_value)
        refuse_now("descriptor", owhere + " '" + *key + "': its default is longer than " + std::to_string(LOOM_MAX_TEXT) +
                                     " bytes (LOOM_MAX_TEXT)", kOptionsHint);
      spec.default_value = default_value.value_or("");
      if (!is_printable(spec.default_value) || (o.choices != nullptr && !is_printable(bounded(o.choices, LOOM_MAX_TEXT).value_or(""))))
        refuse_now("descriptor", owhere + " '" + *key + "': its default or choices hold control characters", kOptionsHint);
      spec.help = text_of(o.help, owhere + " '" + *key + "': its help");
      if (o.type == LOOM_OPTION_ENUM) {
        const auto choices = bounded(o.choices, LOOM_MAX_TEXT);
        if (!choices || sdk::enum_choices(choices->c_str()).empty())
          refuse_now("descriptor", owhere + " '" + *key + "': an enum without choices", kOptionsHint);
        // Each choice once: `a|a||b` is a|b (a wrong value was told "expected one of a, a, b").
        std::vector<std::string> unique;
        for (const auto& choice : sdk::enum_choices(choices->c_str()))
          if (std::find(unique.begin(), unique.end(), choice) == unique.end()) unique.push_back(choice);
        spec.choices = join(unique, "|");
      }
      // A range in `choices` is ABI 1.3's; an older plugin's choices of a number are not read.
      if ((o.type == LOOM_OPTION_INT || o.type == LOOM_OPTION_FLOAT) && o.choices != nullptr && d->abi_minor >= 3) {
        const auto range = bounded(o.choices, LOOM_MAX_TEXT);
        spec.choices = range.value_or("");
        if (!range || !set_range_from_choices(spec))
          refuse_now("descriptor", owhere + " '" + *key + "': range '" + spec.choices + "' is not 'lo..hi'" +
                                       (!sdk::parse_range(spec.choices) ? ""
                                        : o.type == LOOM_OPTION_INT && !range_within_int64(spec.choices) ? " within the 64-bit integers"
                                                                                                        : " with a whole number within"),
                     kOptionsHint);
      }
      // A list default with a stray comma, ",,a b,", is its items, "a b" (`loom config show` wrote it as
      // it was, which a configuration file may not say: a file made from the output was refused).
      if (spec.type == LOOM_OPTION_LIST && sdk::list_has_empty_item(spec.default_value))
        spec.default_value = join(sdk::parse_list(spec.default_value), ", ");
      if (!spec.default_value.empty() &&
          !sdk::is_valid_value(spec.type, spec.default_value, spec.choices.c_str()))
        refuse_now("descriptor",
                   owhere + " '" + *key + "': default '" + spec.default_value + "' is not " +
                       sdk::describe_type(spec.type),
                   kOptionsHint);
      if (!spec.default_value.empty() && spec.min.has_value() + spec.max.has_value() > 0) {
        const auto v = sdk::parse_float(spec.default_value);
        const auto i = o.type == LOOM_OPTION_INT ? sdk::parse_int(spec.default_value) : std::nullopt;
        if (i ? int_outside_range(spec.choices, spec.min, spec.max, *i) : v && ((spec.min && *v < *spec.min) || (spec.max && *v > *spec.max)))
        refuse_now("descriptor", owhere + " '" + *key + "': default " + spec.default_value + " is outside its range " +
                                     spec.choices, kOptionsHint);
      }
      info.options.push_back(std::move(spec));
    }
    report.components.push_back(std::move(info));
  }
}

}  // namespace loom::core
