// Value types shared by the Tier-1 interfaces: named tensor batches, data specs, state dicts,
// batch plans and device-memory figures. Plain data; no behaviour beyond small helpers.
//
// Naming: a micro-batch is what one forward sees; the global batch is what one optimizer step
// sees (micro-batch x accumulation steps x world size).
#pragma once

#include <loom/sdk/error.hpp>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace loom::sdk {

/// Named tensors of one batch; every tensor's first dimension is the batch dimension.
using Batch = std::map<std::string, at::Tensor>;

/// Tensors of a component's state (see state_dict / load_state_dict).
using TensorMap = std::map<std::string, at::Tensor>;

/// Text key/values: manifests, non-tensor state, descriptions.
using TextMap = std::map<std::string, std::string>;

/// A component's checkpointable state: tensors (stored in safetensors) and text (stored in JSON).
struct State {
  TensorMap tensors;
  TextMap text;
};

/// A dataset's splits. kValidation since Dataset interface 1.1: a dataset without one returns
/// size 0 for it, and the host holds out data.validation_fraction of the training split instead.
enum class Split : int32_t { kTrain = 0, kTest = 1, kValidation = 2 };

inline const char* split_name(Split split) {
  return split == Split::kTrain ? "train" : split == Split::kTest ? "test" : "validation";
}

/// One field of a dataset sample: its per-sample shape (without the batch dimension) and dtype.
struct FieldSpec {
  std::vector<int64_t> shape;
  c10::ScalarType dtype = c10::ScalarType::Float;
};

/// What a dataset yields, so a model can shape itself to it (image size, classes, ...).
struct DataSpec {
  std::map<std::string, FieldSpec> fields;  ///< e.g. "image": {1,28,28} uint8, "label": {} int64
  std::string input_key = "input";          ///< the field a model reads
  std::string target_key = "target";        ///< the field a model predicts
  int64_t num_classes = 0;                  ///< for classification; 0 otherwise
  TextMap attributes;                       ///< anything else a model may want to know
};

/// Which way a metric improves.
enum class Direction : int32_t { kMinimize = 0, kMaximize = 1 };

inline const char* direction_name(Direction d) { return d == Direction::kMaximize ? "max" : "min"; }

/// Whether `value` is better than `best` in direction `d` (by more than `min_delta`).
inline bool improves(Direction d, double value, double best, double min_delta = 0.0) {
  return d == Direction::kMaximize ? value > best + min_delta : value < best - min_delta;
}

/// A metric a model reports, declared once (Model::metrics()). Its value over an evaluation is
/// the sum of its per-batch sums divided by the sum of its counts (see MetricValue).
struct MetricSpec {
  std::string name;          ///< the key in ModelOutput::metrics and in the run's files: "accuracy", "rmse", "hr_at_10"
  std::string display_name;  ///< for people: "accuracy", "RMSE", "HR@10" (empty: `name`)
  Direction direction = Direction::kMaximize;
  bool percent = false;      ///< a fraction shown as a percentage
};

/// A batch plan: global batch = micro_batch x accumulation x world_size. The configured global
/// batch never changes silently; a change of plan is logged from what to what. micro_batch is
/// what one device holds in one forward; world_size counts the devices over all ranks (ranks x
/// each rank's devices, several with data_parallel), so a memory policy plans one device.
struct BatchPlan {
  int64_t micro_batch = 1;
  int64_t accumulation = 1;
  int64_t world_size = 1;
  int64_t global() const { return micro_batch * accumulation * world_size; }
  bool operator==(const BatchPlan&) const = default;
};

/// Device-memory figures in bytes; -1 where a device cannot say.
struct MemoryStats {
  int64_t total = -1;      ///< what the device has
  int64_t free = -1;       ///< what the device reports free (all processes)
  int64_t allocated = -1;  ///< live tensor bytes of this process
  int64_t reserved = -1;   ///< held by the caching allocator (>= allocated)
  int64_t peak = -1;       ///< peak of `allocated` since the last reset
  int64_t limit = -1;      ///< the cap Loom enforces, or -1 for none
  int64_t alloc_retries = 0;
  int64_t ooms = 0;
};

}  // namespace loom::sdk
