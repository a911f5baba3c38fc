// What a run's configuration resolves to: the trainer's own options (TrainerOptions::from,
// range-checked) and the automatic choices (precision.name = auto, trainer.schedule = auto,
// --memory-fraction adding fraction_cap) made before the whole configuration is validated.
#include <loom/core/checkpoint.hpp>
#include <loom/core/files.hpp>
#include <loom/core/kinds.hpp>
#include <loom/core/log.hpp>
#include <loom/core/text.hpp>
#include <loom/core/trainer.hpp>
#include "json_limits.hpp"
#include "trainer_internal.hpp"

#include <loom/sdk/helpers.hpp>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <set>
#include <cctype>

namespace fs = std::filesystem;

namespace loom::core {

using namespace detail;

namespace {

// Note [Default precision]
// On a GPU the seeds turn AMP on by default. Loom picks bfloat16 autocast where the GPU has
// bfloat16 tensor cores (compute capability 8.0, Ampere, and newer): the same tensor-core rate
// as float16, but float32's exponent range, so no loss scaling, no skipped steps and no scale
// warm-up; on older GPUs it picks float16 autocast with the dynamic loss scaler. Both are
// explicit choices too (precision.name = fp16_amp / bf16_amp).

/// trainer.device names a device this machine has: auto, cpu (cpu:0), cuda or cuda:N with N below the
/// number of visible CUDA devices (else LibTorch fails later with an internal assertion).
void check_device(const std::string& text) {
  if (text == "auto" || text == "cpu") return;
  std::optional<c10::Device> device;
  try {
    device = c10::Device(text);
  } catch (const c10::Error&) {
  }
  if (!device || !(device->is_cpu() || device->is_cuda()))
    throw Error("trainer.device = '" + text + "' is not a device Loom trains on: use auto, cpu, cuda or cuda:N");
  if (device->is_cpu()) {
    // LibTorch takes cpu:5 for the CPU and ignores the index; the run would record a device it never used.
    if (device->has_index() && device->index() != 0)
      throw Error("trainer.device = '" + text + "': the CPU is one device, cpu (or cpu:0); trainer.threads sets how " +
                  "many cores it uses");
    return;
  }
  const int64_t count = static_cast<int64_t>(torch::cuda::device_count());
  if (count == 0)
    throw Error("trainer.device = '" + text + "', but no CUDA device is visible here; use trainer.device = cpu (or auto, "
                "which picks a GPU when there is one)");
  if (device->has_index() && device->index() >= count)
    throw Error("trainer.device = '" + text + "', but this machine has " + std::to_string(count) +
                " CUDA device(s): cuda:0" + (count > 1 ? " to cuda:" + std::to_string(count - 1) : std::string()));
}

}  // namespace

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
  o.peak_tflops = float_of(c, "trainer.peak_tflops");
  if (const std::string bucket = value_of(c, "parallel.bucket_mb"); bucket != "auto") {
    const auto parsed = sdk::parse_float(bucket);  // (a setting's number: no hexadecimal, no " 25 junk")
    o.bucket_mb = parsed.value_or(-1);
    if (!parsed || !(o.bucket_mb >= 0 && o.bucket_mb <= 1048576))
      throw Error("parallel.bucket_mb = '" + bucket + "': use auto, 0 (one reduction after backward) or a size in MiB "
                  "up to 1048576, e.g. 25");
  }
  o.device_step = bool_of(c, "trainer.device_step");
  o.stop_after_skipped = int_of(c, "trainer.stop_after_skipped");
  o.cuda_graph = bool_of(c, "step.cuda_graph");
  o.cuda_graph_warmup = int_of(c, "step.cuda_graph_warmup");
  o.reference_batch = int_of(c, "trainer.reference_batch");
  o.eval_every = int_of(c, "trainer.eval_every");
  o.log_every = int_of(c, "trainer.log_every");
  o.checkpoint_every = int_of(c, "trainer.checkpoint_every");
  o.keep_last = int_of(c, "trainer.keep_last");
  o.best_metric = value_of(c, "trainer.best_metric");
  o.resume = value_of(c, "trainer.resume");
  o.resume_from = value_of(c, "trainer.resume_from");
  o.init_from = value_of(c, "trainer.init_from");
  o.allow_precision_change = bool_of(c, "precision.allow_precision_change");
  o.device_memory_limit = bytes_of(c, "memory.device_memory_limit");
  // (--device-memory-limit 0.5 was a budget of 1 B, and 0.3 none at all: 0 is "no cap")
  if (const std::string& given = value_of(c, "memory.device_memory_limit");
      o.device_memory_limit < 4096 && (o.device_memory_limit > 0 || given.find_first_of("123456789") != std::string::npos)) {
    const bool unit = given.find_first_not_of("0123456789. ") != std::string::npos;
    throw Error("memory.device_memory_limit = " + given + " is " + std::to_string(o.device_memory_limit) +
                " byte(s), no device's size (0 alone means no cap)" +
                (unit ? std::string("; give at least 4KiB") : "; a size takes its unit, e.g. " + given + "GiB"));
  }
  o.memory_snapshot = value_of(c, "memory.snapshot");
  o.snapshot_on_oom = bool_of(c, "memory.snapshot_on_oom");
  o.estimate_memory = bool_of(c, "memory.estimate");
  o.num_workers = int_of(c, "data.num_workers");
  o.prefetch = int_of(c, "data.prefetch");
  o.pin_memory = bool_of(c, "data.pin_memory");
  o.shuffle = bool_of(c, "data.shuffle");
  o.validation_fraction = float_of(c, "data.validation_fraction");
  // Each key's own range is the schema's (core_schema.cpp), checked by validate() with the file
  // and line it came from; what is left here involves several keys.
  if (o.max_steps == 0 && o.epochs == 0) throw Error("set trainer.max_steps or trainer.epochs (both are 0)");
  // An epochs given on the command line that max_steps overrides would be ignored in silence.
  if (const auto epochs = c.find("trainer.epochs"), steps = c.find("trainer.max_steps");
      o.max_steps > 0 && o.epochs > 0 && epochs != c.end() && steps != c.end() && epochs->second.origin.source != "file" &&
      epochs->second.origin.source != "default" && epochs->second.origin.source != "checkpoint" &&
      epochs->second.origin.source != detail::kRunRecordOrigin) {  // (the run had it so: said when it started)
    static std::set<std::string> said;  // (once per process: a command reads its options more than once)
    const std::string warning = "trainer.epochs = " + epochs->second.value + " (" + epochs->second.origin.describe() +
                                ") is not used: trainer.max_steps = " + std::to_string(o.max_steps) + " (" +
                                steps->second.origin.describe() + ") sets the run's length; set trainer.max_steps = 0 to "
                                "train by epochs";
    if (said.insert(warning).second) log::warn(warning);
  }
  if (o.work_dir.empty())
    throw Error("trainer.work_dir is empty; name the folder the run folders go in (default: runs)");
  if (!o.resume_from.empty() && o.resume == "auto")
    throw Error("trainer.resume = auto and trainer.resume_from are both set; choose one");
  // (resume_from continues a run from its own weights: init_from was ignored, and resume = auto
  // without a name takes work_dir's newest run, the one just trained, and went on training it)
  if (!o.init_from.empty() && !o.resume_from.empty())
    throw Error("trainer.init_from and trainer.resume_from are both set; choose one: init_from starts a new run from a "
                "checkpoint's weights, resume_from continues that checkpoint's run");
  if (!o.init_from.empty() && o.resume == "auto" && o.name.empty())
    throw Error("trainer.init_from with trainer.resume = auto needs a trainer.name: without one, resume = auto takes the "
                "newest run in " + o.work_dir + ", which may be the run init_from comes from. Name the new run, and give "
                "the same name to resume it");
  // A run's name is one folder in work_dir: not a path, nothing a shell or a file system trips on.
  const bool plain = o.name.size() <= 128 && (o.name.empty() || (std::isalnum(static_cast<unsigned char>(o.name[0])) &&
                     std::all_of(o.name.begin(), o.name.end(), [](char ch) {
                       return std::isalnum(static_cast<unsigned char>(ch)) || ch == '-' || ch == '_' || ch == '.';
                     })));
  if (!plain)
    throw Error("trainer.name = '" + o.name + "' is not a run name: use letters, digits, '-', '_' and '.', starting with a "
                "letter or digit, at most 128 characters (the folder goes in trainer.work_dir)");
  return o;
}

