// `loom config show`: the merged configuration, validated, with each value's origin.
#include "cli.hpp"

#include <loom/core/error.hpp>
#include <loom/core/trainer.hpp>

#include <iostream>

namespace loom::cli {

int cmd_config(const Invocation& invocation) {
  // `loom config` alone shows, as `loom config show` (show is its one subcommand).
  const auto& args = invocation.args;
  if (args.size() > (args.empty() || args[0] != "show" ? 0u : 1u)) {
    const std::string refused = args[0] != "show" ? args[0] : args[1];
    throw Error((args[0] != "show" ? "loom config: '" + refused + "' is no subcommand (show is the one there is)"
                                   : "loom config show takes no argument, and '" + refused + "' is one") +
                "; usage: loom config [show] [-c FILE] [--set section.key=value] ..." + switch_value_hint(invocation, refused));
  }
  core::PluginRegistry registry;
  scan_plugins(registry, invocation.options);
  const core::Config config = core::with_run_settings(config_from(invocation.options), registry);  // (as train: --resume auto)
  const core::Resolved resolved = core::resolve_run(config, registry);
  core::Config resolved_config;
  for (const auto& [key, value] : resolved) resolved_config.set(key, value.value, value.origin);
  const core::Schema schema = core::run_schema(resolved_config, registry);
  std::cout << core::format_resolved(resolved, schema);
  return 0;
}

}  // namespace loom::cli
