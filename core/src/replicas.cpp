// Note [Replicas in one process]
// parallel = data_parallel trains one process on several devices, as torch.nn.DataParallel does:
// the strategy (ParallelStrategy 1.2, devices()) only says which devices; the host, which owns the
// model's plugin, the precision and the gradients, does the rest here.
//  - Replicas are built once, through the model's plugin with the run's options (a plugin's module
//    is arbitrary C++: there is no generic clone), and checked to have the primary's parameters.
//  - Before a step's first forward (and an evaluation) the primary's parameters and buffers are
//    copied into every replica: only the primary is updated, and a replica's buffer updates
//    (BatchNorm statistics) are dropped, as DataParallel drops them.
//  - The plan's micro-batch is per device (memory policies plan one device's memory); the process
//    loads micro-batch x devices samples per micro-step and cuts them along the first dimension.
//  - Forwards run one after the other from the training thread (on CUDA a launch returns at
//    once, so the devices compute side by side); the losses are summed on the primary's device
//    and one backward from that sum runs every device's part on autograd's worker thread for
//    that device, in parallel. CPU replicas run one after the other: they exist so that the
//    equivalence with `single` is tested without GPUs.
//  - After the step's last micro-batch each replica's gradients (flat buffers, like the
//    primary's) are added into the primary's, and the trainer divides by the global count as for
//    any strategy: the update is that of one device with the whole batch.
#include "replicas.hpp"

#include <loom/core/error.hpp>

#include <ATen/core/grad_mode.h>
#include <c10/core/DeviceGuard.h>
#include <torch/nn/module.h>

#include "trainer_internal.hpp"

#include <map>

namespace loom::core {

namespace {

/// The module's distinct parameters (tied ones once) then its buffers, with their names.
std::vector<std::pair<std::string, at::Tensor>> tensors_of(sdk::Model& model) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::map<const void*, bool> seen;
  for (const auto& item : model.module().named_parameters())
    if (seen.emplace(item.value().unsafeGetTensorImpl(), true).second) out.emplace_back(item.key(), item.value());
  for (const auto& item : model.module().named_buffers()) out.emplace_back("buffer " + item.key(), item.value());
  return out;
}

std::string shape_of(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "] " + std::string(c10::toString(t.scalar_type()));
}

}  // namespace

std::string describe_devices(const std::vector<c10::Device>& devices) {
  std::string out;
  for (const auto& d : devices) out += (out.empty() ? "" : ", ") + d.str();
  return out;
}

Replicas::Replicas(sdk::Model& primary, std::vector<c10::Device> devices, const std::function<Created<sdk::Model>()>& make,
                   const std::string& model_name)
    : primary_(primary), devices_(std::move(devices)) {
  const auto mine = tensors_of(primary_);
  for (const auto& [name, tensor] : mine) primary_tensors_.push_back(tensor);
  at::Generator cpu = detail::cpu_generator();
  const at::Tensor rng = cpu.get_state();
  for (size_t i = 1; i < devices_.size(); ++i) {
    Created<sdk::Model> model = make();
    model->module().to(devices_[i]);
    const auto theirs = tensors_of(*model);
    std::vector<at::Tensor> tensors;
    for (size_t k = 0; k < std::max(mine.size(), theirs.size()); ++k) {
      const bool same = k < mine.size() && k < theirs.size() && mine[k].first == theirs[k].first &&
                        mine[k].second.sizes() == theirs[k].second.sizes() &&
                        mine[k].second.scalar_type() == theirs[k].second.scalar_type();
      if (!same)
        throw Error("model '" + model_name + "' built a second time for " + devices_[i].str() + " differs from the first: " +
                    (k < mine.size() ? mine[k].first + " " + shape_of(mine[k].second) : std::string("(nothing)")) +
                    " against " +
                    (k < theirs.size() ? theirs[k].first + " " + shape_of(theirs[k].second) : std::string("(nothing)")) +
                    "; parallel = data_parallel needs a model whose structure depends on its options and the data "
                    "alone. Use parallel = single, or ddp");
      tensors.push_back(theirs[k].second);
    }
    replica_tensors_.push_back(std::move(tensors));
    parameters_.push_back(Parameters::of(*model));
    models_.push_back(std::move(model));
  }
  cpu.set_state(rng);
  copy_weights();
}

