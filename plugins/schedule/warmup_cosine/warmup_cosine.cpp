// warmup_cosine: linear warm-up, then half a cosine down to min_lr_ratio x lr at the last update
// (the seeds' --use_scheduler).
#include "../warmup.hpp"

namespace {

class WarmupCosine final : public loom::plugins::WarmupSchedule {
 public:
  static constexpr loom_option_spec kOptions[] = {loom::plugins::kWarmupOption, loom::plugins::kFloorOption};
  explicit WarmupCosine(const loom::sdk::Options& o) : WarmupSchedule(o) {}
  std::string describe() const override {
    return warmup_text() + ", then cosine to " + std::to_string(min_lr_ratio_).substr(0, 4) + " x lr";
  }

 protected:
  double decay(double progress, int64_t) const override { return 0.5 * (1.0 + std::cos(M_PI * progress)); }
};

}  // namespace

LOOM_PLUGIN("warmup_cosine", "1.0.0",
            loom::sdk::component<WarmupCosine>("warmup_cosine", "linear warm-up, then cosine decay"))
