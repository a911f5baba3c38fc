// A LoadReport as one line of JSON: how loom-plugin-scanner tells the host what a plugin file
// holds, so that the host registers its components without loading it (plugin_scan.hpp).
#include <loom/core/plugin_registry.hpp>
#include "json_limits.hpp"

#include <nlohmann/json.hpp>

namespace loom::core {

using json = nlohmann::json;

std::string to_json(const LoadReport& report) {
  json j;
  j["file"] = report.file.string();
  j["accepted"] = report.accepted;
  j["plugin"] = report.plugin_name;
  j["version"] = report.plugin_version;
  j["fingerprint"] = report.fingerprint;
  json components = json::array();
  for (const auto& c : report.components) {
    json options = json::array();
    for (const auto& o : c.options)
      options.push_back({{"key", o.key}, {"type", o.type}, {"default", o.default_value}, {"help", o.help},
                         {"choices", o.choices}});
    components.push_back({{"kind", c.kind}, {"name", c.name}, {"summary", c.summary},
                          {"interface", {c.interface_major, c.interface_minor}}, {"flags", c.flags}, {"options", options}});
  }
  j["components"] = components;
  if (report.refusal) {
    json declared = json::array();
    for (const auto& [kind, name] : report.refusal->components) declared.push_back({kind, name});
    j["refusal"] = {{"stage", report.refusal->stage}, {"reason", report.refusal->reason},
                    {"hint", report.refusal->hint}, {"components", declared}};
  }
  // Invalid UTF-8 in a plugin's strings is replaced, not an exception: the line must be written.
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::optional<LoadReport> load_report_from_json(const std::string& text) {
  // Everything is checked: the line comes from another process, and a cache file on disk. Any
  // surprise means "no report", and the host then loads the file itself.
  try {
    const json j = detail::parse_json<json>(text);
    LoadReport r;
    r.file = j.at("file").get<std::string>();
    r.accepted = j.at("accepted").get<bool>();
    r.plugin_name = j.at("plugin").get<std::string>();
    r.plugin_version = j.at("version").get<std::string>();
    r.fingerprint = j.at("fingerprint").get<std::map<std::string, std::string>>();
    for (const json& c : j.at("components")) {
      ComponentInfo info;
      info.kind = c.at("kind").get<uint32_t>();
      info.name = c.at("name").get<std::string>();
      info.summary = c.at("summary").get<std::string>();
      const json& version = c.at("interface");
      info.interface_major = version.at(0).get<uint32_t>();
      info.interface_minor = version.at(1).get<uint32_t>();
      info.flags = c.at("flags").get<uint32_t>();
      for (const json& o : c.at("options")) {
        OptionSpec spec{o.at("key").get<std::string>(), o.at("type").get<uint32_t>(), o.at("default").get<std::string>(),
                        o.at("help").get<std::string>(), o.at("choices").get<std::string>(), std::nullopt, std::nullopt};
        if (!set_range_from_choices(spec)) return std::nullopt;
        info.options.push_back(std::move(spec));
      }
      r.components.push_back(std::move(info));
    }
    if (j.contains("refusal")) {
      const json& f = j.at("refusal");
      PluginRefusal refusal{r.file, f.at("stage").get<std::string>(), f.at("reason").get<std::string>(),
                            f.at("hint").get<std::string>(), {}};
      for (const json& d : f.at("components"))
        refusal.components.emplace_back(d.at(0).get<uint32_t>(), d.at(1).get<std::string>());
      r.refusal = std::move(refusal);
    }
    if (r.accepted == r.refusal.has_value()) return std::nullopt;  // accepted xor refused
    return r;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

}  // namespace loom::core
