// Conformance suites of memory policies, optimizers, schedules, precision and parallel
// strategies and callbacks (conformance.hpp). Each check says in its reason what the host relies
// on that the component did not do.
#include <loom/core/checkpoint.hpp>
#include <loom/core/error.hpp>
#include <loom/core/files.hpp>
#include <loom/core/kinds.hpp>
#include "conformance_internal.hpp"

#include <loom/sdk/callback.hpp>
#include <loom/sdk/memory_policy.hpp>
#include <loom/sdk/optimizer.hpp>
#include <loom/sdk/parallel.hpp>
#include <loom/sdk/precision.hpp>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <unistd.h>

namespace fs = std::filesystem;

namespace loom::core::conformance {

namespace {

/// Text and tensors equal.
std::string state_difference(const sdk::State& a, const sdk::State& b) {
  if (a.text != b.text) return "its text state differs after load_state_dict(state_dict())";
  if (a.tensors.size() != b.tensors.size()) return "it has another set of state tensors after load_state_dict(state_dict())";
  for (const auto& [k, t] : a.tensors)
    if (!b.tensors.count(k) || !at::equal(t, b.tensors.at(k))) return "state tensor '" + k + "' differs after load_state_dict(state_dict())";
  return {};
}

/// A device of 8 GiB, 6 GiB free, for memory policies.
class CheckMemory final : public sdk::DeviceMemory {
 public:
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  sdk::MemoryStats stats() const override {
    sdk::MemoryStats s;
    s.total = 8LL << 30;
    s.free = 6LL << 30;
    s.allocated = s.reserved = s.peak = 1LL << 30;
    s.limit = limit_;
    return s;
  }
  void reset_peak() override {}
  void set_limit(int64_t bytes) override {
    if (bytes < 0) throw sdk::Error("negative limit");
    limit_ = bytes;
  }
  void empty_cache() override {}

