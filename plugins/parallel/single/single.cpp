// single: one process on one device. Resolves the user's device choice: auto (the first GPU if
// there is one, else the CPU), cpu, cuda, cuda:N.
#include <loom/sdk/device.hpp>
#include <loom/sdk/sdk.hpp>

namespace {

class Single final : public loom::sdk::ParallelStrategy {
 public:
  explicit Single(const loom::sdk::Options&) {}

  void setup(const std::string& device) override {
    if (device == "auto")
      device_ = torch::cuda::is_available() ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
    else
      device_ = loom::sdk::parse_device(device, "trainer.device");
  }

  c10::Device device() const override { return device_; }

 private:
  c10::Device device_{c10::kCPU};
};

}  // namespace

LOOM_PLUGIN("single", "1.0.0", loom::sdk::component<Single>("single", "one process on one device"))
