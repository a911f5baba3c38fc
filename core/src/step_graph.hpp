// The training step as CUDA graphs (step.cuda_graph): see Note [The step as a CUDA graph] in
// step_graph.cpp.
#pragma once

#include <loom/sdk/types.hpp>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace loom::core {

/// One captured step: the tensors its graph reads and writes, which stay where they are.
struct CapturedStep {
  std::vector<sdk::Batch> inputs;  ///< static inputs, one batch per micro-batch: copied into before a replay
  at::Tensor packed;               ///< the step's report (pack_report, norm, found-inf, rate), written by a replay
  /// The metrics' (sum, count) as captured: their names say how `packed` is laid out.
  std::map<std::string, std::pair<at::Tensor, at::Tensor>> metric_sums;
};

/// The captured steps of a run: one graph per shape of the micro-batches, sharing one memory
/// pool, captured and replayed on a stream of their own. Needs a CUDA build and a CUDA device;
/// the constructor throws Error otherwise.
class StepGraphs {
 public:
  StepGraphs(c10::Device device, int64_t warmup_steps);
  ~StepGraphs();
  StepGraphs(const StepGraphs&) = delete;
  StepGraphs& operator=(const StepGraphs&) = delete;

  /// Makes the graphs' stream current (after the current one's queued work), until the scope
  /// ends: then the previous stream is current again and waits for the step's work.
  class Scope {
   public:
    explicit Scope(StepGraphs& graphs);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    StepGraphs& graphs_;
  };

  /// "128x1x28x28:Float,128:Long|..." for the micro-batches of one step.
  static std::string key_of(const std::vector<sdk::Batch>& batches);

  /// The captured step for `key`, or nullptr.
  CapturedStep* find(const std::string& key);
  /// Whether the next step still runs eagerly (the warm-up after the start or a clear()).
  bool warming_up() const { return eager_steps_ < warmup_steps_; }
  void count_eager_step() { ++eager_steps_; }

  /// Captures `body` (the step's device work, reading `step.inputs`, which it receives with
  /// clones of `batches`; it sets `step.packed`) as the graph for `key`. Nothing runs: replay()
  /// runs it. A capture that fails leaves no graph; an out-of-memory propagates as it is (the
  /// step is replayed at a smaller plan), any other failure becomes an Error that says what
  /// cannot be captured.
  CapturedStep& capture(const std::string& key, const std::vector<sdk::Batch>& batches,
                        const std::function<void(CapturedStep&)>& body);
  /// Copies `batches` into the step's static inputs and launches its graph.
  void replay(CapturedStep& step, const std::vector<sdk::Batch>& batches);
  /// Drops every graph and its memory (a new plan, a loaded checkpoint: tensors the graphs read
  /// were replaced); the next steps warm up again.
  void clear();
  size_t size() const;
  /// Captures so far, over the run.
  int64_t captures() const { return captures_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int64_t warmup_steps_ = 0;
  int64_t eager_steps_ = 0;
  int64_t captures_ = 0;
};

}  // namespace loom::core
