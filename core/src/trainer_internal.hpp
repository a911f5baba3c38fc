// Helpers shared by the trainer's translation units (private to the core): reading resolved
// configuration values with their types, naming an error's phase, the default generators.
#pragma once

#include <loom/core/config.hpp>
#include <loom/core/error.hpp>
#include <loom/core/stop_signals.hpp>
#include <loom/core/text.hpp>

#include <loom/sdk/compat.hpp>
#include <loom/sdk/memory_policy.hpp>
#include <loom/sdk/model.hpp>
#include <loom/sdk/options.hpp>
#include <loom/sdk/parallel.hpp>
#include <loom/sdk/precision.hpp>

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <filesystem>
#include <new>
#include <optional>
#include <string>
#include <vector>

namespace loom::sdk {
class Dataset;
}
namespace loom::core {
class PluginRegistry;
class DataLoader;
}

namespace loom::core::detail {

/// lock_run's refusal of a folder another process holds (run_lock.cpp).
class RunInUse : public Error {
 public:
  using Error::Error;
};

using Clock = std::chrono::steady_clock;

/// The most steps the step on the device keeps its table of learning rates for (8 bytes a step on
/// CPU, 4 on CUDA): a run of more checks non-finite steps on the host.
inline constexpr int64_t kLargestRateTable = int64_t{1} << 22;

/// A count is 0 to 2^53 (a double counts each term exactly up to there): a count of NaN, infinity
/// or 1e30 divided the loss to nothing, one below 0 by 1, and the run exited 0 (a probe's plugins).
inline constexpr double kMostTerms = 9007199254740992.0;
inline bool is_count(double c) { return c >= 0 && c <= kMostTerms; }

/// The error for a count that is no count: `terms` says whose ("loss terms", "'correct' terms"),
/// `where` in which step(s).
inline Error no_count(const std::string& model, const std::string& terms, const std::string& where) {
  return Error("model '" + model + "' counted fewer than 0 (or NaN, or more than 2^53) " + terms + " in " + where +
               ": a count is how many terms its sum adds up (ModelOutput::count, MetricValue::count), 0 or more");
}

inline double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

inline const std::string& value_of(const Resolved& config, const std::string& key) {
  auto it = config.find(key);
  if (it == config.end()) throw Error("internal: configuration key '" + key + "' was not resolved");
  return it->second.value;
}

/// A resolved value as its type. validate() checked it against the schema, so a failure here is
/// a key read with the wrong type: an error naming it, never a dereferenced empty optional.
template <class T>
T checked(const Resolved& c, const std::string& key, std::optional<T> (*parse)(std::string_view), const char* type) {
  const std::string& text = value_of(c, key);
  if (auto v = parse(text)) return *v;
  throw Error("internal: configuration key '" + key + "' = '" + text + "' read as " + type);
}
inline int64_t int_of(const Resolved& c, const std::string& key) { return checked<int64_t>(c, key, sdk::parse_int, "an integer"); }
inline double float_of(const Resolved& c, const std::string& key) { return checked<double>(c, key, sdk::parse_float, "a number"); }
inline bool bool_of(const Resolved& c, const std::string& key) { return checked<bool>(c, key, sdk::parse_bool, "a boolean"); }
inline int64_t bytes_of(const Resolved& c, const std::string& key) { return checked<int64_t>(c, key, sdk::parse_bytes, "a size"); }

/// An evaluation that a stop signal (SIGINT, SIGTERM...) ended before its last batch: it reports
/// no figures (Trainer::evaluate_and_report says so and stops the run).
class EvaluationStopped : public StoppedBySignal {
 public:
  EvaluationStopped(int sig, int64_t done, int64_t total)
      : StoppedBySignal(sig, "evaluation stopped by " + signal_name(sig) + " after " + std::to_string(done) + " of " +
                                 std::to_string(total) + " batches") {}
};

/// A stop signal during set-up ends it here, before the first step: there is nothing to save, and
/// set-up's memory probes and batch search can take a while. One process only: ranks agree on a stop
/// at their first step (one that stopped here alone would leave the others waiting).
inline void stop_if_signalled_in_setup(int64_t world_size, const std::string& during) {
  if (world_size > 1) return;
  if (const int sig = stop_signal_received(); sig != 0)
    throw StoppedBySignal(sig, "stopped by " + signal_name(sig) + " during set-up (" + during + "): no step was trained");
}

/// Runs `f`, naming `phase` in any error it throws ("evaluation at step 40: ..."), so that a
/// failure says where the run was. An out-of-memory error that nothing recovered from is one too.
template <class F>
auto in_phase(const std::string& phase, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const StoppedBySignal&) {
    throw;  // not a failure of the phase: the caller ends the run
  } catch (const std::bad_alloc&) {
    throw;  // (the host's refusal: the command says it with the process's limit, cli::message_of)
  } catch (const c10::Error& e) {
    throw Error(phase + ": " + loom::explained(e));
  } catch (const std::filesystem::filesystem_error& e) {
    throw Error(phase + ": " + loom::explained(e));
  } catch (const std::exception& e) {
    // (a plugin's long set-up work ended because a stop was asked, loom::sdk::stop_requested: the stop)
    if (const int sig = stop_signal_received(); sig != 0 && phase == "set-up")
      throw StoppedBySignal(sig, "stopped by " + signal_name(sig) + " during set-up (" + e.what() + "): no step was trained");
    throw Error(phase + ": " + e.what());
  } catch (...) {  // (`throw 42;` in a plugin)
    throw Error(phase + ": a plugin threw a value that is not an exception (not derived from std::exception); a plugin "
                "reports a failure by throwing loom::sdk::Error");
  }
}

