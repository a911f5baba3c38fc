// One optimizer step and one evaluation: micro-batches under the precision strategy, the loss
// and metrics as (sum, count) pairs, gradients summed over ranks and divided once, unscaling,
// clipping, the update (skipped on non-finite gradients); the step's saved state for replays.
#include <loom/core/device_memory.hpp>
#include <loom/core/log.hpp>
#include <loom/core/profiler.hpp>
#include <loom/core/text.hpp>
#include <loom/core/trainer.hpp>
#include "gradient_sync.hpp"
#include "replicas.hpp"
#include "step_graph.hpp"
#include "trainer_internal.hpp"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/_foreach_div.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace fs = std::filesystem;

namespace loom::core {

using namespace detail;

namespace {

using Sums = std::map<std::string, std::pair<at::Tensor, at::Tensor>>;

/// The loss sum, the count and each metric's sum and count (metrics by name) as one tensor on the
/// device: what a step or an evaluation reports, reduced across ranks in one call, read once.
at::Tensor pack_report(const at::Tensor& loss_sum, const at::Tensor& count, const Sums& sums) {
  std::vector<at::Tensor> parts{loss_sum.reshape({1}), count.reshape({1})};
  for (const auto& [name, pair] : sums) {
    parts.push_back(pair.first.reshape({1}));
    parts.push_back(pair.second.reshape({1}));
  }
  return at::cat(parts);
}

struct ReportValues {
  int64_t count = 0;  ///< the loss's terms (the model's count)
  double loss = 0;
  std::map<std::string, double> metrics;  ///< sum / count; NaN where a count is 0
  std::string no_count;  ///< the first of the loss ("loss") and the metrics whose count is no count (is_count)
};

/// A count that is no count (is_count) ends the run: what a model's forward counts, it counts from 0 up.
void refuse_no_count(const ReportValues& values, const std::string& model, const std::string& where) {
  if (values.no_count.empty()) return;
  throw no_count(model, values.no_count == "loss" ? "loss terms" : "'" + values.no_count + "' terms", where);
}

/// One read of a packed report; `tail`, if given, receives the values packed after it.
/// `unreported` false: a metric of count 0 (no rank reported it) is left out, not NaN.
ReportValues read_report(const at::Tensor& totals, const Sums& sums, std::vector<double>* tail = nullptr,
                         bool unreported = true) {
  const at::Tensor host = totals.to(at::kCPU, at::kDouble);
  const double* v = host.data_ptr<double>();
  ReportValues out;
  out.count = is_count(v[1]) ? static_cast<int64_t>(v[1]) : 0;
  out.loss = v[0] / std::max(1.0, v[1]);
  if (!is_count(v[1])) out.no_count = "loss";  // (NaN too: it was divided by 1 as well)
  size_t i = 2;
  for (const auto& [name, pair] : sums) {
    if (!is_count(v[i + 1]) && out.no_count.empty()) out.no_count = name;
    if (unreported || v[i + 1] > 0) out.metrics[name] = v[i + 1] > 0 ? v[i] / v[i + 1] : std::nan("");
    i += 2;
  }
  if (tail != nullptr) tail->assign(v + i, v + host.numel());
  return out;
}

}  // namespace

double Trainer::current_lr() const {
  // Skipped steps (non-finite gradients) do not advance the schedule.
  return rate_after(step_ - skipped_steps_);
}

double Trainer::rate_after(int64_t taken) const {
  const double factor = as_component([&] { return "schedule '" + options_.schedule + "'"; }, options_.schedule,
                                     [&] { return schedule_->factor(taken, total_steps_); });
  if (!std::isfinite(factor) || factor < 0)
    throw Error("schedule '" + options_.schedule + "' gave the learning-rate factor " + std::to_string(factor) +
                " after " + std::to_string(taken) + " updates; a factor is finite and >= 0");
  return base_lr_ * factor;
}

void Trainer::add_metrics(MetricSums& sums, const sdk::ModelOutput& out) const {
  for (const auto& [name, value] : out.metrics) {
    if (!metric_specs_.count(name) || name == "loss")
      throw Error("model '" + value_of(config_, "model.name") + "' reported a metric '" + name +
                  "' that its metrics() does not declare (it declares " + join(metric_names(), ", ") +
                  "); declare it with its direction, or stop reporting it");
    const at::Tensor& count_of = value.count.defined() ? value.count : out.count;
    if (!value.sum.defined() || value.sum.numel() != 1 || !count_of.defined() || count_of.numel() != 1)
      throw Error("model '" + value_of(config_, "model.name") + "' reported metric '" + name + "' with a sum of " +
                  (value.sum.defined() ? std::to_string(value.sum.numel()) : std::string("no")) + " elements and a count of " +
                  (count_of.defined() ? std::to_string(count_of.numel()) : std::string("no")) +
                  " elements; a metric is one sum and one count over the micro-batch (scalars)");
    auto& [sum, count] = sums[name];
    // On the step's device, whatever device the model reported it on: the step's report is one tensor.
    const at::Tensor s = value.sum.detach().to(device_, at::kFloat);
    const at::Tensor c = count_of.detach().to(device_, at::kFloat);
    sum = sum.defined() ? sum + s : s;
    count = count.defined() ? count + c : c;
  }
}

std::vector<std::string> Trainer::metric_names() const {
  std::vector<std::string> names;
  for (const auto& [name, spec] : metric_specs_) names.push_back(name);
  return names;
}

std::string Trainer::format_metric(const std::string& name, double value) const {
  char text[64];
  if (std::isnan(value)) value = std::nan("");  // (printf writes a NaN with its sign bit as "-nan")
  auto it = metric_specs_.find(name);
  if (it != metric_specs_.end() && it->second.percent) std::snprintf(text, sizeof text, "%.2f %%", 100.0 * value);
  else std::snprintf(text, sizeof text, "%.4f", value);
  const std::string shown = it != metric_specs_.end() && !it->second.display_name.empty() ? it->second.display_name : name;
  return shown + " " + text;
}

void Trainer::finish_metrics(std::map<std::string, double>& values, const std::string& prefix) const {
  if (!model_.implements(1)) return;  // Model 2.1: metric_value
  for (auto& [key, value] : values) {
    if (key.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string name = key.substr(prefix.size());
    if (name != "loss" && metric_specs_.count(name))
      value = as_component([&] { return "model '" + model_name_ + "' (metric_value of '" + name + "')"; }, model_name_,
                           [&] { return model_->metric_value(name, value); });
  }
}

sdk::ModelOutput Trainer::run_micro_batch(const sdk::Batch& batch, bool train) {
  sdk::ModelOutput out;
  {
    LOOM_PHASE("forward");
    const auto autocast = precision_->forward_guard();
    // (a label the dataset should not have given fails in the model's loss: the dataset is named)
    const auto who = [&] {
      const std::string outside = targets_outside_classes(data_spec_, batch);
      return outside.empty() ? model_who() : "dataset '" + value_of(config_, "data.name") + "' (" + outside + "), in model '" + model_name_ + "'";
    };
    out = as_component(who, model_name_,
                       [&] { return train ? checked_for_backward(model_->forward(batch, train)) : model_->forward(batch, train); });
  }
  if (train) {
    LOOM_PHASE("backward");
    // Note [The loss scaled as a mean]
    const double divided_by = loss_divisor(*precision_, plan_, data_spec_, replicas_ ? plan_.world_size : 1);
    scaled_for_backward(*precision_, precision_name_, divided_by == 1 ? out.loss_sum : out.loss_sum.mul(1.0 / divided_by)).backward();
  }
  return out;
}

sdk::ModelOutput Trainer::run_spread(const sdk::Batch& batch, bool train) {
  if (!replicas_) return run_micro_batch(batch, train);
  sdk::ModelOutput out;
  {
    LOOM_PHASE("forward");
    std::vector<sdk::Batch> parts;
    {
      LOOM_PHASE("scatter");
      parts = replicas_->scatter(batch);
    }
    const auto autocast = precision_->forward_guard();
    out = replicas_->forward(parts, train);
  }
  if (train) {
    LOOM_PHASE("backward");
    const double divided_by = loss_divisor(*precision_, plan_, data_spec_, replicas_ ? plan_.world_size : 1);
    scaled_for_backward(*precision_, precision_name_, divided_by == 1 ? out.loss_sum : out.loss_sum.mul(1.0 / divided_by))
        .backward();  // to every replica (Note [Replicas in one process])
  }
  return out;
}

// Note [The step on the device]
// The update of a step needs three facts the host used to read from the device, each a wait for
// every kernel queued before it: whether the gradients are finite (the precision's check), their
// norm (for clipping and the report), and the report itself. On a GPU each wait drains the queue
// (the H200 profile: 3 per step). Where the precision and the optimizer implement interface 1.1,
// the decision stays on the device: the gradients are unscaled in place, their norm is computed
// and clipped with tensors, "non-finite" is `!isfinite(norm)` (any inf or NaN makes the norm so),
// the fused optimizer takes the learning rate as a tensor and found_inf, and skips itself, the
// loss scaler updates from found_inf; the host reads the report, the norm and the decision
// together once, after the update is queued. trainer.device_step = false (or a 1.0 plugin) keeps
// the host path: read, check, then step. The two give the same parameters (a test, on CPU).
// What differs: on_before_optimizer_step runs before every update on the device path, skipped or
// not, and a gradient norm that overflows float32 counts as non-finite there.
void Trainer::ensure_rate_table() {
  // Skipped updates do not advance the schedule, and the host does not know which were
  // skipped: the rate is looked up on the device, in a table of the schedule's rate after k
  // taken updates, at the count of taken updates kept there. Made before the commit point: an
  // out-of-memory here is replayed like one in backward.
  if (lr_table_.defined() && lr_table_.size(0) == total_steps_ + 1) return;
  std::vector<double> rates(static_cast<size_t>(total_steps_ + 1));
  const int64_t taken = step_ - skipped_steps_;  // exact when first made: nothing is unread yet
  // (the last entry, after every update, is never looked up: the schedule is asked only of the
  // updates it documents, 0 ... total - 1; a plugin's check of step < total failed here)
  for (int64_t k = 0; k <= total_steps_; ++k)
    rates[static_cast<size_t>(k)] = rate_after(std::clamp<int64_t>(k, 0, std::max<int64_t>(0, total_steps_ - 1)));
  // float on CUDA (the fused kernels' type there), double on CPU
  const auto dtype = device_.is_cpu() ? at::kDouble : at::kFloat;
  at::Tensor table = at::from_blob(rates.data(), {total_steps_ + 1}, at::TensorOptions().dtype(at::kDouble))
                         .to(device_, dtype, /*non_blocking=*/false, /*copy=*/true);
  if (!taken_on_device_.defined())  // (a resume resets it; a table made again keeps the count)
    taken_on_device_ = at::full({1}, taken, at::TensorOptions().dtype(at::kLong)).to(device_);
  lr_on_device_ = at::empty({}, at::TensorOptions().device(device_).dtype(dtype));
  lr_table_ = std::move(table);  // (last: an out-of-memory above left the table made and the rest not, and the replay used them)
  if (graphs_) graphs_->clear();  // they read the table that was
}

// Note [One pass over the gradients]
// The gradients hold sums (over loss_divisor); the update wants them divided by the global count and scaled by the
// clipping factor. Done as written that is two passes over every gradient (_foreach_mul_ by
// 1/count, then by the factor; GPT-2 124M: 0.53 ms per step on an H200, for a fused AdamW of
// 1.0 ms) before the update reads them a third time. The division commutes with the norm
// (norm(g / n) = norm(g) / n), so on the device, when no callback looks at the gradients
// (Callback::reads_gradients, 1.2) and no test hook does, the host takes the norm of the sums,
// divides it, and hands divisor = count / factor to the update (Optimizer::
// step_on_device_dividing, 1.2), whose fused kernels divide each gradient as they read it
// (their grad_scale). A 1.1 optimizer gets one pass (_foreach_div_) instead of two. Anyone who
// does look at the gradients (a 1.0 or 1.1 callback, one that says it reads them) sees them
// divided and clipped, as before. trainer_test's TheStepOnTheDeviceUpdatesAsTheHostPathDoes
// checks that this path trains as the host's (which divides and clips first) for AdamW and SGD,
// in fp32 and fp16_amp; the conformance suite checks each 1.2 optimizer's division.
at::Tensor Trainer::queue_update(const StepWork& work) {
  at::Tensor norm, found;
  {
    LOOM_PHASE("optimizer");
    at::NoGradGuard no_grad;
    precision_->unscale_gradients_on_device(work.flats);
    at::Tensor divisor;  // defined: the update divides the gradients (Note [One pass over the gradients])
    if (work.divided) {
      norm = clip_grad_norm(work.flats, options_.clip_grad_norm).to(at::kFloat).reshape({1});
    } else {
      const double divided_by = loss_divisor(*precision_, plan_, data_spec_, replicas_ ? plan_.world_size : 1);
      const at::Tensor count = work.totals[1].clamp_min(1).div(divided_by).to(work.flats.front().device(), at::kFloat).reshape({1});
      norm = gradient_norm(work.flats).to(at::kFloat).reshape({1}).div(count);
      divisor = options_.clip_grad_norm > 0 ? count.div(clip_coefficient(norm, options_.clip_grad_norm)) : count;
    }
    found = norm.isfinite().logical_not().to(at::kFloat);
    committed_ = true;
    notify("on_before_optimizer_step",
           [&](sdk::Callback& c, sdk::RunContext& run) { c.on_before_optimizer_step(run, work.grads); });
    lr_on_device_.copy_(lr_table_.index_select(0, taken_on_device_.clamp_max(total_steps_)).reshape({}));
    // (an optimizer's error names it: "training step 4: <its message>" did not)
    as_component([&] { return "optimizer '" + options_.optimizer + "'"; }, options_.optimizer, [&] {
      if (!divisor.defined()) {
        optimizer_->step_on_device(lr_on_device_, found);
      } else if (optimizer_divides_) {
        optimizer_->step_on_device_dividing(lr_on_device_, found, divisor, work.flats);
      } else {  // a 1.1 optimizer: one pass here instead of two
        at::_foreach_div_(work.flats, divisor.reshape({}));  // (the foreach division takes no shape [1])
        optimizer_->step_on_device(lr_on_device_, found);
      }
    });
    precision_->update_on_device(found);
    taken_on_device_.add_(found.logical_not().to(at::kLong));
  }
  LOOM_PHASE("report");
  const at::Tensor& totals = work.totals;
  return at::cat({totals, norm.to(totals.device()), found.to(totals.device()),
                  lr_on_device_.to(totals.device(), at::kFloat).reshape({1})});
}

bool Trainer::finish_on_device(StepResult& result, const at::Tensor& packed, const MetricSums& metric_sums, bool read) {
  LOOM_PHASE("report");
  if (!read) {  // a step between log steps: its values join the window on the device
    add_unread(packed, metric_sums);
    last_unread_ = packed;
    result.read = false;
    result.loss = result.grad_norm = result.lr = std::nan("");
    return true;  // not known here: flush_window() counts the skipped steps
  }
  std::vector<double> tail;
  ReportValues values = read_report(packed, metric_sums, &tail);
  refuse_no_count(values, model_name_, "step " + std::to_string(step_ + 1));
  result.terms = values.count;
  result.loss = values.loss;
  result.metrics = std::move(values.metrics);
  const bool finite = tail.size() == 3 && tail[1] == 0;
  result.grad_norm = finite ? tail[0] : std::nan("");  // (not 0: the norm was inf or NaN, not vanishing)
  // On CPU the table holds doubles (the report's floats would round the rate); reading is free there.
  if (tail.size() == 3) result.lr = device_.is_cpu() ? lr_on_device_.item<double>() : tail[2];
  return finite;
}

bool Trainer::update_on_host(StepResult& result, const StepWork& work) {
  const auto& grads = work.grads;
  // What the step reports does not depend on the update: read first (one read of one tensor),
  // so that nothing after the update allocates more than the scaler's few bytes.
  {
    LOOM_PHASE("report");
    ReportValues values = read_report(work.totals, work.metric_sums);
    refuse_no_count(values, model_name_, "step " + std::to_string(step_ + 1));
    result.terms = values.count;
    result.loss = values.loss;
    result.metrics = std::move(values.metrics);
  }
  // Unscaling and clipping change only the gradients, which a replay zeroes: up to here an
  // out-of-memory can be replayed. From the commit on, the step changes the run's state.
  LOOM_PHASE("optimizer");
  const bool finite = precision_->unscale_gradients(grads);
  result.grad_norm = finite ? clip_grad_norm(work.flats, options_.clip_grad_norm).item<double>() : std::nan("");
  committed_ = true;
  if (finite) {
    notify("on_before_optimizer_step", [&](sdk::Callback& c, sdk::RunContext& run) { c.on_before_optimizer_step(run, grads); });
    as_component([&] { return "optimizer '" + options_.optimizer + "'"; }, options_.optimizer,
                 [&] { optimizer_->step(result.lr); });
    if (log::enabled(LOOM_LOG_TRACE)) log::trace("peak after the update: ", memory_->stats().peak);
  }
  precision_->update(!finite);
  return finite;
}

void Trainer::add_unread(const at::Tensor& packed, const MetricSums& metric_sums) {
  at::NoGradGuard no_grad;
  const int64_t m = static_cast<int64_t>(metric_sums.size());
  const at::Tensor count = packed.narrow(0, 1, 1);
  const at::Tensor pairs = packed.narrow(0, 2, 2 * m).view({m, 2});
  const at::Tensor found = packed.narrow(0, 3 + 2 * m, 1);  // after the norm
  // (and whether a count was below 0 or NaN: one step's -7 among others' 32 hid in the window's sum)
  const at::Tensor counts = at::cat({count, pairs.select(1, 1)});
  const at::Tensor no_counts = (counts >= 0).logical_and(counts <= kMostTerms).logical_not().any().to(at::kFloat).reshape({1});
  // (last: the window's steps skipped at its end, (t + 1) x found: trainer.stop_after_skipped)
  const at::Tensor values = at::cat(
      {packed.narrow(0, 0, 1) / count.clamp_min(1), count, pairs.select(1, 0) / pairs.select(1, 1), found, no_counts, found});
  if (window_.device_sums.defined()) {
    const int64_t sums = values.size(0) - 1;
    window_.device_sums.narrow(0, 0, sums).add_(values.narrow(0, 0, sums));
    window_.device_sums.narrow(0, sums, 1).add_(1).mul_(found);
  } else {
    window_.device_sums = values.clone();
    window_.device_metrics.clear();
    for (const auto& [name, pair] : metric_sums) window_.device_metrics.push_back(name);
  }
  ++window_.device_steps;
}

Trainer::StepWork Trainer::forward_backward(const std::function<sdk::Batch(int64_t)>& batch_of) {
  auto& module = model_->module();
  module.train();
  parameters_.zero_grad();
  if (replicas_) {  // the replicas start the step with the weights of the primary, which alone was updated
    replicas_->copy_weights();
    replicas_->zero_grad();
  }
  at::Tensor loss_sum = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device_));
  at::Tensor count = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device_));
  StepWork work;
  // With several ranks an out-of-memory is not thrown at once: the rank stops its micro-batches
  // and says so at the agreement below, before any rank enters the gradients' all-reduce, so
  // that all re-plan and replay the step together (step_with_recovery) and none waits for it.
  const bool ranks = parallel_->world_size() > 1;
  std::string out_of_memory;
  for (int64_t micro = 0; micro < plan_.accumulation; ++micro) {
    sdk::ModelOutput out;
    if (sync_ && micro == plan_.accumulation - 1) sync_->arm();  // the last backward reduces as it goes
    try {
      out = run_spread(batch_of(micro), /*train=*/true);
    } catch (const c10::OutOfMemoryError& e) {
      if (!ranks) throw;
      out_of_memory = e.what_without_backtrace();
      break;
    }
    LOOM_PHASE("report");
    loss_sum.add_(out.loss_sum.detach().to(device_, at::kFloat));
    count.add_(out.count.detach().to(device_, at::kFloat));
    add_metrics(work.metric_sums, out);
  }
  if (replicas_) {
    LOOM_PHASE("reduce");
    replicas_->add_gradients_to(parameters_);
  }
  if (sync_) {  // every bucket started and summed, even in a step cut short (Note [Overlapped gradient reduction])
    LOOM_PHASE("reduce");
    sync_->finish();
  }
  if (ranks && any_rank(!out_of_memory.empty()))
    throw c10::OutOfMemoryError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                                out_of_memory.empty() ? "another rank ran out of memory in this step" : out_of_memory);
  ranks_agreed_ = ranks;  // from here an out-of-memory is this rank's alone: the others cannot replay with it
  // Gradients hold sums over this rank's samples (over loss_divisor): add up the ranks, then divide by the global
  // count once, so the update does not depend on how the global batch was split. The step's
  // report (loss, count, metric sums and counts) travels as one tensor in the same reduction.
  work.grads = parameters_.gradients();
  work.flats = parameters_.flat_gradients();  // the same memory, a few tensors
  {
    LOOM_PHASE("reduce");
    std::vector<at::Tensor> reduced = sync_ ? std::vector<at::Tensor>{} : work.flats;  // summed already
    reduced.push_back(pack_report(loss_sum, count, work.metric_sums));
    parallel_->all_reduce_sum(reduced);
    work.totals = reduced.back();
    at::NoGradGuard no_grad;
    work.divided = work.flats.empty() || !divides_in_update();
    const double divided_by = loss_divisor(*precision_, plan_, data_spec_, replicas_ ? plan_.world_size : 1);
    if (work.divided && !work.flats.empty()) at::_foreach_mul_(work.flats, work.totals[1].clamp_min(1).reciprocal().mul(divided_by));
  }
  if (gradient_hook_) gradient_hook_(work.grads);
  notify("on_after_backward", [&](sdk::Callback& c, sdk::RunContext& run) { c.on_after_backward(run, work.grads); });
  if (log::enabled(LOOM_LOG_TRACE)) log::trace("peak after backward: ", memory_->stats().peak);
  return work;
}

