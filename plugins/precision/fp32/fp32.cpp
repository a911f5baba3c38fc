// fp32: plain float32 everywhere, with TF32 explicitly off on CUDA, so "fp32" means IEEE float32
// whatever the process defaults are.
#include <loom/sdk/sdk.hpp>

#include <ATen/Context.h>

namespace {

class Fp32 final : public loom::sdk::PrecisionStrategy {
 public:
  explicit Fp32(const loom::sdk::Options&) {}

  void setup(const c10::Device& device) override {
    device_ = device;
    // Legacy setters only: they keep the newer fp32_precision state in sync (see
    // research/libtorch-api.md, "Mixing trap").
    at::globalContext().setAllowTF32CuBLAS(false);
    at::globalContext().setAllowTF32CuDNN(false);
  }

  std::unique_ptr<loom::sdk::Guard> forward_guard() override { return std::make_unique<loom::sdk::Guard>(); }

  // No loss scale: nothing to unscale or update, and no wait for the device (interface 1.1).
  void unscale_gradients_on_device(const std::vector<at::Tensor>&) override {}
  void update_on_device(const at::Tensor&) override {}

  loom::sdk::TextMap manifest() const override {
    return {{"precision", "fp32"}, {"autocast", "off"}, {"tf32_matmul", "off"}, {"tf32_cudnn", "off"},
            {"loss_scale", "none"}};
  }

 private:
  c10::Device device_{c10::kCPU};
};

}  // namespace

LOOM_PLUGIN("fp32", "1.0.0", loom::sdk::component<Fp32>("fp32", "float32 everywhere, TF32 off"))