/// Set while a memory probe runs on the CPU (Trainer::probe_peak_within): an allocation the host
/// refuses (`ulimit -v`) is then out of memory, as a device's, which the search reads as "does not
/// fit", not the run's error.
inline thread_local bool host_refusal_is_oom = false;

/// Runs a plugin's call `f` (a model's setup or forward): its error names the component, `who`
/// ("model 'name'", called only on failure), unless the message does already (a built-in's
/// "gpt2_recommender: ..."). Out of memory and a stop pass through unchanged (they are handled).
template <class Who, class F>
auto as_component(Who&& who, const std::string& name, F&& f) -> decltype(f()) {
  const auto named = [&](const std::string& message) {
    return message.rfind(name, 0) == 0 ? Error(message) : Error(who() + ": " + message);
  };
  try {
    return f();
  } catch (const StoppedBySignal&) {
    throw;
  } catch (const c10::OutOfMemoryError&) {
    throw;
  } catch (const std::bad_alloc&) {
    throw;  // (the host's refusal, as in_phase passes it)
  } catch (const c10::Error& e) {
    if (host_refusal_is_oom && std::string(e.what_without_backtrace()).find("DefaultCPUAllocator") != std::string::npos)
      throw c10::OutOfMemoryError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, loom::explained(e));
    throw named(loom::explained(e));
  } catch (const std::filesystem::filesystem_error& e) {
    throw named(loom::explained(e));
  } catch (const std::exception& e) {
    throw named(e.what());
  } catch (...) {  // (`throw 42;`: named by the component; it passed unnamed)
    throw Error(who() + ": threw a value that is not an exception (not derived from std::exception); a plugin reports "
                "a failure by throwing loom::sdk::Error");
  }
}

/// A memory probe asked at a micro-batch outside 1..2^24 (trainer.batch_size's range).
inline std::string probe_refused(int64_t b) {
  return "a memory probe at micro-batch " + std::to_string(b) + " is refused: a micro-batch is in 1..16777216 "
         "(trainer.batch_size's range)";
}

/// What is wrong with a memory policy's plan for `world` devices ("" if nothing): each count at
/// least 1, the run's world size, a global batch that a 64-bit count holds. Said before the
/// plan's global() is computed (it would overflow).
inline std::string plan_problem(const sdk::BatchPlan& p, int64_t world) {
  const std::string text = "micro-batch " + std::to_string(p.micro_batch) + " x accumulation " +
                           std::to_string(p.accumulation) + " x world size " + std::to_string(p.world_size);
  if (p.micro_batch < 1 || p.accumulation < 1) return text + ": the micro-batch and the accumulation are at least 1";
  if (p.world_size != world) return text + ": the world size is the run's, " + std::to_string(world);
  if (p.micro_batch > std::numeric_limits<int64_t>::max() / p.accumulation / p.world_size)
    return text + ": the global batch overflows a 64-bit count";
  return {};
}