int64_t Trainer::graph_captures() const { return graphs_ ? graphs_->captures() : 0; }

bool Trainer::graphed_step(StepResult& result, bool read) {
  const StepGraphs::Scope scope(*graphs_);
  std::vector<sdk::Batch> batches;
  {
    LOOM_PHASE("data");
    for (int64_t micro = 0; micro < plan_.accumulation; ++micro) batches.push_back(train_loader_->next());
  }
  if (!(graph_plan_ == plan_)) {  // a new plan: new shapes; free the old graphs' memory first
    graphs_->clear();
    graph_plan_ = plan_;
  }
  const std::string key = StepGraphs::key_of(batches);
  CapturedStep* step = graphs_->find(key);
  if (step == nullptr && graphs_->warming_up()) {  // eager, on the graphs' stream
    graphs_->count_eager_step();
    const StepWork work = forward_backward([&](int64_t micro) { return batches[static_cast<size_t>(micro)]; });
    return finish_on_device(result, queue_update(work), work.metric_sums, read);
  }
  if (step == nullptr) {
    LOOM_PHASE("capture");
    try {
      step = &graphs_->capture(key, batches, [&](CapturedStep& s) {
        const StepWork work = forward_backward([&](int64_t micro) { return s.inputs[static_cast<size_t>(micro)]; });
        s.packed = queue_update(work);
        s.metric_sums = work.metric_sums;
      });
    } catch (const c10::OutOfMemoryError&) {
      committed_ = false;  // the capture ran nothing: the step can be replayed at a smaller plan
      throw;
    }
    log::info("step      captured as CUDA graph ", graphs_->size(), " (micro-batches ", key, ") at step ", step_ + 1,
              "; replayed from now on");
  }
  committed_ = true;
  {
    LOOM_PHASE("replay");
    graphs_->replay(*step, batches);
  }
  return finish_on_device(result, step->packed, step->metric_sums, read);
}

