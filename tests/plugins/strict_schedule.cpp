// strict: a constant schedule that holds the host to Schedule::factor's contract, as a third
// party's may: asked of an update outside 0 ... total - 1, it throws (the host asked factor(total,
// total) for the step on the device's table of rates).
#include <loom/sdk/sdk.hpp>

#include <string>

namespace {

class Strict final : public loom::sdk::Schedule {
 public:
  explicit Strict(const loom::sdk::Options&) {}
  double factor(int64_t step, int64_t total) const override {
    if (step < 0 || step >= total)
      throw loom::sdk::Error("strict: asked for update " + std::to_string(step) + " of " + std::to_string(total));
    return 1.0;
  }
  std::string describe() const override { return "strict"; }
};

}  // namespace

LOOM_PLUGIN("strict_schedule", "1.0.0",
            loom::sdk::component<Strict>("strict", "test: constant, and throws where asked of an update outside 0 ... total - 1"))
