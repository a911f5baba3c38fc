// Memory planning and recovery: model states for the estimator, probes of a micro-batch's
// peak, the activation fit, replaying a step that ran out of memory under a new plan, and the
// advice when nothing can help.
#include <loom/core/device_memory.hpp>
#include <loom/core/estimator.hpp>
#include <loom/core/log.hpp>
#include <loom/core/text.hpp>
#include <loom/core/trainer.hpp>
#include <loom/sdk/helpers.hpp>
#include "replicas.hpp"
#include "step_graph.hpp"
#include "trainer_internal.hpp"

#include <torch/nn/module.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>
#include <sys/resource.h>

namespace fs = std::filesystem;

namespace loom::core {

using namespace detail;

namespace {
/// How many of `devices` keep their memory where `device` does: each cpu:N is the host's memory
/// (data_parallel over cpu:0,cpu:1 was planned as two memories, and measured 37 % above it).
int64_t sharing_memory(const std::vector<c10::Device>& devices, const c10::Device& device) {
  return std::count_if(devices.begin(), devices.end(),
                       [&](const c10::Device& d) { return d.type() == device.type() && (d.is_cpu() || d.index() == device.index()); });
}
}  // namespace

ModelStates Trainer::model_states() const {
  ModelStates m;
  for (const auto& p : parameters_.all()) {  // each tied parameter once
    const int64_t bytes = p.numel() * static_cast<int64_t>(p.element_size());
    m.parameters += bytes;
    if (!p.requires_grad()) {
      m.frozen += p.numel();
      continue;
    }
    m.trainable += p.numel();
    m.gradients += bytes;
    m.optimizer_states += optimizer_->state_bytes(p);
  }
  if (model_.implements(1)) {  // Model 2.1
    m.held = as_component([&] { return "model '" + model_name_ + "' (held_memory)"; }, model_name_,
                          [&] { return model_->held_memory(); });
    // (-2^50 bytes showed as "workspace 1.0 PiB" beside "total 976 B", in silence)
    for (const auto& [what, bytes] : m.held)
      if (bytes < 0 || bytes >= (int64_t{1} << 50) || what.empty() || printable(what, 64) != what)
        throw Error("model '" + model_name_ + "' says it holds " + std::to_string(bytes) + " bytes as '" + printable(what, 64) +
                    "' (held_memory): each is a plain name and a size in bytes, 0 or more and below 1 PiB (a bug of "
                    "the plugin's: report it to its author)");
  }
  // (the step on the device's table, made at the first step: a run of a million steps held 8 MB
  // more than its estimate)
  if (step_on_device_ && total_steps_ > 0 && total_steps_ < kLargestRateTable)
    m.rate_table = (total_steps_ + 1) * (device_.is_cpu() ? 8 : 4);
  return m;
}

void Trainer::setup_for_estimate() {
  build_components(/*with_optimizer=*/true);
  // The run's length as build_loaders counts it (no loader is made here): the step on the
  // device's table of learning rates, one rate a step, is part of the estimate.
  const int64_t per_epoch = training_samples() / std::max<int64_t>(1, options_.batch_size);
  total_steps_ = options_.max_steps > 0 ? options_.max_steps : per_epoch * options_.epochs;
}

std::optional<ActivationFit> Trainer::activation_fit(int64_t micro) {
  // Two probes, a quarter and half of the micro-batch, extrapolated. Not smaller: a backward's
  // peak is the larger of two lines in the batch (the activations early in the backward, or the
  // largest weight's gradient buffer late in it, when the activations are mostly freed), and
  // probes far below the micro-batch can sit on the flat one (bench/memory_figures.cpp).
  const int64_t limit = std::max<int64_t>(2, dataset_->size(sdk::Split::kTrain) / devices_in_world());
  for (int64_t large = std::clamp<int64_t>(micro / 2, 2, limit); large >= 2; large /= 2) {
    std::optional<ActivationFit> fit;
    try {
      fit = fit_activations([this](int64_t b) { return probe_peak(b); }, std::max<int64_t>(1, large / 2), large);
    } catch (const c10::OutOfMemoryError&) {
      memory_->empty_cache();
      log::debug("memory estimate: probe at ", large, " ran out of memory; probing smaller");
      continue;
    }
    // The evaluation's line apart, smaller where it runs out of memory: probed with the training
    // step's, an evaluation that did not fit under a cap (the recommender ranks the whole
    // catalogue) halved the training probes too, and the step's peak, extrapolated from micro-batches
    // 8 and 16, came out 14 % under the run's (a probe; evaluation 7x over).
    // (an evaluation that fits at no micro-batch: nothing fits, as before)
    int64_t failed_at = 0;
    for (int64_t eval_large = large; eval_large >= 2 && !fit->has_eval; eval_large /= 2) try {
        const ActivationFit e =
            fit_activations([this](int64_t b) { return probe_peak(b, /*train=*/false); }, std::max<int64_t>(1, eval_large / 2), eval_large);
        fit->has_eval = true;
        fit->eval_per_sample = e.per_sample;
        fit->eval_fixed = e.fixed;
        if (failed_at > 0)
          log::warn("memory estimate: an evaluation ran out of memory at micro-batch ", failed_at,
                    memory_->stats().limit > 0 ? " under the cap" : "", ", so its figure is extrapolated from micro-batches ",
                    e.probe_small, " and ", e.probe_large, " (off by much where it levels off, as a catalogue scored in chunks does)",
                    memory_->stats().limit > 0 ? "; drop the cap to measure it" : "");
      } catch (const c10::OutOfMemoryError&) {
        memory_->empty_cache();
        failed_at = eval_large;
        log::debug("memory estimate: the evaluation probe at ", eval_large, " ran out of memory; probing smaller");
      }
    if (!fit->has_eval) return std::nullopt;
    // The evaluation at the micro-batch itself (a forward, no gradients): no line need hold it.
    // (within half of what is free: the probes above stayed at half of the micro-batch)
    if (micro > large) try {
        fit->eval_peak_at = probe_peak_within(micro, /*train=*/false, std::max<int64_t>(1, memory_->stats().free / 2));
        fit->eval_at = micro;
      } catch (const c10::OutOfMemoryError&) {
        memory_->empty_cache();
        log::debug("memory estimate: the evaluation probe at ", micro, " ran out of memory; its line stands");
      }
    return fit;
  }
  return std::nullopt;
}

StepState Trainer::capture() const {
  StepState s;
  s.step = step_;
  s.loader = train_loader_->position();
  {
    // (bookkeeping in host memory, not the device budget's: a step whose start allocated it there
    // ran out of memory before its recovery could act)
    HostMemoryScope host;
    s.cpu_rng = cpu_generator().get_state();
    if (device_.is_cuda()) s.device_rng = device_generator(device_).get_state();
  }
  s.buffers = save_buffers();
  s.peak = memory_->stats().peak;
  return s;
}

void Trainer::restore(const StepState& s) {
  step_ = s.step;
  train_loader_->seek(s.loader);
  cpu_generator().set_state(s.cpu_rng);
  if (s.device_rng.defined()) device_generator(device_).set_state(s.device_rng);
  parameters_.zero_grad();
  restore_buffers(s.buffers);
}

std::vector<at::Tensor> Trainer::save_buffers() const {
  // Buffers a forward in training mode updates (BatchNorm's running statistics): a replayed or
  // probed forward must not count twice.
  std::vector<at::Tensor> out;
  for (const auto& item : model_->module().named_buffers()) out.push_back(item.value().detach().clone());
  return out;
}

void Trainer::restore_buffers(const std::vector<at::Tensor>& saved) {
  at::NoGradGuard no_grad;
  size_t i = 0;
  for (const auto& item : model_->module().named_buffers())
    if (i < saved.size()) item.value().copy_(saved[i++]);
}

namespace {

// The settings that only choose the precision (precision.name, resolved, is what counts): a resume
// given --no-amp or --allow-precision-change at the same precision dropped its run's re-planned
// micro-batch and ran out of memory at once (probe). Left out of the configuration's key, and
// removed from a checkpoint's record of it, which held them before 2026-12-01.
// (precision.tf32, a component's option --allow-tf32 sets: TF32 matmuls, the same memory)
const std::vector<std::string> kPrecisionChoosers = {"precision.amp=", "precision.allow_tf32=",
                                                     "precision.allow_precision_change=", "precision.tf32="};

std::string without_precision_choosers(std::string key) {
  for (const std::string& chooser : kPrecisionChoosers)
    for (size_t at = key.find(chooser); at != std::string::npos; at = key.find(chooser, at))
      if (at == 0 || key[at - 1] == ';') {
        const size_t end = key.find(';', at);
        key.erase(at, end == std::string::npos ? std::string::npos : end - at + 1);
      } else {
        at += chooser.size();
      }
  return key;
}

}  // namespace

std::string Trainer::config_key() const {
  std::string key;
  // (the loader's own settings move samples to the device, not more of them: a run with more
  // workers reuses the answer. data.seed and sizes stay: a seed can change what the data holds,
  // the users a recommender's embedding is sized by.)
  static const std::set<std::string> loader = {"data.num_workers", "data.prefetch", "data.pin_memory", "data.shuffle",
                                               "data.validation_fraction"};
  for (const auto& section : {"model", "data", "precision"})
    for (const auto& [k, v] : this->section(section))
      if (!loader.count(std::string(section) + "." + k)) key += std::string(section) + "." + k + "=" + v + ";";
  key = without_precision_choosers(std::move(key));
  // The optimizer's options too: SGD's momentum holds a buffer per parameter that plain SGD does not.
  key += "optimizer=" + options_.optimizer + ";";
  const std::string optimizer = "optimizer." + options_.optimizer + ".";
  for (const auto& [k, v] : config_)
    if (k.rfind(optimizer, 0) == 0) key += k.substr(optimizer.size()) + "=" + v.value + ";";
  // What the data under data.root make of the model and its batch: a catalogue replaced in place
  // (200 items, then 20000: another embedding) reused the answer measured for the other, which
  // then ran out of memory at step 1.
  int64_t parameters = 0;
  for (const auto& p : model_->module().parameters()) parameters += p.numel();
  key += "parameters=" + std::to_string(parameters) + ";classes=" + std::to_string(data_spec_.num_classes) + ";";
  for (const auto& [name, field] : data_spec_.fields) {
    key += name + "=";
    for (const int64_t d : field.shape) key += std::to_string(d) + "x";
    key += std::string(c10::toString(field.dtype)) + ";";
  }
  // Replicas sharing this device (data_parallel over cpu, cpu) each hold their part's activations
  // (probe_peak): a single device's answer ran out of memory at step 1 there (a review).
  if (const auto sharing = replicas_ ? sharing_memory(replicas_->devices(), device_) : 1;
      sharing > 1)
    key += "replicas_on_device=" + std::to_string(sharing) + ";";
  // probe=2: what a probe holds (its batch in host memory, the staged next one on CUDA); answers
  // measured by the earlier probes are not reused.
  return key + "libtorch=" + TORCH_VERSION + ";probe=2";
}

std::string Trainer::replan_on_oom(sdk::OomContext& context) {
  const auto names = sdk::parse_list(value_of(config_, "memory.policies"));
  for (size_t i = 0; i < memory_policies_.size(); ++i) {
    const std::string name = i < names.size() ? names[i] : "?";
    if (as_component([&] { return "memory policy '" + name + "' (on_oom)"; }, name, [&] { return memory_policies_[i]->on_oom(context); }))
      return name;
  }
  return {};
}

int64_t Trainer::evaluated_samples() const {
  const int64_t validation = dataset_.implements(1) && dataset_->size(sdk::Split::kValidation) > 0
                                 ? dataset_->size(sdk::Split::kValidation)
                                 : dataset_->size(sdk::Split::kTrain) - training_samples();
  return std::max(dataset_->size(sdk::Split::kTest), validation);
}

std::string Trainer::memory_identity() const {
  const sdk::MemoryStats stats = memory_->stats();
  return device_description(device_) + ", " + std::to_string(stats.total) + " bytes, limit " + std::to_string(stats.limit);
}

void Trainer::adopt_oom_plan(const sdk::BatchPlan& saved, const OomRecord& record) {
  // (a resume that runs out of memory again on each resume: oom_recovery replays it, without it
  // the run fails). An accumulation this command gives other than the run's is the user's own.
  const ConfigValue& accumulation = config_.at("trainer.gradient_accumulation_steps");
  const bool given_other = accumulation.origin.source.rfind("--", 0) == 0 && record.accumulation > 0 &&
                           options_.accumulation != record.accumulation;
  const bool same = !record.config.empty() && without_precision_choosers(record.config) == config_key() &&
                    record.device == memory_identity();
  if (same && saved == plan_) plan_after_oom_ = true;  // (the record stays for the next resume)
  if (!same || given_other || saved.global() != plan_.global() || saved.world_size != plan_.world_size ||
      saved.micro_batch >= plan_.micro_batch)
    return;
  log::info("plan: ", sdk::plan_text(plan_), " -> ", sdk::plan_text(saved), ": the run ran out of memory at a larger ",
            "micro-batch on this device and configuration before, and went on at this one");
  use_plan(saved);
}

void Trainer::agree_resumed_plan() {
  // Each rank adopted its checkpoint's re-plan by its own device (load_checkpoint, before the
  // ranks meet again): their plans must be one, the smallest micro-batch's.
  const sdk::BatchPlan agreed = agree_plan(plan_);
  if (!(agreed == plan_)) use_plan(agreed);
}

void Trainer::use_plan(const sdk::BatchPlan& plan) {
  plan_ = plan;
  plan_after_oom_ = true;
  train_loader_->set_micro_batch(plan_.micro_batch * local_devices(), plan_.micro_batch * local_devices() * plan_.accumulation);
  if (fit_) predicted_peak_ = estimate(model_states(), *fit_, plan_.micro_batch).peak();
}

int64_t Trainer::probe_peak_within(int64_t b, bool train, int64_t most) {
  // On the CPU an allocation past the machine's memory is no exception but the kernel's OOM
  // killer: a probe that may be large (an evaluation's; a policy's, whose cap without a budget is
  // the machine's whole memory) runs under a budget, past which it throws as on a GPU.
  if (!device_.is_cpu()) return probe_peak(b, train);
  // The budget, and what the host refuses (`ulimit -v`) read as "does not fit" too, for this probe only.
  struct Within {
    sdk::DeviceMemory& memory;
    const int64_t before;
    ~Within() {
      memory.set_limit(before);
      host_refusal_is_oom = false;
    }
  } within{*memory_, memory_->stats().limit};
  memory_->set_limit(within.before > 0 ? std::min(within.before, most) : most);
  host_refusal_is_oom = true;
  try {
    return probe_peak(b, train);
  } catch (const c10::OutOfMemoryError&) {
    throw;
  } catch (const c10::Error& e) {  // (refused in the backward, which no plugin call wraps)
    if (std::string(e.what_without_backtrace()).find("DefaultCPUAllocator") == std::string::npos) throw;
    throw c10::OutOfMemoryError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, explained(e));
  }
}