 private:
  int64_t limit_ = -1;
};

void check_memory_policy(Suite& s, const PluginRegistry& r, const ComponentInfo& c) {
  std::shared_ptr<sdk::MemoryPolicy> p;
  CheckMemory memory;
  s.require("create", [&] {
    p = r.create<sdk::MemoryPolicy>(c.name, s.options_of(c.name));
    return std::string();
  });
  s.require("setup", [&] {
    p->setup(memory);
    return std::string();
  });
  s.run("plan_keeps_a_given_batch", [&]() -> std::string {
    // Peaks grow with the micro-batch: 1 GiB of states and 16 MiB per sample.
    sdk::PlanContext context;
    context.memory = &memory;
    context.plan = {256, 1, 1};
    context.global_batch = 256;
    context.global_batch_given = true;
    context.probe = [](int64_t b) {  // (as the host's: a micro-batch outside 1..2^24 is refused)
      if (b < 1 || b > (int64_t{1} << 24))
        throw Error("a memory probe at micro-batch " + std::to_string(b) + " is refused: a micro-batch is in 1..16777216");
      return (1LL << 30) + b * (16LL << 20);
    };
    context.config_key = "conformance";
    context.device_name = "conformance check device";
    context.max_micro_batch = 256;
    p->plan(context);
    const auto& q = context.plan;
    if (q.micro_batch < 1 || q.accumulation < 1 || q.world_size != 1)
      return "plan() made " + std::to_string(q.micro_batch) + " x " + std::to_string(q.accumulation) + " x " +
             std::to_string(q.world_size) + ": micro-batch and accumulation are >= 1 and the world size stays";
    if (q.global() != 256) return "plan() changed a global batch the user gave from 256 to " + std::to_string(q.global());
    return {};
  });
  auto on_oom = [&](int64_t micro, int64_t accumulation) {
    sdk::OomContext context;
    context.memory = &memory;
    context.plan = {micro, accumulation, 1};
    context.message = "conformance check: out of memory";
    context.step = 1;
    const bool replanned = p->on_oom(context);
    return std::make_pair(replanned, context.plan);
  };
  s.run("on_oom_shrinks_or_declines", [&]() -> std::string {
    const auto [replanned, q] = on_oom(64, 4);
    if (!replanned) return {};
    if (q.global() != 256 || q.world_size != 1) return "on_oom() re-planned 64 x 4 to a global batch of " + std::to_string(q.global()) + " (it must stay 256)";
    if (q.micro_batch >= 64) return "on_oom() returned true but kept micro-batch " + std::to_string(q.micro_batch) + ": the replay would run out of memory again";
    return {};
  });
  s.run("on_oom_at_micro_batch_1_declines", [&]() -> std::string {
    const auto [replanned, q] = on_oom(1, 256);
    if (replanned) return "on_oom() at micro-batch 1 returned true (micro-batch " + std::to_string(q.micro_batch) + "); it cannot shrink further, so it must return false";
    return {};
  });
}

at::Tensor parameter(double offset) {
  return (at::arange(6, at::TensorOptions().dtype(at::kFloat)).reshape({2, 3}) + offset).set_requires_grad(true);
}

sdk::ParameterGroup group(const std::string& name, std::vector<at::Tensor> params) {
  sdk::ParameterGroup g;
  g.name = name;
  for (size_t i = 0; i < params.size(); ++i) g.names.push_back(name + "." + std::to_string(i));
  g.params = std::move(params);
  return g;
}

void step(sdk::Optimizer& o, const std::vector<at::Tensor>& params) {
  for (auto p : params) p.mutable_grad() = p.detach().sin();
  o.step(0.1);
}

void check_optimizer(Suite& s, const PluginRegistry& r, const ComponentInfo& c) {
  s.require("create", [&] {
    r.create<sdk::Optimizer>(c.name, s.options_of(c.name));
    return std::string();
  });
  s.run("updates_only_parameters_with_gradients", [&]() -> std::string {
    at::Tensor a = parameter(0), b = parameter(1);
    auto o = r.create<sdk::Optimizer>(c.name, s.options_of(c.name));
    o->setup({group("w", {a, b})});
    const at::Tensor a0 = a.detach().clone(), b0 = b.detach().clone();
    a.mutable_grad() = a.detach().sin();
    o->step(0.1);
    if (at::equal(a, a0)) return "step() left a parameter with a gradient unchanged";
    if (!at::equal(b, b0)) return "step() changed a parameter without a gradient";
    return {};
  });
  s.run("state_round_trip", [&]() -> std::string {
    at::Tensor p1 = parameter(0), p2 = parameter(0);
    auto a = r.create<sdk::Optimizer>(c.name, s.options_of(c.name)), b = r.create<sdk::Optimizer>(c.name, s.options_of(c.name));
    a->setup({group("w", {p1})});
    b->setup({group("w", {p2})});
    step(*a, {p1});
    step(*a, {p1});
    {
      at::NoGradGuard no_grad;
      p2.copy_(p1);
    }
    b->load_state_dict(a->state_dict());
    step(*a, {p1});
    step(*b, {p2});
    if (!at::equal(p1, p2)) return "after load_state_dict(state_dict()) the next step differs: a resumed run would not continue exactly";
    return {};
  });
  // Interface 1.1 (Note [The step on the device]): step_on_device(lr, found_inf) is step(lr) when
  // found_inf is 0, and changes nothing, step count included, when it is 1.
  s.run("step_on_device_matches_step", [&]() -> std::string {
    at::Tensor p1 = parameter(0), p2 = parameter(0);
    auto a = r.create<sdk::Optimizer>(c.name, s.options_of(c.name)), b = r.create<sdk::Optimizer>(c.name, s.options_of(c.name));
    if (!b.implements(1)) return {};
    a->setup({group("w", {p1})});
    b->setup({group("w", {p2})});
    const auto lr = at::full({}, 0.1, at::TensorOptions().dtype(at::kDouble));
    const auto taken = at::zeros({1}), skipped = at::ones({1});
    auto close = [](const at::Tensor& x, const at::Tensor& y) { return at::allclose(x, y, 1e-6, 1e-7); };
    step(*a, {p1});
    p2.mutable_grad() = p2.detach().sin();
    b->step_on_device(lr, taken);
    if (!close(p1, p2)) return "step_on_device(lr, found_inf = 0) updates differently from step(lr)";
    const at::Tensor before = p2.detach().clone();
    const sdk::State state_before = b->state_dict();
    p2.mutable_grad() = at::full_like(p2, std::nan(""));
    b->step_on_device(lr, skipped);
    if (!at::equal(p2, before)) return "step_on_device(lr, found_inf = 1) changed the parameters (it must skip the update)";
    if (const std::string d = state_difference(state_before, b->state_dict()); !d.empty())
      return "step_on_device(lr, found_inf = 1) changed the state: " + d;
    step(*a, {p1});
    p2.mutable_grad() = p2.detach().sin();
    b->step_on_device(lr, taken);
    if (!close(p1, p2)) return "after a skipped step_on_device, the next update differs from step(): the skipped step was counted";
    return {};
  });
  // Interface 1.2 (Note [One pass over the gradients]): step_on_device_dividing(lr, found_inf,
  // divisor) on gradients g is step_on_device(lr, found_inf) on g / divisor.
  s.run("step_on_device_dividing_matches_dividing_first", [&]() -> std::string {
    at::Tensor p1 = parameter(0), p2 = parameter(0);
    auto a = r.create<sdk::Optimizer>(c.name, s.options_of(c.name)), b = r.create<sdk::Optimizer>(c.name, s.options_of(c.name));
    if (!b.implements(2)) return {};
    a->setup({group("w", {p1})});
    b->setup({group("w", {p2})});
    const auto lr = at::full({}, 0.1, at::TensorOptions().dtype(at::kDouble));
    const auto taken = at::zeros({1}), divisor = at::full({1}, 8.0);
    for (int i = 0; i < 2; ++i) {
      p1.mutable_grad() = p1.detach().sin().div(8.0);
      a->step_on_device(lr, taken);
      p2.mutable_grad() = p2.detach().sin();
      b->step_on_device_dividing(lr, taken, divisor, {p2.mutable_grad()});
      if (!at::allclose(p1, p2, 1e-6, 1e-7))
        return "step_on_device_dividing(lr, 0, divisor 8) updates differently from step_on_device on gradients / 8";
    }
    return {};
  });
  s.run("state_bytes", [&]() -> std::string {
    at::Tensor p = parameter(0);
    auto o = r.create<sdk::Optimizer>(c.name, s.options_of(c.name));
    o->setup({group("w", {p})});
    o->materialize();
    o->materialize();  // idempotent
    int64_t kept = 0;
    for (const auto& [k, t] : o->state_dict().tensors) kept += t.numel() * static_cast<int64_t>(t.element_size());
    if (o->state_bytes(p) != kept)
      return "state_bytes() says " + std::to_string(o->state_bytes(p)) + " bytes, the materialized state holds " + std::to_string(kept) + " (the memory estimate reads it)";
    return {};
  });
}

void check_schedule(Suite& s, const PluginRegistry& r, const ComponentInfo& c) {
  std::shared_ptr<sdk::Schedule> sched;
  s.require("create", [&] {
    sched = r.create<sdk::Schedule>(c.name, s.options_of(c.name));
    return std::string();
  });
  s.run("factor_finite_and_non_negative", [&]() -> std::string {
    for (const int64_t total : {1, 7, 1000})
      for (int64_t step = 0; step < total; ++step) {  // (the updates the host asks of: 0 ... total - 1)
        const double f = sched->factor(step, total);
        if (!std::isfinite(f) || f < 0)
          return "factor(" + std::to_string(step) + ", " + std::to_string(total) + ") = " + std::to_string(f) + "; a factor is finite and >= 0";
      }
    return {};
  });
  s.run("state_round_trip", [&]() -> std::string {
    auto again = r.create<sdk::Schedule>(c.name, s.options_of(c.name));
    again->load_state_dict(sched->state_dict());
    for (int64_t step = 0; step < 100; ++step)
      if (again->factor(step, 100) != sched->factor(step, 100))
        return "after load_state_dict(state_dict()) factor(" + std::to_string(step) + ", 100) differs";
    return state_difference(sched->state_dict(), again->state_dict());
  });
}

void check_precision(Suite& s, const PluginRegistry& r, const ComponentInfo& c) {
  std::shared_ptr<sdk::PrecisionStrategy> p;
  s.require("create", [&] {
    p = r.create<sdk::PrecisionStrategy>(c.name, s.options_of(c.name));
    return std::string();
  });
  s.require("setup_on_cpu", [&]() -> std::string {
    try {
      p->setup(c10::Device(c10::kCPU));
    } catch (const std::exception& e) {
      throw Skip(std::string("needs a GPU (setup on CPU: ") + e.what() + ")");
    }
    return {};
  });
  s.run("manifest", [&]() -> std::string {
    return p->manifest().empty() ? "manifest() is empty: a checkpoint could not tell which precision wrote it" : "";
  });
  s.run("finite_gradients_step", [&]() -> std::string {
    auto guard = p->forward_guard();
    guard.reset();
    std::vector<at::Tensor> g{at::full({3}, 0.5)};
    const at::Tensor scaled = p->scale_loss(at::full({}, 2.0));
    if (!std::isfinite(scaled.item<double>())) return "scale_loss(2) is not finite";
    if (!p->unscale_gradients(g)) return "unscale_gradients() reported finite gradients as non-finite";
    return {};
  });
  s.run("non_finite_gradients_detected", [&]() -> std::string {
    std::vector<at::Tensor> g{at::full({3}, std::numeric_limits<float>::infinity())};
    if (p->unscale_gradients(g)) return "unscale_gradients() reported an inf gradient as finite: the step would apply it";
    p->update(true);
    return {};
  });
  s.run("state_round_trip", [&]() -> std::string {
    auto again = r.create<sdk::PrecisionStrategy>(c.name, s.options_of(c.name));
    again->setup(c10::Device(c10::kCPU));
    again->load_state_dict(p->state_dict());
    return state_difference(p->state_dict(), again->state_dict());
  });
}

void check_parallel(Suite& s, const PluginRegistry& r, const ComponentInfo& c) {
  std::shared_ptr<sdk::ParallelStrategy> p;
  s.require("create", [&] {
    p = r.create<sdk::ParallelStrategy>(c.name, s.options_of(c.name));
    return std::string();
  });
  s.require("setup_on_cpu", [&]() -> std::string {
    try {
      p->setup("cpu");
    } catch (const std::exception& e) {
      throw Skip(std::string("cannot run on one CPU process (") + e.what() + ")");
    }
    if (p->world_size() < 1 || p->rank() < 0 || p->rank() >= p->world_size())
      return "rank " + std::to_string(p->rank()) + " of world size " + std::to_string(p->world_size());
    return {};
  });
  s.run("all_reduce_of_one_rank", [&]() -> std::string {
    if (p->world_size() != 1) throw Skip("world size is not 1");
    at::Tensor t = at::arange(4, at::TensorOptions().dtype(at::kFloat));
    const at::Tensor before = t.clone();
    p->all_reduce_sum({t});
    p->broadcast({t});
    p->barrier();
    return at::equal(t, before) ? "" : "all_reduce_sum over one rank changed the values";
  });
  s.run("teardown", [&] {
    p->teardown();
    return std::string();
  });
}

/// The run a callback is checked in: a temporary folder, 2 steps, one evaluation. A save is
/// refused where the trainer refuses it (save_refused_in), and told to the callback after step 2.
class CheckRun final : public sdk::RunContext {
 public:
  explicit CheckRun(fs::path dir) : dir_(std::move(dir)) {
    metrics_["loss"] = {"loss", "loss", sdk::Direction::kMinimize, false};
    metrics_["accuracy"] = {"accuracy", "accuracy", sdk::Direction::kMaximize, true};
  }
  fs::path run_dir() const override { return dir_; }
  bool is_main() const override { return true; }
  int64_t step() const override { return step_; }
  int64_t total_steps() const override { return 2; }
  int64_t steps_per_epoch() const override { return 2; }
  int64_t resumed_at() const override { return -1; }
  const std::map<std::string, sdk::MetricSpec>& metrics() const override { return metrics_; }
  std::string format_metric(const std::string& name, double value) const override { return name + " " + std::to_string(value); }
  int64_t eval_every() const override { return 2; }
  int64_t checkpoint_every() const override { return 0; }
  std::string best_metric() const override { return "accuracy"; }
  sdk::Split selection_split() const override { return sdk::Split::kValidation; }
  fs::path save_checkpoint() override {
    const std::string refused = save_refused_in(hook_);
    if (!refused.empty()) throw Error(refused);
    return dir_ / "checkpoints" / step_dir_name(step_);
  }
  fs::path save_weights(const std::string& file, const sdk::TextMap&) override { return dir_ / "checkpoints" / file; }
  void request_stop(const std::string& reason) override { stop_ = reason; }
  bool stop_requested() const override { return !stop_.empty(); }
  int64_t step_ = 0;
  std::string hook_;  ///< the hook being called

