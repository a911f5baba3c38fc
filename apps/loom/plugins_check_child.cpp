// `loom plugins check` in a child process (plugins_check_child.hpp), in a process group of its
// own (a plugin's kill(0, SIGTERM) is its own group's; the parent kills the group when the child
// ends, with what a plugin started in it that stayed in it), killed with its parent (a parent
// killed on its own cannot kill the group: a thread of the child does, core::end_with_parent).
// The child writes one
// line per event to file descriptor 100 (a plugin's own files take the low numbers), its fields
// separated by tabs, tabs, newlines and backslashes in them escaped:
//   component INDEX KIND NAME   the suite of the file's INDEX-th component begins
//   begin NAME CONTEXT          a check begins (CONTEXT: "with dataset synthetic", or empty)
//   end OUTCOME NAME REASON     it ended: pass, fail or skip
//   report                      the component's suite ended
//   done                        every component from the first asked was checked
#include "plugins_check_child.hpp"
#include "child_report.hpp"
#include "cli.hpp"

#include <loom/core/child_process.hpp>
#include <loom/core/error.hpp>
#include <loom/core/kinds.hpp>
#include <loom/core/log.hpp>
#include <loom/core/stop_signals.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <optional>
#include <signal.h>
#include <string>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

namespace loom::cli {

namespace {

constexpr int kChildFd = kCheckChildFd;

void tell_parent(const std::string& line) { cli::tell_parent(kChildFd, line); }

const char* outcome_word(core::ConformanceCheck::Outcome o) {
  return o == core::ConformanceCheck::Outcome::kPass ? "pass" : o == core::ConformanceCheck::Outcome::kFail ? "fail" : "skip";
}

core::ConformanceCheck::Outcome outcome_of(const std::string& word) {
  return word == "pass" ? core::ConformanceCheck::Outcome::kPass
         : word == "fail" ? core::ConformanceCheck::Outcome::kFail
                          : core::ConformanceCheck::Outcome::kSkip;
}

/// Why the child ended before it said "done".
std::string why_it_ended(bool timed_out, double seconds, int status) {
  if (timed_out) {
    char limit[32];
    std::snprintf(limit, sizeof limit, "%g", seconds);
    return std::string("did not finish within ") + limit +
           " s (does it hang? --check-timeout SECONDS gives each check longer); the process running it was stopped";
  }
  return how_it_ended(status);
}

/// What one child reached: the component it was in, and whether it finished.
struct ChildOutcome {
  bool started = false;  ///< it was spawned
  bool done = false;     ///< it said "done" and exited with status 0
  bool said_done = false, any_component = false;  ///< what it said, whatever its end
  std::optional<core::ConformanceReport> open;  ///< the component a hang or a crash ended
  std::optional<std::string> check;             ///< the check running then, if one was
  size_t index = 0;                             ///< that component's index
  std::string why;                              ///< why it ended (not done)
};

// The signal that stopped the parent while a child ran (SIGINT, SIGTERM, SIGHUP), or 0: the child
// is in a group of its own, which the terminal's Ctrl-C no longer reaches.
std::atomic<int> stopped_by{0};
void on_stop(int sig) { stopped_by.store(sig); }

/// While it lives, SIGINT, SIGTERM and SIGHUP are noted (the loop below ends the child and says so).
class StopsNoted {
 public:
  StopsNoted() {
    struct sigaction action {};
    action.sa_handler = &on_stop;
    sigemptyset(&action.sa_mask);
    for (size_t i = 0; i < 3; ++i) {
      ::sigaction(kSignals[i], nullptr, &before_[i]);
      if (before_[i].sa_handler != SIG_IGN) ::sigaction(kSignals[i], &action, nullptr);  // (nohup: stays ignored)
    }
  }
  ~StopsNoted() {
    for (size_t i = 0; i < 3; ++i) ::sigaction(kSignals[i], &before_[i], nullptr);
  }
  StopsNoted(const StopsNoted&) = delete;
  StopsNoted& operator=(const StopsNoted&) = delete;

