// bf16_amp: autocast to bfloat16, no loss scaling (bfloat16 has float32's exponent range). On
// CUDA it needs compute capability 8.0 (Ampere) or newer; on CPU it works everywhere.
#include <loom/sdk/sdk.hpp>

namespace {

class Bf16Amp final : public loom::sdk::PrecisionStrategy {
 public:
  static constexpr loom_option_spec kOptions[] = {
      loom::sdk::option_bool("tf32", "false", "TF32 for the float32 operations outside autocast (CUDA)"),
  };

  explicit Bf16Amp(const loom::sdk::Options& o) : tf32_(o.get_bool("tf32")) {}

  void setup(const c10::Device& device) override {
    device_type_ = device.type();
    if (device.is_cuda()) {
      const int cc = loom::sdk::cuda_capability(device);
      if (cc < 80)
        throw loom::sdk::Error("bf16_amp needs a GPU with bfloat16 tensor cores (compute capability 8.0, Ampere, or "
                               "newer); " + device.str() + " has " + std::to_string(cc / 10) + "." +
                               std::to_string(cc % 10) + ": use fp16_amp");
    } else if (!device.is_cpu()) {
      throw loom::sdk::Error("bf16_amp runs on CUDA or CPU, not on " + device.str());
    }
    loom::sdk::set_tf32(tf32_ && device.is_cuda());
  }

  std::unique_ptr<loom::sdk::Guard> forward_guard() override {
    struct Scope final : loom::sdk::Guard {
      explicit Scope(c10::DeviceType t) : autocast(t, at::kBFloat16) {}
      loom::sdk::AutocastGuard autocast;
    };
    return std::make_unique<Scope>(device_type_);
  }

  // No loss scale: nothing to unscale or update, and no wait for the device (interface 1.1).
  void unscale_gradients_on_device(const std::vector<at::Tensor>&) override {}
  void update_on_device(const at::Tensor&) override {}

  loom::sdk::TextMap manifest() const override {
    const char* tf32 = tf32_ && device_type_ == c10::kCUDA ? "on" : "off";
    return {{"precision", "bf16_amp"}, {"autocast", "bfloat16"}, {"tf32_matmul", tf32}, {"tf32_cudnn", tf32},
            {"loss_scale", "none"}};
  }

 private:
  bool tf32_;
  c10::DeviceType device_type_ = c10::kCUDA;
};

}  // namespace

LOOM_PLUGIN("bf16_amp", "1.0.0", loom::sdk::component<Bf16Amp>("bf16_amp", "autocast to bfloat16, no loss scaling"))