/// The precision strategy's scaled loss, as backward needs it (one element), its errors naming
/// the strategy (backward's own error on an undefined or a vector loss named neither).
inline at::Tensor scaled_for_backward(sdk::PrecisionStrategy& precision, const std::string& name, const at::Tensor& loss_sum) {
  return as_component([&] { return "precision '" + name + "'"; }, name, [&] {
    at::Tensor scaled = precision.scale_loss(loss_sum);
    if (!scaled.defined() || scaled.numel() != 1)
      throw std::runtime_error("scale_loss returned " +
                               (scaled.defined() ? "a tensor of shape " + c10::str(scaled.sizes())
                                                 : std::string("an undefined tensor")) +
                               "; it returns the loss times its scale, a tensor of one element");
    return scaled;
  });
}

// Note [The loss scaled as a mean]
// A precision with a loss scale (fp16_amp) sets it for a mean, as PyTorch's GradScaler (2^16) and
// mmcv's static 512 do; sent into backward as the sum, the loss was the batch's size too large for
// it and overflowed float16 that much sooner (a probe: 512 at batch 1024 skipped every step; a
// dynamic scale skipped log2(batch) more steps than PyTorch's). There the loss goes in divided by
// the terms a rank's step sums (micro-batches x accumulation x the devices of a data_parallel rank x
// the target's elements per sample: an LM's tokens), rounded down to a power of two, and the
// division by the count is that much less. Without a loss scale nothing changes (1).
inline double loss_divisor(sdk::PrecisionStrategy& precision, const sdk::BatchPlan& plan, const sdk::DataSpec& spec,
                           int64_t local_devices) {
  const auto manifest = precision.manifest();
  if (const auto scale = manifest.find("loss_scale"); scale == manifest.end() || scale->second == "none") return 1.0;
  double terms = static_cast<double>(plan.micro_batch) * static_cast<double>(plan.accumulation) * static_cast<double>(local_devices);
  if (const auto target = spec.fields.find(spec.target_key); target != spec.fields.end())
    for (const int64_t extent : target->second.shape) terms *= static_cast<double>(std::max<int64_t>(extent, 1));
  return std::exp2(std::min(std::floor(std::log2(std::max(terms, 1.0))), 60.0));
}

/// Every value a run records in its config.json (JSON: UTF-8 only) is UTF-8, or one error names
/// it, before anything is loaded or made: a work_dir in a folder named in Latin-1 failed as
/// "opening the run folder: [json.exception.type_error.316] ...". (`loom eval` records nothing.)
inline void check_record_values(const Resolved& config) {
  for (const auto& [key, value] : config)
    if (const auto at = invalid_utf8(value.value)) {
      char code[8];  // NOLINT (one byte's code)
      std::snprintf(code, sizeof code, "0x%02X", static_cast<unsigned char>(value.value[*at]));
      throw Error(value.origin.describe() + ": " + key + " is not UTF-8 text (byte " + code + " at position " +
                  std::to_string(*at + 1) + "): a run records its configuration in its config.json, as UTF-8; give " +
                  "the path or name in UTF-8 (rename a folder named in another encoding)");
    }
}

/// trainer.resume_from or trainer.init_from naming nothing, in one set of words: said by
/// Trainer::build_components before the data is read (minutes, for a large set), and where it is read.
inline Error no_such_checkpoint(const std::string& key, const std::string& given) {
  return Error(key + " = " + given + ": no such checkpoint (" +
               (key == "trainer.init_from" ? "a step folder, or a .safetensors file such as best_accuracy.safetensors"
                                           : "a run folder, or a step folder in its checkpoints/") +
               ")");
}

/// How many steps in a row the precision's dynamic loss scale may overflow while it comes down to
/// 1 (fp16_amp halves it from 65536 on each): steps skipped then are its descent, not a sign of
/// damaged weights. 0 for a static scale, none, or one that is not finite (damage itself). Reads
/// the scale to the host: once, at a resume.
inline int64_t loss_scale_descent(const sdk::PrecisionStrategy& precision) {
  const sdk::State state = precision.state_dict();
  const auto scale = state.tensors.find("scale");
  const auto how = state.text.find("scaler");
  if (scale == state.tensors.end() || how == state.text.end() || how->second.rfind("dynamic", 0) != 0 ||
      !scale->second.defined() || scale->second.numel() != 1)
    return 0;
  const double value = scale->second.item<double>();
  double backoff = 0.5;  // ("dynamic (init 65536, x2 after 2000 finite steps, x0.5 on overflow)")
  if (const auto at_end = how->second.find(" on overflow"); at_end != std::string::npos)
    if (const auto x = how->second.rfind('x', at_end); x != std::string::npos) backoff = std::atof(how->second.c_str() + x + 1);
  if (!std::isfinite(value) || value <= 1 || !(backoff > 0 && backoff < 1)) return 0;
  return std::min<int64_t>(100000, static_cast<int64_t>(std::ceil(std::log(value) / -std::log(backoff))));
}

