// The training step as CUDA graphs. See step_graph.hpp.
#include "step_graph.hpp"

#include <loom/core/error.hpp>
#include <loom/core/log.hpp>

#include <c10/core/Event.h>
#include <c10/util/Exception.h>
#if LOOM_TORCH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <optional>
#include <sstream>
#include <utility>

namespace loom::core {

// Note [The step as a CUDA graph]
// A small model's step on a GPU is a few hundred kernels of microseconds each: the host's
// launches, not the device, set the pace (the H100 profile of the default job: 12 ms of host
// time per step for 0.3 ms of kernels). With step.cuda_graph the trainer records the step once
// (forward, backward, the reduction, the update on the device, the packed report) and from then
// on launches it with one call. What that asks of the step:
// - No waits inside it: only the step on the device (Note [The step on the device]) qualifies;
//   the host reads the packed report after a replay, on log steps, as without graphs.
// - The same tensors every step: the graph reads its inputs from static buffers (each batch is
//   copied into them before a replay) and its parameters, gradients (views of flat buffers,
//   zeroed in place), optimizer and scaler state, rate table and counters where they were at
//   capture. Whatever replaces one of those (a loaded checkpoint, a new rate table) clears the
//   graphs; a new plan (out-of-memory recovery, auto_batch) has new shapes and clears them too.
// - Fixed shapes: one graph per shape of the step's micro-batches, up to kMaxShapes.
// - Lazy set-up done: the first step.cuda_graph_warmup steps after a start or a clear run
//   eagerly on the graphs' stream (optimizer state, cuBLAS workspaces), then the step is captured.
// Capture happens on a stream of the trainer's own (the legacy default stream cannot capture),
// in thread-local mode so that the loader's threads may pin memory meanwhile; the step's
// stream waits for the previous current stream's work and makes it wait for the step's.
// Host code inside the step runs at capture only: the hooks on_after_backward and
// on_before_optimizer_step (documented in docs/core.md), and any host-side count of a plugin
// (the SDK asks step_on_device and the precision's calls for device work only).

namespace {
constexpr size_t kMaxShapes = 8;
}

#if LOOM_TORCH_CUDA

struct StepGraphs::Impl {
  c10::Device device;
  c10::cuda::CUDAStream stream;
  std::optional<c10::cuda::CUDAStream> previous;
  // std::map: captured steps do not move (their tensors are handed out by reference).
  std::map<std::string, std::pair<std::unique_ptr<at::cuda::CUDAGraph>, CapturedStep>> graphs;
  using PoolId = decltype(std::declval<at::cuda::CUDAGraph&>().pool());
  PoolId pool{0, 0};

