// The run's parameter groups and the host's gradient handling. See parameters.hpp.
#include <loom/core/error.hpp>
#include <loom/core/parameters.hpp>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/nn/module.h>

#include <map>
#include <set>

namespace loom::core {

Parameters Parameters::of(sdk::Model& model) {
  Parameters out;
  // Each distinct tensor once, under the first name the module gives it (tied weights).
  std::map<const void*, std::string> first_name;
  std::vector<std::pair<std::string, at::Tensor>> unique;
  for (const auto& item : model.module().named_parameters()) {
    const void* impl = item.value().unsafeGetTensorImpl();
    if (first_name.emplace(impl, item.key()).second) {
      unique.emplace_back(item.key(), item.value());
      out.all_.push_back(item.value());
    }
  }

  std::map<const void*, std::string> placed;  // tensor -> the group that has it
  std::vector<sdk::ParameterGroup> groups;
  for (auto group : model.parameter_groups()) {
    if (group.names.size() != group.params.size())
      throw Error("model parameter group '" + group.name + "' has " + std::to_string(group.names.size()) + " names for " +
                  std::to_string(group.params.size()) + " parameters");
    sdk::ParameterGroup kept = group;
    kept.names.clear();
    kept.params.clear();
    for (size_t i = 0; i < group.params.size(); ++i) {
      const void* impl = group.params[i].unsafeGetTensorImpl();
      auto known = first_name.find(impl);
      if (known == first_name.end())
        throw Error("model parameter group '" + group.name + "' names '" + group.names[i] +
                    "', which is not a parameter of the model's module");
      auto [it, inserted] = placed.emplace(impl, group.name);
      if (!inserted) {
        if (it->second == group.name) continue;  // a tied parameter listed under both names
        throw Error("parameter '" + known->second + "' is in two parameter groups, '" + it->second + "' and '" +
                    group.name + "'; each parameter belongs to one group");
      }
      kept.names.push_back(known->second);
      kept.params.push_back(group.params[i]);
    }
    if (group.lr_scale < 0 || !std::isfinite(group.lr_scale))
      throw Error("model parameter group '" + group.name + "': lr_scale must be finite and >= 0");
    groups.push_back(std::move(kept));
  }
  sdk::ParameterGroup decay{"decay", {}, {}, 1.0, std::nullopt, false};
  sdk::ParameterGroup no_decay{"no_decay", {}, {}, 1.0, 0.0, false};
  for (const auto& [name, p] : unique) {
    if (placed.count(p.unsafeGetTensorImpl())) continue;
    if (!p.requires_grad()) continue;  // frozen by the model itself: no gradient, no state
    auto& g = model.decays(name, p) ? decay : no_decay;
    g.names.push_back(name);
    g.params.push_back(p);
  }
  groups.push_back(std::move(decay));
  groups.push_back(std::move(no_decay));

  for (auto& g : groups) {
    if (g.frozen) {
      for (auto& p : g.params) p.set_requires_grad(false);
      continue;
    }
    std::erase_if(g.params, [](const at::Tensor& p) { return !p.requires_grad(); });
    if (!g.params.empty()) out.trainable_.push_back(std::move(g));
  }
  // Names and params stay aligned after the erase above: rebuild names from the module's.
  for (auto& g : out.trainable_) {
    g.names.clear();
    for (const auto& p : g.params) g.names.push_back(first_name.at(p.unsafeGetTensorImpl()));
  }
  return out;
}

std::vector<at::Tensor> Parameters::gradients() {
  std::vector<at::Tensor> grads;
  for (auto& g : trainable_)
    for (auto& p : g.params) {
      if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
      grads.push_back(p.grad());
    }
  return grads;
}

void Parameters::zero_grad() {
  for (auto& g : trainable_)
    for (auto& p : g.params)
      if (p.grad().defined()) p.mutable_grad().zero_();
}

int64_t Parameters::count() const {
  int64_t n = 0;
  for (const auto& p : all_) n += p.numel();
  return n;
}

int64_t Parameters::trainable_count() const {
  int64_t n = 0;
  for (const auto& g : trainable_)
    for (const auto& p : g.params) n += p.numel();
  return n;
}

at::Tensor clip_grad_norm(const std::vector<at::Tensor>& gradients, double max_norm) {
  if (gradients.empty()) return at::zeros({});
  const auto norms = at::_foreach_norm(gradients, 2);
  const at::Tensor total = at::stack(norms).norm();
  if (max_norm > 0) {
    const at::Tensor coef = at::clamp(total.add(1e-6).reciprocal().mul(max_norm), std::nullopt, 1.0);
    at::_foreach_mul_(gradients, coef);
  }
  return total;
}

}  // namespace loom::core
