// `loom plugins check` runs the conformance suites in a child process (this same command line,
// marked as the child by an environment variable), so that a check which hangs (a constructor
// that waits forever) is stopped at a deadline and one which crashes (abort() in a hook) ends
// that child, not the command: the parent reports that check as failed, with why, and goes on
// with the file's next component in a new child.
#pragma once

#include <loom/core/child_process.hpp>
#include <loom/core/conformance.hpp>

#include <filesystem>
#include <functional>
#include <string>

namespace loom::cli {

/// Set in the child's environment, "FIRST:PARENT:SCRATCH": the index (among the file's
/// components) of the first component it checks, the parent's pid, and the folder it uses as
/// LOOM_CACHE. Internal to `loom plugins check`.
inline constexpr const char* kCheckChildVariable = "LOOM_INTERNAL_CHECK_CHILD";
/// The child's end of its pipe to the parent (a plugin's own files take the low numbers).
inline constexpr int kCheckChildFd = core::kReportFd;

/// In the child: runs the suites of `file`'s components from the one `variable` (the value of
/// kCheckChildVariable) names, telling the parent on a pipe as each check begins and ends.
/// Returns the exit status.
int run_check_child(const core::PluginRegistry& registry, const std::filesystem::path& file,
                    core::ConformanceOptions options, const char* variable);

/// In the parent: runs the suites in children, each check given `seconds` at most, and hands each
/// component's report to `on_report` (one a hang or a crash ended has that check failed, with
/// why, last). Returns false when no child could be started (nothing was checked: the caller
/// checks in this process). A SIGINT, SIGTERM or SIGHUP meanwhile ends the child (and what it
/// started) and throws core::StoppedBySignal.
bool check_in_children(const std::string& plugin, double seconds,
                       const std::function<void(const core::ConformanceReport&)>& on_report);

}  // namespace loom::cli
