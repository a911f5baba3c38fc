// Run configuration: INI files with sections and `base = other.ini` inheritance, seed-style
// command-line flags that are aliases of keys, and `--set section.key=value` overrides; then one
// validation of the whole thing against the schema of the core and of every chosen component.
//
// Precedence, lowest first: schema defaults < files (each after its bases, in the order given)
// < alias flags (--batch-size, ...) < --set. Every value remembers where it came from, so
// errors and `loom config show` can say "configs/run.ini:12".
#pragma once

#include <loom/core/error.hpp>
#include <loom/core/plugin_registry.hpp>

#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace loom::core {

class Schema;

/// Where a value came from.
struct Origin {
  std::string source;  ///< "file", "--set", "--batch-size" (an alias), "default"
  std::filesystem::path file;
  int line = 0;
  std::string describe() const;  ///< "configs/run.ini:12", "--set", "--batch-size", "default"
};

struct ConfigValue {
  std::string value;
  Origin origin;
};

/// A seed-style flag that sets a key: `--batch-size 64` is `--set trainer.batch_size=64`.
struct Alias {
  const char* flag;       ///< without the leading dashes
  const char* key;        ///< section.key
  const char* switch_to;  ///< for flags without a value: the value they set; nullptr otherwise
  const char* help;
};
const std::vector<Alias>& aliases();

/// The configuration file that `-c NAME` means: NAME itself when it is a path that exists; else,
/// for a plain name, NAME or NAME.ini in the folders of LOOM_CONFIG_PATH (':'-separated), then in
/// Loom's own configurations, <exe>/../share/loom/configs (installed, and in the build tree).
/// Throws loom::Error naming what was tried and the configurations there are.
std::filesystem::path find_config(const std::string& name);

/// Where find_config looks for a plain name, in order.
std::vector<std::filesystem::path> config_search_path();

/// `name` or `name`.ini in the first folder of config_search_path() that has it.
std::optional<std::filesystem::path> shipped_config(const std::string& name);

/// For a relative path to a missing file that one of Loom's configurations bears the name of
/// (`configs/debug.ini` outside Loom's checkout): " (from <cwd>); Loom's own debug.ini is ..., given
/// by its name: -c debug". Else "".
std::string shipped_hint(const std::filesystem::path& file);

/// The merged, not yet validated configuration: "section.key" -> value and origin.
class Config {
 public:
  /// Reads an INI file and, first, the files its `base` key names (relative to it; a
  /// comma-separated list is applied in order). Throws loom::Error for a missing file, a line
  /// that is not `key = value`, `[section]` or a comment, a key outside any section, or an
  /// inheritance cycle (naming the chain).
  void load_file(const std::filesystem::path& file);

  /// Sets one key (later wins).
  void set(const std::string& key, const std::string& value, Origin origin);

  /// Applies "section.key=value" (from --set); throws loom::Error for any other shape.
  void set_assignment(const std::string& assignment, const std::string& source = "--set");

  const ConfigValue* find(const std::string& key) const;
  std::optional<std::string> get(const std::string& key) const;
  const std::map<std::string, ConfigValue>& values() const { return values_; }
  /// When `key` was last set, in the order of set() calls (files, bases first, then flags, then
  /// --set in order); 0 if never. Of a key written two ways (Note [Component sections]) the later wins.
  uint64_t set_order(const std::string& key) const;
  /// The keys set, in the order they were last set: what copying this configuration into another
  /// follows, so that the copy's set_order keeps the user's order (values() is by name).
  std::vector<std::string> keys_in_set_order() const;
  /// Every file read, bases included, in the order read.
  const std::vector<std::filesystem::path>& files() const { return files_; }
  /// A value a base of a later -c file set over an earlier file's, where it is still the value in
  /// force (no later file, alias or --set replaced it, nor a later setting of the same option
  /// written another way, a shorthand of `schema`'s): one warning each, said by resolve_run.
  std::vector<std::string> base_override_warnings(const Schema* schema = nullptr) const;
  /// After they were said: a configuration resolved again (`loom bench`'s rounds) says them no more.
  void forget_base_override_warnings() { base_overrides_.clear(); }

 private:
  void load_file(const std::filesystem::path& file, std::vector<std::filesystem::path>& chain,
                 const std::string& included_from);

  std::map<std::string, ConfigValue> values_;
  std::map<std::string, uint64_t> order_;
  uint64_t sets_ = 0;
  std::vector<std::filesystem::path> files_;
  uint64_t bytes_read_ = 0;  ///< of every configuration file read (a base once per file that names it)
  /// Values a base set over an earlier file's (base_override_warnings).
  struct BaseOverride {
    std::string key;
    std::filesystem::path file;
    int line = 0;
    std::string warning;
  };
  std::vector<BaseOverride> base_overrides_;
};

