// warmup_linear: linear warm-up, then a straight line down to min_lr_ratio x lr at the last update.
#include "../warmup.hpp"

namespace {

class WarmupLinear final : public loom::plugins::WarmupSchedule {
 public:
  static constexpr loom_option_spec kOptions[] = {loom::plugins::kWarmupOption, loom::plugins::kFloorOption};
  explicit WarmupLinear(const loom::sdk::Options& o) : WarmupSchedule(o) {}
  std::string describe() const override {
    return warmup_text() + ", then linear to " + std::to_string(min_lr_ratio_).substr(0, 4) + " x lr";
  }

 protected:
  double decay(double progress, int64_t) const override { return 1.0 - progress; }
};

}  // namespace

LOOM_PLUGIN("warmup_linear", "1.0.0",
            loom::sdk::component<WarmupLinear>("warmup_linear", "linear warm-up, then linear decay"))