StepResult Trainer::train_step(bool read_values) {
  LOOM_PHASE("step");
  committed_ = ranks_agreed_ = false;
  if (parallel_->world_size() > 1) seed_rank();  // (ranks > 0: this step's own draws)
  // The device path keeps a table of the schedule's rate per taken update (Note [The step on the
  // device]); past a few million steps that table would be large: such runs check on the host.
  if (step_on_device_ && total_steps_ >= kLargestRateTable && !lr_table_.defined()) {
    if (graphs_)
      throw Error("step.cuda_graph: " + std::to_string(total_steps_) + " steps are more than the step on the device's " +
                  "table of learning rates holds (" + std::to_string(kLargestRateTable - 1) +
                  "); train fewer steps per run, or set step.cuda_graph = false");
    step_on_device_ = false;
    log::warn("trainer.device_step: ", total_steps_, " steps are more than its table of learning rates holds (",
              kLargestRateTable - 1, "); non-finite steps are checked on the host instead");
  }
  if (step_on_device_) ensure_rate_table();
  // The first steps after a resume are read: the check below needs each one's skip.
  constexpr int64_t kSkippedAfterResume = 5;
  const bool read = read_values || (resumed_at_ >= 0 && step_ - resumed_at_ < kSkippedAfterResume + scale_descent_);
  StepResult result;
  bool finite = true;
  if (graphs_) {
    finite = graphed_step(result, read);
  } else {
    const StepWork work = forward_backward([&](int64_t) {
      LOOM_PHASE("data");
      return train_loader_->next();
    });
    if (step_on_device_) {
      finite = finish_on_device(result, queue_update(work), work.metric_sums, read);
    } else {
      result.lr = current_lr();
      finite = update_on_host(result, work);
    }
  }
  // The steps before a read one that were not read are counted first: its own skip is said after
  // theirs, with their count in its total.
  if (read) flush_window();
  if (!finite) {
    ++skipped_steps_;
    ++skipped_in_a_row_;
    result.skipped = true;
    log::warn("step ", step_ + 1, ": non-finite gradients, update skipped (", skipped_steps_, " skipped so far)");
  } else if (read || !step_on_device_) {  // (an unread step on the device: its skip is read later)
    skipped_in_a_row_ = 0;
  }
  sync_buffers();  // (ranks > 1: those the step changed)
  ++step_;
  // Every step since a resume skipped: the checkpoint's weights or optimizer state are bad. Stop
  // before a checkpoint of this state is saved and pruning deletes the good ones.
  // (not while a dynamic loss scale still comes down: a checkpoint from fp16_amp's first steps,
  // or one resumed into fp16_amp, overflows until it has; no checkpoint is written meanwhile)
  if (!finite && resumed_at_ >= 0 && step_ - resumed_at_ >= kSkippedAfterResume + scale_descent_ &&
      skipped_steps_ - skipped_at_resume_ == step_ - resumed_at_)
    throw Error("every step since resuming from " + resumed_from_.string() + " (" + std::to_string(step_ - resumed_at_) +
                " steps) had non-finite gradients: the checkpoint is probably damaged. Stopping before a checkpoint "
                "of this state replaces the good ones; resume from an earlier checkpoint with --resume-from");
  if (read || !step_on_device_) stop_if_skipping();  // (trainer.stop_after_skipped; an unread step's skip is not known)
  result.step = step_;
  result.samples = plan_.global();
  return result;
}

