// sgd: stochastic gradient descent with momentum (optionally Nesterov), one fused kernel per
// parameter group (at::_fused_sgd_), with PyTorch's semantics: the first step sets the
// momentum buffer to the gradient.
#include "../grouped_optimizer.hpp"

#include <ATen/ops/_fused_sgd.h>
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

  // The first call starts the momentum buffers, skipped or not: the host cannot know without
  // waiting. A skipped first call leaves them at zero, and the next one then computes
  // momentum x 0 + (1 - dampening) x grad, which is the first step's update when dampening is 0
  // (the default); with dampening, that one update is (1 - dampening) times smaller.
  void update_on_device(std::vector<at::Tensor>& params, std::vector<at::Tensor>& grads,
                        std::vector<std::vector<at::Tensor>>& state, const at::Tensor& lr, double weight_decay,
                        const at::Tensor& found_inf, const at::Tensor& divisor) override {
    at::_fused_sgd_(params, grads, state.empty() ? std::vector<at::Tensor>{} : state[0], weight_decay, momentum_, lr,
                    dampening_, nesterov_, /*maximize=*/false, /*is_first_step=*/steps_called() == 0,
                    /*grad_scale=*/divisor.defined() ? std::optional<at::Tensor>(divisor) : std::nullopt, found_inf);
  }

 private:
  double momentum_, dampening_;
  bool nesterov_;
};

}  // namespace

LOOM_PLUGIN("sgd", "1.0.0", loom::sdk::component<Sgd>("sgd", "SGD with momentum (Nesterov optional), fused"))
