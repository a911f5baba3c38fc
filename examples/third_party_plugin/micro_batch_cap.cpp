// A memory policy built out of tree: never run a micro-batch above `max` samples (a limit the
// user knows, e.g. from another job sharing the device), keeping the global batch through
// gradient accumulation; on out-of-memory, halve the cap and let the host replay the step.
#include <loom/sdk/sdk.hpp>

namespace {

class MicroBatchCap final : public loom::sdk::MemoryPolicy {
 public:
  static constexpr loom_option_spec kOptions[] = {
      loom::sdk::option_int("max", "64", "the largest micro-batch this run may use", "1..16777216"),
  };

  explicit MicroBatchCap(const loom::sdk::Options& o) : max_(o.get_int("max")) {
    if (max_ < 1) throw loom::sdk::Error("micro_batch_cap.max must be at least 1");
  }

  // Before the first step: split the global batch so no micro-batch exceeds the cap.
  void plan(loom::sdk::PlanContext& context) override {
    if (context.plan.micro_batch <= max_) return;
    context.plan = loom::sdk::split_global_batch(context.plan.global(), context.plan.world_size, max_);
  }

  // A step (or an evaluation) ran out of memory: halve the cap and re-split.
  bool on_oom(loom::sdk::OomContext& context) override {
    if (context.plan.micro_batch <= 1) return false;
    max_ = context.plan.micro_batch / 2;
    const auto old = context.plan;
    context.plan = loom::sdk::split_global_batch(old.global(), old.world_size, max_);
    loom::sdk::log::warn("out of memory at step ", context.step, ": ", loom::sdk::plan_text(old), " -> ",
                         loom::sdk::plan_text(context.plan));
    return true;
  }

  std::string describe() const override {
    return "micro_batch_cap: micro-batches of at most " + std::to_string(max_) + " samples";
  }

 private:
  int64_t max_;
};

}  // namespace

LOOM_PLUGIN("micro_batch_cap", "1.0.0",
            loom::sdk::component<MicroBatchCap>("micro_batch_cap", "cap the micro-batch, keep the global batch"))