/// A model's output whose loss_sum and count are one number each (an evaluation's, which needs no gradient).
inline sdk::ModelOutput checked_counts(sdk::ModelOutput out) {
  for (const auto& [what, t] : {std::pair<const char*, const at::Tensor*>{"loss_sum", &out.loss_sum}, {"count", &out.count}})
    if (!t->defined() || t->numel() != 1)
      throw std::runtime_error(std::string("forward's ") + what + " must be a tensor of one element; it " +
                               (t->defined() ? "has " + std::to_string(t->numel()) : std::string("is undefined")));
  return out;
}

/// A model's training output as backward needs it: a loss_sum of one element that depends on the
/// parameters (else backward's own error says neither which model nor what to fix).
inline sdk::ModelOutput checked_for_backward(sdk::ModelOutput out) {
  if (!out.loss_sum.defined() || out.loss_sum.numel() != 1)
    throw std::runtime_error("forward's loss_sum must be a tensor of one element, the sum of the batch's loss terms; it " +
                             (out.loss_sum.defined() ? "has " + std::to_string(out.loss_sum.numel()) + " (shape " +
                                                           c10::str(out.loss_sum.sizes()) + ")"
                                                     : std::string("is undefined")));
  if (!out.count.defined() || out.count.numel() != 1)  // (undefined: "Expected a proper Tensor but got None", no model named)
    throw std::runtime_error("forward's count must be a tensor of one element, how many loss terms loss_sum adds up; it " +
                             (out.count.defined() ? "has " + std::to_string(out.count.numel()) : std::string("is undefined")));
  if (!out.loss_sum.requires_grad())
    throw std::runtime_error("forward's loss_sum does not depend on any trainable parameter (it needs no gradient): "
                             "every parameter is frozen, or the loss was computed from detached tensors or under no_grad");
  return out;
}

/// An evaluation forward's loss_sum and count: one number each (an undefined count was LibTorch's
/// "Expected a proper Tensor but got None", no model named).
inline void check_evaluation_output(const sdk::ModelOutput& out, const std::string& model) {
  if (!out.loss_sum.defined() || out.loss_sum.numel() != 1 || !out.count.defined() || out.count.numel() != 1)
    throw Error("model '" + model + "' gave an evaluation forward's loss_sum and count as " +
                (out.loss_sum.defined() ? std::to_string(out.loss_sum.numel()) : std::string("no")) + " and " +
                (out.count.defined() ? std::to_string(out.count.numel()) : std::string("no")) +
                " elements; each is one number (the sum of the batch's loss terms, and how many it sums)");
}

inline at::Generator cpu_generator() { return sdk::compat::default_generator(c10::Device(c10::kCPU)); }
inline at::Generator device_generator(const c10::Device& device) { return sdk::compat::default_generator(device); }

/// A component's own options, from its section (Note [Component sections]).
inline std::map<std::string, std::string> component_values(const Resolved& config, const ComponentInfo& info) {
  return section_values(config, component_section(info.kind, info.name), info.options);
}

/// Every rank runs the configuration rank 0 runs (trainer_parallel.cpp); throws on every rank
/// where one differs, the rank that differs naming its keys.
void agree_on_configuration(sdk::ParallelStrategy& parallel, const Resolved& config);
/// Rank 0's `mine` (a fact per key) sent to every rank: a line per fact in which this rank's
/// differs, `said(key)` saying this rank's.
std::vector<std::string> differences_from_rank0(sdk::ParallelStrategy& parallel, const std::map<std::string, std::string>& mine,
                                                const std::function<std::string(const std::string&)>& said);
/// Every rank stops where any rank has a difference (`differ`, its own): each names the first of
/// the lowest rank that has one; `what` is what differs ("configuration"), `fix` how to fix it.
void stop_where_ranks_differ(sdk::ParallelStrategy& parallel, const std::vector<std::string>& differ, const std::string& what,
                             const std::string& fix);
/// Every rank stops, naming what differs, where the ranks' models (their tensors' names, shapes and
/// dtypes; the model's and dataset's plugin versions) or data (each split's size) are not rank 0's.
void agree_on_model_and_data(sdk::ParallelStrategy& parallel, const sdk::TensorMap& tensors, const PluginRegistry& registry,
                             const Resolved& config, sdk::Dataset& dataset);

