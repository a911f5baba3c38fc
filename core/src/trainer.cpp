// The trainer. See trainer.hpp for the shape of a run and of a step.
#include <loom/core/checkpoint.hpp>
#include <loom/core/device_memory.hpp>
#include <loom/core/estimator.hpp>
#include <loom/core/error.hpp>
#include <loom/core/files.hpp>
#include <loom/core/log.hpp>
#include <loom/core/metrics.hpp>
#include <loom/core/safetensors.hpp>
#include <loom/core/text.hpp>
#include <loom/core/trainer.hpp>

#include <loom/sdk/compat.hpp>
#include <loom/sdk/helpers.hpp>
#include <loom/sdk/options.hpp>
#include <loom/sdk/version.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/DeviceAccelerator.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/randperm.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <torch/cuda.h>
#include <torch/nn/module.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <sys/resource.h>
#include <unistd.h>

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace loom::core {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

const std::string& value_of(const Resolved& config, const std::string& key) {
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
int64_t int_of(const Resolved& c, const std::string& key) { return checked<int64_t>(c, key, sdk::parse_int, "an integer"); }
double float_of(const Resolved& c, const std::string& key) { return checked<double>(c, key, sdk::parse_float, "a number"); }
bool bool_of(const Resolved& c, const std::string& key) { return checked<bool>(c, key, sdk::parse_bool, "a boolean"); }
int64_t bytes_of(const Resolved& c, const std::string& key) { return checked<int64_t>(c, key, sdk::parse_bytes, "a size"); }

/// Runs `f`, naming `phase` in any error it throws ("evaluation at step 40: ..."), so that a
/// failure says where the run was. An out-of-memory error that nothing recovered from is one too.
template <class F>
auto in_phase(const std::string& phase, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const c10::Error& e) {
    throw Error(phase + ": " + e.what_without_backtrace());
  } catch (const std::exception& e) {
    throw Error(phase + ": " + e.what());
  }
}

int64_t resident_bytes() {
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return static_cast<int64_t>(resident) * ::sysconf(_SC_PAGESIZE);
}

std::string default_run_name() {
  const std::time_t now = std::time(nullptr);
  char buffer[32];
  std::strftime(buffer, sizeof buffer, "%Y%m%d-%H%M%S", std::localtime(&now));
  return buffer;
}

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
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "x" : "") + std::to_string(shape[i]);
  return s.empty() ? "scalar" : s;
}

at::Generator cpu_generator() { return sdk::compat::default_generator(c10::Device(c10::kCPU)); }
at::Generator device_generator(const c10::Device& device) { return sdk::compat::default_generator(device); }

// Note [Default precision]
// On a GPU the seeds turn AMP on by default. Loom picks bfloat16 autocast where the GPU has
// bfloat16 tensor cores (compute capability 8.0, Ampere, and newer): the same tensor-core rate
// as float16, but float32's exponent range, so no loss scaling, no skipped steps and no scale
// warm-up; on older GPUs it picks float16 autocast with the dynamic loss scaler. Both are
// explicit choices too (precision.name = fp16_amp / bf16_amp).

}  // namespace

int64_t peak_resident_bytes() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;
}

TrainerOptions TrainerOptions::from(const Resolved& c) {
  TrainerOptions o;
  o.name = value_of(c, "trainer.name");
  o.work_dir = value_of(c, "trainer.work_dir");
  o.device = value_of(c, "trainer.device");
  o.seed = int_of(c, "trainer.seed");
  o.threads = int_of(c, "trainer.threads");
  o.epochs = int_of(c, "trainer.epochs");
  o.max_steps = int_of(c, "trainer.max_steps");
  o.batch_size = int_of(c, "trainer.batch_size");
  o.accumulation = int_of(c, "trainer.gradient_accumulation_steps");
  o.optimizer = value_of(c, "trainer.optimizer");
  o.schedule = value_of(c, "trainer.schedule");
  o.lr = float_of(c, "trainer.lr");
  o.clip_grad_norm = float_of(c, "trainer.clip_grad_norm");
  o.reference_batch = int_of(c, "trainer.reference_batch");
  o.eval_every = int_of(c, "trainer.eval_every");
  o.log_every = int_of(c, "trainer.log_every");
  o.checkpoint_every = int_of(c, "trainer.checkpoint_every");
  o.keep_last = int_of(c, "trainer.keep_last");
  o.best_metric = value_of(c, "trainer.best_metric");
  o.resume = value_of(c, "trainer.resume");
  o.resume_from = value_of(c, "trainer.resume_from");
  o.allow_precision_change = bool_of(c, "precision.allow_precision_change");
  o.device_memory_limit = bytes_of(c, "memory.device_memory_limit");
  o.memory_snapshot = value_of(c, "memory.snapshot");
  o.snapshot_on_oom = bool_of(c, "memory.snapshot_on_oom");
  o.estimate_memory = bool_of(c, "memory.estimate");
  o.num_workers = int_of(c, "data.num_workers");
  o.prefetch = int_of(c, "data.prefetch");
  o.pin_memory = bool_of(c, "data.pin_memory");
  o.shuffle = bool_of(c, "data.shuffle");
  o.validation_fraction = float_of(c, "data.validation_fraction");
  if (!(o.validation_fraction >= 0 && o.validation_fraction < 1))
    throw Error("data.validation_fraction = " + std::to_string(o.validation_fraction) + " must be in [0, 1)");

  auto positive = [](const char* key, int64_t v) {
    if (v < 1) throw Error(std::string(key) + " = " + std::to_string(v) + " must be at least 1");
  };
  positive("trainer.batch_size", o.batch_size);
  positive("trainer.gradient_accumulation_steps", o.accumulation);
  positive("trainer.log_every", o.log_every);
  if (o.max_steps < 0 || o.epochs < 0 || o.eval_every < 0 || o.checkpoint_every < 0 || o.keep_last < 0 ||
      o.num_workers < -1 || o.prefetch < 1 || o.reference_batch < 0 || o.threads < 0)
    throw Error("trainer.max_steps, epochs, eval_every, checkpoint_every, keep_last, reference_batch and threads "
                "must be >= 0, data.num_workers >= -1, data.prefetch >= 1");
  if (o.max_steps == 0 && o.epochs == 0) throw Error("set trainer.max_steps or trainer.epochs (both are 0)");
  if (o.lr <= 0) throw Error("trainer.lr = " + std::to_string(o.lr) + " must be positive");
  if (o.clip_grad_norm < 0) throw Error("trainer.clip_grad_norm must be >= 0 (0 turns clipping off)");
  if (!o.resume_from.empty() && o.resume == "auto")
    throw Error("trainer.resume = auto and trainer.resume_from are both set; choose one");
  return o;
}

// ---- resolving the configuration -------------------------------------------------------------

