// adamw: Adam with decoupled weight decay, one fused kernel per parameter group
// (at::_fused_adamw_, CPU and CUDA) instead of a dozen ops per parameter.
#include "../grouped_optimizer.hpp"

#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

#include <cstdio>

namespace {

class AdamW final : public loom::plugins::GroupedOptimizer {
 public:
  static constexpr loom_option_spec kOptions[] = {
      loom::sdk::option_float("weight_decay", "0.05", "decoupled weight decay (groups may override it)", "0..10"),
      loom::sdk::option_float("beta1", "0.9", "decay of the first moment", "0..0.999999"),
      loom::sdk::option_float("beta2", "0.999", "decay of the second moment", "0..0.999999"),
      loom::sdk::option_float("eps", "1e-8", "added to the second moment's root", "1e-30..1"),
  };

  explicit AdamW(const loom::sdk::Options& o)
      : GroupedOptimizer("adamw", {"exp_avg", "exp_avg_sq", "step"}, o.get_float("weight_decay")),
        beta1_(o.get_float("beta1")), beta2_(o.get_float("beta2")), eps_(o.get_float("eps")) {
    if (weight_decay() < 0) throw loom::sdk::Error("optimizer.weight_decay must be >= 0");
    if (beta1_ < 0 || beta1_ >= 1 || beta2_ < 0 || beta2_ >= 1)
      throw loom::sdk::Error("optimizer.beta1 and beta2 must be in [0, 1)");
    if (eps_ <= 0) throw loom::sdk::Error("optimizer.eps must be positive");
  }

  int64_t state_bytes(const at::Tensor& p) const override {
    return 2 * p.numel() * static_cast<int64_t>(p.element_size()) + 4;  // two moments and a float step
  }

  std::string describe() const override {
    char text[128];
    std::snprintf(text, sizeof text, "adamw: betas %g/%g, eps %g, weight decay %g (fused)", beta1_, beta2_, eps_,
                  weight_decay());
    return text;
  }

 protected:
  at::Tensor make_state(size_t slot, const at::Tensor& p) const override {
    return slot == 2 ? at::zeros({}, p.options().dtype(at::kFloat)) : at::zeros_like(p, at::MemoryFormat::Preserve);
  }

  void update(std::vector<at::Tensor>& params, std::vector<at::Tensor>& grads,
              std::vector<std::vector<at::Tensor>>& state, double lr, double weight_decay) override {
    at::_foreach_add_(state[2], 1);
    at::_fused_adamw_(params, grads, state[0], state[1], /*max_exp_avg_sqs=*/{}, state[2], lr, beta1_, beta2_,
                      weight_decay, eps_, /*amsgrad=*/false, /*maximize=*/false);
  }

  void update_on_device(std::vector<at::Tensor>& params, std::vector<at::Tensor>& grads,
                        std::vector<std::vector<at::Tensor>>& state, const at::Tensor& lr, double weight_decay,
                        const at::Tensor& found_inf, const at::Tensor& divisor) override {
    // The step count moves by 1 - found_inf (PyTorch adds 1 and takes found_inf back off); the
    // kernel reads it for the bias correction and returns early where found_inf is set.
    const at::Tensor taken = found_inf.reshape({}).neg().add_(1);
    at::_foreach_add_(state[2], std::vector<at::Tensor>(state[2].size(), taken));
    at::_fused_adamw_(params, grads, state[0], state[1], /*max_exp_avg_sqs=*/{}, state[2], lr, beta1_, beta2_,
                      weight_decay, eps_, /*amsgrad=*/false, /*maximize=*/false,
                      /*grad_scale=*/divisor.defined() ? std::optional<at::Tensor>(divisor) : std::nullopt, found_inf);
  }

 private:
  double beta1_, beta2_, eps_;
};

}  // namespace

LOOM_PLUGIN("adamw", "1.0.0", loom::sdk::component<AdamW>("adamw", "AdamW, fused per parameter group"))
