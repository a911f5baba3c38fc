// Tier-1 interface of a parallel strategy: how work spreads over devices and processes.
#pragma once

#include <loom/sdk/abi.h>
#include <loom/sdk/types.hpp>

#include <memory>
#include <string>
#include <vector>

namespace loom::sdk {

/// A reduction in flight (ParallelStrategy::start_all_reduce_sum).
class LOOM_SDK_API PendingReduction {
 public:
  virtual ~PendingReduction();  // defined in libloom_sdk
  /// Blocks until the tensors hold the sums over all ranks. Throws Error when a rank failed.
  virtual void wait() = 0;
};

class LOOM_SDK_API ParallelStrategy {
 public:
  using Interface = ParallelStrategy;
  static constexpr uint32_t kKind = LOOM_KIND_PARALLEL;
  static constexpr uint32_t kInterfaceMajor = 1;
  static constexpr uint32_t kInterfaceMinor = 2;  // 1.1: start_all_reduce_sum; 1.2: devices

  virtual ~ParallelStrategy();  // defined in libloom_sdk: its type info has one home

  /// Finds this process's rank and device and joins the process group, if any. `device` is the
  /// user's choice ("auto", "cpu", "cuda", "cuda:1"). Called once, first, on the main thread.
  /// Throws Error when the environment does not allow the strategy (naming what is missing).
  virtual void setup(const std::string& device) = 0;

  virtual int64_t rank() const { return 0; }
  virtual int64_t world_size() const { return 1; }
  /// The device this process trains on.
  virtual c10::Device device() const = 0;

  /// Makes every rank hold rank 0's values (parameters at start). In place.
  virtual void broadcast(const std::vector<at::Tensor>& tensors) { (void)tensors; }

  /// Sums the tensors over all ranks, in place (gradients, loss sums and counts).
  virtual void all_reduce_sum(const std::vector<at::Tensor>& tensors) { (void)tensors; }

  /// Interface 1.1: starts summing `tensors` over all ranks and returns at once; they must not
  /// be read or written until the handle's wait() returned. Every rank starts the same
  /// reductions in the same order. The trainer starts one per gradient bucket (a slice of a flat
  /// gradient buffer) as backward completes it, so that the reduction overlaps the rest of
  /// backward. Called from autograd's threads. The default sums at once (no overlap).
  virtual std::unique_ptr<PendingReduction> start_all_reduce_sum(const std::vector<at::Tensor>& tensors);

  /// Interface 1.2: every device this process trains on, device() first. More than one: the
  /// host builds a replica of the model per further device through the model's plugin (Note
  /// [Replicas in one process], core/src/replicas.hpp), cuts each micro-batch across the
  /// devices and sums the replicas' gradients into device()'s model, which alone is updated.
  /// Devices of one type, each once (CPU replicas, for tests, may repeat "cpu").
  virtual std::vector<c10::Device> devices() const { return {device()}; }

  /// Waits for every rank.
  virtual void barrier() {}

  /// Leaves the process group. Called once, last, on the main thread.
  virtual void teardown() {}
};

}  // namespace loom::sdk
