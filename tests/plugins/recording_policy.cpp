// A memory policy for tests: on out-of-memory it logs what its OomContext says, word for word
// ("record_oom: step 1, micro-batch 64"), then halves the micro-batch like oom_recovery. Tests
// read the line back to check what the host hands a policy. Its option `margin` has the name of
// an auto_batch option, for the tests of component sections. With `same_plan` it answers with the
// plan unchanged, as a broken third-party policy might; with `plan_micro_batch` it plans that
// micro-batch (one below 1 is a broken policy's plan). Its plan() logs the context's config_key.
#include <loom/sdk/sdk.hpp>

namespace {

class RecordOom final : public loom::sdk::MemoryPolicy {
 public:
  static constexpr loom_option_spec kOptions[] = {
      loom::sdk::option_float("margin", "0.5", "unused; named like auto_batch's margin"),
      loom::sdk::option_bool("same_plan", "false", "answer an out-of-memory with the plan unchanged (a broken policy)"),
      loom::sdk::option_int("plan_micro_batch", "0", "plan this micro-batch (0: leave the plan; below 1: a broken policy)",
                            "-1000000..1000000")};

  explicit RecordOom(const loom::sdk::Options& o)
      : same_plan_(o.get_bool("same_plan")), plan_micro_batch_(o.get_int("plan_micro_batch")) {}

  void plan(loom::sdk::PlanContext& context) override {
    loom::sdk::log::info("record_oom: config key ", context.config_key);
    if (plan_micro_batch_ != 0) context.plan.micro_batch = plan_micro_batch_;
  }

  bool on_oom(loom::sdk::OomContext& context) override {
    loom::sdk::log::warn("record_oom: step ", context.step, ", micro-batch ", context.plan.micro_batch);
    if (same_plan_) return true;
    if (context.plan.micro_batch % 2 != 0) return false;
    context.plan.micro_batch /= 2;
    context.plan.accumulation *= 2;
    return true;
  }

 private:
  bool same_plan_;
  int64_t plan_micro_batch_;
};

}  // namespace

LOOM_PLUGIN("record_oom", "1.0.0",
            loom::sdk::component<RecordOom>("record_oom", "test: logs its OomContext, halves the micro-batch"))
