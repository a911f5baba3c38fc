// A child process that reports on a pipe, line by line, watched with a time limit: the plugin
// scanner (core/src/plugin_scan.cpp) and `loom plugins check`'s children
// (apps/loom/plugins_check_child.cpp) run plugin code in one, so that a plugin that hangs,
// crashes or exits fails alone, by name, and never takes the command down.
#pragma once

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

namespace loom::core {

/// The report pipe's descriptor in a child that runs plugin code: not its stdout, which a plugin
/// (a library that logs) writes to, and high enough that a plugin's own files do not take it.
constexpr int kReportFd = 100;

struct ChildProcess {
  std::filesystem::path exe;      ///< the program
  std::vector<std::string> args;  ///< its argv, the first its name
  std::string environment;        ///< "NAME=VALUE": set in the child, over an inherited NAME
  int report_fd = kReportFd;      ///< the child's end of the report pipe
  bool quiet = false;             ///< its stdout and stderr to /dev/null
  bool own_group = false;         ///< in a process group of its own, killed whole when it ends
  double first_limit = 120;       ///< seconds it may take to its first line of progress (its start)
  double limit = 120;             ///< seconds it may take from one line of progress to the next
};

struct ChildEnd {
  int spawn_error = 0;     ///< errno of a child that could not start (nothing else is set then)
  bool timed_out = false;  ///< it went past its limit and was killed
  bool stopped = false;    ///< stop() said so, and it was killed
  bool heard = false;      ///< it reported progress at least once (the limit was `limit`, not `first_limit`)
  bool paused = false;     ///< it was stopped and continued with this process (Ctrl-Z, fg): its time includes the pause
  int status = 0;          ///< its wait status
};

/// Starts `child` and hands each line it writes to its report pipe to `on_line` (without the
/// newline), which returns whether the line was progress: the limit counts again from it. Returns
/// once the child has ended and what it wrote is read (a process it started that holds the pipe
/// open is read on only a little), or at its limit or when `stop` returns true, the child (its
/// group, with `own_group`) killed then. The limit holds after the child closed its pipe, too.
ChildEnd run_child_process(const ChildProcess& child, const std::function<bool(const std::string&)>& on_line,
                           const std::function<bool()>& stop = {});

/// In a child run_child_process started: a thread that kills this process, and the process group
/// it was started in where it led one (own_group; what plugin code started there goes too), once
/// `parent` is gone (PR_SET_PDEATHSIG kills the process alone, and a handler of a signal of its
/// could be blocked by plugin code); it never signals a group a plugin moved this process to (the
/// command's own, say). Where it leads its group, SIGTTOU is ignored: a background group's write to
/// a terminal set to `stty tostop` would stop it.
void end_with_parent(int parent);

/// A scanner's exit status where its report descriptor could not be written (closed or replaced
/// by plugin code, or the host gone).
constexpr int kReportLost = 4;

}  // namespace loom::core
