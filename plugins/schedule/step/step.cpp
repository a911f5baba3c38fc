// step: after an optional warm-up, the learning rate is multiplied by gamma every step_size
// updates (PyTorch's StepLR, counted in updates).
#include "../warmup.hpp"

#include <sstream>

namespace {

class Step final : public loom::plugins::WarmupSchedule {
 public:
  static constexpr loom_option_spec kOptions[] = {
      loom::sdk::option_float("warmup_ratio", "0.0", "share of the updates spent warming up linearly", "0..0.999"),
      loom::sdk::option_int("step_size", "0", "updates between two decays; 0: a third of the run", "0.."),
      loom::sdk::option_float("gamma", "0.1", "factor of each decay", "1e-6..1"),
  };
  explicit Step(const loom::sdk::Options& o)
      : WarmupSchedule(o, /*has_floor=*/false), step_size_(o.get_int("step_size")), gamma_(o.get_float("gamma")) {
    if (step_size_ < 0) throw loom::sdk::Error("schedule.step_size must be >= 0 (0: a third of the run)");
    if (gamma_ <= 0 || gamma_ > 1) throw loom::sdk::Error("schedule.gamma must be in (0, 1]");
  }

  double factor(int64_t step, int64_t total) const override {
    const int64_t warmup = warmup_steps(std::max<int64_t>(total, 1));
    if (step < warmup) return static_cast<double>(step + 1) / static_cast<double>(warmup);
    const int64_t size = step_size_ > 0 ? step_size_ : std::max<int64_t>(1, (total - warmup) / 3);
    return std::pow(gamma_, static_cast<double>((step - warmup) / size));
  }

  std::string describe() const override {
    std::ostringstream gamma;  // (6 significant digits: 1e-06, not to_string's cut "0.000")
    gamma << gamma_;
    return (warmup_ratio_ > 0 ? warmup_text() + ", then " : std::string()) + "x " + gamma.str() +
           " every " + (step_size_ > 0 ? std::to_string(step_size_) + " updates" : std::string("third of the run"));
  }

 protected:
  double decay(double, int64_t) const override { return 1.0; }

 private:
  int64_t step_size_;
  double gamma_;
};

}  // namespace

LOOM_PLUGIN("step", "1.0.0", loom::sdk::component<Step>("step", "multiply the learning rate by gamma every step_size updates"))
