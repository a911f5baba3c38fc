// Shared by the in-tree schedules: a linear warm-up over the first warmup_ratio x total updates,
// then a decay shape that each schedule supplies, from 1 down to min_lr_ratio.
#pragma once

#include <loom/sdk/sdk.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace loom::plugins {

class WarmupSchedule : public sdk::Schedule {
 public:
  explicit WarmupSchedule(const sdk::Options& o, bool has_floor = true)
      : warmup_ratio_(o.get_float("warmup_ratio")), min_lr_ratio_(has_floor ? o.get_float("min_lr_ratio") : 0.0) {
    if (warmup_ratio_ < 0 || warmup_ratio_ >= 1) throw sdk::Error("schedule.warmup_ratio must be in [0, 1)");
    if (min_lr_ratio_ < 0 || min_lr_ratio_ > 1) throw sdk::Error("schedule.min_lr_ratio must be in [0, 1]");
  }

  double factor(int64_t step, int64_t total) const override {
    if (total <= 0) return 1.0;
    const int64_t warmup = warmup_steps(total);
    if (step < warmup) return static_cast<double>(step + 1) / static_cast<double>(warmup);
    const double span = static_cast<double>(std::max<int64_t>(1, total - warmup));
    const double progress = std::clamp(static_cast<double>(step - warmup) / span, 0.0, 1.0);
    return min_lr_ratio_ + (1.0 - min_lr_ratio_) * decay(progress, step - warmup);
  }

 protected:
  /// The decay from 1 (progress 0, right after the warm-up) towards 0 (progress 1, one update past the
  /// last: the last update's progress is (total - 1 - warmup) / (total - warmup), as Hugging Face's
  /// schedulers have it, so it ends just above min_lr_ratio).
  virtual double decay(double progress, int64_t since_warmup) const = 0;
  int64_t warmup_steps(int64_t total) const {
    return static_cast<int64_t>(std::floor(warmup_ratio_ * static_cast<double>(total)));
  }
  std::string warmup_text() const {
    char text[96];
    std::snprintf(text, sizeof text, "warm-up %g %% of the steps", 100 * warmup_ratio_);
    return text;
  }
  double warmup_ratio_, min_lr_ratio_;
};

constexpr loom_option_spec kWarmupOption =
    sdk::option_float("warmup_ratio", "0.05", "share of the updates spent warming up linearly", "0..0.999");
constexpr loom_option_spec kFloorOption =
    sdk::option_float("min_lr_ratio", "0.0", "the decay ends at lr x this", "0..1");

}  // namespace loom::plugins