Resolved resolve_run(Config config, const PluginRegistry& registry) {
  const Schema core = core_schema();
  auto get = [&](const std::string& key) {
    if (auto v = config.get(key)) return *v;
    return core.find(key)->option.default_value;
  };

  // precision.name = auto, as the seeds: AMP on by default on a GPU, --no-amp gives float32,
  // --allow-tf32 adds TF32. See Note [Default precision].
  const bool tf32 = sdk::parse_bool(get("precision.allow_tf32")).value_or(false);
  if (get("precision.name") == "auto") {
    const std::string device = get("trainer.device");
    const bool cuda = device.rfind("cuda", 0) == 0 || (device == "auto" && torch::cuda::is_available());
    const bool amp = sdk::parse_bool(get("precision.amp")).value_or(true);
    std::string choice = "fp32", why = cuda ? "CUDA device" : "CPU";
    if (cuda && amp) {
      const int cc = sdk::cuda_capability(device == "auto" ? c10::Device(c10::kCUDA, 0) : c10::Device(device));
      choice = cc >= 80 ? "bf16_amp" : "fp16_amp";
      why += std::string(cc >= 80 ? " with bfloat16 (compute capability >= 8.0)" : " without bfloat16") +
             ", AMP on by default; --no-amp for float32";
    } else if (tf32) {
      choice = "tf32";
      why += ", --allow-tf32";
    }
    if (!registry.find(LOOM_KIND_PRECISION, choice)) {
      log::warn("precision '", choice, "' is not loaded; using fp32");
      choice = "fp32";
    }
    config.set("precision.name", choice, Origin{"auto (" + why + ")", {}, 0});
  }
  if (tf32) {
    const std::string name = get("precision.name");
    if (name == "fp32")
      throw Error("precision fp32 keeps TF32 off, but precision.allow_tf32 (--allow-tf32) is set: use "
                  "precision.name=tf32 (or auto)");
    const ComponentInfo* info = registry.find(LOOM_KIND_PRECISION, name);
    const bool has_option = info && std::any_of(info->options.begin(), info->options.end(),
                                                [](const OptionSpec& o) { return o.key == "tf32"; });
    if (has_option && !config.find("precision.tf32") && !config.find(component_section(LOOM_KIND_PRECISION, name) + ".tf32"))
      config.set("precision.tf32", "true", Origin{"auto (--allow-tf32)", {}, 0});
  }

  // trainer.schedule = auto: the seeds' --use_scheduler (warm-up then cosine) or a constant rate.
  if (get("trainer.schedule") == "auto") {
    const bool cosine = sdk::parse_bool(get("trainer.use_scheduler")).value_or(true);
    config.set("trainer.schedule", cosine ? "warmup_cosine" : "constant",
               Origin{std::string("auto (trainer.use_scheduler = ") + (cosine ? "true" : "false") + ")", {}, 0});
  }

  // --memory-fraction / memory.fraction asks for the fraction_cap policy.
  if (config.find("memory.fraction")) {
    auto policies = sdk::parse_list(get("memory.policies"));
    if (std::find(policies.begin(), policies.end(), "fraction_cap") == policies.end()) {
      policies.insert(policies.begin(), "fraction_cap");
      config.set("memory.policies", join(policies, ", "), Origin{"auto (memory.fraction is set)", {}, 0});
    }
  }

  return validate(config, run_schema(config, registry));
}

// ---- building --------------------------------------------------------------------------------

Trainer::Trainer(Resolved config, const PluginRegistry& registry)
    : config_(std::move(config)), registry_(registry), options_(TrainerOptions::from(config_)) {}

