// `loom memory estimate`: what a run's memory is made of, per device; `loom memory suggest`: the
// largest batch that fits a target. Both measure activations with two probes on the real device
// (on CPU under Loom's counting allocator) and take model states from parameter counts.
#include "cli.hpp"

#include <loom/core/config.hpp>
#include <loom/core/error.hpp>
#include <loom/core/estimator.hpp>
#include <loom/core/log.hpp>
#include <loom/core/text.hpp>
#include <loom/core/trainer.hpp>
#include <loom/sdk/helpers.hpp>
#include <loom/sdk/options.hpp>

#include <algorithm>
#include <iostream>
#include <limits>
#include <map>
#include <optional>

namespace loom::cli {

namespace {

// trainer.batch_size's largest, as the core's schema bounds it
const int64_t kMaxBatch = static_cast<int64_t>(*core::core_schema().find("trainer.batch_size")->option.max);

// What `suggest` keeps below the batch where the estimate meets the target (2.5 %): auto_batch's
// aim with its default margin, 1 - 0.05 / 2.
constexpr double kSuggestHeadroom = 0.025;

int64_t devices_of(const Invocation& invocation) {
  const int64_t n = invocation.options["devices"].as<int64_t>();
  if (n < 1 || n > kMaxBatch)
    throw Error("--devices " + std::to_string(n) + " is outside [1, " + std::to_string(kMaxBatch) +
                "]: each device takes at least one sample of a global batch of at most " + std::to_string(kMaxBatch));
  return n;
}

}  // namespace

namespace {

/// Where the probes ran below the micro-batch `wanted` (the larger ones ran out of memory under a
/// cap): the figures are extrapolated from small batches, whose fixed costs weigh more; said.
void cap_note(core::Trainer& trainer, const core::ActivationFit& fit, int64_t wanted) {
  const int64_t cap = trainer.memory().stats().limit;
  wanted = std::clamp<int64_t>(wanted, 2, std::max<int64_t>(2, trainer.dataset().size(sdk::Split::kTrain)));  // (as activation_fit)
  if (cap <= 0 || fit.probe_large >= wanted) return;
  core::log::warn("the probes ran at micro-batch ", fit.probe_small, " and ", fit.probe_large, ", not ", wanted,
                  ": larger ones ran out of memory under the cap of ", core::format_bytes(cap), ". Figures for larger "
                  "batches are extrapolated from these (off by much where fixed costs dominate); drop the cap to measure them");
}

}  // namespace

int cmd_memory(const Invocation& invocation) {
  const std::string what = invocation.args.empty() ? "" : invocation.args[0];
  const std::string usage =
      "usage: loom memory estimate [-c FILE] [--devices N] [--batch B]  |  loom memory suggest --target 8GiB [--devices N] [--batch B]";
  if (what != "estimate" && what != "suggest") throw Error(usage);
  if (invocation.args.size() > 1)
    throw Error("loom memory " + what + ": unexpected argument '" + invocation.args[1] + "'; " + usage + switch_value_hint(invocation, invocation.args[1]));
  if (what == "estimate" && invocation.options.count("target"))
    throw Error("--target is for loom memory suggest (a micro-batch that fits a size); estimate takes --batch");
  // (checked before the data and the model are built: a missing --target was said after loading Fashion-MNIST)
  std::optional<int64_t> target;
  if (what == "suggest") {
    if (!invocation.options.count("target")) throw Error("loom memory suggest needs --target SIZE, e.g. --target 8GiB");
    const std::string target_text = invocation.options["target"].as<std::string>();
    target = sdk::parse_bytes(target_text);
    if (!target) throw Error("--target '" + target_text + "' is not a size (a number of bytes below 8 EiB, with its unit); e.g. 8GiB, 512MiB, 16GB");
    // (as memory.device_memory_limit: --target 8 was 8 bytes, answered "nothing fits" after the probes)
    if (*target < 4096) {
      const bool unit = target_text.find_first_not_of("0123456789. ") != std::string::npos;
      throw Error("--target " + target_text + " is " + std::to_string(*target) + " byte(s), no device's size" +
                  (unit || *target == 0 ? std::string("; give at least 4KiB, e.g. --target 8GiB")
                                        : "; a size takes its unit, e.g. --target " + target_text + "GiB"));
    }
  }
  int64_t devices = devices_of(invocation);
  core::PluginRegistry registry;
  scan_plugins(registry, invocation.options);
  core::Config config = config_from(invocation.options);
  // A run's own keys: nothing of an estimate (a --resume-from that names nothing stopped it; a
  // stage-2 file's init_from, not trained yet, too), cleared; said where the command line gave them.
  for (const char* key : {"trainer.resume_from", "trainer.init_from", "trainer.work_dir", "memory.snapshot"})
    if (const core::ConfigValue* given = config.find(key); given != nullptr && given->origin.source != "default") {
      if (given->origin.source != "file")
        core::log::warn("loom memory does not use ", key, " = '", given->value, "' (", given->origin.describe(),
                        "): an estimate writes no run and loads no weights");
      config.set(key, std::string(key) == "trainer.work_dir" ? "runs" : "", {"loom memory", {}, 0});
    }
  if (invocation.options.count("batch")) {
    const std::string batch = std::to_string(invocation.options["batch"].as<int64_t>());
    // (over a configuration file's batch, --batch is what it is for; beside --set or --batch-size, one is lost)
    if (const core::ConfigValue* given = config.find("trainer.batch_size");
        given != nullptr && given->value != batch && given->origin.source != "file" && given->origin.source != "default")
      core::log::warn("the global batch is given twice: --batch ", batch, " and trainer.batch_size = ", given->value, " (",
                      given->origin.describe(), "); --batch is used");
    config.set("trainer.batch_size", batch, {"--batch", {}, 0});
  }
  // ddp runs one process per device, which a launcher starts: each process's device is one
  // single's, the batch spread over --devices of them (it was refused here: "ddp runs one process
  // per device, started by a launcher", of a command that trains nothing).
  if (config.get("parallel.name") == "ddp") {
    config.set("parallel.name", "single", {"loom memory", {}, 0});
    core::log::info("parallel = ddp: each process's device as one of --devices ", devices, invocation.options["devices"].defaulted()
                    ? " (give --devices with the job's number of processes)" : "");
  }
  const core::Resolved resolved = core::resolve_run(config, registry);
  core::Trainer trainer(resolved, registry);
  trainer.setup_for_estimate();
  // The devices the configuration spreads the batch over (data_parallel's parallel.devices): the
  // estimate said "on 1 device(s)" of a run that planned 16 x 1 x 2.
  if (const int64_t planned = trainer.devices_in_world(); invocation.options["devices"].defaulted())
    devices = planned;
  else if (planned > 1 && planned != devices)
    core::log::warn("--devices ", devices, ", where the configuration spreads the batch over ", planned,
                    " devices (parallel.name = ", resolved.at("parallel.name").value, "): the figures are for ", devices);
  // (the refusals name --devices only where it was given: "x --devices 2" of a run's parallel.devices)
  const std::string on_devices = invocation.options["devices"].defaulted()
                                     ? std::to_string(devices) + " device(s) (the configuration's)"
                                     : "--devices " + std::to_string(devices);
  const core::ModelStates states = trainer.model_states();
  const int64_t samples = trainer.options().batch_size;

  if (what == "estimate") {
    // The plan `loom train` would make, or its refusal: 128 on 3 devices is no plan (it printed
    // a micro-batch of 42, which trains 126).
    const int64_t per_step = trainer.options().accumulation * devices;
    if (per_step > kMaxBatch)
      throw Error("gradient_accumulation_steps " + std::to_string(trainer.options().accumulation) + " x " +
                  on_devices + " needs a global batch of at least " + std::to_string(per_step) +
                  ", more than trainer.batch_size allows (" + std::to_string(kMaxBatch) + "); give fewer devices");
    if (samples % per_step != 0)
      throw Error("trainer.batch_size " + std::to_string(samples) + " is not divisible by gradient_accumulation_steps " +
                  std::to_string(trainer.options().accumulation) + " x " + on_devices +
                  ": loom train refuses that plan; give a global batch that splits evenly, e.g. --batch " +
                  std::to_string(std::max(per_step, samples / per_step * per_step)));
    const int64_t micro = samples / per_step;
    const auto measured = trainer.activation_fit(micro);
    if (!measured) throw Error("even a micro-batch of 2 runs out of memory on " + trainer.device().str());
    const core::ActivationFit& fit = *measured;
    const core::MemoryEstimate e = core::estimate(states, fit, micro, devices);
    std::cout << "batch " << samples << " on " << devices << " device(s): micro-batch " << micro << " x accumulation "
              << trainer.options().accumulation << " per device\n"
              << core::format_estimate(e, trainer.device().str())
              << "(activations from probes at micro-batch " << fit.probe_small << " and " << fit.probe_large << ": "
              << core::format_bytes(static_cast<int64_t>(fit.per_sample)) << " per sample)\n";
    cap_note(trainer, fit, micro / 2);
    // What loom train does with this plan that the figures leave out: a cap they pass, policies
    // that choose another micro-batch (an estimate of 2.1 MiB under a 300 KiB cap said neither).
    if (const int64_t cap = trainer.memory().stats().limit; cap > 0 && e.peak() > cap)
      std::cout << "note: that is above the " << core::format_bytes(cap) << " this run may use (--device-memory-limit or "
                << "--memory-fraction): loom train would run out of memory at this micro-batch unless its memory "
                << "policies re-plan; loom memory suggest --target " << cap << " (bytes) says which fits\n";
    for (const std::string& policy : sdk::parse_list(resolved.at("memory.policies").value))
      if (policy == "auto_batch" || policy == "vram_tiers")
        std::cout << "note: memory.policies = " << policy << " chooses the micro-batch when loom train starts; these "
                  << "figures are for the configured one, " << micro << "\n";
    if (const int64_t have = trainer.training_samples(); micro * devices > have)
      std::cout << "note: this data's training split has " << have << " samples, too few for a micro-batch of " << micro
                << " on each of " << devices << " device(s): loom train refuses this plan with it (the figures hold "
                << "for data with enough samples)\n";
    return 0;
  }

  if (const int64_t cap = trainer.memory().stats().limit; cap > 0 && *target > cap)
    core::log::warn("--target ", core::format_bytes(*target), " is above the cap this command runs under, ",
                    core::format_bytes(cap), " (memory.device_memory_limit or --memory-fraction): the probes cannot go "
                    "past it, and a run with that cap could not use the answer; give a target below the cap, or drop the "
                    "cap to measure for a larger device");
  auto measured = trainer.activation_fit(std::max<int64_t>(2, samples / devices));
  if (!measured) throw Error("even a micro-batch of 2 runs out of memory on " + trainer.device().str());
  cap_note(trainer, *measured, std::max<int64_t>(2, samples / devices) / 2);
  int64_t micro = core::largest_micro_batch(states, *measured, *target);
  // Per-sample memory drifts with the batch (kernels pick other algorithms, buffers round), so
  // a candidate far above the probes is measured again nearer to it: probes at a quarter and half
  // of it, as long as the larger one fits in half of what the device has free now.
  const int64_t free_now = trainer.memory().stats().free;
  if (measured->per_sample > 0 && micro > 4 * measured->probe_large) {
    int64_t refine = micro;
    while (refine > 4 * measured->probe_large &&
           core::estimate(states, *measured, refine / 2).total() > free_now / 2)
      refine /= 2;
    if (refine > 4 * measured->probe_large) {
      try {  // a refinement only: where the host cannot hold its probes (ulimit -v), the first fit stands
        if (auto nearer = trainer.activation_fit(refine)) {
          measured = nearer;
          micro = core::largest_micro_batch(states, *measured, *target);
        }
      } catch (const c10::Error& e) {
        core::log::warn("probes near micro-batch ", refine, " failed (", loom::explained(e),
                        "); the figure is extrapolated from the smaller probes");
      }
    }
  }
  // The evaluation's bound measured, where the device here can hold a probe of the target: its
  // line through two probes is no line for the recommender (it scores the catalogue in chunks of a
  // fixed size: its memory grows, then levels off), which refused targets that fit ("an evaluation
  // of one sample peaks at 34.8 MiB", where one of 16 peaks at 17.9) or gave a batch whose
  // evaluation then ran out of memory. A binary search up to the training step's bound, from the
  // line's answer: each probe under a cap of the target (a larger one fails, it does not allocate
  // past it), none at more samples than the largest split evaluated (its batches are no larger).
  int64_t eval_of_one = -1;
  const bool eval_measured = measured->has_eval && measured->per_sample > 0 && *target <= free_now / 2;
  const int64_t evaluated = std::max<int64_t>(1, trainer.evaluated_samples());
  std::map<int64_t, int64_t> eval_peaks;  // by the samples probed; INT64_MAX: past the target
  const auto eval_fits = [&](int64_t b) {
    b = std::min(b, evaluated);
    if (!eval_peaks.count(b)) {
      try {
        eval_peaks[b] = states.rate_table + trainer.probe_peak_within(b, /*train=*/false, *target - states.rate_table);
      } catch (const c10::OutOfMemoryError&) {
        trainer.memory().empty_cache();
        eval_peaks[b] = std::numeric_limits<int64_t>::max();
      }
    }
    return eval_peaks[b] <= *target;
  };
  if (eval_measured) {
    core::ActivationFit train_only = *measured;
    train_only.has_eval = false;
    const int64_t bound = std::min(core::largest_micro_batch(states, train_only, *target), kMaxBatch);
    int64_t lo = 0, hi = bound;  // lo fits (0: none known), nothing above hi does
    if (micro >= 1 && micro <= bound) {
      if (eval_fits(micro)) lo = micro;
      else hi = micro - 1;
    }
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo + 1) / 2;
      if (eval_fits(mid)) lo = mid;
      else hi = mid - 1;
    }
    micro = lo;
    if (micro >= 1) {
      measured->eval_at = micro;
      measured->eval_peak_at = eval_peaks.at(std::min(micro, evaluated)) - states.rate_table;
    } else if (bound >= 1) {
      eval_of_one = eval_peaks.count(1) ? eval_peaks.at(1) : -1;
    }
  }
  const core::ActivationFit& fit = *measured;
  if (fit.per_sample <= 0) {
    std::cout << "the probes at micro-batch " << fit.probe_small << " and " << fit.probe_large
              << " measured the same peak: no memory per sample to extrapolate from. Give a larger --batch-size so"
                 " the probes are larger, or let memory.policies = auto_batch measure on the device\n";
    return 1;
  }
  if (micro < 1) {
    std::cout << "nothing fits in " << core::format_bytes(*target) << ": the model states alone need "
              << core::format_bytes(states.total())
              << (states.rate_table > 0 ? " (of which the learning rates, one per step of the run, " +
                                              core::format_bytes(states.rate_table) +
                                              ": trainer.device_step = false keeps them on the host)"
                                        : std::string())
              << " and the workspace "
              << core::format_bytes(std::max<int64_t>(0, static_cast<int64_t>(fit.fixed) - states.total()))
              << (eval_of_one == std::numeric_limits<int64_t>::max()
                      ? ", and an evaluation of one sample needs more than that (measured)"
                  : eval_of_one >= 0 ? ", and an evaluation of one sample peaks at " + core::format_bytes(eval_of_one) + " (measured)"
                  : fit.has_eval && fit.eval_fixed + fit.eval_per_sample >= static_cast<double>(*target)
                      ? ", and an evaluation of one sample peaks at " +
                            core::format_bytes(static_cast<int64_t>(fit.eval_fixed + fit.eval_per_sample))
                      : std::string())
              << "\n";
    return 1;
  }
  // The estimate is a line through two probes, off by about a percent either way (docs/memory.md),
  // and the batch where it meets the target exactly ran out of memory by a few hundred bytes: the
  // answer keeps the same headroom auto_batch aims at with its default margin.
  std::string headroom;
  if (const int64_t kept = static_cast<int64_t>(std::floor(static_cast<double>(micro) * (1.0 - kSuggestHeadroom)));
      kept < micro && kept >= 1) {
    char percent[16];  // (at small batches the floor takes more than 2.5 %)
    std::snprintf(percent, sizeof percent, "%.1f", 100.0 * static_cast<double>(micro - kept) / static_cast<double>(micro));
    headroom.append("(").append(std::to_string(kept)).append(" is ").append(percent).append(" % below ").append(std::to_string(micro))
        .append(", where the estimate meets the target exactly: headroom for its error and the allocator's rounding)\n");
    micro = kept;
  }
  std::string capped;  // (a global batch train would refuse is no answer)
  const int64_t accumulation = trainer.options().accumulation;
  if (micro > kMaxBatch / devices / accumulation) {
    micro = std::max<int64_t>(1, kMaxBatch / devices / accumulation);
    capped = "; capped there: a global batch is at most " + std::to_string(kMaxBatch);
    headroom.clear();
  }
  if (const int64_t split = trainer.training_samples(); split > 0 && micro > split / devices / accumulation) {
    if (split < devices * accumulation)
      throw Error(on_devices + " x gradient_accumulation_steps " + std::to_string(accumulation) +
                  ": the run trains on " + std::to_string(split) + " samples, fewer than one per micro-batch; give fewer "
                  "devices or less accumulation");
    micro = split / devices / accumulation;
    const int64_t whole = trainer.dataset().size(sdk::Split::kTrain);
    headroom.clear();
    capped = "; capped there: the run trains on " + std::to_string(split) + " samples" +
             (split < whole ? " (the training split's " + std::to_string(whole) + " less those data.validation_fraction holds out)"
                            : std::string());
  }
  if (eval_measured && micro != fit.eval_at && eval_fits(micro)) {  // (the answer below the searched one: headroom, a cap)
    measured->eval_peak_at = eval_peaks.at(std::min(micro, evaluated)) - states.rate_table;
    measured->eval_at = micro;
  }
  const core::MemoryEstimate e = core::estimate(states, fit, micro, devices);
  // (With --batch, the global batch is the user's, split within this micro-batch below: a global
  // batch of this micro-batch alone read as a second, contradicting answer.)
  const bool kept_batch = invocation.options.count("batch") != 0;
  if (kept_batch && (samples % devices != 0 || samples < devices))  // (before any answer is printed)
    throw Error("--batch " + std::to_string(samples) + " does not split evenly over " + on_devices +
                "; give a multiple of " + std::to_string(devices));
  std::cout << "micro-batch for " << core::format_bytes(*target) << " per device: " << micro
            << (kept_batch ? " (the largest that fits" + capped + "; --batch " + std::to_string(samples) + " is split within it below"
                           : " (global batch " + std::to_string(micro * devices * accumulation) + " on " + std::to_string(devices) +
                                 " device(s) " +
                                 (accumulation > 1 ? "x accumulation " + std::to_string(accumulation)
                                                   : std::string("without accumulation")) +
                                 capped)
            << ")\n"
            << core::format_estimate(e, trainer.device().str())
            << "(activations from probes at micro-batch " << fit.probe_small << " and " << fit.probe_large << ": "
            << core::format_bytes(static_cast<int64_t>(fit.per_sample))
            << " per sample; memory.policies = auto_batch finds the batch by measurement on the device itself)\n"
            << headroom;
  // A global batch the user keeps (--batch): the plan loom train makes of it within that micro-batch.
  // (It was ignored in silence: the answer's global batch was the micro-batch times the config's accumulation.)
  if (invocation.options.count("batch")) {
    const sdk::BatchPlan plan = sdk::split_global_batch(samples, devices, micro);
    std::cout << "--batch " << samples << ": " << sdk::plan_text(plan)
              << (plan.micro_batch == samples / devices ? " (the whole batch fits: no accumulation needed)"
                  : plan.micro_batch < micro ? " (the largest micro-batch up to " + std::to_string(micro) + " that divides " +
                                                   std::to_string(samples / devices) + ")"
                                             : std::string())
              << "; train with --batch-size " << samples << " --gradient-accumulation-steps " << plan.accumulation << "\n";
    // (101, a prime: 101 steps of 1 where 53 fit, unsaid)
    if (plan.micro_batch * 2 <= micro && plan.micro_batch < samples / devices)
      std::cout << "note: within micro-batch " << micro << ", " << samples << " splits evenly only into micro-batches of "
                << plan.micro_batch << "; a batch that is a multiple of " << micro * devices << " ("
                << micro * devices << " or " << 2 * micro * devices << ") keeps micro-batch " << micro << "\n";
  }
  return 0;
}

}  // namespace loom::cli
