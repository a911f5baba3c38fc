// `loom config show`: the merged configuration, validated, with each value's origin.
// `loom config keys`: every key that configuration accepts, with its default, its range or
// choices and what it does (the docs probe found the core's keys explained nowhere a user looks:
// only a range error quoted a key's help).
#include "cli.hpp"

#include <loom/core/error.hpp>
#include <loom/core/log.hpp>
#include <loom/core/trainer.hpp>

#include <iostream>
#include <map>
#include <sstream>

namespace loom::cli {

namespace {

/// Every key of `schema` by section ([memory] before [memory.auto_batch]), as a file would set it
/// to its value in `resolved`, with what it does after the # (and its default where that differs).
std::string format_keys(const core::Schema& schema, const core::Resolved& resolved) {
  std::map<std::string, std::vector<const core::KeySpec*>> by_section;
  const auto value = [&](const core::KeySpec& spec) {
    const auto it = resolved.find(spec.key);
    return it != resolved.end() ? it->second.value : spec.option.default_value;
  };
  size_t width = 0;  // (the # aligned, past short lines only: a long list value is not the measure)
  for (const auto& [key, spec] : schema.keys()) {
    by_section[key.substr(0, key.rfind('.'))].push_back(&spec);
    width = std::max(width, std::min<size_t>(40, key.size() - key.rfind('.') + 2 + value(spec).size()));
  }
  std::ostringstream out;
  for (const auto& [section, specs] : by_section) {
    out << (out.tellp() > 0 ? "\n[" : "[") << section << "]";
    if (specs.front()->owner.find('\'') != std::string::npos) out << "  # " << specs.front()->owner;
    out << "\n";
    for (const core::KeySpec* spec : specs) {
      const core::OptionSpec& o = spec->option;
      const std::string line = spec->key.substr(section.size() + 1) + " = " + value(*spec);
      std::string what = o.help;
      if (!o.choices.empty()) what.append(" (").append(o.choices).append(")");
      else if (o.min || o.max) what.append(" ").append(core::range_text(o));
      if (value(*spec) != o.default_value) what.append("; default ").append(o.default_value.empty() ? "empty" : o.default_value);
      out << line << std::string(width + 2 - std::min(width + 1, line.size()), ' ') << "# " << what << "\n";
    }
  }
  return out.str();
}

}  // namespace

int cmd_config(const Invocation& invocation) {
  // `loom config` alone shows, as `loom config show`.
  const auto& args = invocation.args;
  const bool named = !args.empty() && (args[0] == "show" || args[0] == "keys");
  if (args.size() > (named ? 1u : 0u)) {
    const std::string refused = named ? args[1] : args[0];
    throw Error((named ? "loom config " + args[0] + " takes no argument, and '" + refused + "' is one"
                       : "loom config: '" + refused + "' is no subcommand (show or keys)") +
                "; usage: loom config [show|keys] [-c FILE] [--set section.key=value] ..." + switch_value_hint(invocation, refused));
  }
  core::PluginRegistry registry;
  scan_plugins(registry, invocation.options);
  const core::Config config = core::with_run_settings(config_from(invocation.options), registry);  // (as train: --resume auto)
  // (keys: what a user reads to find what a component still needs, data.root unset, so its
  // components' own checks come after the list, said, not instead of it)
  const bool keys = named && args[0] == "keys";
  const core::Resolved resolved = core::resolve_run(config, registry, /*components=*/!keys);
  core::Config resolved_config;
  for (const auto& [key, value] : resolved) resolved_config.set(key, value.value, value.origin);
  const core::Schema schema = core::run_schema(resolved_config, registry);
  if (keys) {
    std::cout << "# The keys of this configuration's run, the core's and those of the components it selects, at\n"
                 "# its values (loom config show says where each comes from), with what each does. Another\n"
                 "# component's: loom plugins inspect NAME.\n\n"
              << format_keys(schema, resolved) << std::flush;
    try {
      core::check_components(resolved, registry);
    } catch (const Error& e) {
      core::log::error("this configuration does not run as it is (its keys are above): ", e.what());
      return 1;
    }
    return 0;
  }
  std::cout << core::format_resolved(resolved, schema);
  return 0;
}

}  // namespace loom::cli