Trainer::~Trainer() {
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

namespace {
/// A component's own options, from its section (Note [Component sections]).
std::map<std::string, std::string> component_values(const Resolved& config, const ComponentInfo& info) {
  return section_values(config, component_section(info.kind, info.name), info.options);
}
}  // namespace

void Trainer::setup() {
  in_phase("set-up", [&] {
    build_components(/*with_optimizer=*/true);
    build_plan();
    build_loaders();
  });
  in_phase("opening the run folder", [&] { open_run(); });
  report_startup();
}

void Trainer::build_components(bool with_optimizer) {
  if (options_.threads > 0) at::set_num_threads(static_cast<int>(options_.threads));
  at::manual_seed(static_cast<uint64_t>(options_.seed));
  build_parallel();
  build_data();
  build_memory();
  try {
    build_model();
    build_precision();
    if (with_optimizer) {
      build_optimizer();
      build_schedule();
    }
  } catch (const c10::OutOfMemoryError& e) {
    const auto stats = memory_->stats();
    throw Error("out of memory while building the model" + std::string(with_optimizer ? " and its optimizer" : "") +
                " on " + device_.str() + ": " + e.what_without_backtrace() + "; the run may use " +
                format_bytes(stats.limit > 0 ? stats.limit : stats.total) +
                " (a cap from --memory-fraction or --device-memory-limit?). Use a smaller model or more memory");
  }
}

void Trainer::build_parallel() {
  const std::string name = value_of(config_, "parallel.name");
  const auto& info = registry_.require(LOOM_KIND_PARALLEL, name);
  parallel_ = registry_.create<sdk::ParallelStrategy>(name, component_values(config_, info));
  parallel_->setup(options_.device);
  device_ = parallel_->device();
}

void Trainer::build_memory() {
  // On CPU this installs the counting allocator: from here on, CPU tensors are the emulated
  // device's memory (the dataset, built before, stays host memory). See Note [CPU budget allocator].
  memory_ = make_device_memory(device_, options_.device_memory_limit);
  if (device_.is_cuda() && options_.device_memory_limit > 0) memory_->set_limit(options_.device_memory_limit);
  if (device_.is_cuda() && !options_.memory_snapshot.empty()) start_memory_history(device_);
  if (!device_.is_cuda() && (!options_.memory_snapshot.empty() || options_.snapshot_on_oom))
    log::warn("memory snapshots are the CUDA allocator's (for pytorch.org/memory_viz); on ", device_.str(),
              " none is written. The run's memory is in metrics.jsonl (memory/allocated_bytes, memory/peak_bytes)");
  for (const auto& policy : sdk::parse_list(value_of(config_, "memory.policies"))) {
    const auto& policy_info = registry_.require(LOOM_KIND_MEMORY, policy);
    memory_policies_.push_back(registry_.create<sdk::MemoryPolicy>(policy, component_values(config_, policy_info)));
    memory_policies_.back()->setup(*memory_);
  }
}

void Trainer::build_data() {
  const std::string name = value_of(config_, "data.name");
  const auto& info = registry_.require(LOOM_KIND_DATASET, name);
  dataset_ = registry_.create<sdk::Dataset>(name, component_values(config_, info));
  HostMemoryScope host;  // the data set lives in host memory, whatever the device
  dataset_->setup();
  data_spec_ = dataset_->spec();
}

void Trainer::build_model() {
  const std::string name = value_of(config_, "model.name");
  const auto& info = registry_.require(LOOM_KIND_MODEL, name);
  model_ = registry_.create<sdk::Model>(name, component_values(config_, info));
  model_->setup(data_spec_);
  model_->module().to(device_);
  metric_specs_.clear();
  metric_specs_["loss"] = sdk::MetricSpec{"loss", "loss", sdk::Direction::kMinimize, false};
  for (const auto& spec : model_->metrics()) {
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
    const auto declared = model_->metrics();
    best = declared.empty() ? "loss" : declared.front().name;
  }
  if (!metric_specs_.count(best)) {
    const auto names = metric_names();
    const auto close = closest(best, names);
    throw Error("trainer.best_metric = '" + best + "' is not a metric of model '" + name + "', which reports " +
                join(names, ", ") + (close ? "; did you mean '" + *close + "'?" : std::string()));
  }
}

void Trainer::build_precision() {
  const std::string name = value_of(config_, "precision.name");
  const auto& info = registry_.require(LOOM_KIND_PRECISION, name);
  precision_ = registry_.create<sdk::PrecisionStrategy>(name, component_values(config_, info));
  precision_->setup(device_);
}

void Trainer::build_plan() {
  const int64_t world = parallel_->world_size();
  const int64_t per_step = options_.accumulation * world;
  if (options_.batch_size % per_step != 0)
    throw Error("trainer.batch_size " + std::to_string(options_.batch_size) + " is not divisible by " +
                "gradient_accumulation_steps " + std::to_string(options_.accumulation) + " x world size " +
                std::to_string(world) + "; the global batch must split evenly into micro-batches");
  plan_ = sdk::BatchPlan{options_.batch_size / per_step, options_.accumulation, world};
  // Memory policies may choose or change the micro-batch; a global batch the user gave stays.
  const bool given = config_.at("trainer.batch_size").origin.source != "default";
  for (auto& policy : memory_policies_) {
    sdk::PlanContext context;
    context.memory = memory_.get();
    context.plan = plan_;
    context.global_batch = plan_.global();
    context.global_batch_given = given;
    context.probe = [this](int64_t b) { return probe_peak(b); };
    context.config_key = config_key();
    context.device_name = device_description(device_);
    // A micro-batch above the global batch could not be used: when the user gave one, it bounds
    // a search too.
    context.max_micro_batch = dataset_->size(sdk::Split::kTrain) / world;
    if (given) context.max_micro_batch = std::min(context.max_micro_batch, plan_.global() / world);
    policy->plan(context);
    if (context.plan.micro_batch < 1 || context.plan.accumulation < 1 || context.plan.world_size != world)
      throw Error("memory policy '" + policy->describe() + "' made an invalid plan");
    if (given && context.plan.global() != options_.batch_size)
      throw Error("memory policy changed the global batch from " + std::to_string(options_.batch_size) + " to " +
                  std::to_string(context.plan.global()) + "; a policy may only re-split a batch the user chose");
    if (!(context.plan == plan_))
      log::info("plan: ", plan_.global(), " = ", plan_.micro_batch, " x ", plan_.accumulation, " x ", plan_.world_size,
                " -> ", context.plan.micro_batch, " x ", context.plan.accumulation, " x ", context.plan.world_size,
                " (", policy->describe(), ")");
    plan_ = context.plan;
  }
  if (options_.estimate_memory && plan_.micro_batch >= 2) {
    // Probes now, so the end of the run can say how far the estimate was off.
    fit_ = activation_fit(plan_.micro_batch);
    if (fit_) predicted_peak_ = estimate(model_states(), *fit_, plan_.micro_batch).total();
  }
  base_lr_ = options_.lr;
  if (options_.reference_batch > 0) {
    base_lr_ = options_.lr * static_cast<double>(plan_.global()) / static_cast<double>(options_.reference_batch);
    log::info("linear LR scaling: lr ", options_.lr, " x batch ", plan_.global(), " / reference ", options_.reference_batch,
              " = ", base_lr_);
  }
}

void Trainer::build_optimizer() {
  parameters_ = Parameters::of(*model_);
  const auto& info = registry_.require(LOOM_KIND_OPTIMIZER, options_.optimizer);
  optimizer_ = registry_.create<sdk::Optimizer>(options_.optimizer, component_values(config_, info));
  optimizer_->setup(parameters_.trainable());
  // Optimizer state and gradients exist from the start, so memory planning measures the steady
  // state. (Before its gradient exists, backward hands a parameter the incoming buffer; after,
  // it adds into it through a temporary: probes taken across that change disagree by a
  // parameter-sized buffer per parameter, which the activation fit would read as per-sample
  // memory.)
  optimizer_->materialize();
  parameters_.gradients();
}

void Trainer::build_schedule() {
  const auto& info = registry_.require(LOOM_KIND_SCHEDULE, options_.schedule);
  schedule_ = registry_.create<sdk::Schedule>(options_.schedule, component_values(config_, info));
}

void Trainer::build_loaders() {
  DataLoader::Options train;
  train.micro_batch = plan_.micro_batch;
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
  train.device = device_;

  // Validation: the dataset's own split (interface 1.1 and newer), else a share of train held
  // out by a permutation that depends on the seed alone, so a resumed run holds out the same.
  DataLoader::Options eval = train;
  eval.shuffle = false;
  eval.drop_last = false;
  eval.workers = std::min<int64_t>(train.workers, 1);
  const bool asks_validation = registry_.require(LOOM_KIND_DATASET, value_of(config_, "data.name")).interface_minor >= 1;
  const int64_t native = asks_validation ? dataset_->size(sdk::Split::kValidation) : 0;
  const int64_t train_size = dataset_->size(sdk::Split::kTrain);
  held_out_ = 0;
  if (native > 0) {
    val_loader_ = std::make_unique<DataLoader>(dataset_, sdk::Split::kValidation, eval);
  } else if (options_.validation_fraction > 0) {
    held_out_ = std::clamp<int64_t>(static_cast<int64_t>(std::llround(options_.validation_fraction * static_cast<double>(train_size))),
                                    1, std::max<int64_t>(1, train_size - 1));
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
  train_loader_ = std::make_unique<DataLoader>(dataset_, sdk::Split::kTrain, train);
  const int64_t per_epoch = train_loader_->batches_per_epoch() / plan_.accumulation;
  if (per_epoch < 1 && options_.max_steps == 0)
    throw Error("one epoch has fewer micro-batches than one optimizer step needs; lower the batch or set trainer.max_steps");
  total_steps_ = options_.max_steps > 0 ? options_.max_steps : per_epoch * options_.epochs;

  if (dataset_->size(sdk::Split::kTest) > 0) test_loader_ = std::make_unique<DataLoader>(dataset_, sdk::Split::kTest, eval);
}

DataLoader* Trainer::eval_loader(sdk::Split split) const {
  if (split == sdk::Split::kValidation) return val_loader_.get();
  if (split == sdk::Split::kTest) return test_loader_.get();
  return nullptr;
}

void Trainer::open_run() {
  fs::path work_dir = options_.work_dir;
  fs::path checkpoint;
  std::string name = options_.name;
  if (!options_.resume_from.empty()) {
    checkpoint = options_.resume_from;
    if (!fs::exists(checkpoint)) throw Error("trainer.resume_from = " + options_.resume_from + ": no such checkpoint");
    if (fs::exists(checkpoint / "checkpoints")) {  // a run folder: its newest checkpoint
      const auto all = CheckpointStore(checkpoint).list();
      if (all.empty()) throw Error(options_.resume_from + " holds no checkpoint to resume from");
      checkpoint = all.back();
    }
    if (name.empty()) name = checkpoint.parent_path().parent_path().filename().string();
  } else if (options_.resume == "auto") {
    if (name.empty() && fs::is_directory(work_dir)) {
      // The most recent run in the work folder that has a checkpoint.
      fs::file_time_type newest{};
      for (const auto& entry : fs::directory_iterator(work_dir)) {
        const fs::path cp = entry.path() / "checkpoints";
        if (!fs::is_directory(cp)) continue;
        const auto all = CheckpointStore(entry.path()).list();
        if (all.empty()) continue;
        const auto t = fs::last_write_time(all.back());
        if (name.empty() || t > newest) {
          newest = t;
          name = entry.path().filename().string();
        }
      }
    }
  }
  if (name.empty()) name = default_run_name();
  run_dir_ = work_dir / name;
  fs::create_directories(run_dir_);
  checkpoints_ = std::make_unique<CheckpointStore>(run_dir_);

  if (checkpoint.empty() && options_.resume == "auto") {
    // Newest first; a damaged checkpoint (a disk that filled up, a file edited by hand) is
    // skipped with a warning in favour of the one before it.
    auto all = checkpoints_->list();
    for (auto it = all.rbegin(); it != all.rend(); ++it) {
      try {
        load_checkpoint(*it);
        checkpoint = *it;
        break;
      } catch (const ResumeRefused&) {
        throw;
      } catch (const Error& e) {
        log::warn("cannot resume from ", it->string(), ": ", e.what(), "; trying an older checkpoint");
      }
    }
    if (checkpoint.empty()) log::info("resume = auto: no checkpoint in ", run_dir_.string(), "; starting fresh");
  } else if (!checkpoint.empty()) {
    load_checkpoint(checkpoint);
  }
  metrics_ = std::make_unique<MetricsWriter>(run_dir_, resumed_at_);
  json manifest;
  for (const auto& [key, value] : config_) manifest[key] = {{"value", value.value}, {"origin", value.origin.describe()}};
  write_file_atomic(run_dir_ / "config.json", manifest.dump(2) + "\n");
}

// ---- checkpoints -----------------------------------------------------------------------------

sdk::TensorMap Trainer::model_tensors() const {
  sdk::TensorMap out;
  for (const auto& item : model_->module().named_parameters()) out["param." + item.key()] = item.value();
  for (const auto& item : model_->module().named_buffers()) out["buffer." + item.key()] = item.value();
  return out;
}

std::string Trainer::state_json() const {
  json s;
  s["format"] = 1;
  s["loom_version"] = LOOM_SDK_VERSION;
  s["step"] = step_;
  s["total_steps"] = total_steps_;
  s["skipped_steps"] = skipped_steps_;
  const auto position = train_loader_->position();
  s["loader"] = {{"epoch", position.epoch}, {"offset", position.offset}, {"seed", options_.seed}};
  s["plan"] = {{"micro_batch", plan_.micro_batch}, {"accumulation", plan_.accumulation}, {"world_size", plan_.world_size}};
  s["schedule"] = {{"name", options_.schedule}, {"base_lr", base_lr_}, {"step", step_}, {"state", schedule_->state_dict().text}};
  const sdk::State optimizer = optimizer_->state_dict();
  s["optimizer"] = optimizer.text;
  const sdk::State precision = precision_->state_dict();
  s["precision"] = {{"name", value_of(config_, "precision.name")}, {"manifest", precision_->manifest()},
                    {"state", precision.text}};
  s["model"] = {{"name", value_of(config_, "model.name")}, {"config", section("model")}};
  s["data"] = {{"name", value_of(config_, "data.name")}, {"config", section("data")}};
  return s.dump(2) + "\n";
}

fs::path Trainer::save_checkpoint() {
  sdk::TensorMap extra;
  const sdk::State optimizer = optimizer_->state_dict();
  for (const auto& [k, t] : optimizer.tensors) extra["optimizer." + k] = t;
  const sdk::State precision = precision_->state_dict();
  for (const auto& [k, t] : precision.tensors) extra["precision." + k] = t;
  for (const auto& [k, t] : schedule_->state_dict().tensors) extra["schedule." + k] = t;
  extra["rng.cpu"] = cpu_generator().get_state();
  if (device_.is_cuda()) extra["rng.device"] = device_generator(device_).get_state();
  return checkpoints_->save(step_, model_tensors(), extra, state_json(), options_.keep_last);
}

void Trainer::load_checkpoint(const fs::path& dir) {
  const Checkpoint c = CheckpointStore::load(dir);
  json s;
  try {
    s = json::parse(c.state_json);
  } catch (const std::exception& e) {
    throw Error((dir / "state.json").string() + " is not valid JSON (" + e.what() + "); the checkpoint is damaged");
  }
  // The checkpoint must fit this run: same model configuration, same precision unless allowed.
  std::map<std::string, std::string> saved_config;
  for (const auto& [key, value] : s["model"]["config"].items()) saved_config[key] = value.get<std::string>();
  check_model_config(s["model"].value("name", ""), saved_config, dir.string());
  const auto manifest = precision_->manifest();
  std::vector<std::string> precision_diff;
  for (const auto& [key, value] : s["precision"]["manifest"].items()) {
    auto it = manifest.find(key);
    const std::string mine = it == manifest.end() ? "(none)" : it->second;
    if (mine != value.get<std::string>())
      precision_diff.push_back(key + ": checkpoint " + value.get<std::string>() + ", this run " + mine);
  }
  if (!precision_diff.empty()) {
    const std::string what = "the precision differs from the checkpoint's (" + join(precision_diff, "; ") + ")";
    if (!options_.allow_precision_change)
      throw ResumeRefused("refusing to resume from " + dir.string() + ": " + what +
                  ". Use the checkpoint's precision, or --set precision.allow_precision_change=true");
    log::warn(what, "; continuing because precision.allow_precision_change is set");
  }

  restore_model(c.model, dir.string());

  sdk::State optimizer;
  for (const auto& [k, v] : s["optimizer"].items()) optimizer.text[k] = v.get<std::string>();
  sdk::State precision, schedule;
  for (const auto& [k, v] : s["precision"]["state"].items()) precision.text[k] = v.get<std::string>();
  if (s["schedule"].contains("state"))
    for (const auto& [k, v] : s["schedule"]["state"].items()) schedule.text[k] = v.get<std::string>();
  for (const auto& [k, t] : c.extra) {
    if (k.rfind("optimizer.", 0) == 0) optimizer.tensors[k.substr(10)] = t;
    else if (k.rfind("precision.", 0) == 0) precision.tensors[k.substr(10)] = t;
    else if (k.rfind("schedule.", 0) == 0) schedule.tensors[k.substr(9)] = t;
  }
  if (const std::string saved = s["schedule"].value("name", options_.schedule); saved != options_.schedule)
    log::warn("the checkpoint was trained with schedule ", saved, ", this run uses ", options_.schedule);
  optimizer_->load_state_dict(optimizer);
  precision_->load_state_dict(precision);
  schedule_->load_state_dict(schedule);
  if (auto it = c.extra.find("rng.cpu"); it != c.extra.end()) cpu_generator().set_state(it->second);
  if (auto it = c.extra.find("rng.device"); it != c.extra.end() && device_.is_cuda()) device_generator(device_).set_state(it->second);

  step_ = s.value("step", int64_t{0});
  skipped_steps_ = s.value("skipped_steps", int64_t{0});
  const sdk::BatchPlan saved{s["plan"].value("micro_batch", int64_t{1}), s["plan"].value("accumulation", int64_t{1}),
                             s["plan"].value("world_size", int64_t{1})};
  if (saved.global() != plan_.global())
    log::warn("the checkpoint was trained with global batch ", saved.global(), ", this run uses ", plan_.global());
  train_loader_->seek(DataLoader::Position{s["loader"].value("epoch", int64_t{0}), s["loader"].value("offset", int64_t{0})});
  resumed_at_ = step_;
  log::info("resumed from ", dir.string(), " at step ", step_);
}

void Trainer::check_model_config(const std::string& saved_name, const std::map<std::string, std::string>& saved,
                                 const std::string& what) const {
  std::vector<std::string> differences;
  const auto mine_all = section("model");
  if (saved_name != value_of(config_, "model.name")) {
    differences.push_back("model.name: checkpoint '" + saved_name + "', this run '" + value_of(config_, "model.name") + "'");
  } else {
    for (const auto& [key, value] : saved) {
      auto it = mine_all.find(key);
      const std::string mine = it == mine_all.end() ? "(unset)" : it->second;
      if (mine != value) differences.push_back("model." + key + ": checkpoint " + value + ", this run " + mine);
    }
  }
  if (!differences.empty())
    throw ResumeRefused("refusing to resume from " + what + ": the model configuration differs (" + join(differences, "; ") +
                "). Use the checkpoint's model settings, or start a new run");
}

void Trainer::restore_model(const sdk::TensorMap& tensors, const std::string& what) {
  at::NoGradGuard no_grad;
  auto restore_into = [&](const std::string& key, at::Tensor into) {
    auto it = tensors.find(key);
    if (it == tensors.end()) throw ResumeRefused("refusing to load " + what + ": it has no tensor '" + key + "'");
    if (it->second.sizes() != into.sizes())
      throw ResumeRefused("refusing to load " + what + ": tensor '" + key + "' has shape " + c10::str(it->second.sizes()) +
                  " in the checkpoint, " + c10::str(into.sizes()) + " in this model");
    into.copy_(it->second);
  };
  for (const auto& item : model_->module().named_parameters()) restore_into("param." + item.key(), item.value());
  for (const auto& item : model_->module().named_buffers()) restore_into("buffer." + item.key(), item.value());
}

std::map<std::string, std::string> checkpoint_run_config(const fs::path& checkpoint) {
  std::map<std::string, std::string> out;
  json model, data;
  if (fs::is_directory(checkpoint)) {
    const json s = json::parse(read_file(checkpoint / "state.json"));
    model = s.at("model");
    data = s.at("data");
  } else {
    sdk::TextMap metadata;
    load_safetensors(checkpoint, &metadata);
    if (!metadata.count("model") || !metadata.count("data"))
      throw Error(checkpoint.string() + " carries no model configuration; pass a checkpoint folder or a best_*.safetensors Loom wrote");
    model = json::parse(metadata.at("model"));
    data = json::parse(metadata.at("data"));
  }
  for (const auto& [key, value] : model.at("config").items()) out["model." + key] = value.get<std::string>();
  for (const auto& [key, value] : data.at("config").items()) out["data." + key] = value.get<std::string>();
  return out;
}

void Trainer::setup_for_evaluation() {
  build_components(/*with_optimizer=*/false);
  plan_ = sdk::BatchPlan{std::max<int64_t>(1, options_.batch_size / parallel_->world_size()), 1, parallel_->world_size()};
  build_loaders();
}

void Trainer::setup_for_estimate() { build_components(/*with_optimizer=*/true); }

void Trainer::load_weights(const fs::path& checkpoint) {
  if (fs::is_directory(checkpoint)) {
    const Checkpoint c = CheckpointStore::load(checkpoint);
    restore_model(c.model, checkpoint.string());
  } else {
    restore_model(load_safetensors(checkpoint), checkpoint.string());
  }
}

// ---- the step --------------------------------------------------------------------------------

StepState Trainer::capture() const {
  StepState s;
  s.step = step_;
  s.loader = train_loader_->position();
  s.cpu_rng = cpu_generator().get_state();
  if (device_.is_cuda()) s.device_rng = device_generator(device_).get_state();
  s.buffers = save_buffers();
  return s;
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

void Trainer::restore(const StepState& s) {
  step_ = s.step;
  train_loader_->seek(s.loader);
  cpu_generator().set_state(s.cpu_rng);
  if (s.device_rng.defined()) device_generator(device_).set_state(s.device_rng);
  parameters_.zero_grad();
  restore_buffers(s.buffers);
}

void Trainer::report_evaluation(const EvalResult& e) {
  const std::string prefix = e.split == sdk::Split::kValidation ? "val/" : "test/";
  std::map<std::string, double> m{{prefix + "loss", e.loss}};
  for (const auto& [k, v] : e.metrics) m[prefix + k] = v;
  metrics_->write(step_, m);
  std::string line = std::string(e.split == sdk::Split::kValidation ? "validation" : "test") + " step " +
                     std::to_string(step_) + ": " + format_metric("loss", e.loss);
  for (const auto& [k, v] : e.metrics) line += ", " + format_metric(k, v);
  log::info(line, " (", format_duration(e.seconds), ")");
}

double Trainer::current_lr() const {
  // Skipped steps (non-finite gradients) do not advance the schedule.
  const double factor = schedule_->factor(step_ - skipped_steps_, total_steps_);
  if (!std::isfinite(factor) || factor < 0)
    throw Error("schedule '" + options_.schedule + "' gave the learning-rate factor " + std::to_string(factor) +
                " at step " + std::to_string(step_ + 1) + "; a factor is finite and >= 0");
  return base_lr_ * factor;
}

void Trainer::add_metrics(MetricSums& sums, const sdk::ModelOutput& out) const {
  for (const auto& [name, value] : out.metrics) {
    if (!metric_specs_.count(name) || name == "loss")
      throw Error("model '" + value_of(config_, "model.name") + "' reported a metric '" + name +
                  "' that its metrics() does not declare (it declares " + join(metric_names(), ", ") +
                  "); declare it with its direction, or stop reporting it");
    auto& [sum, count] = sums[name];
    const at::Tensor s = value.sum.detach().to(at::kFloat);
    const at::Tensor c = value.count.defined() ? value.count.detach().to(at::kFloat) : out.count.detach().to(at::kFloat);
    sum = sum.defined() ? sum + s : s;
    count = count.defined() ? count + c : c;
  }
}

std::map<std::string, double> Trainer::reduce_metrics(MetricSums& sums) const {
  std::vector<at::Tensor> totals;
  for (auto& [name, pair] : sums) {
    totals.push_back(pair.first);
    totals.push_back(pair.second);
  }
  if (!totals.empty()) parallel_->all_reduce_sum(totals);
  std::map<std::string, double> out;
  for (auto& [name, pair] : sums) {
    const double count = pair.second.item<double>();
    out[name] = count > 0 ? pair.first.item<double>() / count : std::nan("");
  }
  return out;
}

std::vector<std::string> Trainer::metric_names() const {
  std::vector<std::string> names;
  for (const auto& [name, spec] : metric_specs_) names.push_back(name);
  return names;
}

std::string Trainer::format_metric(const std::string& name, double value) const {
  char text[64];
  auto it = metric_specs_.find(name);
  if (it != metric_specs_.end() && it->second.percent) std::snprintf(text, sizeof text, "%.2f %%", 100.0 * value);
  else std::snprintf(text, sizeof text, "%.4f", value);
  const std::string shown = it != metric_specs_.end() && !it->second.display_name.empty() ? it->second.display_name : name;
  return shown + " " + text;
}

StepResult Trainer::train_step() {
  committed_ = false;
  auto& module = model_->module();
  module.train();
  parameters_.zero_grad();
  at::Tensor loss_sum = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device_));
  at::Tensor count = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device_));
  MetricSums metric_sums;
  for (int64_t micro = 0; micro < plan_.accumulation; ++micro) {
    const sdk::Batch batch = train_loader_->next();
    sdk::ModelOutput out;
    {
      auto guard = precision_->forward_guard();
      out = model_->forward(batch, /*train=*/true);
    }
    precision_->scale_loss(out.loss_sum).backward();
    loss_sum.add_(out.loss_sum.detach().to(at::kFloat));
    count.add_(out.count.detach().to(at::kFloat));
    add_metrics(metric_sums, out);
  }
  // Gradients hold sums over this rank's samples: add up the ranks, then divide by the global
  // count once, so the update does not depend on how the global batch was split.
  std::vector<at::Tensor> grads = parameters_.gradients();
  std::vector<at::Tensor> totals{loss_sum, count};
  parallel_->all_reduce_sum(totals);
  parallel_->all_reduce_sum(grads);
  {
    at::NoGradGuard no_grad;
    const at::Tensor inverse = count.clamp_min(1).reciprocal();
    for (auto& g : grads) g.mul_(inverse);
  }
  if (gradient_hook_) gradient_hook_(grads);
  if (log::enabled(LOOM_LOG_TRACE)) log::trace("peak after backward: ", memory_->stats().peak);
  // What the step reports does not depend on the update: computed first, so that nothing after
  // the update allocates more than the scaler's few bytes.
  StepResult result;
  const double n = count.item<double>();
  result.samples = static_cast<int64_t>(n);
  result.loss = loss_sum.item<double>() / std::max(1.0, n);
  result.metrics = reduce_metrics(metric_sums);
  result.lr = current_lr();
  // Unscaling and clipping change only the gradients, which a replay zeroes: up to here an
  // out-of-memory can be replayed. From the commit on, the step changes the run's state.
  const bool finite = precision_->unscale_gradients(grads);
  if (finite) result.grad_norm = clip_grad_norm(grads, options_.clip_grad_norm).item<double>();
  committed_ = true;
  if (finite) {
    optimizer_->step(result.lr);
    if (log::enabled(LOOM_LOG_TRACE)) log::trace("peak after the update: ", memory_->stats().peak);
  } else {
    ++skipped_steps_;
    result.skipped = true;
    log::warn("step ", step_ + 1, ": non-finite gradients, update skipped (", skipped_steps_, " skipped so far)");
  }
  ++step_;
  precision_->update(!finite);
  result.step = step_;
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
      loader->set_micro_batch(micro);
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
      const bool replanned = std::any_of(memory_policies_.begin(), memory_policies_.end(),
                                         [&](auto& policy) { return policy->on_oom(context); });
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
  at::Tensor loss_sum = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device_));
  at::Tensor count = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device_));
  MetricSums sums;
  for (int64_t i = 0; i < loader.batches_per_epoch(); ++i) {
    const sdk::Batch batch = loader.next();
    sdk::ModelOutput out;
    {
      auto guard = precision_->forward_guard();
      out = model_->forward(batch, /*train=*/false);
    }
    loss_sum.add_(out.loss_sum.to(at::kFloat));
    count.add_(out.count.to(at::kFloat));
    add_metrics(sums, out);
  }
  std::vector<at::Tensor> totals{loss_sum, count};
  parallel_->all_reduce_sum(totals);
  const double n = std::max(1.0, count.item<double>());
  result.samples = static_cast<int64_t>(count.item<double>());
  result.loss = loss_sum.item<double>() / n;
  result.metrics = reduce_metrics(sums);
  result.seconds = seconds_since(start);
  module.train();
  return result;
}

