#pragma once
// A crash says so: see crash_report.cpp.

namespace loom::core {

/// From now on a crash (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) writes a report to stderr
/// (PROGRAM, the signal, the faulting address, what Loom was doing in a plugin, the stack as
/// module+offset) and then ends the process with the same signal, so exit statuses and core
/// dumps are unchanged.
void install_crash_report(const char* program);

/// For a program whose main never returns through exit() (loom ends with _Exit): from now on a
/// call of exit() (from a plugin: Loom's own code calls none) is reported, and the process ends
/// with status 1, not the status the plugin gave (exit(0) made a command that did nothing
/// succeed). Until command_returning().
void report_exit_calls();

/// The program is now returning through exit() itself (a sanitized build's main).
void command_returning();

/// What the process is doing in a plugin, for the reports above ("creating callback 'x' of
/// FILE"), while alive; the one before it again after. Cheap: a copy into a fixed buffer. One
/// buffer for the process: for the main thread's calls (creation, checks), not a pool's.
class CrashContext {
 public:
  explicit CrashContext(const char* what);
  ~CrashContext();
  CrashContext(const CrashContext&) = delete;
  CrashContext& operator=(const CrashContext&) = delete;

 private:
  char previous_[256];
};

}  // namespace loom::core