/// One key the configuration may contain.
struct KeySpec {
  std::string key;    ///< section.key
  OptionSpec option;  ///< type, default, help, choices
  std::string owner;  ///< who defines it: "trainer", "model 'lightweight_transformer'"
};

// Note [Component sections]
// A component's options live in its own section, [<kind section>.<name>]: [model.
// lightweight_transformer], [memory.auto_batch], [memory.oom_recovery]. Two components of one run
// never share a key, so two memory policies may both have an option `margin`. The kind's section
// is a shorthand: `model.d_model` (or [model] d_model = 96, or --d-model) is the selected model's
// `d_model`, when exactly one selected component of that kind has the option (given both ways, the
// later setting wins, as for one spelling, and a warning names both); when two do, the
// shorthand is an error that names both sections. A key of a component the run does not select
// (a loaded one: [memory.auto_batch] cache when memory.policies = oom_recovery, or
// model.num_heads when the model is an MLP) is ignored with a warning naming the component and
// the key that did not select it, so one file can hold options for several components. A key
// that belongs to no loaded component is an error with the closest valid key.

/// The keys a run accepts: the core's sections plus the chosen components' options.
class Schema {
 public:
  /// Adds `options` under `section` (a key already present is an error naming both owners).
  void add(const std::string& section, const std::string& owner,
           const std::vector<OptionSpec>& options);
  /// `key` ("memory.margin") stands for `canonical` ("memory.auto_batch.margin"); added for two
  /// different canonical keys, it is ambiguous. See Note [Component sections].
  void add_shorthand(const std::string& key, const std::string& canonical);
  /// `key` is an option of a component this run does not select; `why` says whose and why it is
  /// ignored ("memory policy 'auto_batch', which this run does not select (memory.policies = ...)").
  void add_foreign(const std::string& key, const std::string& why);

  const KeySpec* find(const std::string& key) const;
  /// The canonical keys `key` is a shorthand for (one, or several when ambiguous; none).
  std::vector<std::string> shorthand(const std::string& key) const;
  /// Why `key` is ignored, if it is a foreign key.
  const std::string* foreign(const std::string& key) const;
  /// Where `key` (no key of this schema) is in the section of a component the run does not select
  /// ([model.gpt2_lm] sizex), or of one no loaded plugin gives: what is wrong, said as that
  /// component's, with the closest of its keys; empty where its section is no component's.
  std::string foreign_section_problem(const std::string& key) const;
  const std::map<std::string, KeySpec>& keys() const { return keys_; }
  std::vector<std::string> sections() const;

 private:
  std::map<std::string, KeySpec> keys_;
  std::map<std::string, std::vector<std::string>> shorthands_;
  std::map<std::string, std::string> foreign_;
};

/// The core's own sections and keys (trainer, data, model, precision, memory, parallel).
Schema core_schema();

/// Which components a configuration selects (defaults applied), in the order of kinds() and,
/// within a kind, of its list.
struct ComponentChoice {
  uint32_t kind;
  std::string section;  ///< where its options live: "model.lightweight_transformer"
  std::string name;
  std::string selected_by;  ///< the key that chose it: "model.name", "memory.policies"
};
std::vector<ComponentChoice> chosen_components(const Config& config);

/// The schema of a run: core_schema() plus the options of every chosen component, which must be
/// loaded (otherwise loom::Error from PluginRegistry::require says which and why).
Schema run_schema(const Config& config, const PluginRegistry& registry);

/// Every key of the schema with its final value and origin.
using Resolved = std::map<std::string, ConfigValue>;

/// Validates the whole configuration against `schema` and returns every key's value. Throws one
/// loom::Error listing each problem: an unknown section or key (with its file:line and the
/// closest valid one), a value that is not of the key's type (key, value, what was expected), a
/// required key without a value.
Resolved validate(const Config& config, const Schema& schema);

/// "is outside its range [1, 64]" when `text` (valid for the key's type) is outside the key's
/// range, else nullopt.
std::optional<std::string> out_of_range(const OptionSpec& o, const std::string& text);
/// "[1, 64]".
std::string range_text(const OptionSpec& o);

/// `loom config show`: the resolved configuration by section, with each value's origin.
std::string format_resolved(const Resolved& resolved, const Schema& schema);

/// The values of one section, for a component factory: key (without the section) -> value,
/// restricted to `keys`.
std::map<std::string, std::string> section_values(const Resolved& resolved, const std::string& section,
                                                  const std::vector<OptionSpec>& keys);

/// The section of a component's options: "memory.auto_batch" for memory policy auto_batch.
std::string component_section(uint32_t kind, const std::string& name);

}  // namespace loom::core
