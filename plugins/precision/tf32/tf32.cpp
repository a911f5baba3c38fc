// tf32: float32 parameters and activations, with TF32 tensor-core matmuls and cuDNN
// convolutions on CUDA (Ampere and newer). On CPU TF32 does not exist: the run is plain float32,
// and the plugin says so once.
#include <loom/sdk/sdk.hpp>

namespace {

class Tf32 final : public loom::sdk::PrecisionStrategy {
 public:
  explicit Tf32(const loom::sdk::Options&) {}

  void setup(const c10::Device& device) override {
    on_gpu_ = device.is_cuda();
    if (!on_gpu_) {
      loom::sdk::log::info("tf32: TF32 is a CUDA tensor-core mode and does not apply on ", device.str(),
                           "; training in plain float32");
      loom::sdk::set_tf32(false);
      return;
    }
    if (loom::sdk::cuda_capability(device) < 80)
      loom::sdk::log::warn("tf32: ", device.str(), " has no TF32 tensor cores (compute capability < 8.0); "
                           "matmuls run in float32");
    loom::sdk::set_tf32(true);
  }

  std::unique_ptr<loom::sdk::Guard> forward_guard() override { return std::make_unique<loom::sdk::Guard>(); }

  // No loss scale: nothing to unscale or update, and no wait for the device (interface 1.1).
  void unscale_gradients_on_device(const std::vector<at::Tensor>&) override {}
  void update_on_device(const at::Tensor&) override {}

  loom::sdk::TextMap manifest() const override {
    const char* tf32 = on_gpu_ ? "on" : "off (cpu)";
    return {{"precision", "tf32"}, {"autocast", "off"}, {"tf32_matmul", tf32}, {"tf32_cudnn", tf32},
            {"loss_scale", "none"}};
  }

 private:
  bool on_gpu_ = false;
};

}  // namespace

LOOM_PLUGIN("tf32", "1.0.0", loom::sdk::component<Tf32>("tf32", "float32 with TF32 matmuls and convolutions on CUDA"))