// ---- memory --------------------------------------------------------------------------------

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
  return m;
}

std::optional<ActivationFit> Trainer::activation_fit(int64_t micro) {
  // Two probes, a quarter and half of the micro-batch, extrapolated. Not smaller: a backward's
  // peak is the larger of two lines in the batch (the activations early in the backward, or the
  // largest weight's gradient buffer late in it, when the activations are mostly freed), and
  // probes far below the micro-batch can sit on the flat one (bench/memory_figures.cpp).
  const int64_t limit = std::max<int64_t>(2, dataset_->size(sdk::Split::kTrain) / parallel_->world_size());
  for (int64_t large = std::clamp<int64_t>(micro / 2, 2, limit); large >= 2; large /= 2) {
    try {
      return fit_activations([this](int64_t b) { return probe_peak(b); }, std::max<int64_t>(1, large / 2), large);
    } catch (const c10::OutOfMemoryError&) {
      memory_->empty_cache();
      log::debug("memory estimate: probe at ", large, " ran out of memory; probing smaller");
    }
  }
  return std::nullopt;
}

std::string Trainer::config_key() const {
  std::string key;
  for (const auto& section : {"model", "data", "precision"})
    for (const auto& [k, v] : this->section(section)) key += std::string(section) + "." + k + "=" + v + ";";
  return key + "optimizer=" + options_.optimizer + ";libtorch=" + TORCH_VERSION;
}

