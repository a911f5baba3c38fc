// Tier-1 interface of a parallel strategy: how work spreads over devices and processes.
#pragma once

#include <loom/sdk/abi.h>
#include <loom/sdk/types.hpp>

#include <string>
#include <vector>

namespace loom::sdk {

class LOOM_SDK_API ParallelStrategy {
 public:
  using Interface = ParallelStrategy;
  static constexpr uint32_t kKind = LOOM_KIND_PARALLEL;
  static constexpr uint32_t kInterfaceMajor = 1;
  static constexpr uint32_t kInterfaceMinor = 0;

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

  /// Waits for every rank.
  virtual void barrier() {}

  /// Leaves the process group. Called once, last, on the main thread.
  virtual void teardown() {}
};

}  // namespace loom::sdk
