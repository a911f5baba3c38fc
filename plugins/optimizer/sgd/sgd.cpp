// sgd: stochastic gradient descent with momentum (optionally Nesterov), one fused kernel per
// parameter group (at::_fused_sgd_), with PyTorch's semantics: the first step sets the
// momentum buffer to the gradient.
#include "../grouped_optimizer.hpp"

#include <ATen/ops/_fused_sgd.h>
#include <ATen/ops/full.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros_like.h>

#include <cstdio>

namespace {

class Sgd final : public loom::plugins::GroupedOptimizer {
 public:
  static constexpr loom_option_spec kOptions[] = {
      loom::sdk::option_float("weight_decay", "0.0", "L2 weight decay added to the gradient (groups may override it)", "0..10"),
      loom::sdk::option_float("momentum", "0.9", "momentum; 0 turns it off", "0..0.999999"),
      loom::sdk::option_bool("nesterov", "false", "Nesterov momentum"),
      loom::sdk::option_float("dampening", "0.0", "dampening of the momentum", "0..1"),
  };

  explicit Sgd(const loom::sdk::Options& o)
      : GroupedOptimizer("sgd", o.get_float("momentum") > 0 ? std::vector<std::string>{"momentum_buffer"}
                                                             : std::vector<std::string>{},
                         o.get_float("weight_decay")),
        momentum_(o.get_float("momentum")), dampening_(o.get_float("dampening")), nesterov_(o.get_bool("nesterov")) {
    if (weight_decay() < 0) throw loom::sdk::Error("optimizer.weight_decay must be >= 0");
    if (momentum_ < 0) throw loom::sdk::Error("optimizer.momentum must be >= 0");
    if (nesterov_ && (momentum_ <= 0 || dampening_ != 0))
      throw loom::sdk::Error("optimizer.sgd.nesterov needs momentum > 0 and dampening 0 (as PyTorch's SGD)");
  }

  int64_t state_bytes(const at::Tensor& p) const override {
    return momentum_ > 0 ? p.numel() * static_cast<int64_t>(p.element_size()) : 0;  // the momentum buffer
  }

  std::string describe() const override {
    char text[128];
    std::snprintf(text, sizeof text, "sgd: momentum %g%s, dampening %g, weight decay %g (fused)", momentum_,
                  nesterov_ ? " (Nesterov)" : "", dampening_, weight_decay());
    return text;
  }

 protected:
  at::Tensor make_state(size_t, const at::Tensor& p) const override {
    return at::zeros_like(p, at::MemoryFormat::Preserve);
  }

  void update(std::vector<at::Tensor>& params, std::vector<at::Tensor>& grads,
              std::vector<std::vector<at::Tensor>>& state, double lr, double weight_decay) override {
    // Without momentum there is no buffer, and the kernel wants an empty list.
    at::_fused_sgd_(params, grads, state.empty() ? std::vector<at::Tensor>{} : state[0], weight_decay, momentum_, lr,
                    dampening_, nesterov_, /*maximize=*/false, /*is_first_step=*/steps_taken() == 0);
  }

  // The first call starts the momentum buffers where it is not skipped. A skipped first call
  // (fp16_amp's scale coming down) leaves them at zero, and the host cannot know without waiting:
  // the kernel's next call would compute momentum x 0 + (1 - dampening) x grad, PyTorch's first
  // update only where dampening is 0. With dampening, a device flag says whether the buffers have
  // started; until they have, each buffer is set beforehand to (dampening / momentum) x grad, so
  // that the kernel's momentum x buffer + (1 - dampening) x grad is the gradient itself (to a
  // rounding), as PyTorch's first step.
  void update_on_device(std::vector<at::Tensor>& params, std::vector<at::Tensor>& grads,
                        std::vector<std::vector<at::Tensor>>& state, const at::Tensor& lr, double weight_decay,
                        const at::Tensor& found_inf, const at::Tensor& divisor) override {
    if (!state.empty() && dampening_ > 0 && steps_called() > 0 && !known_started_)
      start_buffers(params, grads, state[0], weight_decay, found_inf, divisor);
    at::_fused_sgd_(params, grads, state.empty() ? std::vector<at::Tensor>{} : state[0], weight_decay, momentum_, lr,
                    dampening_, nesterov_, /*maximize=*/false, /*is_first_step=*/steps_called() == 0,
                    /*grad_scale=*/divisor.defined() ? std::optional<at::Tensor>(divisor) : std::nullopt, found_inf);
  }

 public:
  void step_on_device(const at::Tensor& lr, const at::Tensor& found_non_finite) override {
    GroupedOptimizer::step_on_device(lr, found_non_finite);
    note_started(found_non_finite);
  }
  void step_on_device_dividing(const at::Tensor& lr, const at::Tensor& found_non_finite, const at::Tensor& divisor,
                               const std::vector<at::Tensor>& grads) override {
    GroupedOptimizer::step_on_device_dividing(lr, found_non_finite, divisor, grads);
    note_started(found_non_finite);
  }
  void load_state_dict(const loom::sdk::State& state) override {
    GroupedOptimizer::load_state_dict(state);
    started_ = at::Tensor();  // from the loaded count of updates taken, at the next call
    known_started_ = steps_taken() > 0;
  }

 private:
  // The flag on the buffers' device: 1 once an update was taken, read by the kernels' stream only.
  // Undefined before the first call and after a checkpoint is loaded; there, the count of updates
  // taken is the host's (no read from the device).
  const at::Tensor& started(const at::Tensor& like) {
    if (!started_.defined())
      started_ = at::full({1}, steps_taken() > 0 ? 1.0 : 0.0, like.options().dtype(at::kFloat));
    return started_;
  }
  void note_started(const at::Tensor& found_non_finite) {
    if (dampening_ <= 0 || momentum_ <= 0 || known_started_) return;
    const at::Tensor taken = found_non_finite.reshape({1}).to(at::kFloat).neg().add_(1);
    if (started_.defined()) started_.clamp_min_(taken);
    else started_ = taken.clone();
    // On the CPU the host reads the flag for nothing (no device to wait for): once started, the
    // buffers are left to the kernel. On a device it stays there (a read would wait for it).
    if (started_.is_cpu()) known_started_ = started_.item<float>() > 0;
  }
  void start_buffers(std::vector<at::Tensor>& params, std::vector<at::Tensor>& grads, std::vector<at::Tensor>& buffers,
                     double weight_decay, const at::Tensor& found_inf, const at::Tensor& divisor) {
    const at::Tensor keep = started(found_inf).add(found_inf).gt(0);  // started, or this call is skipped
    const double ratio = dampening_ / momentum_;
    const at::Tensor scale = divisor.defined() ? divisor.reciprocal().mul_(ratio) : at::Tensor();
    for (size_t i = 0; i < buffers.size(); ++i) {  // (one temporary, and the buffer written in place)
      at::Tensor g = scale.defined() ? grads[i].mul(scale) : grads[i].mul(ratio);
      if (weight_decay != 0) g.add_(params[i], weight_decay * ratio);
      at::where_out(buffers[i], keep, buffers[i], g);
    }
  }

  double momentum_, dampening_;
  bool nesterov_;
  at::Tensor started_;
  bool known_started_ = false;  // the host knows an update was taken: start_buffers is done
};

}  // namespace

LOOM_PLUGIN("sgd", "1.0.0", loom::sdk::component<Sgd>("sgd", "SGD with momentum (Nesterov optional), fused"))