/// "trainer.batch_size 48 is not divisible by gradient_accumulation_steps 5 x world size 1; ...",
/// with the batches and the accumulations near the given ones that divide (trainer_data.cpp).
std::string uneven_batch(int64_t batch, bool given, int64_t accumulation, int64_t world);
/// "the global batch, G, is more than the N samples an epoch of the training split has: ..."
/// `kept`: the global batch is the checkpoint's, which a resume that gives none keeps.
std::string no_step_in_an_epoch(int64_t global, int64_t samples, bool held_out, bool kept = false);

/// The optimizer steps of an epoch of `loader` (whole steps: no sample twice in one), or an error.
int64_t steps_per_epoch(const DataLoader& loader, const sdk::BatchPlan& plan, int64_t world, bool held_out, bool kept = false);

/// What the run's final plan leaves out, said at the end of its set-up: a tenth or more of each
/// epoch's samples (its global batch fits in them with that much left over), and on a resume an
/// accumulation the user gave that the plan does not take (the checkpoint's batch, its re-plan).
void say_plan_leaves_out(const DataLoader& loader, const sdk::BatchPlan& plan, const Resolved& config,
                         int64_t accumulation, bool resumed);
/// Each split's size (`size`, the dataset's own) in [0, 2^40] and the same when asked again, or an
/// error naming dataset `name` (trainer_data.cpp).
void check_split_sizes(const std::string& name, const std::function<int64_t(sdk::Split)>& size, bool has_validation);
/// The spec's input_key and target_key among its fields, or an error naming dataset `name` (a
/// model's `fields.at(input_key)` said only "map::at", blaming the model).
void check_spec_keys(const std::string& name, const sdk::DataSpec& spec);

/// Throws loom::Error where `module` (the model's module() now) no longer holds one of the
/// parameters set up and trained, `trained`: a module() that answered another module saved none
/// of the trained weights, and the run exited 0.
void check_module_holds(const std::string& model, const torch::nn::Module& module, const std::vector<at::Tensor>& trained);

/// A data.validation_fraction the user set, said once where the dataset's own validation split
/// (`native` samples) makes it hold out nothing (it was ignored without a word).
void say_validation_fraction_unused(const Resolved& config, int64_t native);

/// The origin of a setting `--resume auto` took from the run's record (with_run_settings); its
/// Origin::file is that config.json.
inline constexpr const char* kRunRecordOrigin = "the run's config.json";

/// Rank 0's `text` on every rank (read on rank 0), through the strategy's broadcast; none where rank 0 had none to give.
std::optional<std::string> from_rank0(sdk::ParallelStrategy& parallel, const std::optional<std::string>& text);

/// trainer.resume_from, or a new run's trainer.init_from, naming nothing: said before the data is
/// read (minutes, for a large set). Rank 0 looks (it opens the run and names the checkpoint the
/// others load); every rank stops with its words (rank 1 of another node said Gloo's "connection
/// closed", or waited for rank 0 up to parallel.timeout). A path that cannot be looked
/// at (EACCES) is left to the reading of it, which says why.
inline void refuse_missing_start(sdk::ParallelStrategy& parallel, const std::string& resume_from, const std::string& init_from) {
  std::optional<std::string> problem;
  if (parallel.rank() == 0)
    for (const auto& [key, given] : {std::pair<std::string, std::string>{"trainer.resume_from", resume_from},
                                     std::pair<std::string, std::string>{"trainer.init_from", init_from}}) {
      std::error_code ec;
      if (!problem && !given.empty() && !std::filesystem::exists(std::filesystem::path(given).lexically_normal(), ec) && !ec)
        problem = no_such_checkpoint(key, given).what();
    }
  if (parallel.world_size() > 1) problem = from_rank0(parallel, problem);
  if (problem) throw Error(*problem);
}

/// The runs in `work_dir`, the one last active first (run_scan.cpp); `strict`: refused where a
/// folder this process cannot read changed after the newest of them.
std::vector<std::string> runs_newest_first(const std::filesystem::path& work_dir, bool strict = false);
/// Whether a folder holds what a run writes (a best file, summary or events alone too).
bool holds_a_run(const std::filesystem::path& dir);
/// Refuses a run folder whose checkpoints folder or a step folder this process cannot read.
void refuse_unreadable_checkpoints(const std::filesystem::path& run_dir);

}  // namespace loom::core::detail