namespace {

/// The choices a run's configuration leaves to Loom (precision and schedule `auto`, the policy
/// --memory-fraction asks for), made; the device it names, checked.
Config automatic_choices(Config config, const PluginRegistry& registry) {
  const Schema core = core_schema();
  auto get = [&](const std::string& key) {
    if (auto v = config.get(key)) return *v;
    return core.find(key)->option.default_value;
  };

  // precision.name = auto, as the seeds: AMP on by default on a GPU, --no-amp gives float32,
  // --allow-tf32 adds TF32. See Note [Default precision].
  check_device(get("trainer.device"));
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
    } else if (!amp) {  // (named, as the choice's origin: "auto (CPU)" after --no-amp hid it)
      why += ", precision.amp = false (--no-amp)";
    }
    if (!registry.find(LOOM_KIND_PRECISION, choice)) {
      log::warn("precision '", choice, "' is not loaded; using fp32");
      choice = "fp32";
    }
    config.set("precision.name", choice, Origin{"auto (" + why + ")", {}, 0});
  }
  // --no-amp beside a precision that is mixed by name: one of the two is a mistake, and the named
  // one would win without a word (the run trained in 16 bits after asking for float32).
  if (const ConfigValue* amp = config.find("precision.amp"); amp && !sdk::parse_bool(amp->value).value_or(true)) {
    const std::string name = get("precision.name");
    if (name.size() > 4 && name.compare(name.size() - 4, 4, "_amp") == 0)
      throw Error("precision.name = " + name + " (" + config.find("precision.name")->origin.describe() +
                  ") trains with autocast, but precision.amp = false (" + amp->origin.describe() +
                  ") asks for float32: drop one of the two (precision.name = auto with --no-amp trains in fp32)");
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

  // --memory-fraction / memory.fraction asks for the fraction_cap policy (in either spelling: a
  // run's config.json records the option's full key).
  if (config.find("memory.fraction") || config.find("memory.fraction_cap.fraction")) {
    auto policies = sdk::parse_list(get("memory.policies"));
    if (std::find(policies.begin(), policies.end(), "fraction_cap") == policies.end()) {
      policies.insert(policies.begin(), "fraction_cap");
      // (a list the user gave keeps naming them: the run's record then holds it as theirs)
      // (one the run's record gave stays the run's record's: the trainer checks which run that was)
      const ConfigValue* given = config.find("memory.policies");
      const Origin origin =
          given == nullptr || given->origin.source == "default" ? Origin{"auto (memory.fraction is set)", {}, 0}
          : given->origin.source == detail::kRunRecordOrigin
              ? given->origin
              : Origin{given->origin.describe() + ", with fraction_cap (memory.fraction is set)", {}, 0};
      config.set("memory.policies", join(policies, ", "), origin);
    }
  }

  return config;
}

}  // namespace

