// The plugin registry: finds plugin files, checks and loads them (Boost.DLL), and creates
// components from them.
//
// Per file: static check (ELF, entry symbol, and the fingerprint note read with libelf and
// compared, all without running any of its code) -> scan (all of the next stages in
// loom-plugin-scanner, a child process, which reports what the file holds) -> load (RTLD_NOW |
// RTLD_LOCAL) -> descriptor validation -> fingerprint of a pre-1.4 plugin -> interface versions
// -> init -> register. With the scanner, the file is registered from its report and the in-process stages
// run when one of its components is first created: a run loads only the plugins it selects.
// Without it (LOOM_PLUGIN_SCANNER=off), every stage runs in-process at scan time.
// A file that fails a stage is refused with one log line (file, stage, reason, hint) and the
// others still load; nothing a plugin does at load time aborts the host (short of a crash in
// its own static constructors, which no in-process loader can stop). Libraries are never
// unloaded: every component object keeps its library alive, and the registry keeps every
// library until the process ends.
#pragma once

#include <loom/core/error.hpp>
#include <loom/core/kinds.hpp>
#include <loom/sdk/abi.h>

#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace loom::core {

/// What create() throws where a plugin's factory broke the ABI's contract (a C-tier table that is
/// missing, too short or without a function it must have; a factory that threw across the C
/// boundary): a defect of the plugin whatever options it is given, not a refusal of its options.
class ContractBroken : public Error {
 public:
  using Error::Error;
};

/// A host-side copy of one loom_option_spec.
struct OptionSpec {
  std::string key;
  uint32_t type = LOOM_OPTION_STRING;
  std::string default_value;
  std::string help;
  std::string choices;  ///< enums: "a|b|c"
  /// int and float: the valid range, inclusive (the core's keys; a plugin's options get theirs
  /// when the ABI's option table can grow, and check them in their constructors until then).
  std::optional<double> min, max;
  /// No default: a run must give it. A string's or a list's empty default is the empty value.
  bool required() const {
    return default_value.empty() && type != LOOM_OPTION_STRING && type != LOOM_OPTION_LIST;
  }
};

/// A loaded, accepted plugin library.
struct LoadedPlugin {
  std::filesystem::path file;
  std::string name;
  std::string version;
  std::string sdk_version;
  std::shared_ptr<void> library;  ///< the boost::dll::shared_library; never released early
  /// Null until the file is loaded in-process: a file the scanner read is registered from its
  /// report and loaded when one of its components is first created.
  bool loaded() const { return library != nullptr; }
};

/// One component of an accepted plugin.
struct ComponentInfo {
  uint32_t kind = 0;
  std::string name;
  std::string summary;
  uint32_t interface_major = 0;
  uint32_t interface_minor = 0;
  uint32_t flags = 0;  ///< LOOM_COMPONENT_* (ABI 1.4)
  std::vector<OptionSpec> options;
  std::shared_ptr<LoadedPlugin> plugin;
  const loom_component* raw = nullptr;  ///< in the plugin's memory, valid while it is loaded
  /// A C-tier component (c_plugin.h): its factory makes a C table, which the host wraps.
  bool c_tier() const { return (flags & LOOM_COMPONENT_C_TIER) != 0; }
};

/// This host's own build fingerprint, as a plugin's note says its own (plugin_fingerprint.cpp):
/// LibTorch's version, commit and CUDA version, the standard library, sanitizers, the layout of
/// the SDK's value types, and the compiler.
const std::map<std::string, std::string>& host_fingerprint();

/// The host's Tier-1 adapter around the C table `object` that C-tier component `info` created
/// (c_tier.cpp): a pointer to the kind's interface (sdk::Dataset*, sdk::MemoryPolicy*,
/// sdk::Callback*), type-erased; destroying it hands the table back to the plugin's destroy.
std::shared_ptr<void> adapt_c_tier(const ComponentInfo& info, void* object);

/// An object a plugin made, with the version of the interface it was built against: the host
/// calls a method added in interface minor k only when `implements(k)`.
template <class Interface>
struct Created : std::shared_ptr<Interface> {
  Created() = default;
  Created(std::shared_ptr<Interface> object, uint32_t major, uint32_t minor)
      : std::shared_ptr<Interface>(std::move(object)), interface_major(major), interface_minor(minor) {}
  uint32_t interface_major = 0;
  uint32_t interface_minor = 0;
  bool implements(uint32_t minor) const { return interface_minor >= minor; }
};

/// Why a file was not accepted.
struct PluginRefusal {
  std::filesystem::path file;
  std::string stage;   ///< static-check, scan, load, descriptor, fingerprint, interface, init, register
  std::string reason;
  std::string hint;
  std::vector<std::pair<uint32_t, std::string>> components;  ///< (kind, name) it declared, if read
  std::string line() const;  ///< the one log line
};

/// What loading one file found: its descriptor's contents as far as they could be read, and
/// the refusal, if any. Used by `loom plugins inspect`.
struct LoadReport {
  std::filesystem::path file;
  bool accepted = false;
  std::optional<PluginRefusal> refusal;
  std::string plugin_name;
  std::string plugin_version;
  std::map<std::string, std::string> fingerprint;  ///< field -> value, when read
  std::vector<ComponentInfo> components;           ///< when the descriptor was read
};

/// An int or float option's range from its `choices` text ("lo..hi", ABI 1.3) into min and max;
/// false when the text is not a range. Other types and an empty text: true, nothing set.
bool set_range_from_choices(OptionSpec& spec);