 private:
  static constexpr int kSignals[3] = {SIGINT, SIGTERM, SIGHUP};
  struct sigaction before_[3] {};
};

ChildOutcome run_child(size_t first, double seconds, const std::string& scratch,
                       const std::function<void(const core::ConformanceReport&)>& on_report) {
  ChildOutcome out;
  core::ChildProcess child;
  child.exe = "/proc/self/exe";
  child.args = own_arguments();
  child.environment = std::string(kCheckChildVariable) + "=" + std::to_string(first) + ":" + std::to_string(::getpid()) +
                      ":" + scratch;
  child.report_fd = kChildFd;
  child.own_group = true;
  // A check gets `seconds` from the child's last word; its start (LibTorch, the plugins' scan)
  // two minutes or more.
  child.limit = seconds;
  child.first_limit = std::max(seconds, 120.0);
  size_t last_index = first;  // (components come in order, from `first`: anything else is not the child's)
  const core::ChildEnd end = core::run_child_process(
      child,
      [&](const std::string& line) {
        const auto f = fields(line);
        if (f[0] == "component" && f.size() == 4 && !out.check) {
          char* tail = nullptr;
          const unsigned long index = std::strtoul(f[1].c_str(), &tail, 10);
          if (tail == f[1].c_str() || *tail != '\0' || index < last_index || (out.any_component && index == last_index))
            return false;
          last_index = index;
          out.any_component = true;
          out.open = core::ConformanceReport{f[2], f[3], {}, {}};
          out.index = index;
        } else if (f[0] == "begin" && f.size() == 3 && out.open && !out.check) {
          out.check = f[1];
          out.open->context = f[2];
        } else if (f[0] == "end" && f.size() == 4 && out.open && out.check == f[2]) {
          out.open->checks.push_back({f[2], outcome_of(f[1]), f[3]});
          out.check.reset();
        } else if (f[0] == "report" && f.size() == 1 && out.open && !out.check) {
          on_report(*out.open);
          out.open.reset();
        } else if (f[0] == "done" && f.size() == 1 && !out.open) {
          out.done = out.said_done = true;
        } else {
          return false;  // (not the child's, or out of order: no progress, or writing would hold off the limit)
        }
        return true;
      },
      [] { return stopped_by.load() != 0; });
  if (end.spawn_error != 0) {
    out.why = std::strerror(end.spawn_error);
    if (first == 0)  // (later, the components left are reported unchecked: no process could run them)
      core::log::warn("cannot start a process for the checks (", out.why, "): they run in this one, and one that hangs ",
                      "or crashes ends the command");
    return out;
  }
  out.started = true;
  if (const int sig = stopped_by.load(); sig != 0)
    throw core::StoppedBySignal(sig, "loom plugins check: stopped by " + core::signal_name(sig) +
                                         (out.open ? " during the checks of " + out.open->kind + " '" + out.open->component + "'"
                                                   : std::string()) + "; the process running them was stopped");
  if (out.done && !(WIFEXITED(end.status) && WEXITSTATUS(end.status) == 0)) out.done = false;  // (it crashed in its exit)
  // (the limit its start had, where it said nothing: as the message says)
  if (!out.done) out.why = why_it_ended(end.timed_out, end.heard ? seconds : child.first_limit, end.status);
  return out;
}

}  // namespace

int run_check_child(const core::PluginRegistry& registry, const std::filesystem::path& file,
                    core::ConformanceOptions options, const char* variable) {
  // "FIRST:PARENT:SCRATCH": the first component's index, the parent's pid, the cache folder.
  const std::string value = variable;
  const size_t colon = value.find(':'), second = colon == std::string::npos ? colon : value.find(':', colon + 1);
  struct stat st {};
  char* end = nullptr;
  const unsigned long first = std::strtoul(value.c_str(), &end, 10);
  const long parent = second == std::string::npos ? 0 : std::strtol(value.c_str() + colon + 1, nullptr, 10);
  if (second == std::string::npos || end != value.c_str() + colon || ::fstat(kChildFd, &st) != 0 || !S_ISFIFO(st.st_mode))
    throw Error(std::string(kCheckChildVariable) + " is set: it is internal to loom plugins check; unset it");
  // A parent killed on its own (SIGKILL): this process goes too, not on for ever, and so do the
  // processes a plugin started in its group (they lived on, a plugin's workers or servers).
  if (::getppid() != parent) std::_Exit(1);  // (it went already; cmd_plugins.cpp's check() started core::end_with_parent)
  ::fcntl(kChildFd, F_SETFD, FD_CLOEXEC);  // (not inherited by the processes a plugin starts)
  // Components that cache answers (auto_batch) write to the parent's scratch folder, not the user's cache;
  // and the checks' own scratch goes there too, which the parent removes however this process ends (a
  // callback's check folder, loom_check_NAME_PID, was left in /tmp by each check that crashed).
  ::setenv("LOOM_CACHE", value.c_str() + second + 1, 1);
  ::setenv("TMPDIR", value.c_str() + second + 1, 1);
  options.on_report = nullptr;
  options.on_check_begin = [](const core::ConformanceReport& r, const std::string& check) {
    tell_parent("begin\t" + escaped(check) + "\t" + escaped(r.context));
  };
  options.on_check_end = [](const core::ConformanceReport& r) {
    const auto& c = r.checks.back();
    tell_parent(std::string("end\t") + outcome_word(c.outcome) + "\t" + escaped(c.name) + "\t" + escaped(c.reason));
  };
  std::error_code ec;
  const auto canonical = std::filesystem::weakly_canonical(file, ec);
  size_t index = 0;
  for (const auto& c : registry.components()) {
    if (!c.plugin || std::filesystem::weakly_canonical(c.plugin->file, ec) != canonical) continue;
    if (index++ < first) continue;
    tell_parent("component\t" + std::to_string(index - 1) + "\t" + core::kind_name(c.kind) + "\t" + escaped(c.name));
    core::check_component(registry, c, options);
    tell_parent("report");
  }
  tell_parent("done");
  return 0;
}

bool check_in_children(const std::string& plugin, double seconds,
                       const std::function<void(const core::ConformanceReport&)>& on_report) {
  const ScratchFolder scratch("loom-check");  // (the children's; removed here, however they end)
  stopped_by.store(0);
  const StopsNoted noted;
  for (size_t first = 0;;) {
    ChildOutcome child = run_child(first, seconds, scratch.path().string(), on_report);
    if (const int sig = stopped_by.load(); sig != 0)  // (between the child's end and this)
      throw core::StoppedBySignal(sig, "loom plugins check: stopped by " + core::signal_name(sig));
    if (child.done) return true;
    if (!child.started && first == 0) return false;
    if (!child.open) {  // it ended before its first component began, or between two, or after its last; or none started
      const std::string context = first == 0 ? "" : "from its component " + std::to_string(first + 1) + " on";
      core::ConformanceReport r{"plugin", plugin, context, {}};
      r.checks.push_back({child.said_done ? "exit" : child.any_component ? "(between its components)" : "start",
                          core::ConformanceCheck::Outcome::kFail,
                          child.started ? "the process running the checks " + child.why
                                        : "no process could be started for the checks (" + child.why + ")"});
      on_report(r);
      return true;
    }
    child.open->checks.push_back({child.check.value_or("(between its checks)"), core::ConformanceCheck::Outcome::kFail,
                                  child.why + "; its other checks did not run"});
    on_report(*child.open);
    first = child.index + 1;
  }
}

}  // namespace loom::cli