Resolved resolve_run(Config config, const PluginRegistry& registry, bool components) {
  // A base's override is said before anything fails on the value it set (a device, a plugin's
  // name), and of the values as given (an automatic choice does not hide one).
  const Config given = config;
  Schema schema;
  try {
    config = automatic_choices(std::move(config), registry);
    schema = run_schema(config, registry);
  } catch (...) {
    for (const auto& warning : given.base_override_warnings()) log::warn(warning);
    throw;
  }
  for (const auto& warning : given.base_override_warnings(&schema)) log::warn(warning);
  Resolved resolved = validate(config, schema);
  // What `loom train` checks before it builds anything, `loom config show` checks too: the
  // trainer's ranges, and each chosen component's own checks of its options (its factory).
  TrainerOptions::from(resolved);
  if (components) check_components(resolved, registry);
  return resolved;
}

void check_components(const Resolved& resolved, const PluginRegistry& registry) {
  Config config;
  for (const auto& [key, value] : resolved) config.set(key, value.value, value.origin);
  for (const auto& choice : chosen_components(config)) {
    const ComponentInfo& info = registry.require(choice.kind, choice.name);
    registry.check_options(info, detail::component_values(resolved, info));  // its errors name it
  }
}

Config with_run_settings(Config config, const PluginRegistry& registry) {
  const Schema core = core_schema();
  const auto get = [&](const std::string& key) {
    if (auto v = config.get(key)) return *v;
    return core.find(key)->option.default_value;
  };
  if (get("trainer.resume") != "auto" || !get("trainer.resume_from").empty()) return config;
  const fs::path work_dir = home_expanded(get("trainer.work_dir"), /*alone_too=*/true);  // (as validate() expands it for the trainer)
  std::string name = get("trainer.name");
  if (name.empty()) {
    const std::vector<std::string> runs = detail::runs_newest_first(work_dir, /*strict=*/true);
    if (runs.empty()) return config;
    name = runs.front();
  }
  // (a name that is no plain folder name, or a run without a checkpoint: the trainer says what happens)
  if (name.find('/') != std::string::npos || name == "." || name == ".." || CheckpointStore::list_run(work_dir / name).empty())
    return config;
  const fs::path record = work_dir / name / "config.json";
  nlohmann::json manifest;
  try {  // (unreadable or damaged: said first, before what follows from it, a model that differs say)
    manifest = detail::parse_json(read_file(record, int64_t{64} << 20));
  } catch (const std::exception& e) {
    log::warn("resume = auto: ", record.string(), ", the record of the run's settings, cannot be read (",
              printable(detail::json_reason(e), 300), "): this resume runs with the command's own settings (defaults "
              "where it gives none); give the run's -c file and --set values again");
    return config;
  }
  if (!manifest.is_object()) return config;
  // The keys that place the run are this command's; so are those of this machine (its device and
  // threads, the loader's workers, a memory cap of one device, the parallel strategy and the step's
  // CUDA graphs: a run may resume elsewhere, and with another strategy). A dataset's folder is the run's.
  // So is a permission given for one resume (--allow-precision-change: it let every later resume
  // change the precision with a warning, probe).
  const auto this_machines = [](const std::string& key) {
    static const std::set<std::string> keys = {"trainer.name", "trainer.work_dir", "trainer.resume", "trainer.resume_from",
                                               "trainer.init_from", "trainer.device", "trainer.threads",
                                               "trainer.peak_tflops", "memory.device_memory_limit", "memory.snapshot",
                                               "memory.snapshot_on_oom", "data.num_workers", "data.prefetch",
                                               "data.pin_memory", "precision.allow_precision_change"};
    return keys.count(key) > 0 || key.rfind("parallel.", 0) == 0 || key.rfind("step.", 0) == 0;
  };
  // The command's value of `key`, or of its short spelling (data.limit_train for
  // data.fashion_mnist.limit_train), where the command gives one (not a default).
  const auto mine = [&](const std::string& key) -> const ConfigValue* {
    const size_t first = key.find('.'), last = key.rfind('.');
    for (const std::string& k : {key, first != last ? key.substr(0, first) + key.substr(last) : key})
      if (const ConfigValue* v = config.find(k); v != nullptr && v->origin.source != "default") return v;
    return nullptr;
  };
  const auto given = [&](const std::string& key) { return mine(key) != nullptr; };
  // Keys that together set one thing are the command's where it gives one of them otherwise than
  // the run had it: its epochs with the run's max_steps would be overridden (the run's epochs beside
  // its max_steps only count at max_steps = 0, as the command then asks); its --no-amp with the
  // run's bf16_amp refused; its policies with the run's memory fraction kept fraction_cap for good.
  // (The same value, from the same -c file, is the run's own: it blocks nothing.)
  const auto changed = [&](const std::string& key) {
    const ConfigValue* value = mine(key);
    if (value == nullptr) return false;
    const auto it = manifest.find(key);
    const bool recorded = it != manifest.end() && it->is_object() && it->contains("value") && (*it)["value"].is_string();
    return !recorded || (*it)["value"].get<std::string>() != value->value;
  };
  std::set<std::string> its_own;
  if (changed("trainer.epochs")) its_own.insert("trainer.max_steps");
  for (const std::vector<std::string>& group :
       {std::vector<std::string>{"precision.name", "precision.amp", "precision.allow_tf32"},
        std::vector<std::string>{"memory.policies", "memory.fraction_cap.fraction"}})
    if (std::any_of(group.begin(), group.end(), changed)) its_own.insert(group.begin(), group.end());
  Config candidate = config;
  std::vector<std::pair<std::string, std::string>> taken;
  for (const auto& [key, entry] : manifest.items()) {
    if (!entry.is_object() || !entry.contains("value") || !entry["value"].is_string() || !entry.contains("origin") ||
        !entry["origin"].is_string() || this_machines(key) || its_own.count(key) || given(key))
      continue;
    const std::string origin = entry["origin"].get<std::string>();
    if (origin == "default" || origin.rfind("auto (", 0) == 0) continue;  // (chosen here again, as the run chose it)
    try {  // (a value Loom never writes, a control character, is left out: the trainer's comparison says it)
      candidate.set(key, entry["value"].get<std::string>(), Origin{detail::kRunRecordOrigin, record, 0});
    } catch (const std::exception&) {
      continue;
    }
    taken.emplace_back(key, entry["value"].get<std::string>());
  }
  if (taken.empty()) return config;
  const auto listed = [&] {
    std::vector<std::string> out;
    for (const auto& [key, value] : taken)
      if (out.size() < 10) out.push_back(key + " = " + printable(value, 80));
    return join(out, ", ") + (taken.size() > 10 ? " and " + std::to_string(taken.size() - 10) + " more" : std::string());
  };
  // A key the chosen components do not have is left out (a model chosen anew; an option an older
  // Loom had): the selection itself comes from the run where this command leaves it, so its
  // components are the run's.
  Schema schema;
  try {
    const log::Quiet quiet(true);  // (resolve_run says the automatic choices' warnings, once)
    schema = run_schema(automatic_choices(candidate, registry), registry);
  } catch (const std::exception& e) {  // (a component of the run not loaded now: one a --plugin-dir gave)
    try {  // (an error of the command's own, with or without the run's settings, is its own)
      const log::Quiet quiet(true);
      run_schema(automatic_choices(config, registry), registry);
    } catch (const std::exception&) {
      throw;
    }
    std::string why = e.what();
    while (!why.empty() && why.back() == '.') why.pop_back();
    throw Error("resume = auto takes the settings " + (work_dir / name).string() + " was given (its config.json) where " +
                "this command leaves them out (" + listed() + "), and with them: " + why +
                ". Give what differs here on the command line (--set KEY=VALUE, --plugin-dir FOLDER)");
  }
  std::vector<std::string> said;
  for (const auto& [key, value] : taken) {
    if (schema.find(key) == nullptr) continue;
    config.set(key, value, Origin{detail::kRunRecordOrigin, record, 0});
    said.push_back(key + " = " + printable(value, 80));
  }
  if (!said.empty())
    log::info("resume = auto: as ", (work_dir / name).string(), " was given (its config.json), where this command leaves them out: ",
              join(said, ", "));
  return config;
}

}  // namespace loom::core
