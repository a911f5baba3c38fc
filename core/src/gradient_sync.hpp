// Note [Overlapped gradient reduction]
// With several ranks, the gradients' all-reduce runs while backward is still going: the flat
// gradient buffers are cut into buckets (Parameters::buckets, the last parameters first), a hook
// on each parameter's gradient accumulator counts the parameters of its bucket that are done,
// and a full bucket is handed to the strategy's start_all_reduce_sum at once, from autograd's
// thread, while backward computes the earlier layers' gradients. Only in the last micro-batch
// of a step (arm()): accumulation micro-batches reduce nothing. Buckets start in one order on
// every rank (a collective pairs with the other ranks' by order): a full bucket waits for the
// buckets before it. finish() starts what backward left (a parameter that got no gradient, or a
// step cut short by an out-of-memory) and waits for all, so every rank has started every bucket
// exactly once per step whatever happened. This is the scheme of c10d's Reducer, over Loom's own
// flat buffers (the Reducer would keep buffers of its own and average by the world size).
#pragma once

#include <loom/core/parameters.hpp>
#include <loom/sdk/parallel.hpp>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

namespace loom::core {

class GradientSync {
 public:
  GradientSync(sdk::ParallelStrategy& parallel, std::vector<Parameters::Bucket> buckets);
  ~GradientSync();
  GradientSync(const GradientSync&) = delete;
  GradientSync& operator=(const GradientSync&) = delete;

  /// The next backward is the step's last: reduce its buckets as they fill.
  void arm();
  /// Starts every bucket not started yet, in order, and waits for all: the gradients hold the
  /// sums over the ranks. Disarms.
  void finish();

  size_t buckets() const { return buckets_.size(); }
  /// Buckets started from a hook (during backward) at the last finish(), of buckets().
  size_t overlapped() const { return overlapped_; }
  /// Over every finish() so far: steps, and buckets started during backward.
  int64_t steps() const { return steps_; }
  int64_t overlapped_total() const { return overlapped_total_; }

 private:
  void ready(size_t bucket);              // a parameter of `bucket` is done (autograd's thread)
  void start_ready(bool all);             // under mutex_
  void reset();                           // under mutex_: no bucket started, none done

  sdk::ParallelStrategy& parallel_;
  std::vector<Parameters::Bucket> buckets_;
  std::vector<size_t> done_;              // parameters done per bucket
  std::vector<std::unique_ptr<sdk::PendingReduction>> pending_;
  size_t next_ = 0;                       // the first bucket not started
  size_t overlapped_ = 0;
  int64_t steps_ = 0, overlapped_total_ = 0;
  bool armed_ = false;
  std::mutex mutex_;
  std::vector<std::function<void()>> remove_hooks_;
};

}  // namespace loom::core
