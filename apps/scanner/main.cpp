// loom-plugin-scanner FILE...: loads plugin files the way the host does, one after another, in a
// process of its own, so that a plugin which crashes, exits or hangs while loading takes only
// this process down. For file N it writes "begin N" before loading it, then "report N JSON" (what
// the file holds, or why it was refused: the host registers its components from that without
// loading the file, and loads it only when a run creates one of them), then "ok N", on file
// descriptor 100 (core::kReportFd; the standard output where that is not open: run by hand),
// never on the standard output a plugin writes to. The host (core/src/plugin_scan.cpp) reads
// those lines, in that order only, and how the process ended, nothing else.
#include <loom/core/child_process.hpp>
#include <loom/core/plugin_registry.hpp>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fcntl.h>
#include <string>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace {

int report_fd = STDOUT_FILENO;

void report(const std::string& line) {
  const std::string text = line + "\n";
  for (size_t done = 0; done < text.size();) {
    const ssize_t n = ::write(report_fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) std::_Exit(loom::core::kReportLost);  // plugin code closed or replaced it, or the host is gone
    done += static_cast<size_t>(n);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: loom-plugin-scanner FILE...\n");
    return 2;
  }
  // Dies with the command that started it: a plugin whose initializer spins or hangs kept a
  // scanner at full CPU for good after the command was interrupted (the time limit is the
  // command's to enforce, and it was gone). Started by the host, in a process group of its own,
  // it takes the processes a plugin's initializer started in that group with it (a host killed
  // at once cannot end them).
  const char* parent = std::getenv("LOOM_SCANNER_PARENT");
  // (the host names itself: a parent of pid 1 may be a container's loom, not an orphan's reaper)
  if (parent != nullptr && ::getppid() != std::atoi(parent)) return 3;  // it was gone already
  if (parent != nullptr) loom::core::end_with_parent(std::atoi(parent));
  else ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // (run by hand)
  if (struct stat st {}; ::fstat(loom::core::kReportFd, &st) == 0 && S_ISFIFO(st.st_mode)) {
    report_fd = loom::core::kReportFd;
    ::fcntl(report_fd, F_SETFD, FD_CLOEXEC);  // (not inherited by the processes a plugin starts)
  }
  for (int i = 1; i < argc; ++i) {
    report("begin " + std::to_string(i - 1));
    try {
      // A registry per file: whether two files provide one component is the host's question.
      loom::core::PluginRegistry registry;
      registry.set_isolation(false);  // this is the isolated process
      registry.set_log_refusals(false);
      const loom::core::LoadReport loaded = registry.load(argv[i]);
      report("report " + std::to_string(i - 1) + " " + loom::core::to_json(loaded));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());  // the loader refuses by report, not by exception
    }
    report("ok " + std::to_string(i - 1));
  }
  // Without the static destructors and atexit handlers of what it loaded (plugins are never
  // unloaded): one that crashes or hangs at exit would read as the last file's failure.
  std::_Exit(0);
}