EvalResult Trainer::evaluate(sdk::Split split) {
  DataLoader* loader = eval_loader(split);
  if (loader == nullptr) return {};
  // Evaluation runs at the training plan's micro-batch (what training found fits), smaller when
  // it runs out of memory itself: the memory policies re-plan it as they would a step, and the
  // evaluation starts again (it changes nothing but its own sums).
  int64_t micro = std::min(plan_.micro_batch, eval_micro_batch_cap_);
  while (true) {
    try {
      loader->set_micro_batch(micro * local_devices(), 0);
      EvalResult result = evaluate_once(*loader);
      result.split = split;
      return result;
    } catch (const c10::OutOfMemoryError& e) {
      model_->module().train();
      memory_->empty_cache();
      sdk::OomContext context;
      context.memory = memory_.get();
      context.plan = sdk::BatchPlan{micro, 1, plan_.world_size};
      context.message = e.what_without_backtrace();
      context.step = step_;
      context.evaluation = true;
      const bool replanned = !replan_on_oom(context).empty();
      if (!replanned || context.plan.micro_batch >= micro)
        throw Error("evaluation ran out of memory at micro-batch " + std::to_string(micro) + " on " + device_.str() +
                    ": " + context.message +
                    (memory_policies_.empty() ? "; memory.policies = oom_recovery evaluates in smaller micro-batches"
                                              : "; no memory policy could make the micro-batch smaller"));
      log::info("evaluation: micro-batch ", micro, " -> ", context.plan.micro_batch, " after running out of memory");
      micro = eval_micro_batch_cap_ = context.plan.micro_batch;
    }
  }
}

