// The command table and the helpers commands share.
#include "cli.hpp"

#include <loom/core/config.hpp>

namespace loom::cli {

const std::vector<Command>& commands() {
  static const std::vector<Command> table = {
      {"plugins", "list the loaded components and the refused plugin files",
       "loom plugins [inspect FILE]", false, nullptr, cmd_plugins},
      {"config", "show the merged run configuration and where each value comes from",
       "loom config show [-c FILE] [--set section.key=value] ...", true, nullptr, cmd_config},
  };
  return table;
}

core::Config config_from(const po::variables_map& options) {
  core::Config config;
  if (options.count("config"))
    for (const auto& file : options["config"].as<std::vector<std::string>>()) config.load_file(file);
  for (const auto& alias : core::aliases()) {
    if (!options.count(alias.flag)) continue;
    const std::string value =
        alias.switch_to != nullptr ? alias.switch_to : options[alias.flag].as<std::string>();
    config.set(alias.key, value, core::Origin{std::string("--") + alias.flag, {}, 0});
  }
  if (options.count("set"))
    for (const auto& assignment : options["set"].as<std::vector<std::string>>())
      config.set_assignment(assignment);
  return config;
}

void scan_plugins(core::PluginRegistry& registry, const po::variables_map& options, bool log_refusals) {
  std::vector<std::filesystem::path> extra;
  if (options.count("plugin-dir"))
    for (const auto& dir : options["plugin-dir"].as<std::vector<std::string>>()) extra.emplace_back(dir);
  registry.set_log_refusals(log_refusals);
  registry.scan(core::PluginRegistry::search_path(extra));
}

}  // namespace loom::cli
