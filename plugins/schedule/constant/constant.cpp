// constant: the peak learning rate (trainer.lr) at every update.
#include <loom/sdk/sdk.hpp>

namespace {

class Constant final : public loom::sdk::Schedule {
 public:
  explicit Constant(const loom::sdk::Options&) {}
  double factor(int64_t, int64_t) const override { return 1.0; }
  std::string describe() const override { return "constant"; }
};

}  // namespace

LOOM_PLUGIN("constant", "1.0.0", loom::sdk::component<Constant>("constant", "the same learning rate at every update"))
