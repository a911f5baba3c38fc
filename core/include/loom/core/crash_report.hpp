#pragma once
// A crash says so: see crash_report.cpp.

namespace loom::core {

/// From now on a crash (SIGSEGV, SIGBUS, SIGFPE, SIGILL) writes a report to stderr (PROGRAM, the
/// signal, the faulting address, the stack as module+offset) and then ends the process with the
/// same signal, so exit statuses and core dumps are unchanged.
void install_crash_report(const char* program);

}  // namespace loom::core
