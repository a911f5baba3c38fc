// Callbacks that end the process from a plugin's code, past the scanner (which loads a plugin but
// creates nothing): one is fine, one calls abort() in on_run_begin, one calls exit(0) in its
// factory, one never returns from its constructor, one sends SIGTERM to its process group. `loom plugins check` must report each, name
// the check that crashed or hung, and go on to the next; a command must not succeed because a
// plugin said exit(0) (integration.cli).
#include <loom/sdk/sdk.hpp>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <thread>
#include <unistd.h>

namespace {

class Fine final : public loom::sdk::Callback {
 public:
  explicit Fine(const loom::sdk::Options&) {}
};

class AbortsAtRunBegin final : public loom::sdk::Callback {
 public:
  explicit AbortsAtRunBegin(const loom::sdk::Options&) {}
  void on_run_begin(loom::sdk::RunContext&) override { std::abort(); }
};

class ExitsOnCreate final : public loom::sdk::Callback {
 public:
  explicit ExitsOnCreate(const loom::sdk::Options&) { std::exit(0); }
};

class HangsOnCreate final : public loom::sdk::Callback {
 public:
  explicit HangsOnCreate(const loom::sdk::Options&) {
    if (::fork() == 0) {  // a process it starts first (a worker, a server): it goes when its check is stopped
      ::sleep(300);
      ::_exit(0);
    }
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
};

class KillsItsGroup final : public loom::sdk::Callback {  // (a plugin's clean-up of its workers, gone wrong)
 public:
  explicit KillsItsGroup(const loom::sdk::Options&) {
    ::kill(0, SIGTERM);
    std::this_thread::sleep_for(std::chrono::seconds(5));
  }
};

}  // namespace

LOOM_PLUGIN("ending", "1.0.0", loom::sdk::component<Fine>("fine", "test: does nothing"),
            loom::sdk::component<AbortsAtRunBegin>("aborts_at_run_begin", "test: abort() in on_run_begin"),
            loom::sdk::component<ExitsOnCreate>("exits_on_create", "test: exit(0) in its factory"),
            loom::sdk::component<HangsOnCreate>("hangs_on_create", "test: its constructor never returns"),
            loom::sdk::component<KillsItsGroup>("kills_its_group", "test: kill(0, SIGTERM) in its constructor"))
