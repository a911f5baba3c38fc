// single: one process on one device. Resolves the user's device choice: auto (the first GPU if
// there is one, else the CPU), cpu, cuda, cuda:N.
#include <loom/sdk/sdk.hpp>

#include <torch/cuda.h>

namespace {

class Single final : public loom::sdk::ParallelStrategy {
 public:
  explicit Single(const loom::sdk::Options&) {}

  void setup(const std::string& device) override {
    const bool cuda = torch::cuda::is_available();
    if (device == "auto") {
      device_ = cuda ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
      return;
    }
    c10::Device parsed(c10::kCPU);
    try {
      parsed = c10::Device(device);
    } catch (const std::exception&) {
      throw loom::sdk::Error("trainer.device = '" + device + "' is not a device; use auto, cpu, cuda or cuda:N");
    }
    if (parsed.is_cuda()) {
      if (!cuda)
        throw loom::sdk::Error("trainer.device = '" + device +
                               "' but no CUDA device is available to this process; use trainer.device=cpu (or auto)");
      const int64_t index = parsed.has_index() ? parsed.index() : 0;
      const auto count = static_cast<int64_t>(torch::cuda::device_count());
      if (index >= count)
        throw loom::sdk::Error("trainer.device = '" + device + "' but this machine has " + std::to_string(count) +
                               " CUDA device(s)");
      parsed = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
    } else if (!parsed.is_cpu()) {
      throw loom::sdk::Error("trainer.device = '" + device + "': parallel 'single' runs on cpu or cuda");
    }
    device_ = parsed;
  }

  c10::Device device() const override { return device_; }

 private:
  c10::Device device_{c10::kCPU};
};

}  // namespace

LOOM_PLUGIN("single", "1.0.0", loom::sdk::component<Single>("single", "one process on one device"))
