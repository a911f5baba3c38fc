// Building a run: the components from the configuration (parallel strategy, data, device memory,
// model, precision, optimizer, schedule), the batch plan the memory policies agree on, and the
// data loaders with the validation split. See trainer.hpp for the shape of a run and of a step;
// the other trainer_*.cpp files hold the rest of the class, one responsibility each.
#include <loom/core/device_memory.hpp>
#include <loom/core/estimator.hpp>
#include <loom/core/files.hpp>
#include <loom/core/log.hpp>
#include <loom/core/text.hpp>
#include <loom/core/checkpoint.hpp>
#include <loom/core/trainer.hpp>
#include <loom/sdk/helpers.hpp>
#include <loom/sdk/launch.hpp>
#include "gradient_sync.hpp"
#include "replicas.hpp"
#include "run_context.hpp"
#include "step_graph.hpp"
#include "trainer_internal.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/ops/randperm.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sched.h>
#include <sys/resource.h>
#include <thread>
#include <unistd.h>

namespace fs = std::filesystem;

namespace loom::core {

std::string threads_over_process_limit(int64_t threads, uint64_t limit) {
  // Past `ulimit -u` OpenMP's thread creation fails inside the first operator and ends the process
  // with its own line (libgomp: Thread creation failed).
  if (threads < static_cast<int64_t>(std::min<uint64_t>(limit, INT64_MAX))) return "";
  return "trainer.threads = " + std::to_string(threads) + ", but this user may run at most " + std::to_string(limit) +
         " processes and threads (ulimit -u); set trainer.threads = 0 (LibTorch's default, the physical cores) or a " +
         "number of cores";
}

namespace {

/// The processes of this job on this node (LOCAL_WORLD_SIZE, which loom launch and torchrun set;
/// Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE), or 1.
int64_t local_processes() {
  for (const char* name : {"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"})
    if (const char* text = std::getenv(name)) {
      const auto n = sdk::parse_int(text);
      return n && *n > 1 && *n <= 4096 ? *n : 1;
    }
  return 1;
}

/// N processes of a job on this machine (loom launch, torchrun), each with LibTorch's default of
/// every core's threads, oversubscribe it (on 2 cores, 2 ranks ran 8x slower): each takes its
/// share. Not where the launcher bound each process to cores of its own (Open MPI, Slurm's
/// binding: OpenMP's default follows the binding), nor where OMP_NUM_THREADS says.
void share_cores(int default_threads) {
  const int64_t local = local_processes();
  if (local <= 1) return;
  if (const char* omp = std::getenv("OMP_NUM_THREADS")) {  // (OpenMP's form: "4", or "4,2" for nested levels)
    const std::string text(omp);
    if (const auto n = sdk::parse_int(text.substr(0, text.find(','))); n && *n > 0) return;  // the user's choice
    if (const char* local_rank = std::getenv("LOCAL_RANK"); local_rank == nullptr || std::string(local_rank) == "0")
      log::warn("OMP_NUM_THREADS = '", text, "' is no number of threads (OpenMP ignores it): the ", local,
                " processes of this job share the cores as without it");
  }
  cpu_set_t set;
  CPU_ZERO(&set);
  const unsigned all = std::thread::hardware_concurrency();
  if (::sched_getaffinity(0, sizeof set, &set) != 0 || (all > 0 && static_cast<unsigned>(CPU_COUNT(&set)) < all)) return;
  const int share = std::max<int>(1, default_threads / static_cast<int>(local));
  at::set_num_threads(share);
  log::info("threads   ", share, " per process: ", local, " processes of this job share this machine's ", default_threads,
            " cores (trainer.threads = 0; set it, or OMP_NUM_THREADS, to choose)");
}

/// trainer.threads within what this process may start (the kernel holds root to no ulimit -u) and
/// a warning past the cores, which only slow every operator down.
void check_threads(int64_t threads) {
  rlimit limit{};
  if (::geteuid() != 0 && ::getrlimit(RLIMIT_NPROC, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY)
    if (const std::string why = threads_over_process_limit(threads, limit.rlim_cur); !why.empty()) throw Error(why);
  const unsigned cores = std::thread::hardware_concurrency();
  if (cores > 0 && threads > static_cast<int64_t>(cores))
    log::warn("trainer.threads = ", threads, " on a machine with ", cores, " logical cores: threads beyond the ",
              "cores make every operator slower; 0 picks LibTorch's default (the physical cores)");
}

}  // namespace

using namespace detail;

Trainer::Trainer(Resolved config, const PluginRegistry& registry)
    : config_(std::move(config)), registry_(registry), options_(TrainerOptions::from(config_)) {}

Trainer::~Trainer() {
  graphs_.reset();
  train_loader_.reset();
  val_loader_.reset();
  test_loader_.reset();
  if (parallel_) {
    try {
      parallel_->teardown();
    } catch (const std::exception& e) {
      log::warn("parallel teardown: ", e.what());
    }
  }
}

std::map<std::string, std::string> Trainer::section(const std::string& name) const {
  // The kind section's own keys ("name") and the selected component's options, by their bare
  // keys: what a checkpoint records of its model and data (the same shape as before component
  // sections existed, so older checkpoints still compare).
  std::map<std::string, std::string> out;
  const std::string prefix = name + ".";
  for (const auto& [key, value] : config_)
    if (key.rfind(prefix, 0) == 0 && key.find('.', prefix.size()) == std::string::npos)
      out[key.substr(prefix.size())] = value.value;
  const std::string component = prefix + value_of(config_, prefix + "name") + ".";
  for (const auto& [key, value] : config_)
    if (key.rfind(component, 0) == 0) out[key.substr(component.size())] = value.value;
  return out;
}

void Trainer::setup() {
  check_record_values(config_);
  in_phase("set-up", [&] {
    const PluginsSeeStops plugins_see_stops;  // (their long work, a catalogue's encoding, ends on a stop)
    build_components(/*with_optimizer=*/true);
    refuse_training_alone_among_ranks();
    build_throughput();
    build_plan();
    build_step_graphs();
    build_loaders();
    build_callbacks();
    detail::agree_on_model_and_data(*parallel_, model_tensors(), registry_, config_, *dataset_);  // (before the folder)
  });
  stop_if_signalled_in_setup(parallel_->world_size(), "before the run folder was opened");
  // Not after it: a stop from here on trains one step and writes its checkpoint, which resumes
  // as the user's command was (a folder with only config.json would be refused by that command).
  // trainer.init_from: in a new run by rank 0 before its folder is made (open_run_here); in a named
  // folder that did not resume, by every rank (a resumed run has its own weights, trained further).
  const bool init_before = init_first();
  in_phase(init_before ? "set-up" : "opening the run folder", [&] { open_run(); });
  if (parallel_->world_size() > 1 && resumed_at_ >= 0) agree_resumed_plan();
  note_pending_test();
  if (!options_.init_from.empty() && !init_before && resumed_at_ < 0)
    in_phase("loading trainer.init_from", [&] { init_weights(options_.init_from); });
  else if (!options_.init_from.empty() && resumed_at_ >= 0)  // (it was ignored without a word)
    log::info("trainer.init_from = ", options_.init_from, " is not used: the run resumes its own weights at step ", resumed_at_);
  if (parallel_->world_size() > 1) in_phase("agreeing on the weights", [&] { broadcast_model(); });
  seed_rank();
  build_gradient_sync();
  if (parallel_->rank() == 0) say_plan_leaves_out(*train_loader_, plan_, config_, options_.accumulation, resumed_at_ >= 0);
  report_startup();
}

void Trainer::build_components(bool with_optimizer) {
  static const int default_threads = at::get_num_threads();  // (LibTorch's, before any run of this process set one)
  if (options_.threads > 0) {
    check_threads(options_.threads);
    at::set_num_threads(static_cast<int>(options_.threads));
  } else {
    at::set_num_threads(default_threads);
  }
  at::manual_seed(static_cast<uint64_t>(options_.seed));
  build_parallel();
  detail::agree_on_configuration(*parallel_, config_);  // (before any collective whose shapes it decides)
  if (options_.threads == 0) share_cores(default_threads);  // (after build_parallel: said by rank 0 alone)
  if (with_optimizer) refuse_missing_start(*parallel_, options_.resume_from, init_first() ? options_.init_from : "");
  build_data();
  // (0 training samples: a SIGFPE in the memory probes, sample i % size; an evaluation needs none)
  if (with_optimizer && dataset_->size(sdk::Split::kTrain) == 0)
    throw Error("dataset '" + value_of(config_, "data.name") + "' says its train split has 0 samples: there is nothing to "
                "train on; point the dataset's options at data that has samples (`loom config keys` lists them), or, "
                "where the plugin should have found some, report it to its author");
  // (a dataset is not interrupted while it builds: a stop during it is acted on here, and named so)
  stop_if_signalled_in_setup(parallel_->world_size(), "while the data was built");
  build_memory();
  try {
    build_model();
    build_replicas();
    build_precision();
    if (with_optimizer) {
      build_optimizer();
      build_schedule();
    }
  } catch (const c10::OutOfMemoryError& e) {
    const auto stats = memory_->stats();  // (a cap only where one is below the device's memory: one was said where none was)
    const bool capped = stats.limit > 0 && stats.total > 0 && static_cast<double>(stats.limit) < 0.999 * static_cast<double>(stats.total);
    throw Error("out of memory while building the model" + std::string(with_optimizer ? " and its optimizer" : "") + " on " + device_.str() +
                ": " + e.what_without_backtrace() + (capped ? "; the run may use " + format_bytes(stats.limit) + " of the " + format_bytes(stats.total) +
                " there, the cap memory.fraction or --device-memory-limit sets: raise it, or use a smaller model"
                : "; it has " + format_bytes(stats.total > 0 ? stats.total : stats.limit) + " in all: use a smaller model, or more memory"));
  }
}

void Trainer::refuse_training_alone_among_ranks() const {
  // Launched as one of several processes, with a strategy that trains alone: each process would
  // train the whole model on its own, into runs of its own, and nothing would say so. Training
  // only: `loom eval` and the others may be run by a process of such a job.
  if (parallel_->world_size() != 1) return;
  std::optional<sdk::LaunchEnvironment> found;
  try {
    found = sdk::launch_environment();
  } catch (const std::exception&) {
    return;  // an incomplete launcher environment matters only to a strategy that reads it
  }
  if (!found || found->world_size <= 1) return;
  const std::string what = "this process is rank " + std::to_string(found->rank) + " of " +
                           std::to_string(found->world_size) + " (" +
                           (std::getenv("LOOM_LAUNCH_CHECKED") != nullptr ? std::string("started by loom launch")
                                                                            : found->launcher + "'s variables") +
                           "), but " +
                           "parallel strategy '" + value_of(config_, "parallel.name") + "' trains alone: every " +
                           "process would train the whole model by itself. Set parallel.name=ddp to train together";
  // torchrun and `loom launch` start the processes for this command; under Slurm or MPI a job's
  // variables can be set around a single process (an sbatch script), so only a warning.
  if (found->launcher == "torchrun") throw Error(what);
  log::warn(what);
}

void Trainer::build_parallel() {
  const std::string name = value_of(config_, "parallel.name");
  const auto& info = registry_.require(LOOM_KIND_PARALLEL, name);
  parallel_ = registry_.create<sdk::ParallelStrategy>(name, component_values(config_, info));
  {
    // Joining the other ranks waits up to parallel.timeout for ones that may never come, and
    // checks no flag: a stop signal then ends the process at once (nothing is written yet).
    StopAtOnce at_once("\nloom: stopping at once (joining the other ranks: nothing to save)\n", "joining the other ranks");
    parallel_->setup(options_.device);
  }
  if (const int64_t world = parallel_->world_size(), rank = parallel_->rank(); world < 1 || world > (int64_t{1} << 20) || rank < 0 || rank >= world)
    throw Error("parallel strategy '" + name + "' says this process is rank " + std::to_string(rank) + " of " +
                std::to_string(world) + ": a world has 1 or more ranks, numbered from 0 (loom plugins check tests a strategy)");
  device_ = parallel_->device();
  log::set_rank(parallel_->rank(), parallel_->world_size());
}

void Trainer::build_memory() {
  // On CPU this installs the counting allocator: from here on, CPU tensors are the emulated
  // device's memory (the dataset, built before, stays host memory). See Note [CPU budget allocator].
  memory_ = make_device_memory(device_, options_.device_memory_limit);
  // On CUDA the cap is the caching allocator's fraction, process-wide: set (or reset to none) for
  // every run, or a run would inherit the cap of one before it in the process (loom bench's configs).
  if (device_.is_cuda()) memory_->set_limit(options_.device_memory_limit);
  if (device_.is_cuda() && !options_.memory_snapshot.empty()) start_memory_history(device_);
  if (!device_.is_cuda() && (!options_.memory_snapshot.empty() || options_.snapshot_on_oom))
    log::warn("memory snapshots are the CUDA allocator's (for pytorch.org/memory_viz); on ", device_.str(),
              " none is written. The run's memory is in metrics.jsonl (memory/allocated_bytes, memory/peak_bytes)");
  for (const auto& policy : sdk::parse_list(value_of(config_, "memory.policies"))) {
    const auto& policy_info = registry_.require(LOOM_KIND_MEMORY, policy);
    memory_policies_.push_back(registry_.create<sdk::MemoryPolicy>(policy, component_values(config_, policy_info)));
    as_component([&] { return "memory policy '" + policy + "'"; }, policy, [&] { memory_policies_.back()->setup(*memory_); });
  }
  // On the CPU without a budget only a block more than the host has left fails (Note [Host memory left]).
  const auto policies = sdk::parse_list(value_of(config_, "memory.policies"));
  if (device_.is_cpu() && memory_->stats().limit <= 0 && std::count(policies.begin(), policies.end(), "oom_recovery"))
    log::warn("memory.policies has oom_recovery, but on the CPU without a budget (memory.device_memory_limit or "
              "--memory-fraction) only a single block larger than the host's memory left fails; smaller ones the kernel "
              "lends, and its OOM killer may end the run first. Set a budget for it to act on every allocation");
}

void Trainer::build_data() {
  const std::string name = value_of(config_, "data.name");
  const auto& info = registry_.require(LOOM_KIND_DATASET, name);
  dataset_ = registry_.create<sdk::Dataset>(name, component_values(config_, info));
  HostMemoryScope host;  // the data set lives in host memory, whatever the device
  const auto who = [&] { return "dataset '" + name + "'"; };
  as_component(who, name, [&] { dataset_->setup(); });
  data_spec_ = as_component(who, name, [&] { return dataset_->spec(); });
  detail::check_spec_keys(name, data_spec_);
  detail::check_split_sizes(name, [&](sdk::Split s) { return as_component(who, name, [&] { return dataset_->size(s); }); },
                            dataset_.implements(1));
}

Created<sdk::Model> Trainer::make_model() {
  const std::string name = value_of(config_, "model.name");
  const auto& info = registry_.require(LOOM_KIND_MODEL, name);
  Created<sdk::Model> model = registry_.create<sdk::Model>(name, component_values(config_, info));
  model_name_ = name;
  const auto who = [&] { return "model '" + name + "'" + (info.plugin ? " (" + info.plugin->file.filename().string() + ")" : ""); };
  as_component(who, name, [&] { model->setup(data_spec_); });
  if (dataset_.implements(2) && model.implements(1)) {  // Dataset 1.2 and Model 2.1: the shared tables
    sdk::TensorMap tables = as_component([&] { return "dataset '" + value_of(config_, "data.name") + "' (tables)"; },
                                         value_of(config_, "data.name"), [&] { return dataset_->tables(); });
    if (!tables.empty()) as_component(who, name, [&] { model->use_tables(tables); });
  }
  return model;
}

int64_t Trainer::local_devices() const { return replicas_ ? replicas_->size() : 1; }

void Trainer::build_model() {
  const std::string name = value_of(config_, "model.name");
  model_ = make_model();
  model_->module().to(device_);
  metric_specs_.clear();
  metric_specs_["loss"] = sdk::MetricSpec{"loss", "loss", sdk::Direction::kMinimize, false};
  // (its calls name it: a metrics() that threw was "set-up: a plugin threw ...", unnamed)
  const auto declared = as_component([&] { return "model '" + name + "' (metrics)"; }, name, [&] { return model_->metrics(); });
  for (const auto& spec : declared) {
    const bool well_formed = !spec.name.empty() && spec.name.size() <= 64 &&
                             std::all_of(spec.name.begin(), spec.name.end(), [](char ch) {
                               return (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '_';
                             });
    if (!well_formed || metric_specs_.count(spec.name))
      throw Error("model '" + name + "' declares a metric named '" + spec.name + "': " +
                  (well_formed ? "the name is taken (\"loss\" is the host's, and each name is declared once)"
                               : "a metric name is lower_snake_case (a-z, 0-9, _), at most 64 characters"));
    metric_specs_[spec.name] = spec;
  }
  std::string& best = options_.best_metric;
  if (best == "auto") {
    best = declared.empty() ? "loss" : declared.front().name;
  }
  if (!metric_specs_.count(best)) {
    const auto names = metric_names();
    const auto close = closest(best, names);
    throw Error("trainer.best_metric = '" + best + "' is not a metric of model '" + name + "', which reports " +
                join(names, ", ") + (close ? "; did you mean '" + *close + "'?" : std::string()));
  }
}

sdk::Batch Trainer::predict(const sdk::Batch& inputs) {
  const std::string name = value_of(config_, "model.name");
  if (!model_.implements(1))
    throw Error("model '" + name + "' is built against model interface 2.0, which has no predict path; rebuild it against this SDK");
  sdk::Batch on_device;
  for (const auto& [key, tensor] : inputs) on_device[key] = tensor.to(device_);
  auto& module = model_->module();
  const bool was_training = module.is_training();
  module.eval();
  sdk::Batch out;
  {
    at::NoGradGuard no_grad;
    const auto autocast = precision_->forward_guard();
    out = model_->predict(on_device);
  }
  module.train(was_training);
  for (auto& [key, tensor] : out) tensor = tensor.to(at::kCPU);
  return out;
}

sdk::TensorMap Trainer::dataset_tables() const { return dataset_.implements(2) ? dataset_->tables() : sdk::TensorMap(); }

void Trainer::build_precision() {
  const std::string name = value_of(config_, "precision.name");
  const auto& info = registry_.require(LOOM_KIND_PRECISION, name);
  auto precision = registry_.create<sdk::PrecisionStrategy>(name, component_values(config_, info));
  precision_on_device_ = precision.implements(1);  // 1.1: unscale_gradients_on_device, update_on_device
  precision_ = std::move(precision);
  precision_name_ = name;
  as_component([&] { return "precision '" + name + "'"; }, name, [&] { precision_->setup(device_); });
}

void Trainer::build_throughput() {
  const std::string name = value_of(config_, "model.name");
  flops_per_term_ = model_.implements(2) ? as_component([&] { return "model '" + name + "' (flops_per_loss_term)"; }, name,
                                                        [&] { return model_->flops_per_loss_term(); })
                                         : 0;  // Model 2.2
  if (!std::isfinite(flops_per_term_) || flops_per_term_ < 0) {
    log::warn("model '", value_of(config_, "model.name"), "' declares ", flops_per_term_,
              " FLOPs per loss term (Model::flops_per_loss_term); not a count of FLOPs, so the log reports no "
              "TFLOP/s or MFU. Return 0 (not declared) or the forward and backward's FLOPs");
    flops_per_term_ = 0;
  }
  peak_ = options_.peak_tflops > 0 ? PeakFlops{options_.peak_tflops, "trainer.peak_tflops"}
                                   : device_peak(device_description(device_), precision_->manifest());
}

void Trainer::build_plan() {
  const int64_t world = devices_in_world();  // ranks x the devices of each (data_parallel)
  const int64_t per_step = options_.accumulation * world;
  // Memory policies may choose or change the micro-batch; a global batch the user gave stays. One
  // not given is only where the policies start (auto_batch's micro-batch x the accumulation).
  const bool given = config_.at("trainer.batch_size").origin.source != "default";
  if (options_.batch_size % per_step != 0 && (given || memory_policies_.empty()))
    throw Error(uneven_batch(options_.batch_size, given, options_.accumulation, world));
  plan_ = sdk::BatchPlan{std::max<int64_t>(1, options_.batch_size / per_step), options_.accumulation, world};
  if (options_.batch_size % per_step != 0)
    log::info("trainer.batch_size ", options_.batch_size, " (the default) does not divide into ", per_step,
              " micro-batches: the memory policies start from ", sdk::plan_text(plan_));
  const auto names = sdk::parse_list(value_of(config_, "memory.policies"));
  for (size_t i = 0; i < memory_policies_.size(); ++i) {
    auto& policy = memory_policies_[i];
    const std::string name = i < names.size() ? names[i] : policy->describe();
    sdk::PlanContext context;
    context.memory = memory_.get();
    context.plan = plan_;
    context.global_batch = plan_.global();
    context.global_batch_given = given;
    context.probe = [this](int64_t b) { return probe_peak_within(b, true, memory_->stats().allocated + memory_->stats().free); };
    context.config_key = config_key();
    context.device_name = device_description(device_);
    // A micro-batch above the global batch could not be used: when the user gave one, it bounds a
    // search too (accumulated as the run asks: a global batch no larger than the samples it trains on).
    context.max_micro_batch = std::max<int64_t>(1, training_samples() / (world * plan_.accumulation));
    if (given) context.max_micro_batch = std::min(context.max_micro_batch, plan_.global() / world);
    as_component([&] { return "memory policy '" + name + "'"; }, name, [&] { policy->plan(context); });
    const std::string problem = plan_problem(context.plan, world);
    if (!problem.empty()) throw Error("memory policy '" + name + "' made an impossible plan, " + problem);
    if (given && context.plan.global() != options_.batch_size)
      throw Error("memory policy '" + name + "' changed the global batch from " + std::to_string(options_.batch_size) +
                  " to " + std::to_string(context.plan.global()) + " (" + sdk::plan_text(context.plan) +
                  "); a policy may only re-split a batch the user chose");
    if (!(context.plan == plan_))
      log::info("plan: ", plan_.global(), " = ", plan_.micro_batch, " x ", plan_.accumulation, " x ", plan_.world_size,
                " -> ", context.plan.micro_batch, " x ", context.plan.accumulation, " x ", context.plan.world_size,
                " (", policy->describe(), ")");
    plan_ = context.plan;
  }
  plan_ = agree_plan(plan_);
  if (options_.estimate_memory && plan_.micro_batch >= 2) {
    // Probes now, so the end of the run can say how far the estimate was off.
    fit_ = activation_fit(plan_.micro_batch);
    if (fit_) predicted_peak_ = estimate(model_states(), *fit_, plan_.micro_batch).peak();
  }
  base_lr_ = options_.lr;
  if (options_.reference_batch > 0) {
    base_lr_ = options_.lr * static_cast<double>(plan_.global()) / static_cast<double>(options_.reference_batch);
    log::info("linear LR scaling: lr ", options_.lr, " x batch ", plan_.global(), " / reference ", options_.reference_batch,
              " = ", base_lr_);
  }
}

void Trainer::adopt_global_batch(int64_t global) {
  const sdk::BatchPlan chosen = plan_;
  plan_ = sdk::split_global_batch(global, plan_.world_size, plan_.micro_batch);
  train_loader_->set_micro_batch(plan_.micro_batch * local_devices(), plan_.micro_batch * local_devices() * plan_.accumulation);
  // (the data may have shrunk below the checkpoint's batch since: no step would fit an epoch)
  const int64_t per_epoch = steps_per_epoch(*train_loader_, plan_, parallel_->world_size(), held_out_ > 0, /*kept=*/true);
  if (options_.max_steps == 0) total_steps_ = per_epoch * options_.epochs;
  if (options_.eval_every == 0) eval_every_ = std::max<int64_t>(1, per_epoch);
  if (options_.reference_batch > 0)
    base_lr_ = options_.lr * static_cast<double>(global) / static_cast<double>(options_.reference_batch);
  log::info("plan: ", sdk::plan_text(chosen), " -> ", sdk::plan_text(plan_), ": the checkpoint's global batch (this ",
            "resume gives none, and its memory policies planned ", chosen.global(), "; a resumed run keeps its batch, its ",
            "schedule and its epochs; --batch-size sets another)");
}

int64_t Trainer::training_samples() const {
  const int64_t train_size = dataset_->size(sdk::Split::kTrain);
  // (one sample: none held out, or the training would have none; a loader's empty subset is its whole split)
  if ((dataset_.implements(1) && dataset_->size(sdk::Split::kValidation) > 0) || options_.validation_fraction <= 0 ||
      train_size < 2)
    return train_size;
  return train_size - std::clamp<int64_t>(static_cast<int64_t>(std::llround(options_.validation_fraction *
                                                                              static_cast<double>(train_size))),
                                          1, std::max<int64_t>(1, train_size - 1));
}

void Trainer::build_optimizer() {
  parameters_ = Parameters::of(*model_);
  const auto& info = registry_.require(LOOM_KIND_OPTIMIZER, options_.optimizer);
  auto optimizer = registry_.create<sdk::Optimizer>(options_.optimizer, component_values(config_, info));
  step_on_device_ = options_.device_step && precision_on_device_ && optimizer.implements(1);  // 1.1: step_on_device
  optimizer_divides_ = optimizer.implements(2);  // 1.2: step_on_device_dividing
  optimizer_ = std::move(optimizer);
  const auto who = [&] { return "optimizer '" + options_.optimizer + "'"; };
  as_component(who, options_.optimizer, [&] { optimizer_->setup(parameters_.trainable()); });
  parameter_shapes_.clear();
  for (const auto& item : model_->module().named_parameters()) parameter_shapes_.emplace_back(item.key(), item.value().sizes().vec());
  // Optimizer state and gradients exist from the start, so memory planning measures the steady state.
  // (Before its gradient exists, backward hands a parameter the incoming buffer; after, it adds into
  // it through a temporary: probes taken across that change disagree by a parameter-sized buffer per
  // parameter, which the activation fit would read as per-sample memory.)
  as_component(who, options_.optimizer, [&] { optimizer_->materialize(); });
  parameters_.gradients();
}

std::string Trainer::model_who() const {
  // A parameter whose shape changed since the optimizer was set up was changed by an update (an
  // optimizer's or a callback's): the model's error that follows is not the model's doing.
  const std::string model = "model '" + model_name_ + "'";
  const auto now = model_->module().named_parameters();
  for (const auto& [name, sizes] : parameter_shapes_) {
    const at::Tensor* p = now.find(name);
    if (p != nullptr && p->sizes().vec() != sizes)
      return model + " (its parameter '" + name + "' is now of shape " + c10::str(p->sizes()) + ", of shape " +
             c10::str(c10::IntArrayRef(sizes)) + " when training began: an update changed it, optimizer '" +
             options_.optimizer + "' or a callback)";
  }
  return model;
}

void Trainer::build_step_graphs() {
  if (!options_.cuda_graph) return;
  auto graphs = std::make_unique<StepGraphs>(device_, options_.cuda_graph_warmup);  // refuses a CPU device
  if (!step_on_device_)
    throw Error(std::string("step.cuda_graph needs the step on the device (a step that waits for the device cannot be "
                            "captured), and ") +
                (!options_.device_step ? "trainer.device_step is false: set it to true"
                 : !precision_on_device_
                     ? "precision '" + value_of(config_, "precision.name") + "' implements interface 1.0 (1.1 has the "
                       "on-device calls): update the plugin, or set step.cuda_graph = false"
                     : "optimizer '" + options_.optimizer + "' implements interface 1.0 (1.1 has step_on_device): update "
                       "the plugin, or set step.cuda_graph = false"));
  if (devices_in_world() > 1)
    throw Error("step.cuda_graph: parallel strategy '" + value_of(config_, "parallel.name") + "' runs " +
                std::to_string(devices_in_world()) + " devices; CUDA graphs are captured for one process on one "
                "device here: set step.cuda_graph = false");
  graphs_ = std::move(graphs);
}

void Trainer::build_schedule() {
  const auto& info = registry_.require(LOOM_KIND_SCHEDULE, options_.schedule);
  schedule_ = registry_.create<sdk::Schedule>(options_.schedule, component_values(config_, info));
}

void Trainer::build_loaders(bool training) {
  DataLoader::Options train;
  train.micro_batch = plan_.micro_batch * local_devices();  // cut across this process's devices
  train.step_samples = train.micro_batch * plan_.accumulation;  // (Note [An epoch of whole steps])
  train.shuffle = options_.shuffle;
  train.drop_last = true;
  train.seed = static_cast<uint64_t>(options_.seed);
  train.rank = parallel_->rank();
  train.world_size = parallel_->world_size();
  // See Note [Data loader threads run operators serially]: on CPU the training step's operators
  // already use every core, and a loader thread only preempts them; the in-memory datasets cost
  // little to index on the training thread.
  train.workers = options_.num_workers >= 0 ? options_.num_workers : (device_.is_cpu() ? 0 : 2);
  train.prefetch = options_.prefetch;
  train.pin_memory = options_.pin_memory;
  train.fills_buffers = dataset_.implements(3);  // Dataset 1.3: get_batch_into (Note [Reused batch buffers])
  train.device = device_;
  train.name = value_of(config_, "data.name");

  // Validation: the dataset's own split (interface 1.1 and newer), else a share of train held
  // out by a permutation that depends on the seed alone, so a resumed run holds out the same.
  DataLoader::Options eval = train;
  eval.shuffle = false;
  eval.drop_last = false;
  eval.one_epoch = true;
  eval.workers = std::min<int64_t>(train.workers, 1);
  const bool asks_validation = dataset_.implements(1);  // Dataset 1.1: Split::kValidation
  const int64_t native = asks_validation ? dataset_->size(sdk::Split::kValidation) : 0;
  const int64_t train_size = dataset_->size(sdk::Split::kTrain);
  held_out_ = 0;
  if (native > 0) {
    val_loader_ = std::make_unique<DataLoader>(dataset_, sdk::Split::kValidation, eval);
    if (training && parallel_->rank() == 0) say_validation_fraction_unused(config_, native);
  } else if (options_.validation_fraction > 0 && train_size < 2) {
    log::warn("the training split has ", train_size, train_size == 1 ? " sample" : " samples", ": none is held out for "
              "validation (data.validation_fraction), so the run has no validation split");
  } else if (options_.validation_fraction > 0) {
    check_order_memory(train.name, sdk::Split::kTrain, train_size);
    held_out_ = train_size - training_samples();
    HostMemoryScope host;  // bookkeeping in host memory, not the device's budget
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(options_.seed) * 7919ULL + 17ULL);
    const at::Tensor perm = at::randperm(train_size, gen, at::TensorOptions().dtype(at::kLong));
    const int64_t* p = perm.data_ptr<int64_t>();
    std::vector<int64_t> held(p, p + held_out_), kept(p + held_out_, p + train_size);
    std::sort(held.begin(), held.end());
    std::sort(kept.begin(), kept.end());
    eval.subset = std::move(held);
    train.subset = std::move(kept);
    val_loader_ = std::make_unique<DataLoader>(dataset_, sdk::Split::kTrain, eval);
    eval.subset.clear();
  }
  if (dataset_->size(sdk::Split::kTest) > 0) test_loader_ = std::make_unique<DataLoader>(dataset_, sdk::Split::kTest, eval);
  if (!training) return;
  // A step past the epoch: said as the global batch's (the loader said "micro-batch" of a step's
  // samples), with what holding out took, where it took some.
  if (const int64_t each = training_samples() / train.world_size; each < train.step_samples) {
    char fraction[32];
    std::snprintf(fraction, sizeof fraction, "%g", options_.validation_fraction);
    throw Error(no_step_in_an_epoch(plan_.global(), each * train.world_size, false) +
                (held_out_ > 0 ? ", or hold out less of it for validation (data.validation_fraction = " + std::string(fraction) +
                                     " holds out " + std::to_string(held_out_) + " of its " + std::to_string(train_size) + ")"
                               : std::string()));
  }
  train_loader_ = std::make_unique<DataLoader>(dataset_, sdk::Split::kTrain, train);
  const int64_t per_epoch = steps_per_epoch(*train_loader_, plan_, train.world_size, held_out_ > 0);
  total_steps_ = options_.max_steps > 0 ? options_.max_steps : per_epoch * options_.epochs;
  eval_every_ = options_.eval_every > 0 ? options_.eval_every : std::max<int64_t>(1, per_epoch);
}

DataLoader* Trainer::eval_loader(sdk::Split split) const {
  if (split == sdk::Split::kValidation) return val_loader_.get();
  if (split == sdk::Split::kTest) return test_loader_.get();
  return nullptr;
}

void Trainer::setup_for_evaluation() {
  build_components(/*with_optimizer=*/false);
  plan_ = sdk::BatchPlan{std::max<int64_t>(1, options_.batch_size / devices_in_world()), 1, devices_in_world()};
  build_loaders(/*training=*/false);
}

}  // namespace loom::core
