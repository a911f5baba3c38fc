// fp16_amp: autocast to float16 with loss scaling, dynamic (PyTorch's GradScaler policy) or
// static (`loss_scale = 512`, mmcv's `fp16 = dict(loss_scale=512.0)`; from 1 to 65504).
#include <loom/sdk/sdk.hpp>

namespace {

loom::sdk::GradScaler::Options scaler_options(const loom::sdk::Options& o) {
  loom::sdk::GradScaler::Options s;
  const std::string scale = std::string(loom::sdk::trim(o.get_string("loss_scale")));
  if (scale == "dynamic") {
    s.dynamic = true;
    s.init_scale = o.get_float("init_scale");
  } else {
    const auto value = loom::sdk::parse_float(scale);
    if (!value || *value <= 0)
      throw loom::sdk::Error("precision.loss_scale = '" + scale + "' (fp16_amp): expected 'dynamic' or a positive number such as 512");
    // float16 holds at most 65504: a larger static scale overflows every step's gradients, and every
    // step would be skipped.
    if (*value > 65504)
      throw loom::sdk::Error("precision.loss_scale = " + scale + " (fp16_amp) is more than float16's largest value (65504): " +
                             "every step's gradients would overflow and be skipped; use 'dynamic', or a static scale "
                             "such as 512 or 1024");
    // Below 1 it shrinks the loss, and float16 gradients underflow to zero: nothing would learn.
    if (*value < 1)
      throw loom::sdk::Error("precision.loss_scale = " + scale + " (fp16_amp) is below 1: it shrinks the loss, so more of its " +
                             "float16 gradients round to zero (at 1e-10 all of them: nothing learns); use 'dynamic', or " +
                             "a static scale such as 512 or 1024");
    s.dynamic = false;
    s.init_scale = *value;
  }
  s.growth_factor = o.get_float("growth_factor");
  s.backoff_factor = o.get_float("backoff_factor");
  s.growth_interval = o.get_int("growth_interval");
  return s;
}

class Fp16Amp final : public loom::sdk::PrecisionStrategy {
 public:
  static constexpr loom_option_spec kOptions[] = {
      loom::sdk::option_string("loss_scale", "dynamic", "'dynamic', or a static scale such as 512 (1 to 65504)"),
      loom::sdk::option_float("init_scale", "65536", "dynamic: the first scale (2^16)", "1..1e30"),
      loom::sdk::option_float("growth_factor", "2.0", "dynamic: scale x this after growth_interval finite steps", "1.001..1000"),
      loom::sdk::option_float("backoff_factor", "0.5", "dynamic: scale x this after a step with inf/NaN gradients", "1e-6..0.999"),
      loom::sdk::option_int("growth_interval", "2000", "dynamic: finite steps in a row before the scale grows", "1..1000000000"),
      loom::sdk::option_bool("tf32", "false", "TF32 for the float32 operations outside autocast (CUDA)"),
  };

  explicit Fp16Amp(const loom::sdk::Options& o) : scaler_(scaler_options(o)), tf32_(o.get_bool("tf32")) {}

  void setup(const c10::Device& device) override {
    device_type_ = device.type();
    if (device.is_cpu()) {
      loom::sdk::log::warn("fp16_amp on CPU: float16 has no fast path on most CPUs and is here for testing; "
                           "use bf16_amp or fp32 to train on CPU");
    } else if (!device.is_cuda()) {
      throw loom::sdk::Error("fp16_amp runs on CUDA (or, slowly, CPU), not on " + device.str());
    }
    loom::sdk::set_tf32(tf32_ && device.is_cuda());
  }

  std::unique_ptr<loom::sdk::Guard> forward_guard() override {
    struct Scope final : loom::sdk::Guard {
      explicit Scope(c10::DeviceType t) : autocast(t, at::kHalf) {}
      loom::sdk::AutocastGuard autocast;
    };
    return std::make_unique<Scope>(device_type_);
  }

  at::Tensor scale_loss(const at::Tensor& loss) override { return scaler_.scale(loss); }
  bool unscale_gradients(const std::vector<at::Tensor>& gradients) override { return scaler_.unscale(gradients); }
  void update(bool found_non_finite) override { scaler_.update(found_non_finite); }
  void unscale_gradients_on_device(const std::vector<at::Tensor>& gradients) override {
    scaler_.unscale_on_device(gradients);
  }
  void update_on_device(const at::Tensor& found_non_finite) override { scaler_.update_on_device(found_non_finite); }

  loom::sdk::TextMap manifest() const override {
    const char* tf32 = tf32_ && device_type_ == c10::kCUDA ? "on" : "off";
    return {{"precision", "fp16_amp"}, {"autocast", "float16"}, {"tf32_matmul", tf32}, {"tf32_cudnn", tf32},
            {"loss_scale", scaler_.describe()}};
  }

  loom::sdk::State state_dict() const override { return scaler_.state_dict(); }
  void load_state_dict(const loom::sdk::State& state) override { scaler_.load_state_dict(state); }

 private:
  loom::sdk::GradScaler scaler_;
  bool tf32_;
  c10::DeviceType device_type_ = c10::kCUDA;
};

}  // namespace

LOOM_PLUGIN("fp16_amp", "1.0.0",
            loom::sdk::component<Fp16Amp>("fp16_amp", "autocast to float16 with dynamic or static loss scaling"))