void Replicas::copy_weights() {
  at::NoGradGuard no_grad;
  for (auto& tensors : replica_tensors_)
    for (size_t k = 0; k < tensors.size(); ++k) tensors[k].copy_(primary_tensors_[k], /*non_blocking=*/true);
}

std::vector<sdk::Batch> Replicas::scatter(const sdk::Batch& batch) const {
  int64_t samples = -1;
  std::string first;
  for (const auto& [key, tensor] : batch) {
    const int64_t n = tensor.dim() > 0 ? tensor.size(0) : -1;
    if (samples < 0) {
      samples = n;
      first = key;
    }
    if (n < 0 || n != samples)
      throw Error("parallel = data_parallel cuts each batch along its first dimension, but batch field '" + key +
                  "' has shape " + shape_of(tensor) + " where '" + first + "' has " + std::to_string(samples) +
                  " samples; every field of a batch needs one row per sample");
  }
  const int64_t parts = std::min<int64_t>(size(), std::max<int64_t>(samples, 1));
  std::vector<sdk::Batch> out(static_cast<size_t>(parts));
  for (const auto& [key, tensor] : batch) {
    const auto pieces = tensor.tensor_split(parts, 0);
    for (int64_t i = 0; i < parts; ++i)
      out[static_cast<size_t>(i)][key] = pieces[static_cast<size_t>(i)].to(devices_[static_cast<size_t>(i)], /*non_blocking=*/true);
  }
  return out;
}

sdk::ModelOutput Replicas::forward(const std::vector<sdk::Batch>& parts, bool train) {
  std::vector<sdk::ModelOutput> outs;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i == 0) {
      outs.push_back(primary_.forward(parts[0], train));
      continue;
    }
    const c10::DeviceGuard guard(devices_[i]);
    sdk::Model& model = *models_[i - 1];
    model.module().train(train);
    outs.push_back(model.forward(parts[i], train));
  }
  // (as one device's forward is checked, trainer_step.cpp: an undefined count was LibTorch's
  // "Expected a proper Tensor but got None" at the sum below; a review)
  for (sdk::ModelOutput& out : outs) out = train ? detail::checked_for_backward(std::move(out)) : detail::checked_counts(std::move(out));
  sdk::ModelOutput sum = outs.front();
  const c10::Device home = devices_.front();
  for (auto& [name, value] : sum.metrics)
    if (!value.count.defined()) value.count = sum.count;
  for (size_t i = 1; i < outs.size(); ++i) {
    const sdk::ModelOutput& o = outs[i];
    sum.loss_sum = sum.loss_sum + o.loss_sum.to(home);
    sum.count = sum.count + o.count.to(home);
    for (const auto& [name, value] : o.metrics) {
      const at::Tensor count = (value.count.defined() ? value.count : o.count).detach().to(home);
      auto it = sum.metrics.find(name);
      if (it == sum.metrics.end()) {
        sum.metrics[name] = sdk::MetricValue{value.sum.detach().to(home), count};
      } else {
        it->second.sum = it->second.sum.detach() + value.sum.detach().to(home);
        it->second.count = it->second.count.detach() + count;
      }
    }
  }
  return sum;
}

void Replicas::zero_grad() {
  for (auto& p : parameters_) p.zero_grad();
}

void Replicas::add_gradients_to(Parameters& primary) {
  at::NoGradGuard no_grad;
  const std::vector<at::Tensor> mine = primary.flat_gradients();
  for (auto& replica : parameters_) {
    const std::vector<at::Tensor> theirs = replica.flat_gradients();
    if (theirs.size() != mine.size())
      throw Error("internal: a replica's gradients are in " + std::to_string(theirs.size()) + " buffers, the model's in " +
                  std::to_string(mine.size()));
    for (size_t k = 0; k < mine.size(); ++k) mine[k].add_(theirs[k].to(mine[k].device(), /*non_blocking=*/true));
  }
}

}  // namespace loom::core