int64_t Trainer::probe_peak(int64_t b, bool train) {
  // (a policy's probe at -5 was "cannot create std::vector larger than max_size()", at 2^40
  // std::bad_alloc: neither the out-of-memory a search catches)
  // (an evaluation probe is cut to the samples an evaluation reads, below: the host's own at a
  // micro-batch past 2^24, suggest's for a small model and a large target, is no error; a review)
  if (b < 1 || (train && b > (int64_t{1} << 24))) throw Error(probe_refused(b));
  if (!checkpoints_) stop_if_signalled_in_setup(parallel_->world_size(), "memory probes");
  ++probes_run_;
  if (!probed_) {
    // What a model builds lazily on its first forward and keeps (a recommender's cache of text
    // vectors, kernels' workspaces) is there in every step after it: built now, unmeasured, it
    // counts in the probes' fixed part and not as a per-sample cost of the first probe.
    probed_ = true;
    probe_peak(1, false);
  }
  at::Generator cpu = cpu_generator();
  at::Tensor cpu_state, device_state;
  {
    HostMemoryScope host;  // (bookkeeping, as in capture())
    cpu_state = cpu.get_state();
    if (device_.is_cuda()) device_state = device_generator(device_).get_state();
  }
  const std::vector<at::Tensor> buffers = save_buffers();
  auto restore_state = [&] {
    model_->module().train();  // (an evaluation probe that ran out of memory left it in evaluation mode)
    parameters_.zero_grad();
    cpu.set_state(cpu_state);
    if (device_state.defined()) device_generator(device_).set_state(device_state);
    restore_buffers(buffers);
  };
  parameters_.zero_grad();
  memory_->empty_cache();
  memory_->reset_peak();
  const int64_t held = memory_->stats().allocated;
  int64_t peak = 0;
  try {
    // An evaluation forward reads the test split (the samples it evaluates), without gradients.
    const sdk::Split split = !train && dataset_->size(sdk::Split::kTest) > 0 ? sdk::Split::kTest : sdk::Split::kTrain;
    const int64_t n = dataset_->size(split);
    // ... and no more of them than an evaluation's largest split holds: its batches are no larger
    // (a recommender's one user validated was estimated at 16 samples, 414 % above its peak).
    if (!train) b = std::min(b, std::max<int64_t>(1, evaluated_samples()));
    std::vector<int64_t> indices(static_cast<size_t>(b));
    for (int64_t i = 0; i < b; ++i) indices[static_cast<size_t>(i)] = i % n;
    // The batches as a run holds them (DataLoader::fetch): in host memory, and on a CUDA device
    // the batch in use plus the next one, staged on the device while this one computes.
    sdk::Batch batch, staged;
    {
      HostMemoryScope host;
      const std::string name = value_of(config_, "data.name");
      batch = as_component([&] { return "dataset '" + name + "' (get_batch of a memory probe's " + std::to_string(b) + " samples)"; },
                           name, [&] { return dataset_->get_batch(split, indices); });
      // (as a run's batches are checked: a field left out was "model 'x': map::at", one on the
      // meta device "Cannot copy out of meta tensor", the dataset unnamed)
      check_batch("dataset '" + name + "'", data_spec_, batch, b);
    }
    for (auto& [name, t] : batch) t = t.to(device_);
    if (device_.is_cuda())
      for (const auto& [name, t] : batch) staged[name] = t.clone();
    if (train) {
      model_->module().train();
      run_micro_batch(batch, /*train=*/true);
    } else {
      at::NoGradGuard no_grad;
      model_->module().eval();
      run_micro_batch(batch, /*train=*/false);
    }
    peak = memory_->stats().peak;
    // Replicas on this same device (data_parallel over cpu, cpu) share its budget, each holding its
    // part's activations until the one backward: the probe ran one part (a plan that fit one
    // replica ran out of memory at step 1).
    // (an evaluation frees each part's activations as it goes: no backward holds them)
    if (replicas_ && train)
      peak += (sharing_memory(replicas_->devices(), device_) - 1) *
              std::max<int64_t>(0, peak - held);
  } catch (...) {
    restore_state();
    throw;
  }
  restore_state();
  log::debug("probe at micro-batch ", b, ": peak ", peak, " bytes");
  return peak;
}

