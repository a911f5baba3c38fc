// `loom config show`: the merged configuration, validated, with each value's origin.
#include "cli.hpp"

#include <loom/core/error.hpp>
#include <loom/core/trainer.hpp>

#include <iostream>

namespace loom::cli {

int cmd_config(const Invocation& invocation) {
  if (invocation.args.size() != 1 || invocation.args[0] != "show") {
    const auto& args = invocation.args;
    const std::string refused = args.empty() ? "" : args[0] != "show" ? args[0] : args[1];
    throw Error("usage: loom config show [-c FILE] [--set section.key=value] ..." + switch_value_hint(invocation, refused));
  }
  core::PluginRegistry registry;
  scan_plugins(registry, invocation.options);
  const core::Config config = config_from(invocation.options);
  const core::Resolved resolved = core::resolve_run(config, registry);
  core::Config resolved_config;
  for (const auto& [key, value] : resolved) resolved_config.set(key, value.value, value.origin);
  const core::Schema schema = core::run_schema(resolved_config, registry);
  std::cout << core::format_resolved(resolved, schema);
  return 0;
}

}  // namespace loom::cli
