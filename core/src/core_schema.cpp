// The core's configuration keys: every section and key that is not a component's option; the
// schema of a run (the core's keys and each chosen component's options).
// Components add their own keys to the section that selects them ([model], [data], ...).
#include <loom/core/config.hpp>
#include <loom/core/kinds.hpp>
#include <loom/core/plugin_registry.hpp>
#include <loom/core/text.hpp>

#include <loom/sdk/options.hpp>

#include <algorithm>
#include <map>
#include <set>

namespace loom::core {

namespace {

OptionSpec key(uint32_t type, const char* name, const char* def, const char* help,
               const char* choices = "") {
  return OptionSpec{name, type, def, help, choices, std::nullopt, std::nullopt};
}

/// An int or float key with its valid range, inclusive.
OptionSpec key(uint32_t type, const char* name, const char* def, double min, double max, const char* help) {
  return OptionSpec{name, type, def, help, "", min, max};
}

constexpr double kHuge = 1e12;  // a count no run reaches: steps, intervals

}  // namespace

Schema core_schema() {
  Schema s;
  s.add("trainer", "trainer",
        {
            key(LOOM_OPTION_STRING, "name", "", "run name; the run goes to <work_dir>/<name> (default: from the time)"),
            key(LOOM_OPTION_STRING, "work_dir", "runs", "folder of runs"),
            key(LOOM_OPTION_STRING, "device", "auto", "auto (first GPU, else CPU), cpu, cuda, cuda:N"),
            key(LOOM_OPTION_INT, "seed", "0", 0, 9.2e18, "seed of every random number generator"),
            key(LOOM_OPTION_INT, "threads", "0", 0, 4096, "CPU threads of LibTorch's operators (0: LibTorch's default, the physical cores)"),
            key(LOOM_OPTION_INT, "epochs", "7", 0, 1e6, "passes over the training data (when max_steps is 0)"),
            key(LOOM_OPTION_INT, "max_steps", "0", 0, kHuge, "optimizer steps to train; 0: as many as `epochs` take"),
            key(LOOM_OPTION_INT, "batch_size", "128", 1, 16777216, "global batch: samples per optimizer step"),
            key(LOOM_OPTION_INT, "gradient_accumulation_steps", "1", 1, 65536, "micro-batches per optimizer step"),
            key(LOOM_OPTION_STRING, "optimizer", "adamw", "optimizer plugin (adamw, sgd; its options in [optimizer])"),
            key(LOOM_OPTION_FLOAT, "lr", "0.002", 1e-12, 10, "peak learning rate; the schedule scales it per step"),
            key(LOOM_OPTION_STRING, "schedule", "auto",
                "learning-rate schedule plugin (constant, warmup_cosine, warmup_linear, step; its options in "
                "[schedule]); auto: warmup_cosine when use_scheduler is true, else constant"),
            key(LOOM_OPTION_BOOL, "use_scheduler", "true", "with schedule = auto: warm-up then cosine decay (false: constant)"),
            key(LOOM_OPTION_FLOAT, "clip_grad_norm", "1.0", 0, 1e6, "clip gradients to this global norm; 0 turns clipping off"),
            key(LOOM_OPTION_BOOL, "device_step", "true",
                "decide on the device whether a step with non-finite gradients is skipped (fused optimizer with "
                "found-inf; the host does not wait before the update); false: check on the host first"),
            key(LOOM_OPTION_INT, "stop_after_skipped", "100", 0, kHuge,
                "stop the run with an error when this many steps in a row had non-finite gradients (none of them "
                "updated the weights); 0: never"),
            key(LOOM_OPTION_INT, "reference_batch", "0", 0, 16777216, "linear LR scaling: lr x batch_size / reference_batch; 0 turns it off"),
            key(LOOM_OPTION_LIST, "callbacks", "progress, jsonl, tensorboard, checkpoint, best, memory_summary",
                "callback plugins, called in this order (their options in [callback.<name>]); add early_stopping "
                "to stop when the validation metric stops improving"),
            key(LOOM_OPTION_INT, "eval_every", "0", 0, kHuge, "evaluate every N steps; 0: at the end of each epoch"),
            key(LOOM_OPTION_INT, "log_every", "10", 1, kHuge, "write metrics every N steps"),
            key(LOOM_OPTION_FLOAT, "peak_tflops", "0", 0, 1e6,
                "the device's dense peak in TFLOP/s at the run's precision, for the model FLOPs utilization (MFU) "
                "in the log; 0: known cards by name (H100, H200, A100), none on CPU"),
            key(LOOM_OPTION_INT, "checkpoint_every", "0", 0, kHuge, "save every N steps; 0: at each evaluation"),
            key(LOOM_OPTION_INT, "keep_last", "3", 0, 1e6, "step checkpoints kept (the newest; 0: all), besides the best"),
            key(LOOM_OPTION_STRING, "best_metric", "auto",
                "metric that picks the best checkpoint, in the direction the model declares for it (loss: lower is "
                "better); auto: the model's first declared metric, else loss"),
            key(LOOM_OPTION_ENUM, "resume", "none", "auto: resume from the latest checkpoint in the run folder", "none|auto"),
            key(LOOM_OPTION_STRING, "resume_from", "", "a checkpoint folder to resume from"),
            key(LOOM_OPTION_STRING, "init_from", "",
                "a checkpoint (folder or .safetensors) whose model weights a new run starts from, with a fresh optimizer "
                "and step 1 (fine-tuning, a second stage); the model's settings may differ where its tensors keep their shapes"),
        });
  s.add("model", "model", {key(LOOM_OPTION_STRING, "name", "lightweight_transformer", "model plugin")});
  s.add("data", "data",
        {
            key(LOOM_OPTION_STRING, "name", "fashion_mnist", "dataset plugin"),
            key(LOOM_OPTION_INT, "num_workers", "-1", -1, 64,
                "loader threads; -1: automatic (none on CPU, where the operators already use every core; 2 on a GPU)"),
            key(LOOM_OPTION_INT, "prefetch", "2", 1, 64, "batches each loader thread prepares ahead"),
            key(LOOM_OPTION_BOOL, "pin_memory", "true", "page-locked host batches and non-blocking copies (CUDA)"),
            key(LOOM_OPTION_BOOL, "shuffle", "true", "reshuffle the training data each epoch"),
            key(LOOM_OPTION_FLOAT, "validation_fraction", "0.1", 0, 0.999,
                "share of the training split held out for validation (fixed by trainer.seed) when the dataset has "
                "no validation split; it picks the best checkpoint and drives early stopping, the test split is "
                "evaluated at the end. 0: evaluate on the test split during training"),
        });
  s.add("precision", "precision",
        {
            key(LOOM_OPTION_STRING, "name", "auto", "precision plugin; auto: AMP on a GPU, fp32 on CPU"),
            key(LOOM_OPTION_BOOL, "amp", "true", "with name=auto: mixed precision on a GPU (false: fp32)"),
            key(LOOM_OPTION_BOOL, "allow_tf32", "false", "with name=auto: TF32 matmuls on CUDA"),
            key(LOOM_OPTION_BOOL, "allow_precision_change", "false", "resume under a different precision"),
        });
  s.add("memory", "memory",
        {
            key(LOOM_OPTION_LIST, "policies", "", "memory policies, applied in order"),
            key(LOOM_OPTION_BYTES, "device_memory_limit", "0",
                "cap the device's memory at this size; on CPU the CPU then behaves as a device of that size (0: no cap)"),
            key(LOOM_OPTION_STRING, "snapshot", "", "CUDA: write a memory snapshot (pytorch.org/memory_viz) here at the end"),
            key(LOOM_OPTION_BOOL, "snapshot_on_oom", "false", "CUDA: write <run>/oom_snapshot.pickle when out of memory cannot be recovered"),
            key(LOOM_OPTION_BOOL, "estimate", "true", "probe twice at start and report the estimate's error against the measured peak"),
        });
  s.add("parallel", "parallel",
        {
            key(LOOM_OPTION_STRING, "name", "single", "parallel strategy plugin"),
            key(LOOM_OPTION_STRING, "bucket_mb", "auto",
                "several ranks: gradients are summed in buckets of this many MiB as backward completes them, "
                "overlapping communication with backward; 0: one reduction after backward; auto: 25 on CUDA, 0 on "
                "the CPU (where Gloo's threads take the cores backward needs: bench/ddp_cpu.py)"),
        });
  s.add("step", "step",
        {
            key(LOOM_OPTION_BOOL, "cuda_graph", "false",
                "CUDA: capture the whole training step (forward, backward, update) as a CUDA graph and replay it, one "
                "launch per step instead of hundreds; needs fixed shapes and trainer.device_step"),
            key(LOOM_OPTION_INT, "cuda_graph_warmup", "3", 1, 1000,
                "eager steps before the step is captured (after the start and after each new plan)"),
        });
  return s;
}

// ---- Schema ----------------------------------------------------------------------------------

void Schema::add(const std::string& section, const std::string& owner,
                 const std::vector<OptionSpec>& options) {
  for (const auto& option : options) {
    const std::string key = section + "." + option.key;
    if (auto it = keys_.find(key); it != keys_.end())
      throw Error("key '" + key + "' is defined by both " + it->second.owner + " and " + owner +
                  "; these two cannot be used together");
    keys_[key] = KeySpec{key, option, owner};
  }
}

void Schema::add_shorthand(const std::string& key, const std::string& canonical) {
  auto& targets = shorthands_[key];
  if (std::find(targets.begin(), targets.end(), canonical) == targets.end()) targets.push_back(canonical);
}

void Schema::add_foreign(const std::string& key, const std::string& why) { foreign_.emplace(key, why); }

const KeySpec* Schema::find(const std::string& key) const {
  auto it = keys_.find(key);
  return it == keys_.end() ? nullptr : &it->second;
}

std::vector<std::string> Schema::shorthand(const std::string& key) const {
  auto it = shorthands_.find(key);
  return it == shorthands_.end() ? std::vector<std::string>{} : it->second;
}

const std::string* Schema::foreign(const std::string& key) const {
  auto it = foreign_.find(key);
  return it == foreign_.end() ? nullptr : &it->second;
}

std::string Schema::foreign_section_problem(const std::string& key) const {
  const std::string section = key.substr(0, key.rfind('.'));
  std::vector<std::string> here, components;  // (the keys of that section; every component's section)
  for (const auto& [k, why] : foreign_) {
    const std::string s = k.substr(0, k.rfind('.'));
    if (s == section) here.push_back(k);
    if (s.find('.') != std::string::npos && std::find(components.begin(), components.end(), s) == components.end())
      components.push_back(s);
  }
  if (!here.empty()) {
    const auto close = closest(key, here);
    return "unknown key '" + key + "' of " + *foreign(here.front()) +
           (close ? "; did you mean '" + *close + "'?" : "; its keys are " + join(here, ", "));
  }
  const size_t dot = section.find('.');
  const KindInfo* kind = nullptr;
  for (const auto& k : kinds())
    if (dot != std::string::npos && k.section == std::string_view(section).substr(0, dot)) kind = &k;
  if (kind == nullptr) return "";
  for (const auto& s : sections())
    if (s.find('.') != std::string::npos) components.push_back(s);
  const auto close = closest(section, components);
  return "[" + section + "] (key '" + key + "') is the section of " + std::string(kind->noun) + " '" + section.substr(dot + 1) +
         "', which no loaded plugin gives" + (close ? "; did you mean [" + *close + "]?" : "") +
         " (`loom plugins` lists the loaded components, and the files it refused with why)";
}

std::vector<std::string> Schema::sections() const {
  std::vector<std::string> out;
  for (const auto& [key, spec] : keys_) {
    const std::string s = key.substr(0, key.rfind('.'));  // (every schema key has a section)
    if (std::find(out.begin(), out.end(), s) == out.end()) out.push_back(s);
  }
  return out;
}

std::string component_section(uint32_t kind, const std::string& name) {
  const KindInfo* k = find_kind(kind);
  return (k ? std::string(k->section) : kind_name(kind)) + "." + name;
}

std::vector<ComponentChoice> chosen_components(const Config& config) {
  const Schema core = core_schema();
  auto value = [&](const std::string& key) {
    if (auto v = config.get(key)) return *v;
    const KeySpec* spec = core.find(key);
    return spec ? spec->option.default_value : std::string();
  };
  std::vector<ComponentChoice> out;
  for (const KindInfo& kind : kinds()) {
    const std::string key(kind.select_key);
    const std::vector<std::string> names = kind.many ? sdk::parse_list(value(key)) : std::vector<std::string>{value(key)};
    std::set<std::string> seen;
    if (!kind.many && names.front().empty())  // `--set model.name=`: no choice, not "the default"
      throw Error(key + " is empty; name the " + std::string(kind.noun) + " to use (`loom plugins` lists them), or " +
                  "remove the setting for the default");
    for (const auto& name : names) {
      if (name.empty()) continue;
      if (!seen.insert(name).second)
        throw Error(key + " lists '" + name + "' twice (" + value(key) + "); each " + std::string(kind.noun) +
                    " is used once: remove one");
      out.push_back({kind.id, component_section(kind.id, name), name, key});
    }
  }
  return out;
}

Schema run_schema(const Config& config, const PluginRegistry& registry) {
  Schema schema = core_schema();
  const auto chosen = chosen_components(config);
  auto owner = [](const ComponentInfo& c) { return std::string(find_kind(c.kind)->noun) + " '" + c.name + "'"; };
  for (const auto& choice : chosen) {
    const ComponentInfo& info = registry.require(choice.kind, choice.name);
    schema.add(choice.section, owner(info), info.options);
    const std::string kind_section(find_kind(choice.kind)->section);
    for (const auto& option : info.options)
      if (!schema.find(kind_section + "." + option.key))
        schema.add_shorthand(kind_section + "." + option.key, choice.section + "." + option.key);
  }
  // The options of every loaded component the run does not select: ignored, with a warning. A
  // section's short key may be an option of several (model.vocab_size): each is named.
  std::map<std::string, std::pair<std::vector<std::string>, std::string>> short_keys;  // key -> owners, the choice made
  for (const auto& info : registry.components()) {
    const KindInfo* kind = find_kind(info.kind);
    if (kind == nullptr) continue;
    const bool selected = std::any_of(chosen.begin(), chosen.end(), [&](const ComponentChoice& c) {
      return c.kind == info.kind && c.name == info.name;
    });
    if (selected) continue;
    const std::string key(kind->select_key);
    const std::string now = config.get(key).value_or(core_schema().find(key)->option.default_value);
    const std::string choice = key + " = " + (now.empty() ? "(none)" : now);
    const std::string section = component_section(info.kind, info.name);
    for (const auto& option : info.options) {
      schema.add_foreign(section + "." + option.key, owner(info) + ", which this run does not select (" + choice + ")");
      const std::string short_key = std::string(kind->section) + "." + option.key;
      if (!schema.find(short_key) && schema.shorthand(short_key).empty()) {
        auto& [owners, made] = short_keys[short_key];
        owners.push_back(owner(info));
        made = choice;
      }
    }
  }
  for (const auto& [short_key, owned] : short_keys) {
    const auto& [owners, made] = owned;
    schema.add_foreign(short_key, owners.size() == 1 ? owners.front() + ", which this run does not select (" + made + ")"
                                                     : join(owners, " and ") + (owners.size() == 2 ? ", neither of which" : ", none of which") +
                                                           " this run selects (" + made + ")");
  }
  return schema;
}

}  // namespace loom::core
