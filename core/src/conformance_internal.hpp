// The conformance runner shared by the suites (private to the core): a suite records one check
// per call; a check returns "" when it passes, else the reason; a check that others depend on
// (`require`) makes them skip when it does not pass.
#pragma once

#include <loom/core/conformance.hpp>

#include <functional>
#include <map>
#include <stdexcept>
#include <string>

namespace loom::core::conformance {

/// Thrown by a check that cannot run here (a GPU-only strategy on CPU): the check is skipped.
struct Skip : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Thrown by a check that passes with something the author should know (a model that declares no
/// FLOPs): the check passes, with this as its note.
struct PassWithNote : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Suite {
 public:
  Suite(std::string kind, std::string component, const ConformanceOptions* hooks = nullptr) : hooks_(hooks) {
    report_.kind = std::move(kind);
    report_.component = std::move(component);
  }
  void run(const std::string& name, const std::function<std::string()>& check);
  void require(const std::string& name, const std::function<std::string()>& check);
  ConformanceReport& report() { return report_; }
  /// The options `component` is built with in the checks: those `--set` gave it, else its defaults.
  std::map<std::string, std::string> options_of(const std::string& component) const;

 private:
  ConformanceReport report_;
  std::string blocked_;
  const ConformanceOptions* hooks_;  ///< its on_check_begin/on_check_end, if any
};

/// The suites of the kinds besides model and dataset (conformance_kinds.cpp).
void check_other_kind(Suite& suite, const PluginRegistry& registry, const ComponentInfo& component);

}  // namespace loom::core::conformance