/// The report as one line of JSON, and back (nullopt for anything that is not such a line): how
/// loom-plugin-scanner tells the host what a file holds (load_report_json.cpp).
std::string to_json(const LoadReport& report);
std::optional<LoadReport> load_report_from_json(const std::string& text);

class PluginRegistry {
 public:
  PluginRegistry() = default;
  PluginRegistry(const PluginRegistry&) = delete;
  PluginRegistry& operator=(const PluginRegistry&) = delete;

  /// The folders searched, in order, the one the user named for this command first: `extra`
  /// (from --plugin-dir), each folder of LOOM_PLUGIN_PATH (':'-separated), then the plugin
  /// folder beside the executable (<exe>/../lib/loom/plugins: the build tree and the install
  /// prefix have the same layout). Never the current directory unless named.
  static std::vector<std::filesystem::path> search_path(
      const std::vector<std::filesystem::path>& extra = {});

  /// Loads every *.so in each folder (a file named directly is loaded too), in name order. A
  /// folder that does not exist is skipped (and logged at debug level). A file whose every
  /// component a file of an earlier folder provides is passed over (passed_over()): a new build
  /// in --plugin-dir is used before the installed copy of the same plugin.
  void scan(const std::vector<std::filesystem::path>& folders);

  /// Loads one file through all stages. Returns what it found; a refusal is also logged once
  /// and kept in refusals(). Loading the same file twice is a no-op that reports it accepted.
  LoadReport load(const std::filesystem::path& file);

  /// Whether refusals are logged as warnings when they happen (default) or only kept.
  void set_log_refusals(bool on) { log_refusals_ = on; }

  /// Whether each file is first loaded by loom-plugin-scanner in a child process (default on;
  /// the scanner itself turns it off). See core/src/plugin_scan.hpp.
  void set_isolation(bool on) { isolation_ = on; }

  const std::vector<ComponentInfo>& components() const { return components_; }
  const std::vector<PluginRefusal>& refusals() const { return refusals_; }
  /// Files scan() passed over, stage "shadowed": each component they declare comes from a file
  /// found earlier in the search order (the reason names it). Not refusals: nothing is broken.
  const std::vector<PluginRefusal>& passed_over() const { return passed_over_; }
  const std::vector<std::shared_ptr<LoadedPlugin>>& plugins() const { return plugins_; }

  /// The component (kind, name), or nullptr.
  const ComponentInfo* find(uint32_t kind, std::string_view name) const;

  /// The component (kind, name); throws loom::Error saying why it is not there: refused (with
  /// the refusal), or not found (with the available names of that kind and the folders).
  const ComponentInfo& require(uint32_t kind, std::string_view name) const;

  /// Creates a component through its plugin's factory with `values` (key -> text, every key of
  /// the schema; keys missing here get their defaults). The returned object keeps its plugin
  /// loaded and is destroyed through the plugin. Throws loom::Error when the factory fails.
  /// Creates and destroys a component with `values`: its factory's own checks of its options
  /// (`loom config show` validates what `loom train` would). Throws loom::Error like create().
  void check_options(const ComponentInfo& info, const std::map<std::string, std::string>& values) const;

  template <class Interface>
  Created<Interface> create(std::string_view name, const std::map<std::string, std::string>& values = {}) const {
    const ComponentInfo& info = require(Interface::kKind, name);
    if (info.c_tier()) {
      // A C-tier component: the host's adapter implements the interface (c_tier.hpp); the version
      // the host reports for it is the Tier-1 one the adapter implements.
      return {std::static_pointer_cast<Interface>(adapt_c_tier(info, create_raw(info, values))),
              Interface::kInterfaceMajor, Interface::kInterfaceMinor};
    }
    check_interface(info, Interface::kInterfaceMajor);
    void* object = create_raw(info, values);
    auto plugin = info.plugin;
    auto destroy = info.raw->destroy;
    return {std::shared_ptr<Interface>(static_cast<Interface*>(object), [plugin, destroy](Interface* p) { destroy(p); }),
            info.interface_major, info.interface_minor};
  }

 private:
  void* create_raw(const ComponentInfo& info,
                   const std::map<std::string, std::string>& values) const;
  void check_interface(const ComponentInfo& info, uint32_t host_major) const;
  /// Loads in-process the file of a component registered from the scanner's report (stages 3
  /// to 5) and gives its plugin's components their function tables; throws loom::Error when the
  /// file no longer loads as the scanner found it.
  void materialize(const ComponentInfo& info) const;
  void refuse(LoadReport& report, std::string stage, std::string reason, std::string hint);
  /// Has the scanner load the files not scanned yet (plugin_scan.hpp); verdicts in scanned_.
  /// Files load() has already seen are passed over unless `even_seen` (load()'s own call).
  void prescan(const std::vector<std::filesystem::path>& files, bool even_seen = false);

  std::vector<std::filesystem::path> searched_;
  std::vector<ComponentInfo> components_;
  std::vector<PluginRefusal> refusals_;
  std::vector<PluginRefusal> passed_over_;
  std::map<std::filesystem::path, size_t> folder_of_;  ///< file -> its folder's place in scan()'s order
  std::vector<std::shared_ptr<LoadedPlugin>> plugins_;
  std::vector<std::filesystem::path> seen_files_;
  bool isolation_ = true;
  std::map<std::filesystem::path, std::string> scanned_;  ///< file -> "" (loads) or why it must not
  std::map<std::filesystem::path, std::string> scan_reports_;  ///< file -> the scanner's report (JSON)
  bool log_refusals_ = true;
};

}  // namespace loom::core
