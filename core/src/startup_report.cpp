// The start-up report: device, data, model, plan, optimizer, schedule, precision and memory,
// one line each, before the first step.
#include <loom/core/device_memory.hpp>
#include <loom/core/log.hpp>
#include <loom/core/text.hpp>
#include <loom/core/trainer.hpp>
#include "replicas.hpp"
#include "trainer_internal.hpp"

#include <loom/sdk/version.hpp>
#include <ATen/DeviceAccelerator.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <sys/resource.h>
#include <cstdio>
#include <unistd.h>

namespace fs = std::filesystem;

namespace loom::core {

using namespace detail;

namespace {

std::string format_count(int64_t n) {
  std::string s = std::to_string(n), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return out;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) s += 'x';  // appended: GCC 12's -Wrestrict misreads "x" + std::string&& (bug 105329)
    s += std::to_string(shape[i]);
  }
  return s.empty() ? "scalar" : s;
}

}  // namespace

void Trainer::report_startup() const {
  std::string device = device_.str();
  if (device_.is_cpu()) {
    // (a container's: its cgroup's limit; under `ulimit -v`, half the address space it leaves, said
    // as such: "3.2 GiB free" beside `free` showing 20 GB read as a wrong figure, probe)
    rlimit space{};
    const bool limited = ::getrlimit(RLIMIT_AS, &space) == 0 && space.rlim_cur != RLIM_INFINITY;
    device += ", " + std::to_string(at::get_num_threads()) + " threads, " + format_bytes(physical_memory()) + " RAM (" +
              format_bytes(available_memory()) + " free" + (limited ? " within ulimit -v, counting half of the address space left)" : ")");
  } else {
    const auto [free, total] = at::accelerator::getMemoryInfo(device_.index());
    device += ", " + format_bytes(static_cast<int64_t>(total)) + " (" + format_bytes(static_cast<int64_t>(free)) + " free)";
  }
  int64_t params = 0, trainable = 0, bytes = 0;
  for (const auto& p : parameters_.all()) {  // each tied parameter once
    params += p.numel();
    if (p.requires_grad()) trainable += p.numel();
    bytes += p.numel() * p.element_size();
  }
  std::string fields;
  for (const auto& [name, f] : data_spec_.fields)
    fields += (fields.empty() ? "" : ", ") + name + " " + shape_string(f.shape) + " " + c10::toString(f.dtype);
  std::string manifest;
  for (const auto& [k, v] : precision_->manifest()) manifest += (manifest.empty() ? "" : ", ") + k + " " + v;
  const int64_t per_epoch = train_loader_->batches_per_epoch() / plan_.accumulation;

  log::info("Loom ", LOOM_SDK_VERSION, ", LibTorch ", TORCH_VERSION, LOOM_TORCH_CUDA ? " (CUDA build)" : " (CPU build)",
            "; run folder ", run_dir_.string());
  log::info("device    ", device);
  if (replicas_)
    log::info("parallel  ", value_of(config_, "parallel.name"), ": ", replicas_->size(), " devices in this process (",
              describe_devices(replicas_->devices()), "), a model replica on each; each loader batch of ",
              plan_.micro_batch * replicas_->size(), " cut across them (the plan's micro-batch, ", plan_.micro_batch,
              " per device), gradients summed on ", device_.str());
  // (the split's size: a rank's loader holds its share of it)
  const std::string validation =
      held_out_ > 0 ? " (" + std::to_string(held_out_) + " of them held out for validation)"
                    : val_loader_ ? ", " + std::to_string(dataset_->size(sdk::Split::kValidation)) + " validation"
                                  : " (no validation: the test split picks the best checkpoint)";
  log::info("data      ", value_of(config_, "data.name"), ": ", dataset_->size(sdk::Split::kTrain), " train", validation,
            ", ", dataset_->size(sdk::Split::kTest), " test; ", fields,
            data_spec_.num_classes ? "; " + std::to_string(data_spec_.num_classes) + " classes" : std::string());
  // (the plugin describes the model it built, "random start" where it had no pretrained weights:
  // what replaced them is the core's to say)
  const std::string model = as_component([&] { return "model '" + value_of(config_, "model.name") + "' (describe)"; },
                                         value_of(config_, "model.name"), [&] { return model_->describe(); });
  const std::string weights = resumed_at_ >= 0 ? "; weights from the checkpoint of step " + std::to_string(resumed_at_)
                              : !options_.init_from.empty() ? "; weights from trainer.init_from (" + options_.init_from + ")"
                                                            : std::string();
  log::info("model     ", value_of(config_, "model.name"), ": ", model.empty() ? std::string() : model + "; ", format_count(params),
            " parameters (", format_count(trainable), " trainable, ", format_bytes(bytes), ")", weights);
  log::info("plan      batch ", plan_.global(), " = ", plan_.micro_batch, " x ", plan_.accumulation, " x ",
            plan_.world_size, " (micro-batch x accumulation x devices); ", per_epoch, " steps/epoch, ", total_steps_,
            total_steps_ == 1 ? " step" : " steps",
            options_.max_steps == 0 ? " (" + std::to_string(options_.epochs) + (options_.epochs == 1 ? " epoch)" : " epochs)")
                                    : std::string());
  std::string groups;
  for (const auto& g : parameters_.trainable())
    groups += (groups.empty() ? "" : ", ") + g.name + " " + std::to_string(g.params.size()) +
              (g.lr_scale != 1.0 ? " (lr x " + std::to_string(g.lr_scale).substr(0, 5) + ")" : std::string());
  log::info("optimizer ", optimizer_->describe().empty() ? options_.optimizer : optimizer_->describe(), "; groups ",
            groups, "; clip ", options_.clip_grad_norm,
            step_on_device_ ? "; non-finite steps skipped on the device" : "; non-finite steps checked on the host");
  if (graphs_)
    log::info("step      CUDA graph: ", options_.cuda_graph_warmup, " eager steps, then the step is captured and "
              "replayed (on_after_backward and on_before_optimizer_step run on the eager steps and the capture only)");
  log::info("schedule  ", options_.schedule, ": peak lr ", base_lr_,
            schedule_->describe().empty() ? std::string() : ", " + schedule_->describe());
  log::info("precision ", value_of(config_, "precision.name"), ": ", manifest);
  if (flops_per_term_ > 0) {  // Note [Model FLOPs in the log]
    const double f = flops_per_term_;
    char count[64], peak[96];
    std::snprintf(count, sizeof count, "%.4g %s", f >= 1e9 ? f / 1e9 : f >= 1e6 ? f / 1e6 : f >= 1e3 ? f / 1e3 : f,
                  f >= 1e9 ? "GFLOP" : f >= 1e6 ? "MFLOP" : f >= 1e3 ? "kFLOP" : "FLOP");
    std::snprintf(peak, sizeof peak, "%.4g", peak_.tflops);
    log::info("speed     model FLOPs ", count, " per loss term (forward and backward); the log's TFLOP/s are per device",
              peak_.tflops > 0 ? std::string("; MFU against ") + peak + " TFLOP/s (" + peak_.source + ")"
                               : "; " + peak_.source);
  }
  const auto mem = memory_->stats();
  if (mem.limit > 0)
    // (on the CPU the budget is the device's size: "of" it only where --device-memory-limit made
    // the CPU a device of that size; a fraction's share of the machine its policy's line says)
    log::info("memory    ", device_.str(), " may use ", format_bytes(mem.limit),
              !device_.is_cpu() ? " of " + format_bytes(mem.total)
              : options_.device_memory_limit > 0
                  ? " of " + format_bytes(options_.device_memory_limit) + " (--device-memory-limit: the CPU acts as a device of that size)"
                  : std::string());
  for (const auto& policy : memory_policies_) log::info("memory    ", policy->describe());
  // (with the run's length known now: the step on the device's table of learning rates)
  const int64_t predicted = fit_ ? estimate(model_states(), *fit_, plan_.micro_batch).peak() : predicted_peak_;
  if (predicted > 0) log::info("memory    estimated peak ", format_bytes(predicted), " at micro-batch ", plan_.micro_batch);
  // (said before a step runs out of memory against it: an oom_recovery policy re-plans there)
  // (a policy listed after auto_batch that plans, vram_tiers, replaced what it measured: the
  // warning blamed auto_batch's cache)
  const auto policies = sdk::parse_list(value_of(config_, "memory.policies"));
  const auto searched = std::find(policies.begin(), policies.end(), "auto_batch");
  std::string after;
  for (auto it = searched == policies.end() ? policies.end() : searched + 1; it != policies.end(); ++it)
    if (*it != "oom_recovery") after += (after.empty() ? "" : ", ") + *it;
  if (const int64_t cap = memory_->stats().limit; predicted > 0 && cap > 0 && predicted > cap)
    log::warn("the estimated peak, ", format_bytes(predicted), ", is above the ", format_bytes(cap),
              " this run may use: a step or an evaluation may run out of memory (a smaller --batch-size",
              searched == policies.end() ? ", or memory.policies = auto_batch, which measures what fits)"
              : !after.empty() ? "; " + after + ", listed after auto_batch, planned after it: list auto_batch last, which " +
                                     "measures what fits)"
                               : std::any_of(memory_policies_.begin(), memory_policies_.end(),
                                             [](const auto& p) { return p->describe().find("(cached)") != std::string::npos; })
                                     ? std::string("; auto_batch's answer came from its cache and may be stale: "
                                                   "memory.auto_batch.cache = off searches again)")
                                     : std::string("; auto_batch measured that this micro-batch's step fits: the estimate, "
                                                   "extrapolated from probes under the cap, may run high)"));
  // On the CPU without a cap, past what the machine has free the kernel's OOM killer ends the
  // process with no word from it (exit 137), minutes in; said now, with what would help.
  // (what is allocated already, the model and its optimizer, is in the peak and no longer free)
  else if (const int64_t more = predicted - std::max<int64_t>(0, mem.allocated);
           device_.is_cpu() && predicted > 0 && mem.limit <= 0 && mem.free > 0 && more > mem.free)
    log::warn("the estimated peak, ", format_bytes(predicted), ", needs ", format_bytes(more), " more than is "
              "allocated now, above the ", format_bytes(mem.free), " of memory this machine has free: the system may end "
              "the process without a word (killed, exit 137). A smaller --batch-size or model, or --device-memory-limit "
              "with memory.policies = auto_batch to find what fits");
  std::vector<std::string> names;
  for (const auto& [name, callback] : callbacks_) {
    names.push_back(name);
    const std::string text = callback->describe();
    // A third-party callback's line is said (what it will do: "early stop after 3 evaluations"); Loom's
    // own are README's, said where they act, and their lines are for --log-level debug.
    const auto& info = registry_.require(LOOM_KIND_CALLBACK, name);
    const bool own = info.plugin && info.plugin->file.filename() == "libloom_callback_standard.so";
    if (!text.empty() && !own) log::info("callback ", name, ": ", printable(text, 300));  // (a plugin's text: one line)
    else if (log::enabled(LOOM_LOG_DEBUG) && !text.empty()) log::debug("callback  ", text);
  }
  // loom bench and loom profile take steps alone (cli's set_scratch_run): no evaluation to announce.
  const std::string& by = config_.at("trainer.callbacks").origin.source;
  const bool scratch = by == "loom bench" || by == "loom profile";
  log::info("callbacks ", names.empty() ? std::string("none") : join(names, ", "),
            scratch ? "; " + by + " times steps alone, without evaluation"
                    : "; evaluation every " + std::to_string(eval_every_) + " steps on the " +
                          sdk::split_name(selection_split()) + " split, best by " + options_.best_metric,
            step_on_device_ && read_every_step_
                ? "; " + step_readers_ + " read every step's values (the host waits for the device each step)"
                : std::string());
}

}  // namespace loom::core