namespace {
// A size as one command-line word ("2.0GiB"), rounded down so the suggestion stays under the cap.
std::string target_arg(int64_t bytes) {
  char text[32];
  if (bytes >= (int64_t{1} << 30))
    std::snprintf(text, sizeof text, "%.2fGiB", std::floor(static_cast<double>(bytes) / (1 << 30) * 100) / 100);
  else if (bytes >= (int64_t{1} << 20))
    std::snprintf(text, sizeof text, "%lldMiB", static_cast<long long>(bytes >> 20));
  else  // (a cap under a MiB: "0MiB" would ask about nothing)
    std::snprintf(text, sizeof text, "%lldKiB", static_cast<long long>(bytes >> 10));
  return text;
}
}  // namespace

std::string Trainer::oom_advice(const std::string& message) const {
  const auto stats = memory_->stats();
  const ModelStates states = model_states();
  const int64_t cap = stats.limit > 0 ? stats.limit : stats.total;
  std::string text = "out of memory at micro-batch " + std::to_string(plan_.micro_batch) + " (step " +
                     std::to_string(step_ + 1) + " of " + std::to_string(total_steps_) + " on " + device_.str() +
                     "): " + message;
  text += "\nWhat would help, in order:";
  int item = 0;  // (what this run already does is not offered: under bf16_amp, "use bf16_amp" was)
  const auto add = [&](const std::string& line) { text += "\n  " + std::to_string(++item) + ". " + line; };
  if (plan_.micro_batch > 1)  // (at micro-batch 1 a smaller global batch only means fewer micro-batches of 1)
    add("a smaller batch: --batch-size (now " + std::to_string(plan_.global()) + ")");
  const auto policies = sdk::parse_list(value_of(config_, "memory.policies"));
  const bool recovering = std::find(policies.begin(), policies.end(), "oom_recovery") != policies.end();
  // (said as it happened: it claimed a re-plan where none had been, at a micro-batch of 1 from
  // the start or an out-of-memory no step replays; a review)
  const std::string why = plan_.micro_batch <= 1 ? std::string("micro-batch 1 is the smallest")
                                                 : "memory.max_replans re-plans, or no re-plan was possible here";
  if (recovering && oom_recoveries_ > 0)
    add("gradient accumulation: oom_recovery re-planned to micro-batch " + std::to_string(plan_.micro_batch) +
        " x accumulation " + std::to_string(plan_.accumulation) + " and stopped there (" + why + ")");
  else if (recovering)
    add("gradient accumulation: oom_recovery is on and made no smaller plan (" + why + ")");
  else if (plan_.micro_batch > 1)  // (accumulation makes micro-batches smaller: none is smaller than 1)
    add("gradient accumulation: --gradient-accumulation-steps (memory.policies = oom_recovery does it for you)");
  if (const std::string precision = value_of(config_, "precision.name"); precision != "bf16_amp" && precision != "fp16_amp")
    add(device_.is_cpu() ? "mixed precision: precision.name = bf16_amp (not --no-amp; fp16_amp has no fast path on most CPUs)"
                         : "mixed precision: precision.name = bf16_amp or fp16_amp (not --no-amp)");
  if (stats.limit > 0)  // (the cap this run was given: by memory.fraction or memory.device_memory_limit)
    add("the memory cap: this run may use " + format_bytes(stats.limit) + " (--memory-fraction or "
        "memory.device_memory_limit); raise it where the device has room");
  else
    add("the memory the device has: no cap is set (--memory-fraction), so what other processes hold is what this run "
        "lacks; free it, or use another device");
  // (only where the data are images: synthetic sequences take --image-size and ignore it)
  if (const auto input = data_spec_.fields.find(data_spec_.input_key);
      section("model").count("image_size") && input != data_spec_.fields.end() && input->second.shape.size() == 3)
    add("a smaller input: --image-size");
  text += "\nThe estimator: the model states alone need " + format_bytes(states.total()) + " (parameters " +
          format_bytes(states.parameters) + ", gradients " + format_bytes(states.gradients) + ", optimizer " +
          format_bytes(states.optimizer_states) +
          (states.rate_table > 0 ? ", the learning rates, one per step of the run, " + format_bytes(states.rate_table) +
                                       " (trainer.device_step = false keeps them on the host)"
                                 : std::string()) +
          ") of the " + format_bytes(cap) + " this run may use";
  text += states.total() >= cap ? std::string(": no batch fits; use a smaller model, AMP, or more memory.")
                                : "; `loom memory suggest --target " + target_arg(cap) + "` says which batch fits.";
  return text;
}

