// Conformance of a plugin's components: per kind, the contract the host relies on, checked on
// the component itself (a model's loss is a sum, a dataset's batches match its spec, a memory
// policy keeps the global batch, an optimizer's and a callback's state round-trip, ...). The
// same functions serve `loom plugins check FILE`, which third parties run on their own plugins,
// and the conformance tests that run them over every in-tree plugin and the examples.
#pragma once

#include <loom/core/plugin_registry.hpp>

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace loom::core {

struct ConformanceCheck {
  enum class Outcome { kPass, kFail, kSkip };
  std::string name;    ///< "loss_is_a_sum"
  Outcome outcome = Outcome::kPass;
  std::string reason;  ///< why it failed or was skipped; for a pass, empty or a note (a model that declares no FLOPs)
};

struct ConformanceReport {
  std::string kind, component;
  std::string context;  ///< what it was checked with ("with dataset synthetic"), if anything
  std::vector<ConformanceCheck> checks;
  bool passed() const;  ///< no check failed (skipped ones do not count)
};

struct ConformanceOptions {
  /// For a model: the dataset component it is shaped to and fed from. Empty: a dataset of the
  /// model's own plugin if it has one, else the first of `fallback_datasets` the registry has
  /// whose data the model's setup accepts (synthetic_tokens for a language model).
  std::string dataset;
  std::vector<std::string> fallback_datasets{"synthetic", "synthetic_tokens", "fashion_mnist"};
  /// Options of components by name (a dataset of the user's files needs its folder); the others
  /// are built with their defaults. A dataset that cannot be created with its defaults, and has
  /// none here, is skipped with the reason.
  std::map<std::string, std::map<std::string, std::string>> options;
  /// Called with each component's report as soon as its suite ends (a later component that
  /// crashes the process loses no earlier report).
  std::function<void(const ConformanceReport&)> on_report;
  /// Called as each check begins (the component's report so far, the check's name) and as it
  /// ends (the report, the check that ended last in it): `loom plugins check` runs the suites in a
  /// child process and names the check a hang or a crash ended it in.
  std::function<void(const ConformanceReport&, const std::string& check)> on_check_begin;
  std::function<void(const ConformanceReport&)> on_check_end;
};

/// Runs the suite of `component`'s kind on a fresh instance built with its default options.
/// Never throws for a component's failure: that is a failed check with its reason.
ConformanceReport check_component(const PluginRegistry& registry, const ComponentInfo& component,
                                  const ConformanceOptions& options = {});

/// The suites of every component of the plugin loaded from `file`, in the plugin's order.
std::vector<ConformanceReport> check_plugin(const PluginRegistry& registry, const std::filesystem::path& file,
                                            const ConformanceOptions& options = {});

}  // namespace loom::core