  explicit Impl(c10::Device d) : device(d), stream(c10::cuda::getStreamFromPool(false, d.index())) {}
};

StepGraphs::StepGraphs(c10::Device device, int64_t warmup_steps) : warmup_steps_(warmup_steps) {
  if (!device.is_cuda())
    throw Error("step.cuda_graph needs a CUDA device; this run trains on " + device.str() +
                " (CUDA graphs replay GPU kernels): set step.cuda_graph = false");
  impl_ = std::make_unique<Impl>(device);
}

StepGraphs::Scope::Scope(StepGraphs& graphs) : graphs_(graphs) {
  Impl& g = *graphs_.impl_;
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(g.device.index());
  c10::Event ready(c10::DeviceType::CUDA);
  ready.record(current);
  ready.block(g.stream);
  g.previous = current;
  c10::cuda::setCurrentCUDAStream(g.stream);
}

StepGraphs::Scope::~Scope() {
  Impl& g = *graphs_.impl_;
  if (!g.previous) return;
  try {
    c10::Event done(c10::DeviceType::CUDA);
    done.record(g.stream);
    done.block(*g.previous);
  } catch (const std::exception& e) {  // unwinding from a CUDA error: the error that matters is in flight
    log::debug("step graphs: could not order the streams: ", e.what());
  }
  c10::cuda::setCurrentCUDAStream(*g.previous);
  g.previous.reset();
}

CapturedStep* StepGraphs::find(const std::string& key) {
  auto it = impl_->graphs.find(key);
  return it == impl_->graphs.end() ? nullptr : &it->second.second;
}

CapturedStep& StepGraphs::capture(const std::string& key, const std::vector<sdk::Batch>& batches,
                                  const std::function<void(CapturedStep&)>& body) {
  Impl& g = *impl_;
  if (g.graphs.size() >= kMaxShapes) {
    std::string shapes;
    for (const auto& [k, entry] : g.graphs) shapes += "\n  " + k;
    throw Error("step.cuda_graph: the step's micro-batches came in more than " + std::to_string(kMaxShapes) +
                " shapes (now " + key + "; captured:" + shapes +
                "); a CUDA graph replays fixed shapes: pad the data to a few fixed sizes, or set step.cuda_graph = false");
  }
  CapturedStep step;
  for (const auto& batch : batches) {
    sdk::Batch copy;
    for (const auto& [name, t] : batch) copy[name] = t.clone();
    step.inputs.push_back(std::move(copy));
  }
  auto graph = std::make_unique<at::cuda::CUDAGraph>();
  // All graphs share the first one's pool: they replay one after another, and what a replay
  // leaves in the pool (the packed report) is read before the next replay.
  const bool first = g.pool.first == 0 && g.pool.second == 0;
  graph->capture_begin(first ? Impl::PoolId{0, 0} : g.pool, cudaStreamCaptureModeThreadLocal);
  try {
    body(step);
    graph->capture_end();
  } catch (const c10::OutOfMemoryError&) {
    try { graph->capture_end(); } catch (...) {}  // ends the capture; the graph is dropped
    throw;
  } catch (const std::exception& e) {
    try { graph->capture_end(); } catch (...) {}
    throw Error(std::string("step.cuda_graph: the training step could not be captured as a CUDA graph: ") +
                (dynamic_cast<const c10::Error*>(&e) ? static_cast<const c10::Error&>(e).what_without_backtrace()
                                                     : e.what()) +
                "\nSomething in the step waits for the device (a read such as .item() in the model, a metric or a "
                "plugin's step) or depends on a value on the device; set step.cuda_graph = false, or make it queue "
                "device work only (docs/core.md, \"The step as a CUDA graph\")");
  }
  if (first) g.pool = graph->pool();
  ++captures_;
  auto [it, inserted] = g.graphs.emplace(key, std::make_pair(std::move(graph), std::move(step)));
  (void)inserted;
  return it->second.second;
}

void StepGraphs::replay(CapturedStep& step, const std::vector<sdk::Batch>& batches) {
  auto it = std::find_if(impl_->graphs.begin(), impl_->graphs.end(),
                         [&](const auto& entry) { return &entry.second.second == &step; });
  if (it == impl_->graphs.end()) throw Error("step graphs: replay of a step that was not captured here");
  for (size_t i = 0; i < batches.size(); ++i)
    for (const auto& [name, t] : batches[i]) step.inputs[i].at(name).copy_(t, /*non_blocking=*/true);
  it->second.first->replay();
}

void StepGraphs::clear() {
  impl_->graphs.clear();  // the pool goes back to the allocator with its last graph
  impl_->pool = {0, 0};
  eager_steps_ = 0;
}

size_t StepGraphs::size() const { return impl_->graphs.size(); }

#else  // a CPU build of LibTorch

struct StepGraphs::Impl {};

StepGraphs::StepGraphs(c10::Device device, int64_t warmup_steps) : warmup_steps_(warmup_steps) {
  throw Error("step.cuda_graph needs a CUDA build of LibTorch and a CUDA device; this Loom was built against a CPU "
              "build and trains on " + device.str() + ": set step.cuda_graph = false");
}
StepGraphs::Scope::Scope(StepGraphs& graphs) : graphs_(graphs) {}
StepGraphs::Scope::~Scope() = default;
CapturedStep* StepGraphs::find(const std::string&) { return nullptr; }
CapturedStep& StepGraphs::capture(const std::string&, const std::vector<sdk::Batch>&,
                                  const std::function<void(CapturedStep&)>&) {
  throw Error("step graphs: no CUDA in this build");
}
void StepGraphs::replay(CapturedStep&, const std::vector<sdk::Batch>&) {}
void StepGraphs::clear() {}
size_t StepGraphs::size() const { return 0; }

#endif

StepGraphs::~StepGraphs() = default;

std::string StepGraphs::key_of(const std::vector<sdk::Batch>& batches) {
  std::ostringstream key;
  for (size_t i = 0; i < batches.size(); ++i) {
    if (i > 0) key << " | ";
    bool first = true;
    for (const auto& [name, t] : batches[i]) {
      key << (first ? "" : ", ") << name << " ";
      first = false;
      for (int64_t d = 0; d < t.dim(); ++d) key << (d ? "x" : "") << t.size(d);
      key << " " << t.scalar_type();
    }
  }
  return key.str();
}

}  // namespace loom::core
