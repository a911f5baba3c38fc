// Checkpoint IO of a run: what a checkpoint holds (model, optimizer, precision, schedule, each
// callback's state, RNG, data position, plan; state.json), saving it, and loading it back after
// checking that it fits this run (ResumeRefused when it does not). The files: checkpoint.cpp.
#include <loom/core/checkpoint.hpp>
#include <loom/core/log.hpp>
#include <loom/core/safetensors.hpp>
#include <loom/core/text.hpp>
#include <loom/core/files.hpp>
#include <loom/core/trainer.hpp>
#include "trainer_internal.hpp"

#include <loom/sdk/version.hpp>
#include <ATen/core/grad_mode.h>
#include <torch/nn/module.h>
#include <nlohmann/json.hpp>

#include <cmath>

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace loom::core {

using namespace detail;

namespace {

/// Gives each callback of this run its state from a checkpoint. A callback the checkpoint has no
/// state for (added on resume) starts fresh; the state of one this run does not select stays in
/// the checkpoint.
void load_callback_states(const std::vector<std::pair<std::string, std::shared_ptr<sdk::Callback>>>& callbacks,
                          const json& saved, const sdk::TensorMap& extra, const fs::path& dir) {
  for (const auto& [name, callback] : callbacks) {
    if (!saved.contains(name)) {
      log::info("callback '", name, "' has no state in ", dir.string(), "; it starts fresh");
      continue;
    }
    sdk::State state;
    for (const auto& [k, v] : saved[name].items()) {
      if (!v.is_string())
        throw Error((dir / "state.json").string() + ": the state of callback '" + name + "' is damaged (key '" + k +
                    "' is not text)");
      state.text[k] = v.get<std::string>();
    }
    const std::string prefix = "callback." + name + ".";
    for (const auto& [k, t] : extra)
      if (k.rfind(prefix, 0) == 0) state.tensors[k.substr(prefix.size())] = t;
    in_phase("restoring the state of callback '" + name + "' from " + dir.string(), [&] { callback->load_state_dict(state); });
  }
}

}  // namespace

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
  s["log_window"] = {{"steps", window_.steps}, {"loss", window_.loss}, {"samples", window_.samples},
                     {"seconds", window_.seconds}, {"metrics", window_.metrics}};
  json callbacks = json::object();
  for (const auto& [name, callback] : callbacks_) callbacks[name] = callback->state_dict().text;
  s["callbacks"] = callbacks;
  return s.dump(2) + "\n";
}

fs::path Trainer::save_checkpoint() {
  sdk::TensorMap extra;
  const sdk::State optimizer = optimizer_->state_dict();
  for (const auto& [k, t] : optimizer.tensors) extra["optimizer." + k] = t;
  const sdk::State precision = precision_->state_dict();
  for (const auto& [k, t] : precision.tensors) extra["precision." + k] = t;
  for (const auto& [k, t] : schedule_->state_dict().tensors) extra["schedule." + k] = t;
  for (const auto& [name, callback] : callbacks_)
    for (const auto& [k, t] : callback->state_dict().tensors) extra["callback." + name + "." + k] = t;
  extra["rng.cpu"] = cpu_generator().get_state();
  if (device_.is_cuda()) extra["rng.device"] = device_generator(device_).get_state();
  const fs::path dir = checkpoints_->save(step_, model_tensors(), extra, state_json(), options_.keep_last);
  notify("on_checkpoint_saved", [&](sdk::Callback& c, sdk::RunContext& run) { c.on_checkpoint_saved(run, dir); });
  return dir;
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
  load_callback_states(callbacks_, s.contains("callbacks") ? s["callbacks"] : json::object(), c.extra, dir);
  if (auto it = c.extra.find("rng.cpu"); it != c.extra.end()) cpu_generator().set_state(it->second);
  if (auto it = c.extra.find("rng.device"); it != c.extra.end() && device_.is_cuda()) device_generator(device_).set_state(it->second);

  step_ = s.value("step", int64_t{0});
  skipped_steps_ = s.value("skipped_steps", int64_t{0});
  const sdk::BatchPlan saved{s["plan"].value("micro_batch", int64_t{1}), s["plan"].value("accumulation", int64_t{1}),
                             s["plan"].value("world_size", int64_t{1})};
  if (saved.global() != plan_.global())
    log::warn("the checkpoint was trained with global batch ", saved.global(), ", this run uses ", plan_.global());
  train_loader_->seek(DataLoader::Position{s["loader"].value("epoch", int64_t{0}), s["loader"].value("offset", int64_t{0})});
  window_ = {};
  if (const auto w = s.find("log_window"); w != s.end() && w->is_object()) {
    window_.steps = w->value("steps", int64_t{0});
    window_.loss = w->value("loss", 0.0);
    window_.samples = w->value("samples", int64_t{0});
    window_.seconds = w->value("seconds", 0.0);
    if (w->contains("metrics")) window_.metrics = (*w)["metrics"].get<std::map<std::string, double>>();
    if (window_.steps < 0 || window_.samples < 0 || !std::isfinite(window_.loss) || !std::isfinite(window_.seconds))
      throw Error((dir / "state.json").string() + ": log_window holds impossible values; the checkpoint is damaged");
  }
  resumed_at_ = step_;
  resumed_from_ = dir;
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

void Trainer::load_weights(const fs::path& checkpoint) {
  if (fs::is_directory(checkpoint)) {
    const Checkpoint c = CheckpointStore::load(checkpoint);
    restore_model(c.model, checkpoint.string());
  } else {
    restore_model(load_safetensors(checkpoint), checkpoint.string());
  }
}

}  // namespace loom::core