EvalResult Trainer::evaluate_once(DataLoader& loader) {
  EvalResult result;
  const auto start = Clock::now();
  auto& module = model_->module();
  module.eval();
  at::NoGradGuard no_grad;
  loader.seek({0, 0});
  if (replicas_) replicas_->copy_weights();
  at::Tensor loss_sum = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device_));
  at::Tensor count = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device_));
  MetricSums sums;
  if (parallel_->world_size() > 1)  // every rank packs every metric, even one with no batch of the split
    for (const auto& [name, spec] : metric_specs_)
      if (name != "loss") sums[name] = {at::zeros({}, loss_sum.options()), at::zeros({}, loss_sum.options())};
  for (int64_t i = 0; i < loader.batches_per_epoch(); ++i) {
    // A stop signal ends the evaluation here (one process: with several ranks each would wait
    // for the others' all-reduce below); it took 24 s to end the test split's before.
    if (const int sig = stop_signal_received(); sig != 0 && parallel_->world_size() == 1) {
      module.train();
      throw EvaluationStopped(sig, i, loader.batches_per_epoch());
    }
    const sdk::ModelOutput out = run_spread(loader.next(), /*train=*/false);
    check_evaluation_output(out, model_name_);
    loss_sum.add_(out.loss_sum.to(device_, at::kFloat));
    count.add_(out.count.to(device_, at::kFloat));
    add_metrics(sums, out);
  }
  std::vector<at::Tensor> totals{pack_report(loss_sum, count, sums)};
  parallel_->all_reduce_sum(totals);
  ReportValues values = read_report(totals.front(), sums, nullptr, /*unreported=*/parallel_->world_size() == 1);
  refuse_no_count(values, model_name_, "an evaluation");
  result.samples = loader.size();
  result.loss = values.loss;
  result.metrics = std::move(values.metrics);
  finish_metrics(result.metrics);
  result.seconds = seconds_since(start);
  module.train();
  return result;
}

}  // namespace loom::core
