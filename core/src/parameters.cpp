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
#include <c10/util/StringUtil.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>
#include <set>

namespace loom::core {

Parameters Parameters::of(sdk::Model& model) {
  Parameters out;
  // Each distinct tensor once, under the first name the module gives it (tied weights).
  std::map<const void*, std::string> first_name;
  std::map<std::string, const void*> tensor_named;  // (every name, a tied tensor's each)
  std::vector<std::pair<std::string, at::Tensor>> unique;
  for (const auto& item : model.module().named_parameters()) {
    const void* impl = item.value().unsafeGetTensorImpl();
    tensor_named.emplace(item.key(), impl);
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
      if (!group.params[i].defined())
        throw Error("model parameter group '" + group.name + "' gives an undefined tensor for '" + group.names[i] +
                    "': each entry is a parameter of the model's module");
      const void* impl = group.params[i].unsafeGetTensorImpl();
      auto known = first_name.find(impl);
      if (known == first_name.end())
        throw Error("model parameter group '" + group.name + "' names '" + group.names[i] +
                    "', which is not a parameter of the model's module");
      // (names that are not their tensors' were taken in silence: the group's log named others)
      if (const auto named = tensor_named.find(group.names[i]); named == tensor_named.end() || named->second != impl)
        throw Error("model parameter group '" + group.name + "' names '" + group.names[i] + "' beside the tensor of '" +
                    known->second + "': each name is its own tensor's (names[i] is params[i]'s)");
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
    // (a NaN weight decay was taken, and the run ended with "lower trainer.lr" when it made the weights NaN)
    if (group.weight_decay && (*group.weight_decay < 0 || !std::isfinite(*group.weight_decay)))
      throw Error("model parameter group '" + group.name + "': weight_decay is " + std::to_string(*group.weight_decay) +
                  "; it must be finite and >= 0 (or unset: trainer.weight_decay)");
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
    for (const auto& p : g.params) {
      g.names.push_back(first_name.at(p.unsafeGetTensorImpl()));
      // (an expanded view, stride 0, registered as a parameter: the fused optimizers wrote numel
      // elements into its one, past its storage's end, and the heap broke at the next checkpoint;
      // a transposed one they would update out of its gradient's order)
      if (!p.is_contiguous())
        throw Error("model parameter '" + g.names.back() + "' is not contiguous in memory (sizes " + c10::str(p.sizes()) +
                    ", strides " + c10::str(p.strides()) + ": an expanded or transposed view): an update writes a "
                    "parameter's memory in order, as its gradient's; register a contiguous tensor (.contiguous() or "
                    ".clone() of it), or freeze it (a frozen parameter group, or requires_grad false)");
    }
  }
  return out;
}

// Note [Flat gradients]
// Every trainable parameter's gradient is a view into a flat buffer of its device and dtype,
// set before the first backward: autograd then accumulates into the views in place, and the
// host's work on all gradients is one operation per buffer (at batch 8 on CPU the per-parameter
// operations were a tenth of the step). Something else may replace a gradient (a callback
// calling Module::zero_grad, which drops them): each use checks that every gradient is still
// its view and puts it back, copying what it held.
void Parameters::bind_gradients() {
  if (slices_.empty()) {
    std::vector<std::vector<at::Tensor>> buckets;
    for (auto& g : trainable_)
      for (auto& p : g.params) {
        auto it = std::find_if(buckets.begin(), buckets.end(), [&](const auto& b) {
          return b.front().device() == p.device() && b.front().scalar_type() == p.scalar_type();
        });
        if (it == buckets.end()) buckets.push_back({p});
        else it->push_back(p);
      }
    for (const auto& bucket : buckets) {
      int64_t total = 0;
      for (const auto& p : bucket) total += p.numel();
      at::Tensor flat = at::zeros({total}, bucket.front().options().requires_grad(false));
      int64_t offset = 0;
      for (const auto& p : bucket) {
        slices_.emplace_back(p, flat.narrow(0, offset, p.numel()).view(p.sizes()));
        offset += p.numel();
      }
      flats_.push_back(flat);
    }
  }
  at::NoGradGuard no_grad;
  for (auto& [p, view] : slices_) {
    const at::Tensor& grad = p.grad();
    if (grad.defined() && grad.unsafeGetTensorImpl() == view.unsafeGetTensorImpl()) continue;
    if (grad.defined()) view.copy_(grad.is_sparse() ? grad.to_dense() : grad);
    else view.zero_();
    p.mutable_grad() = view;
  }
}

std::vector<at::Tensor> Parameters::gradients() {
  bind_gradients();
  std::vector<at::Tensor> grads;
  grads.reserve(slices_.size());
  for (const auto& [p, view] : slices_) grads.push_back(view);
  return grads;
}

std::vector<at::Tensor> Parameters::flat_gradients() {
  bind_gradients();
  return flats_;
}

std::vector<Parameters::Bucket> Parameters::buckets(int64_t bytes) {
  bind_gradients();
  std::vector<Bucket> out;
  for (const auto& flat : flats_) {
    // The slices of this buffer, in buffer order: (offset, numel, parameter).
    std::vector<std::tuple<int64_t, int64_t, at::Tensor>> here;
    const auto* base = static_cast<const char*>(flat.data_ptr());
    for (const auto& [p, view] : slices_)
      if (view.data_ptr() >= flat.data_ptr() && static_cast<const char*>(view.data_ptr()) < base + flat.nbytes())
        here.emplace_back((static_cast<const char*>(view.data_ptr()) - base) / flat.element_size(), view.numel(), p);
    std::sort(here.begin(), here.end(), [](const auto& a, const auto& b) { return std::get<0>(a) < std::get<0>(b); });
    int64_t end = flat.numel();  // walk from the back
    Bucket bucket;
    for (auto it = here.rbegin(); it != here.rend(); ++it) {
      bucket.params.push_back(std::get<2>(*it));
      const int64_t start = std::get<0>(*it);
      if ((end - start) * flat.element_size() >= bytes || std::next(it) == here.rend()) {
        bucket.slice = flat.narrow(0, start, end - start);
        out.push_back(std::move(bucket));
        bucket = {};
        end = start;
      }
    }
  }
  return out;
}

void Parameters::zero_grad() {
  bind_gradients();
  for (auto& flat : flats_) flat.zero_();
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

at::Tensor gradient_norm(const std::vector<at::Tensor>& gradients) {
  if (gradients.empty()) return at::zeros({});
  return at::stack(at::_foreach_norm(gradients, 2)).norm();
}

at::Tensor clip_coefficient(const at::Tensor& norm, double max_norm) {
  return at::clamp(norm.add(1e-6).reciprocal().mul(max_norm), std::nullopt, 1.0);
}

at::Tensor clip_grad_norm(const std::vector<at::Tensor>& gradients, double max_norm) {
  const at::Tensor total = gradient_norm(gradients);
  if (max_norm > 0 && !gradients.empty()) at::_foreach_mul_(gradients, clip_coefficient(total, max_norm));
  return total;
}

}  // namespace loom::core
