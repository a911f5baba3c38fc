// Note [Overlapped gradient reduction] is in gradient_sync.hpp.
#include "gradient_sync.hpp"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace loom::core {

namespace {

class AfterAccumulation final : public torch::autograd::FunctionPostHook {
 public:
  explicit AfterAccumulation(std::function<void()> f) : f_(std::move(f)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    f_();
    return outputs;
  }

 private:
  std::function<void()> f_;
};

}  // namespace

GradientSync::GradientSync(sdk::ParallelStrategy& parallel, std::vector<Parameters::Bucket> buckets)
    : parallel_(parallel), buckets_(std::move(buckets)), done_(buckets_.size(), 0) {
  for (size_t b = 0; b < buckets_.size(); ++b)
    for (const auto& p : buckets_[b].params) {
      // The accumulator is held here, as c10d's Reducer holds it: a parameter keeps only a weak
      // reference, and the hook must outlive each backward's graph. (Its smart pointer type
      // differs between LibTorch versions: `auto`.)
      auto accumulator = torch::autograd::impl::grad_accumulator(p);
      const auto key = accumulator->add_post_hook(std::make_unique<AfterAccumulation>([this, b] { ready(b); }));
      remove_hooks_.push_back([accumulator, key] { accumulator->del_post_hook(key); });
    }
}

GradientSync::~GradientSync() {
  for (auto& remove : remove_hooks_) remove();
}

void GradientSync::reset() {
  std::fill(done_.begin(), done_.end(), 0);
  pending_.clear();
  next_ = 0;
  overlapped_ = 0;
}

void GradientSync::arm() {
  std::lock_guard<std::mutex> lock(mutex_);
  reset();
  armed_ = true;
}

void GradientSync::ready(size_t bucket) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!armed_) return;
  ++done_[bucket];
  if (bucket == next_) {
    const size_t before = pending_.size();
    start_ready(false);
    overlapped_ += pending_.size() - before;
  }
}

void GradientSync::start_ready(bool all) {
  while (next_ < buckets_.size() && (all || done_[next_] >= buckets_[next_].params.size())) {
    pending_.push_back(parallel_.start_all_reduce_sum({buckets_[next_].slice}));
    ++next_;
  }
}

void GradientSync::finish() {
  std::vector<std::unique_ptr<sdk::PendingReduction>> pending;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!armed_) reset();  // not armed: nothing started this step; start all now
    armed_ = false;
    start_ready(true);
    pending.swap(pending_);
    ++steps_;
    overlapped_total_ += static_cast<int64_t>(overlapped_);
  }
  for (auto& p : pending) p->wait();
}

}  // namespace loom::core