StepResult Trainer::step_with_recovery(bool read_values) {
  StepState start;
  try {  // (a model's buffers are copied on the device: that too may run out of memory)
    start = capture();
  } catch (const c10::OutOfMemoryError& e) {
    throw OutOfMemory(oom_advice(e.what_without_backtrace()));
  }
  while (true) {
    try {
      return train_step(read_values);
    } catch (const c10::OutOfMemoryError& e) {
      const auto t0 = Clock::now();
      const std::string message = e.what_without_backtrace();
      if (committed_ || ranks_agreed_) {
        const bool alone = !committed_;
        committed_ = ranks_agreed_ = false;
        throw Error("out of memory in the " + std::string(alone ? "gradients' reduction or the update" : "update") +
                    " of step " + std::to_string(start.step + 1) +
                    (alone ? " on this rank alone, after the ranks agreed its forward and backward went well, so the "
                             "others cannot replay it with this one: "
                           : ", after it began to change the weights, so it cannot be replayed: ") +
                    message +
                    "\nLeave more room (a smaller batch, or a cap further below the device's memory) and continue"
                    " with --resume auto from the last checkpoint");
      }
      // Unwind: nothing of the step was applied; drop its gradients, return cached blocks, and
      // put the data position and the RNG back where the step began.
      restore(start);
      if (graphs_) graphs_->clear();  // their memory, before the policies measure what is free
      memory_->empty_cache();
      sdk::OomContext context;
      context.memory = memory_.get();
      context.plan = plan_;
      context.message = message;
      context.step = step_ + 1;
      const std::string replanned_by = replan_on_oom(context);  // the policy's name in memory.policies
      bool replanned = !replanned_by.empty();
      // The same step is replayed with the new plan: one no smaller would run out of memory again, for
      // ever. (With several ranks, said here and agreed below, so that every rank stops, none waits.)
      std::string refused;
      const std::string problem = replanned ? plan_problem(context.plan, plan_.world_size) : std::string();
      if (!problem.empty())
        refused = "memory policy '" + replanned_by + "' answered an out-of-memory at step " + std::to_string(step_ + 1) +
                  " with an impossible plan, " + problem + "; " + message;
      else if (replanned && context.plan.global() != plan_.global())
        refused = "memory policy '" + replanned_by + "' changed the global batch while recovering from out-of-memory";
      else if (replanned && !(context.plan.micro_batch >= 1 && context.plan.micro_batch < plan_.micro_batch &&
                              context.plan.accumulation >= 1 && context.plan.world_size == plan_.world_size))
        refused = "memory policy '" + replanned_by + "' answered an out-of-memory at step " + std::to_string(step_ + 1) +
                  " with the plan " + sdk::plan_text(context.plan) + " (it was " + sdk::plan_text(plan_) +
                  "): a replay needs a smaller micro-batch; " + message;
      if (!refused.empty() && parallel_->world_size() <= 1) throw Error(refused);
      if (!refused.empty()) {
        log::error(refused);
        replanned = false;
      }
      // Every rank re-plans (the others learnt of the failure at the step's agreement); they go
      // on with the smallest micro-batch any chose. A rank with no policy that can re-plan stops
      // the run on every rank.
      if (parallel_->world_size() > 1 && any_rank(!replanned)) {
        if (replanned)  // the rank that could not re-plan says why below
          throw Error("a rank ran out of memory at step " + std::to_string(step_ + 1) +
                      " and could not re-plan (its log says why); every rank stops");
      } else if (replanned) {
        context.plan = agree_plan(context.plan);
      }
      if (!replanned) {
        if (options_.snapshot_on_oom && device_.is_cuda()) {
          const auto path = run_dir_ / "oom_snapshot.pickle";
          write_memory_snapshot(device_, path);
          log::error("memory snapshot of the failure: ", path.string(), " (https://pytorch.org/memory_viz)");
        }
        throw OutOfMemory(oom_advice(message));
      }
      log::info("plan: ", plan_.global(), " = ", plan_.micro_batch, " x ", plan_.accumulation, " x ", plan_.world_size,
                " -> ", context.plan.micro_batch, " x ", context.plan.accumulation, " x ", context.plan.world_size,
                " after running out of memory at step ", step_ + 1);
      plan_ = context.plan;
      train_loader_->set_micro_batch(plan_.micro_batch * local_devices(), plan_.micro_batch * local_devices() * plan_.accumulation);
      // The peak from here on is the new plan's (the attempt that failed is not what the run
      // uses: memory/peak_bytes and the estimate's check would keep it for the rest of the run);
      // what the steps before it used stays the run's peak (finish_run).
      peak_before_replan_ = std::max(peak_before_replan_, start.peak);
      memory_->reset_peak();
      ++oom_recoveries_;
      plan_after_oom_ = true;
      recovery_seconds_ += seconds_since(t0);
    }
  }
}

int64_t peak_resident_bytes() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;
}

}  // namespace loom::core