int64_t Trainer::probe_peak(int64_t b) {
  ++probes_run_;
  at::Generator cpu = cpu_generator();
  const at::Tensor cpu_state = cpu.get_state();
  at::Tensor device_state;
  if (device_.is_cuda()) device_state = device_generator(device_).get_state();
  const std::vector<at::Tensor> buffers = save_buffers();
  auto restore_state = [&] {
    parameters_.zero_grad();
    cpu.set_state(cpu_state);
    if (device_state.defined()) device_generator(device_).set_state(device_state);
    restore_buffers(buffers);
  };
  parameters_.zero_grad();
  memory_->empty_cache();
  memory_->reset_peak();
  int64_t peak = 0;
  try {
    const int64_t n = dataset_->size(sdk::Split::kTrain);
    std::vector<int64_t> indices(static_cast<size_t>(b));
    for (int64_t i = 0; i < b; ++i) indices[static_cast<size_t>(i)] = i % n;
    sdk::Batch batch = dataset_->get_batch(sdk::Split::kTrain, indices);
    for (auto& [name, t] : batch) t = t.to(device_);
    model_->module().train();
    sdk::ModelOutput out;
    {
      auto guard = precision_->forward_guard();
      out = model_->forward(batch, /*train=*/true);
    }
    precision_->scale_loss(out.loss_sum).backward();
    peak = memory_->stats().peak;
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
  else
    std::snprintf(text, sizeof text, "%lldMiB", static_cast<long long>(bytes >> 20));
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
  text += "\n  1. a smaller batch: --batch-size (now " + std::to_string(plan_.global()) + ")";
  const auto policies = sdk::parse_list(value_of(config_, "memory.policies"));
  const bool recovering = std::find(policies.begin(), policies.end(), "oom_recovery") != policies.end();
  text += recovering ? "\n  2. gradient accumulation: oom_recovery re-planned to micro-batch " +
                           std::to_string(plan_.micro_batch) + " x accumulation " + std::to_string(plan_.accumulation) +
                           " and stopped there (micro-batch 1, or memory.max_replans re-plans)"
                     : std::string("\n  2. gradient accumulation: --gradient-accumulation-steps (memory.policies ="
                                   " oom_recovery does it for you)");
  text += "\n  3. mixed precision: precision.name = bf16_amp or fp16_amp (not --no-amp)";
  text += "\n  4. the memory fraction: a cap (--memory-fraction) below what the device has also limits this run;"
          " lower it only to leave room for other processes";
  if (section("model").count("image_size")) text += "\n  5. a smaller input: --image-size";
  text += "\nThe estimator: the model states alone need " + format_bytes(states.total()) + " (parameters " +
          format_bytes(states.parameters) + ", gradients " + format_bytes(states.gradients) + ", optimizer " +
          format_bytes(states.optimizer_states) + ") of the " + format_bytes(cap) + " this run may use";
  text += states.total() >= cap ? std::string(": no batch fits; use a smaller model, AMP, or more memory.")
                                : "; `loom memory suggest --target " + target_arg(cap) + "` says which batch fits.";
  return text;
}

StepResult Trainer::step_with_recovery() {
  const StepState start = capture();
  while (true) {
    try {
      return train_step();
    } catch (const c10::OutOfMemoryError& e) {
      const auto t0 = Clock::now();
      const std::string message = e.what_without_backtrace();
      if (committed_) {
        committed_ = false;
        throw Error("out of memory in the update of step " + std::to_string(start.step + 1) +
                    ", after it began to change the weights, so it cannot be replayed: " + message +
                    "\nLeave more room (a smaller batch, or a cap further below the device's memory) and continue"
                    " with --resume auto from the last checkpoint");
      }
      // Unwind: nothing of the step was applied; drop its gradients, return cached blocks, and
      // put the data position and the RNG back where the step began.
      restore(start);
      memory_->empty_cache();
      sdk::OomContext context;
      context.memory = memory_.get();
      context.plan = plan_;
      context.message = message;
      context.step = step_ + 1;
      bool replanned = false;
      for (auto& policy : memory_policies_)
        if (policy->on_oom(context)) {
          replanned = true;
          break;
        }
      if (replanned && context.plan.global() != plan_.global())
        throw Error("memory policy changed the global batch while recovering from out-of-memory; refusing");
      if (!replanned) {
        if (options_.snapshot_on_oom && device_.is_cuda()) {
          const auto path = run_dir_ / "oom_snapshot.pickle";
          write_memory_snapshot(device_, path);
          log::error("memory snapshot of the failure: ", path.string(), " (https://pytorch.org/memory_viz)");
        }
        throw Error(oom_advice(message));
      }
      log::info("plan: ", plan_.global(), " = ", plan_.micro_batch, " x ", plan_.accumulation, " x ", plan_.world_size,
                " -> ", context.plan.micro_batch, " x ", context.plan.accumulation, " x ", context.plan.world_size,
                " after running out of memory at step ", step_ + 1);
      plan_ = context.plan;
      train_loader_->set_micro_batch(plan_.micro_batch);
      ++oom_recoveries_;
      recovery_seconds_ += seconds_since(t0);
    }
  }
}

// ---- the loop --------------------------------------------------------------------------------

TrainSummary Trainer::train() {
  TrainSummary summary;
  summary.run_dir = run_dir_;
  const int64_t per_epoch = std::max<int64_t>(1, train_loader_->batches_per_epoch() / plan_.accumulation);
  const int64_t eval_every = options_.eval_every > 0 ? options_.eval_every : per_epoch;
  const int64_t checkpoint_every = options_.checkpoint_every > 0 ? options_.checkpoint_every : eval_every;
  std::optional<double> best = checkpoints_->best_value(options_.best_metric);
  Progress progress(total_steps_);
  const int64_t first_step = step_;
  memory_->reset_peak();
  double train_seconds = 0;
  double window_seconds = 0, window_loss = 0;
  int64_t window_steps = 0, window_samples = 0;
  std::map<std::string, double> window_metrics;
  std::optional<EvalResult> last_eval;

  auto checkpoint = [&] {
    progress.finish();
    const auto dir = save_checkpoint();
    log::debug("checkpoint ", dir.string());
  };

  while (step_ < total_steps_) {
    const auto start = Clock::now();
    const StepResult r = in_phase("training step " + std::to_string(step_ + 1), [&] { return step_with_recovery(); });
    const double dt = seconds_since(start);
    train_seconds += dt;
    window_seconds += dt;
    window_loss += r.loss;
    window_samples += r.samples;
    ++window_steps;
    for (const auto& [k, v] : r.metrics) window_metrics[k] += v;

    const double rate = window_samples / std::max(1e-9, window_seconds);
    const double eta = (total_steps_ - step_) * (train_seconds / std::max<int64_t>(1, step_ - first_step));
    if (step_ % options_.log_every == 0 || step_ == total_steps_) {
      const sdk::MemoryStats mem = memory_->stats();
      std::map<std::string, double> m{{"train/loss", window_loss / window_steps},
                                      {"train/lr", r.lr},
                                      {"train/samples_per_s", rate},
                                      {"train/grad_norm", r.grad_norm},
                                      {"train/epoch", static_cast<double>(train_loader_->position().epoch)},
                                      {"train/skipped_steps", static_cast<double>(skipped_steps_)},
                                      {"train/skipped_rate", static_cast<double>(skipped_steps_) / std::max<int64_t>(1, step_)},
                                      {"memory/allocated_bytes", static_cast<double>(mem.allocated)},
                                      {"memory/reserved_bytes", static_cast<double>(mem.reserved)},
                                      {"memory/peak_bytes", static_cast<double>(mem.peak)}};
      for (const auto& [k, v] : window_metrics) m["train/" + k] = v / window_steps;
      metrics_->write(step_, m);
      char fields[256];
      std::snprintf(fields, sizeof fields, "loss %.4f | lr %.2e | %.0f samples/s | ETA %s | mem %s (peak %s)",
                    window_loss / window_steps, r.lr, rate, format_duration(eta).c_str(),
                    format_bytes(mem.allocated).c_str(), format_bytes(mem.peak).c_str());
      progress.update(step_, fields);
      window_seconds = window_loss = 0;
      window_steps = window_samples = 0;
      window_metrics.clear();
    }

    const bool last = step_ == total_steps_;
    if (step_ % eval_every == 0 || last) {
      // Validation picks the best checkpoint; without a validation split, the test split does.
      const sdk::Split split = val_loader_ ? sdk::Split::kValidation : sdk::Split::kTest;
      if (eval_loader(split)) {
        const EvalResult e = in_phase("evaluation at step " + std::to_string(step_), [&] { return evaluate(split); });
        last_eval = e;
        progress.finish();
        report_evaluation(e);
        const auto& best_spec = metric_specs_.at(options_.best_metric);
        const std::optional<double> it = e.value(best_spec.name);
        if (it && (!best || sdk::improves(best_spec.direction, *it, *best))) {
          best = *it;
          in_phase("saving the best checkpoint at step " + std::to_string(step_), [&] {
            const json state = json::parse(state_json());
            checkpoints_->save_best(options_.best_metric, *it, step_, model_tensors(),
                                    {{"model", state["model"].dump()}, {"data", state["data"].dump()}});
          });
        }
      }
    }
    if (step_ % checkpoint_every == 0 || last)
      in_phase("saving the checkpoint of step " + std::to_string(step_), [&] { checkpoint(); });
  }
  progress.finish();
  // The test split, once, at the end (when validation chose the best checkpoint).
  if (val_loader_ && test_loader_ && step_ > first_step) {
    last_eval = in_phase("the final test evaluation", [&] { return evaluate(sdk::Split::kTest); });
    report_evaluation(*last_eval);
  }
  summary.steps = step_;
  summary.seconds = train_seconds;
  summary.samples_per_second = (step_ - first_step) * plan_.global() / std::max(1e-9, train_seconds);
  summary.final_eval = last_eval;
  summary.peak_memory = memory_->stats().peak;
  summary.peak_resident = peak_resident_bytes();
  if (fit_) predicted_peak_ = estimate(model_states(), *fit_, plan_.micro_batch).total();  // the final plan
  summary.predicted_peak = predicted_peak_;
  summary.oom_recoveries = oom_recoveries_;
  summary.recovery_seconds = recovery_seconds_;
  if (predicted_peak_ > 0 && summary.peak_memory > 0) {
    const double error = 100.0 * static_cast<double>(predicted_peak_ - summary.peak_memory) / static_cast<double>(summary.peak_memory);
    char line[160];
    std::snprintf(line, sizeof line, "memory estimate: predicted peak %s at micro-batch %lld, measured %s (error %+.1f %%)",
                  format_bytes(predicted_peak_).c_str(), static_cast<long long>(plan_.micro_batch),
                  format_bytes(summary.peak_memory).c_str(), error);
    log::info(line);
  }
  if (!options_.memory_snapshot.empty() && device_.is_cuda()) {
    write_memory_snapshot(device_, options_.memory_snapshot);
    log::info("memory snapshot written to ", options_.memory_snapshot, " (open it at https://pytorch.org/memory_viz)");
  }
  return summary;
}

void Trainer::report_startup() const {
  std::string device = device_.str();
  if (device_.is_cpu()) {
    const int64_t pages = ::sysconf(_SC_PHYS_PAGES), free_pages = ::sysconf(_SC_AVPHYS_PAGES);
    device += ", " + std::to_string(at::get_num_threads()) + " threads, " +
              format_bytes(pages * ::sysconf(_SC_PAGESIZE)) + " RAM (" +
              format_bytes(free_pages * ::sysconf(_SC_PAGESIZE)) + " free)";
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
  const std::string validation =
      held_out_ > 0 ? " (" + std::to_string(held_out_) + " of them held out for validation)"
                    : val_loader_ ? ", " + std::to_string(val_loader_->samples_per_epoch()) + " validation"
                                  : " (no validation: the test split picks the best checkpoint)";
  log::info("data      ", value_of(config_, "data.name"), ": ", dataset_->size(sdk::Split::kTrain), " train", validation,
            ", ", dataset_->size(sdk::Split::kTest), " test; ", fields,
            data_spec_.num_classes ? "; " + std::to_string(data_spec_.num_classes) + " classes" : std::string());
  log::info("model     ", value_of(config_, "model.name"), ": ", model_->describe(), "; ", format_count(params),
            " parameters (", format_count(trainable), " trainable, ", format_bytes(bytes), ")");
  log::info("plan      batch ", plan_.global(), " = ", plan_.micro_batch, " x ", plan_.accumulation, " x ",
            plan_.world_size, " (micro-batch x accumulation x world); ", per_epoch, " steps/epoch, ", total_steps_,
            " steps", options_.max_steps == 0 ? " (" + std::to_string(options_.epochs) + " epochs)" : std::string());
  std::string groups;
  for (const auto& g : parameters_.trainable())
    groups += (groups.empty() ? "" : ", ") + g.name + " " + std::to_string(g.params.size()) +
              (g.lr_scale != 1.0 ? " (lr x " + std::to_string(g.lr_scale).substr(0, 5) + ")" : std::string());
  log::info("optimizer ", optimizer_->describe().empty() ? options_.optimizer : optimizer_->describe(), "; groups ",
            groups, "; clip ", options_.clip_grad_norm);
  log::info("schedule  ", options_.schedule, ": peak lr ", base_lr_,
            schedule_->describe().empty() ? std::string() : ", " + schedule_->describe());
  log::info("precision ", value_of(config_, "precision.name"), ": ", manifest);
  const auto mem = memory_->stats();
  if (mem.limit > 0)
    log::info("memory    ", device_.str(), " may use ", format_bytes(mem.limit), " of ", format_bytes(device_.is_cpu() && options_.device_memory_limit > 0 ? options_.device_memory_limit : mem.total),
              device_.is_cpu() && options_.device_memory_limit > 0 ? " (--device-memory-limit: the CPU acts as a device of that size)" : "");
  for (const auto& policy : memory_policies_) log::info("memory    ", policy->describe());
  if (predicted_peak_ > 0) log::info("memory    estimated peak ", format_bytes(predicted_peak_), " at micro-batch ", plan_.micro_batch);
}

}  // namespace loom::core
