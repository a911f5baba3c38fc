// `loom config show`: the merged configuration, validated, with each value's origin.
#include "cli.hpp"

#include <loom/core/error.hpp>

#include <iostream>

namespace loom::cli {

int cmd_config(const Invocation& invocation) {
  if (invocation.args.size() != 1 || invocation.args[0] != "show")
    throw Error("usage: loom config show [-c FILE] [--set section.key=value] ...");
  core::PluginRegistry registry;
  scan_plugins(registry, invocation.options);
  const core::Config config = config_from(invocation.options);
  const core::Schema schema = core::run_schema(config, registry);
  const core::Resolved resolved = core::validate(config, schema);
  std::cout << core::format_resolved(resolved, schema);
  return 0;
}

}  // namespace loom::cli
