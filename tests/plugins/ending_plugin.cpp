// Callbacks that end the process from a plugin's code, past the scanner (which loads a plugin but
// creates nothing): one is fine, one calls abort() in on_run_begin, one calls exit(0) in its
// factory. `loom plugins check` must keep the fine one's report and say what crashed, and a
// command must not succeed because a plugin said exit(0) (integration.cli).
#include <loom/sdk/sdk.hpp>

#include <cstdlib>

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

}  // namespace

LOOM_PLUGIN("ending", "1.0.0", loom::sdk::component<Fine>("fine", "test: does nothing"),
            loom::sdk::component<AbortsAtRunBegin>("aborts_at_run_begin", "test: abort() in on_run_begin"),
            loom::sdk::component<ExitsOnCreate>("exits_on_create", "test: exit(0) in its factory"))
