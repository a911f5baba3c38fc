// Tier-1 interface of a memory policy: how a run fits in device memory (caps, batch choice,
// recovery from out-of-memory). Policies compose in the configured order
// (memory.policies = fraction_cap, vram_tiers, oom_recovery).
#pragma once

#include <loom/sdk/abi.h>
#include <loom/sdk/types.hpp>

#include <functional>
#include <string>
#include <vector>

namespace loom::sdk {

/// The host's view of one device's memory, offered to memory policies. Implemented by the host
/// for CUDA (caching allocator) and CPU (a budget allocator that makes the CPU behave like a
/// device with a given amount of memory). Valid for the duration of the call it is passed to.
class LOOM_SDK_API DeviceMemory {
 public:
  virtual ~DeviceMemory();  // defined in libloom_sdk: its type info has one home
  virtual c10::Device device() const = 0;
  virtual MemoryStats stats() const = 0;
  virtual void reset_peak() = 0;
  /// Caps this process's allocations on the device at `bytes` (-1 removes the cap); past it an
  /// allocation throws c10::OutOfMemoryError.
  virtual void set_limit(int64_t bytes) = 0;
  /// Returns cached, unused blocks to the device.
  virtual void empty_cache() = 0;
};

/// What plan() sees and may change.
struct PlanContext {
  DeviceMemory* memory = nullptr;
  BatchPlan plan;                  ///< in: the plan so far; out: this policy's plan
  int64_t global_batch = 0;        ///< the configured global batch; a policy keeps it
  bool global_batch_given = false; ///< whether the user chose it (else a policy may choose)
  /// Runs forward and backward of one micro-batch of `b` samples (the largest samples the data
  /// has) without side effects on weights, optimizer or RNG, and returns the peak memory the
  /// run then holds (parameters, gradients and optimizer state included); throws
  /// c10::OutOfMemoryError past the cap. It throws another error (a loom::sdk::Error) when a stop
  /// signal ends set-up: let that one through, it is not a size that does not fit.
  std::function<int64_t(int64_t b)> probe;
  /// Identifies what a probe measures (model, data, precision, optimizer configuration): equal
  /// keys give equal probes on equal devices, so a policy may cache its answer under it.
  std::string config_key;
  /// The device's name ("NVIDIA H100 80GB HBM3", "cpu"), for caches and messages.
  std::string device_name;
  /// How many samples one micro-batch may take at most (the split's size on this rank).
  int64_t max_micro_batch = 0;
};

/// What on_oom() sees and may change.
struct OomContext {
  DeviceMemory* memory = nullptr;
  BatchPlan plan;          ///< in: the plan that ran out of memory; out: the plan to replay with
                           ///< (the same global batch: a policy may only re-split it)
  std::string message;     ///< the allocator's message
  int64_t step = 0;        ///< the optimizer step that ran out of memory, 1-based as the logs
                           ///< count ("step 1" is the run's first step); in an evaluation, the
                           ///< last step taken before it
  bool evaluation = false; ///< an evaluation ran out of memory (no gradients; only the
                           ///< micro-batch of `plan` matters, and the evaluation starts again)
};

class LOOM_SDK_API MemoryPolicy {
 public:
  using Interface = MemoryPolicy;
  static constexpr uint32_t kKind = LOOM_KIND_MEMORY;
  static constexpr uint32_t kInterfaceMajor = 2;
  static constexpr uint32_t kInterfaceMinor = 0;

  virtual ~MemoryPolicy();  // defined in libloom_sdk

  /// Called once, on the main thread, before the model is built (caps belong here).
  virtual void setup(DeviceMemory& memory) { (void)memory; }

  /// Chooses or adjusts the batch plan, after the model and data are built and before the first
  /// step. Called on the main thread in policy order; each sees the previous one's plan.
  virtual void plan(PlanContext& context) { (void)context; }

  /// A step ran out of memory and was unwound. Returns true when this policy changed the plan
  /// and the step should be replayed; false to let the next policy (or the error) have it.
  virtual bool on_oom(OomContext& context) {
    (void)context;
    return false;
  }

  /// One line for the start-up report.
  virtual std::string describe() const { return {}; }
};

}  // namespace loom::sdk
