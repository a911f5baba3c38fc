// loom-plugin-scanner FILE...: loads plugin files the way the host does, one after another, in a
// process of its own, so that a plugin which crashes, exits or hangs while loading takes only
// this process down. It prints "begin N" before file N and "ok N" after it; the host
// (core/src/plugin_scan.cpp) reads that and how the process ended, nothing else: "ok" means the
// file loaded, or was refused cleanly, which the host's own load finds again.
#include <loom/core/plugin_registry.hpp>

#include <cstdio>
#include <exception>

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: loom-plugin-scanner FILE...\n");
    return 2;
  }
  loom::core::PluginRegistry registry;
  registry.set_isolation(false);  // this is the isolated process
  registry.set_log_refusals(false);
  for (int i = 1; i < argc; ++i) {
    std::printf("begin %d\n", i - 1);
    std::fflush(stdout);
    try {
      registry.load(argv[i]);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());  // the loader refuses by report, not by exception
    }
    std::printf("ok %d\n", i - 1);
    std::fflush(stdout);
  }
  return 0;
}
