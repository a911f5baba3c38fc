// oom_recovery: when a step runs out of memory, halve the micro-batch and double the
// accumulation (the global batch stays), and let the host replay the step from its saved
// state. At micro-batch 1 it gives up and the host reports the error with advice.
#include <loom/sdk/helpers.hpp>

#include <loom/sdk/sdk.hpp>

#include "../uneven_split.hpp"

namespace {

class OomRecovery final : public loom::sdk::MemoryPolicy {
 public:
  static constexpr loom_option_spec kOptions[] = {
      loom::sdk::option_int("max_replans", "16", "re-plans allowed in one run before giving up", "1..1000"),
  };

  explicit OomRecovery(const loom::sdk::Options& o) : max_replans_(o.get_int("max_replans")) {
    if (max_replans_ < 1) throw loom::sdk::Error("memory.max_replans must be at least 1");
  }

  bool on_oom(loom::sdk::OomContext& context) override {
    const auto old = context.plan;
    if (old.micro_batch <= 1 || replans_ >= max_replans_) return false;
    ++replans_;
    // An evaluation has no global batch to keep: halved (its micro-batch 97 became 1 under the
    // training's rule, the largest divisor of the batch, for the rest of the run; a review).
    if (context.evaluation) {
      context.plan.micro_batch = old.micro_batch / 2;
      loom::sdk::log::warn("out of memory in the evaluation after step ", context.step, ": micro-batch ", old.micro_batch,
                           " -> ", context.plan.micro_batch, ", evaluating again");
      return true;
    }
    context.plan = loom::sdk::split_global_batch(old.global(), old.world_size, old.micro_batch / 2);
    loom::memory::warn_uneven_split(context.plan, old.global(), old.micro_batch / 2, "{} would be half the one that ran out");
    loom::sdk::log::warn("out of memory at step ", context.step, ": re-planning ", loom::sdk::plan_text(old), " -> ",
                         loom::sdk::plan_text(context.plan), " and replaying the step");
    return true;
  }

  std::string describe() const override {
    return "oom_recovery: on out-of-memory, halve the micro-batch (or less: the largest that divides the batch), keep the "
           "global batch, replay the step";
  }

 private:
  int64_t max_replans_;
  int64_t replans_ = 0;
};

}  // namespace

LOOM_PLUGIN("oom_recovery", "1.0.0",
            loom::sdk::component<OomRecovery>("oom_recovery", "on out-of-memory: halve the micro-batch and replay"))