 private:
  fs::path dir_;
  std::map<std::string, sdk::MetricSpec> metrics_;
  std::string stop_;
};

void check_callback(Suite& s, const PluginRegistry& r, const ComponentInfo& c) {
  std::shared_ptr<sdk::Callback> cb;
  const fs::path dir = temp_folder() / ("loom_check_" + c.name + "_" + std::to_string(::getpid()));
  s.require("create", [&] {
    cb = r.create<sdk::Callback>(c.name, s.options_of(c.name));
    return std::string();
  });
  s.run("hooks_of_a_short_run", [&]() -> std::string {
    fs::remove_all(dir);
    fs::create_directories(dir);
    CheckRun run(dir);
    std::vector<at::Tensor> grads{at::full({2}, 0.25)};
    const auto in = [&](const char* hook, const std::function<void()>& call) {
      run.hook_ = hook;
      call();
      run.hook_.clear();
    };
    in("on_run_begin", [&] { cb->on_run_begin(run); });
    for (int64_t step = 1; step <= 2; ++step) {
      in("on_step_begin", [&] { cb->on_step_begin(run, step); });
      in("on_after_backward", [&] { cb->on_after_backward(run, grads); });
      in("on_before_optimizer_step", [&] { cb->on_before_optimizer_step(run, grads); });
      run.step_ = step;
      sdk::StepReport report;
      report.step = step;
      report.total_steps = 2;
      report.loss = 1.0 / static_cast<double>(step);
      report.metrics = {{"accuracy", 0.5}};
      report.lr = 1e-3;
      report.samples = 32;
      report.seconds = 0.01;
      in("on_log", [&] { cb->on_log(run, step, {{"train/loss", report.loss}, {"train/lr", 1e-3}, {"train/samples_per_s", 3200.0}}); });
      if (step == 2) {
        sdk::EvalReport eval;
        eval.step = 2;
        eval.loss = 0.5;
        eval.metrics = {{"accuracy", 0.75}};
        eval.samples = 64;
        in("on_log", [&] { cb->on_log(run, step, {{"val/loss", 0.5}, {"val/accuracy", 0.75}}); });
        in("on_evaluation_end", [&] { cb->on_evaluation_end(run, eval); });
        report.evaluated = report.last = true;
      }
      in("on_step_end", [&] { cb->on_step_end(run, report); });
    }
    const fs::path saved = dir / "checkpoints" / step_dir_name(2);  // (a folder there, as after a save: one may copy it)
    fs::create_directories(saved);
    in("on_checkpoint_saved", [&] { cb->on_checkpoint_saved(run, saved); });
    sdk::RunReport end;
    end.steps = 2;
    end.seconds = 0.02;
    in("on_run_end", [&] { cb->on_run_end(run, end); });
    return std::string();
  });
  s.run("state_round_trip", [&]() -> std::string {
    auto again = r.create<sdk::Callback>(c.name, s.options_of(c.name));
    again->load_state_dict(cb->state_dict());
    return state_difference(cb->state_dict(), again->state_dict());
  });
  std::error_code ec;
  fs::remove_all(dir, ec);
}

}  // namespace

void check_other_kind(Suite& s, const PluginRegistry& r, const ComponentInfo& c) {
  switch (c.kind) {
    case LOOM_KIND_MEMORY: check_memory_policy(s, r, c); break;
    case LOOM_KIND_OPTIMIZER: check_optimizer(s, r, c); break;
    case LOOM_KIND_SCHEDULE: check_schedule(s, r, c); break;
    case LOOM_KIND_PRECISION: check_precision(s, r, c); break;
    case LOOM_KIND_PARALLEL: check_parallel(s, r, c); break;
    case LOOM_KIND_CALLBACK: check_callback(s, r, c); break;
    default: s.run("known_kind", [&] { return "the host has no suite for " + kind_name(c.kind); }); break;
  }
}

}  // namespace loom::core::conformance
