// Model replicas on further devices of one process (parallel = data_parallel): see Note [Replicas
// in one process] in replicas.cpp.
#pragma once

#include <loom/core/parameters.hpp>
#include <loom/core/plugin_registry.hpp>

#include <loom/sdk/model.hpp>

#include <functional>
#include <string>
#include <vector>

namespace loom::core {

class Replicas {
 public:
  /// `primary` is the trained model, set up and on devices[0]; `make` builds one more model
  /// through its plugin (created, set up, given the dataset's tables, still on the CPU). Builds
  /// a replica on each further device and checks that it has the primary's parameters (names,
  /// shapes, dtypes): a model whose build depends on more than its options cannot be replicated.
  /// The CPU generator's state is kept: building replicas draws no random numbers of the run.
  Replicas(sdk::Model& primary, std::vector<c10::Device> devices, const std::function<Created<sdk::Model>()>& make,
           const std::string& model_name);

  /// The devices, the primary's first.
  const std::vector<c10::Device>& devices() const { return devices_; }
  int64_t size() const { return static_cast<int64_t>(devices_.size()); }

  /// Copies the primary's parameters and buffers into every replica: before a step's first
  /// forward (the primary alone is updated) and before an evaluation.
  void copy_weights();

  /// Cuts `batch` along its first dimension into as many parts as there are devices (fewer when it
  /// has fewer samples; sizes differ by one at most), part i on device i. Throws Error when the
  /// batch's tensors disagree on the number of samples.
  std::vector<sdk::Batch> scatter(const sdk::Batch& batch) const;

  /// Runs each part through its device's model (part 0 through the primary, whose training mode
  /// the caller set) and sums the outputs on the primary's device: the loss sum (differentiable:
  /// one backward from it reaches every replica), the count and each metric's sum and count.
  sdk::ModelOutput forward(const std::vector<sdk::Batch>& parts, bool train);

  /// Zeroes the replicas' gradients.
  void zero_grad();
  /// Adds the replicas' gradients into the primary's (`primary` holds them in flat buffers of the
  /// same layout as each replica's).
  void add_gradients_to(Parameters& primary);

 private:
  sdk::Model& primary_;
  std::vector<c10::Device> devices_;
  std::vector<Created<sdk::Model>> models_;  // devices_[1..]
  std::vector<Parameters> parameters_;       // each replica's, gradients in flat buffers
  std::vector<at::Tensor> primary_tensors_;  // the primary's parameters then buffers
  std::vector<std::vector<at::Tensor>> replica_tensors_;
};

/// "cuda:0, cuda:1": devices for messages.
std::string describe_devices(const std::vector<c10::Device>& devices);

}  // namespace loom::core
