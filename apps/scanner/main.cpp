// loom-plugin-scanner FILE...: loads plugin files the way the host does, one after another, in a
// process of its own, so that a plugin which crashes, exits or hangs while loading takes only
// this process down. For file N it prints "begin N" before loading it, then "report N JSON" (what
// the file holds, or why it was refused: the host registers its components from that without
// loading the file, and loads it only when a run creates one of them), then "ok N". The host
// (core/src/plugin_scan.cpp) reads those lines and how the process ended, nothing else.
#include <loom/core/plugin_registry.hpp>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <sys/prctl.h>
#include <unistd.h>

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: loom-plugin-scanner FILE...\n");
    return 2;
  }
  // Dies with the command that started it: a plugin whose initializer spins or hangs kept a
  // scanner at full CPU for good after the command was interrupted (the time limit is the
  // command's to enforce, and it was gone).
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  // (the host names itself: a parent of pid 1 may be a container's loom, not an orphan's reaper)
  if (const char* parent = std::getenv("LOOM_SCANNER_PARENT"); parent != nullptr && ::getppid() != std::atoi(parent))
    return 3;  // it was gone before prctl
  for (int i = 1; i < argc; ++i) {
    std::printf("begin %d\n", i - 1);
    std::fflush(stdout);
    try {
      // A registry per file: whether two files provide one component is the host's question.
      loom::core::PluginRegistry registry;
      registry.set_isolation(false);  // this is the isolated process
      registry.set_log_refusals(false);
      const loom::core::LoadReport report = registry.load(argv[i]);
      std::printf("report %d %s\n", i - 1, loom::core::to_json(report).c_str());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());  // the loader refuses by report, not by exception
    }
    std::printf("ok %d\n", i - 1);
    std::fflush(stdout);
  }
  return 0;
}
