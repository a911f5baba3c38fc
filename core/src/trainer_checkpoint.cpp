// Checkpoint IO of a run: what a checkpoint holds (model, optimizer, precision, schedule, each
// callback's state, RNG, data position, plan; state.json), saving it, and loading it back after
// checking that it fits this run (ResumeRefused when it does not). The files: checkpoint.cpp.
#include <loom/core/checkpoint.hpp>
#include <loom/core/log.hpp>
#include <loom/core/safetensors.hpp>
#include <loom/core/stop_signals.hpp>
#include <loom/core/text.hpp>
#include <loom/core/files.hpp>
#include <loom/core/trainer.hpp>
#include "json_limits.hpp"
#include "saved_state.hpp"
#include "step_graph.hpp"
#include "trainer_internal.hpp"

#include <loom/sdk/version.hpp>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/isnan.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/stack.h>
#include <torch/nn/module.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <random>

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace loom::core {
using namespace detail;
namespace {

bool same_value(const OptionSpec& spec, const std::string& a, const std::string& b) {  // ("2" and "2.0", "yes" and "true")
  if (spec.type == LOOM_OPTION_FLOAT) return sdk::parse_float(a) == sdk::parse_float(b) && sdk::parse_float(a).has_value();
  if (spec.type == LOOM_OPTION_INT) return sdk::parse_int(a) == sdk::parse_int(b) && sdk::parse_int(a).has_value();
  if (spec.type == LOOM_OPTION_BOOL) return sdk::parse_bool(a) == sdk::parse_bool(b) && sdk::parse_bool(a).has_value();
  return a == b;
}

}  // namespace

sdk::TensorMap Trainer::model_tensors() const {
  sdk::TensorMap out;
  check_module_holds(model_name_, model_->module(), parameters_.all());  // (what is written is what trained)
  for (const auto& item : model_->module().named_parameters()) out["param." + item.key()] = item.value();
  for (const auto& item : model_->module().named_buffers()) out["buffer." + item.key()] = item.value();
  return out;
}

namespace {

/// restore_model's refusal of a tensor whose shape is not the model's (load_checkpoint tells a
/// change of the data from damage by it).
class ShapeDiffers : public Error {
 public:
  ShapeDiffers(const std::string& what, std::string detail) : Error(what), detail(std::move(detail)) {}
  std::string detail;  ///< "tensor 'x' has shape [4, 32] in the checkpoint, [5, 32] in this model"
};

}  // namespace

namespace detail {

// In slices of a million values: isfinite holds |x| and three masks at once, 1.75 times the
// tensor, which for a large embedding was the run's peak (a save measured 1.3 GiB where the steps
// peaked at 495 MiB). A boolean of one element, on the tensor's device (no read of it here).
at::Tensor all_finite(const at::Tensor& t, bool nan_only) {
  constexpr int64_t kSlice = int64_t{1} << 20;
  const at::Tensor flat = t.detach().reshape({-1});
  std::vector<at::Tensor> slices;
  for (int64_t from = 0; from < flat.numel(); from += kSlice) {
    const at::Tensor part = flat.narrow(0, from, std::min(kSlice, flat.numel() - from));
    slices.push_back(nan_only ? at::isnan(part).any().logical_not() : at::isfinite(part).all());
  }
  return slices.empty() ? at::ones({}, flat.options().dtype(at::kBool)) : at::stack(slices).all();
}

}  // namespace detail

std::string Trainer::nonfinite_weights() const {
  // A parameter may hold neither NaN nor an infinity; a buffer may hold infinities (a mask's
  // -inf), not NaN: as a resume checks them (restore_model).
  at::NoGradGuard no_grad;
  std::vector<std::string> names;
  std::vector<at::Tensor> fine;
  for (const auto& item : model_->module().named_parameters())
    if (at::isFloatingType(item.value().scalar_type())) {
      names.push_back("parameter '" + item.key() + "' holds NaN or infinite values");
      fine.push_back(detail::all_finite(item.value(), /*nan_only=*/false));
    }
  for (const auto& item : model_->module().named_buffers())
    if (at::isFloatingType(item.value().scalar_type())) {
      names.push_back("buffer '" + item.key() + "' holds NaN");
      fine.push_back(detail::all_finite(item.value(), /*nan_only=*/true));
    }
  if (fine.empty()) return {};
  const at::Tensor read = at::stack(fine).to(at::kCPU);  // one read of the device
  const bool* flags = read.data_ptr<bool>();
  for (size_t i = 0; i < names.size(); ++i)
    if (!flags[i]) return names[i];
  return {};
}

void Trainer::check_weights_before_saving(const std::string& what) const {
  check_run_folder();  // (never at a moved run folder's old path)
  // NaN weights never recover, and a resume refuses them as damage: written, pruning would delete good checkpoints.
  const std::string bad = nonfinite_weights();
  if (bad.empty()) return;
  throw Error("not writing " + what + " of step " + std::to_string(step_) + ": the model's " + bad +
              ", written by an update or a forward (a step with non-finite gradients updates nothing), and the run cannot "
              "recover from them; the run stops here, its older checkpoints kept. Lower trainer.lr, or "
              "clip the gradients (trainer.clip_grad_norm); if it happens at any rate, look at optimizer '" +
              options_.optimizer + "' and the callbacks that change weights");
}

namespace {
/// A component's state text as state.json holds it: UTF-8 (JSON holds nothing else), or an error
/// that names the component (a callback's bytes failed the checkpoint as "callback 'checkpoint':
/// [json.exception.type_error.316] invalid UTF-8 byte", the first checkpoint of the run lost).
const sdk::TextMap& utf8_state(const std::string& who, const sdk::TextMap& text) {
  for (const auto& [key, value] : text)
    for (const std::string* part : {&key, &value})
      if (const auto bad = invalid_utf8(*part))
        throw Error("the state_dict of " + who + " has " + (part == &key ? "a key" : "the value of '" + printable(key, 80) + "'") +
                    " that is not UTF-8 text (byte " + std::to_string(*bad) + "); a state's text is saved in state.json, "
                    "which holds UTF-8 only: write bytes as hex or base64, or as a tensor of the state");
  return text;
}
}  // namespace

std::string Trainer::state_json() const {
  json s;
  s["format"] = 1;
  s["loom_version"] = LOOM_SDK_VERSION;
  s["step"] = step_;
  s["total_steps"] = total_steps_;
  s["device"] = c10::DeviceTypeName(device_.type(), /*lower_case=*/true);  // (loom eval: the precision's device)
  s["skipped_steps"] = skipped_steps_;
  const auto position = train_loader_->position();
  // The offset is into this rank's share of the epoch; "ranks" says how many shares there were
  // (the plan's world_size counts devices, several per rank with data_parallel).
  s["loader"] = {{"epoch", position.epoch}, {"offset", position.offset}, {"seed", options_.seed}, {"ranks", parallel_->world_size()}};
  s["plan"] = {{"micro_batch", plan_.micro_batch}, {"accumulation", plan_.accumulation}, {"world_size", plan_.world_size}};
  if (plan_after_oom_)
    s["plan"]["after_oom"] = {{"config", config_key()}, {"device", memory_identity()}, {"accumulation", options_.accumulation}};
  s["schedule"] = {{"name", options_.schedule}, {"base_lr", base_lr_}, {"step", step_},
                   {"state", utf8_state("schedule '" + options_.schedule + "'", schedule_->state_dict().text)}};
  const sdk::State optimizer = optimizer_->state_dict();
  s["optimizer"] = utf8_state("optimizer '" + options_.optimizer + "'", optimizer.text);
  const sdk::State precision = precision_->state_dict();
  s["precision"] = {{"name", value_of(config_, "precision.name")},
                    {"manifest", utf8_state("precision '" + precision_name_ + "' (its manifest)", precision_->manifest())},
                    {"state", utf8_state("precision '" + precision_name_ + "'", precision.text)}};
  s["model"] = {{"name", value_of(config_, "model.name")}, {"config", section("model")}};
  s["data"] = {{"name", value_of(config_, "data.name")}, {"config", section("data")}, {"sizes", json::parse(data_sizes_json())}};
  s["log_window"] = {{"steps", window_.steps}, {"loss", window_.loss}, {"samples", window_.samples},
                     {"terms", window_.terms}, {"seconds", window_.seconds}, {"metrics", window_.metrics}};
  json callbacks = json::object();
  for (const auto& [name, callback] : callbacks_) {
    const auto who = [&] { return "callback '" + name + "' (state_dict)"; };
    callbacks[name] = utf8_state("callback '" + name + "'", as_component(who, name, [&] { return callback->state_dict(); }).text);
  }
  for (const auto& [name, text] : unselected_callback_text_)  // (not selected now: kept for a run that selects it again)
    if (!callbacks.contains(name)) callbacks[name] = text;
  s["callbacks"] = callbacks;
  if (evaluation_cut_at_ == step_) s["evaluation_pending"] = true;
  // (its own per save: the weights files record state.json's checksum, alike in runs unlike in weights)
  s["save"] = std::to_string((uint64_t{std::random_device{}()} << 32) | std::random_device{}());
  return s.dump(2) + "\n";
}

fs::path Trainer::save_checkpoint() {
  flush_window();  // the skipped steps and the window's sums are part of the state
  stop_if_skipping();  // (their count read now: a run that stops writes no checkpoint, prunes none)
  window_saved_at_ = window_.steps > 0 ? step_ : -1;
  // Rank 0 writes; every rank holds the same state (the weights were broadcast and every update
  // is the same sum), so the others only name the folder rank 0 writes.
  check_weights_before_saving("the checkpoint");  // (on every rank: they stop together)
  if (parallel_->rank() != 0) return run_dir_ / "checkpoints" / step_dir_name(step_);
  // Since resuming, no update had finite gradients: this state is the resumed checkpoint's at
  // best, and perhaps damaged; writing it could let pruning delete the good checkpoints.
  if (resumed_at_ >= 0 && step_ > resumed_at_ && skipped_steps_ - skipped_at_resume_ == step_ - resumed_at_) {
    log::warn("not saving a checkpoint of step ", step_, ": no step since resuming at step ", resumed_at_,
              " had finite gradients; ", resumed_from_.string(), " stays the newest checkpoint");
    return resumed_from_;
  }
  sdk::TensorMap extra;
  // A state's tensor that is not one is named with its component (the writer's own error said
  // neither, and blamed the disk).
  const auto add = [&](const std::string& who, const std::string& prefix, const sdk::State& state) {
    for (const auto& [k, t] : state.tensors) {
      if (invalid_utf8(k))  // (the safetensors header is JSON too)
        throw Error("the state_dict of " + who + " has a tensor key that is not UTF-8 text; a key is UTF-8");
      if (!t.defined())
        throw Error(who + "'s state_dict() gives tensor '" + k + "' undefined: a state holds defined tensors only (leave "
                    "out what it does not have)");
      extra[prefix + k] = t;
    }
  };
  add("optimizer '" + options_.optimizer + "'", "optimizer.", optimizer_->state_dict());
  add("precision '" + precision_name_ + "'", "precision.", precision_->state_dict());
  add("schedule '" + options_.schedule + "'", "schedule.", schedule_->state_dict());
  for (const auto& [name, callback] : callbacks_)
    add("callback '" + name + "'", "callback." + name + ".",
        as_component([&] { return "callback '" + name + "' (state_dict)"; }, name, [&] { return callback->state_dict(); }));
  for (const auto& [key, tensor] : unselected_callback_tensors_) extra.emplace(key, tensor);
  extra["rng.cpu"] = cpu_generator().get_state();
  if (device_.is_cuda()) extra["rng.device"] = device_generator(device_).get_state();
  const fs::path dir = checkpoints_->save(step_, model_tensors(), extra, state_json(), options_.keep_last);
  note_checkpoint_written();  // (a second Ctrl-C from here on says that this one stands)
  notify("on_checkpoint_saved", [&](sdk::Callback& c, sdk::RunContext& run) { c.on_checkpoint_saved(run, dir); });
  return dir;
}

void Trainer::load_checkpoint(const fs::path& dir) {
  const Checkpoint c = CheckpointStore::load(dir);
  // Another model's checkpoint is named as such before its fields are checked against this run's
  // data (a recommender's loader offset is no damage of a transformer's checkpoint).
  try {
    const json j = detail::parse_json<json>(c.state_json);
    if (j.contains("model") && j["model"].is_object() && j["model"].contains("name") && j["model"]["name"].is_string() &&
        j["model"]["name"].get<std::string>() != value_of(config_, "model.name"))
      check_model_config(j["model"]["name"].get<std::string>(), {}, dir.string());
  } catch (const json::exception&) {
  }  // parse_state_json names what is wrong with it
  const std::vector<std::string> data_changes = changed_data(c.state_json);
  // Every field is read with its type and range before anything changes: a damaged file leaves
  // the run as it was (and --resume auto falls back to an older checkpoint).
  // (where the data changed, an epoch may now hold fewer samples than the checkpoint had taken of
  // its own: that is no damage, and the run goes on at the next epoch below)
  // (and a checkpoint of before Note [An epoch of whole steps] may be further into one: taken up at the next)
  const int64_t epoch_samples = train_loader_->size();
  const SavedState saved =
      parse_state_json(c.state_json, dir / "state.json", data_changes.empty() ? epoch_samples : int64_t{1} << 40);
  const int64_t step = saved.step;
  check_step_folder_name(dir, step);  // (damage: --resume auto falls back to the one before)
  const std::string& model_name = saved.model_name;
  const auto& model_config = saved.model_config;
  const auto& saved_manifest = saved.manifest;
  sdk::State optimizer, precision, schedule;
  optimizer.text = saved.optimizer;
  precision.text = saved.precision;
  schedule.text = saved.schedule;
  const std::string& schedule_name = saved.schedule_name;
  const sdk::BatchPlan saved_plan = saved.plan;
  // (offset at most 2^40 and ranks 2^20: the product holds in 64 bits)
  const bool beyond = saved.offset * saved.ranks > epoch_samples;
  if (beyond)
    log::warn("the checkpoint had taken ", saved.offset * saved.ranks, " samples of its epoch ", saved.epoch,
              ", more than this run's training split holds (", epoch_samples, ": the data changed), so training goes on at the "
              "start of epoch ", saved.epoch + 1);
  DataLoader::Position position =
      beyond ? DataLoader::Position{saved.epoch + 1, 0} : position_for_world(saved.epoch, saved.offset, saved.ranks);
  LogWindow window;
  window.steps = saved.window_steps;
  window.samples = saved.window_samples;
  window.terms = saved.window_terms;
  window.loss = saved.window_loss;
  window.seconds = saved.window_seconds;
  window.metrics = saved.window_metrics;
  const json& callbacks = saved.callbacks;

  // The checkpoint must fit this run: same model configuration, same precision unless allowed.
  check_model_config(model_name, model_config, dir.string());
  const auto manifest = precision_->manifest();
  std::vector<std::string> precision_diff;
  for (const auto& [key, value] : saved_manifest) {
    auto it = manifest.find(key);
    const std::string mine = it == manifest.end() ? "(none)" : it->second;
    if (mine != value) precision_diff.push_back(key + ": checkpoint " + value + ", this run " + mine);
  }
  if (!precision_diff.empty()) {
    const std::string what = "the precision differs from the checkpoint's (" + join(precision_diff, "; ") + ")";
    if (!options_.allow_precision_change)
      throw ResumeRefused("refusing to resume from " + dir.string() + ": " + what +
                  ". Use the checkpoint's precision, or --set precision.allow_precision_change=true");
    log::warn(what, "; continuing because precision.allow_precision_change is set");
  }

  try {
    restore_model(c.model, dir.string());
  } catch (const ShapeDiffers& e) {
    // Weights whose shapes follow the data (a recommender's users and items) do not fit data
    // that changed: that is the data's change, not damage (every older checkpoint was passed over
    // as damaged, and the run called unloadable). Other damage still falls back to an older one.
    // With the data's settings unchanged too, what the model is sized by changed in the data's own
    // files (a user added to ratings.csv): it was called damage, and the run unloadable ("move the
    // folder away"), every checkpoint failing alike.
    if (data_changes.empty())
      throw ResumeRefused("refusing to resume from " + dir.string() + ": its weights do not fit this run (" + e.detail +
                          ") though the model's and the data's settings are the checkpoint's: the data the model is "
                          "sized by changed in its files (more users or items, another vocabulary), or the model's plugin "
                          "shapes its weights otherwise since (another version). Resume with the data and plugin it was "
                          "trained with, or train as a new run (another trainer.name)");
    throw ResumeRefused("refusing to resume from " + dir.string() + ": its weights do not fit this run's data (" +
                        e.detail + "), and the data differs from the checkpoint's: " + join(data_changes, "; ") +
                        ". Resume with the checkpoint's data, or train on this data as a new run (another trainer.name)");
  }
  for (const auto& [k, t] : c.extra) {
    if (k.rfind("optimizer.", 0) == 0) optimizer.tensors[k.substr(10)] = t;
    else if (k.rfind("precision.", 0) == 0) precision.tensors[k.substr(10)] = t;
    else if (k.rfind("schedule.", 0) == 0) schedule.tensors[k.substr(9)] = t;
  }
  if (schedule_name != options_.schedule)
    log::warn("the checkpoint was trained with schedule ", schedule_name, ", this run uses ", options_.schedule);
  optimizer_->load_state_dict(optimizer);
  // A precision changed (allowed) from one that keeps no state, fp32 or bf16, to one that does, a
  // loss scaler: the scaler starts afresh, as in a new run (its state is not the checkpoint's to
  // lack: that was taken for damage, and every checkpoint passed over).
  // A loss scale configured otherwise (precision.init_scale, allowed) is this run's: the checkpoint's
  // scale overrode it, and a lower start was no way out of a scale still coming down.
  // (its start or its kind, not its growth: "dynamic (init 65536, x2 after 2000 ...)" against the checkpoint's)
  const auto start_of = [](const sdk::TextMap& m) {
    const auto it = m.find("loss_scale");
    return it == m.end() ? std::string() : it->second.substr(0, it->second.find(','));
  };
  const bool rescaled = start_of(manifest) != start_of(saved_manifest) && !start_of(manifest).empty() &&
                        !precision_->state_dict().tensors.empty();  // (fp16_amp to bf16_amp: no scale to start)
  if (!precision_diff.empty() && precision.tensors.empty() && !precision_->state_dict().tensors.empty())
    log::warn("precision '", precision_name_, "' starts afresh (the checkpoint's precision kept no state of its own, "
              "such as a loss scale)");
  else if (rescaled)
    log::warn("precision '", precision_name_, "' starts its loss scale afresh, as this run configures it (",
              manifest.find("loss_scale")->second, "), not at the checkpoint's");
  else
    precision_->load_state_dict(precision);
  scale_descent_ = loss_scale_descent(*precision_);
  schedule_->load_state_dict(schedule);
  load_callback_states(callbacks_, callbacks, c.extra, dir, unselected_callback_text_, unselected_callback_tensors_);
  if (auto it = c.extra.find("rng.cpu"); it != c.extra.end()) cpu_generator().set_state(it->second);
  if (auto it = c.extra.find("rng.device"); it != c.extra.end() && device_.is_cuda()) device_generator(device_).set_state(it->second);

  step_ = step;
  skipped_steps_ = skipped_at_resume_ = saved.skipped;
  const bool chosen_here = config_.at("trainer.batch_size").origin.source == "default" && !memory_policies_.empty();
  if (saved_plan.global() != plan_.global() && chosen_here && saved_plan.global() % plan_.world_size == 0)
    adopt_global_batch(saved_plan.global());
  else if (saved_plan.global() != plan_.global()) {
    // (where this run's batch came from: a -c file's is easy to miss in a `-c F --resume auto`; a probe)
    const Origin& from = config_.at("trainer.batch_size").origin;
    const std::string why = from.source != "default" ? "trainer.batch_size from " + from.describe()
                            : memory_policies_.empty() ? std::string("trainer.batch_size's default")
                                                       : "its memory policies' plan: the checkpoint's does not split over " +
                                                             std::to_string(plan_.world_size) + " devices";
    log::warn("the checkpoint was trained with global batch ", saved_plan.global(), ", this run uses ", plan_.global(), " (",
              why, ")");
  }
  adopt_oom_plan(saved_plan, {saved.oom_config, saved.oom_device, saved.oom_accumulation});
  // (its end at this batch: an epochs-based run with nothing left of its last epoch is at its end,
  // whose evaluation runs as a cut one's would; a review)
  const bool ended_here = on_the_steps_grid(position) && saved.total_steps > step_;
  if (!data_changes.empty())  // (a choice, as fine-tuning on other data is: said, not refused; after the length is known)
    log::warn("this run's data differs from the checkpoint's: ", join(data_changes, "; "), "; the resumed run ",
              step < total_steps_ ? "trains on these" : "is trained: what evaluations it runs are of these");
  // Another length (trainer.max_steps, epochs, or the batch in epochs): the schedule is computed
  // over it, and where that moves the next update's rate, a decay resumes elsewhere than it was.
  if (const int64_t taken = step_ - skipped_steps_;
      saved.total_steps > 0 && saved.total_steps != total_steps_ && step_ < total_steps_ && schedule_name == options_.schedule) {
    const double before = base_lr_ * schedule_->factor(std::min(taken, saved.total_steps - 1), saved.total_steps),  // (its last)
                 now = base_lr_ * schedule_->factor(taken, total_steps_);
    if (std::abs(now - before) > 1e-9 * std::max(std::abs(before), std::abs(now)))
      log::warn("the run is now ", total_steps_, " steps long, not ", saved.total_steps, ": the ", options_.schedule,
                " schedule is computed over the new length, so step ", step_ + 1, "'s learning rate is ", now, ", not ", before,
                now > before ? " (the decay resumes from higher up: a warm restart)" : " (the decay goes on faster)");
  }
  train_loader_->seek(position);
  window_ = window;
  taken_on_device_ = lr_table_ = at::Tensor();  // made again from step_ and the loaded schedule
  if (graphs_) graphs_->clear();  // they read the optimizer's and the scaler's tensors of before
  resumed_at_ = step_;
  resumed_from_ = dir;
  evaluation_pending_ = saved.evaluation_pending || ended_here;
  log::info("resumed from ", dir.string(), " at step ", step_);
}

// Note [An epoch of whole steps] (data_loader.cpp) holds from a step that starts on the grid of
// this run's steps: a position off it (another global batch or world than the checkpoint's) made
// every later epoch's last step take the next epoch's first samples, with accumulation or OOM
// recovery, and an epoch end early (a probe). It goes on at the next step's start. An epochs-based
// run is as long as its epochs: the steps its last epochs take at this batch, not epochs x steps
// per epoch, which trained 192 samples short or 6 steps into a third epoch after such a resume.
bool Trainer::on_the_steps_grid(DataLoader::Position& position) {
  const int64_t step = plan_.micro_batch * local_devices() * plan_.accumulation, epoch = train_loader_->samples_per_epoch();
  // (past the epoch's end: a checkpoint of before, whose epochs were longer, or of another world)
  if (position.offset > epoch) position = {position.epoch + 1, 0};
  const bool epochs = options_.max_steps == 0;
  if (const int64_t off = position.offset % step; off != 0) {
    const int64_t next = position.offset - off + step;
    const std::string each = parallel_->world_size() > 1 ? " on each rank" : "";
    log::info("the checkpoint's data position (", position.offset, " samples into epoch ", position.epoch, each,
              ") is no whole number of this run's steps of ", step, each, ": it goes on at ",
              next < epoch                                    ? std::to_string(next)
              : !epochs || position.epoch + 1 < options_.epochs ? std::string("the next epoch's start")
                                                              : std::string("the run's end, its last epoch's"),
              " (", std::min(next, epoch) - position.offset, " samples of this epoch left out", each,
              "), so that no step takes two epochs");
    position = next >= epoch ? DataLoader::Position{position.epoch + 1, 0} : DataLoader::Position{position.epoch, next};
  }
  if (!epochs) return false;
  total_steps_ = step_ + std::max<int64_t>(0, (epoch - position.offset) / step +
                                                 epoch / step * (options_.epochs - 1 - position.epoch));
  return total_steps_ == step_;
}

void Trainer::check_model_config(const std::string& saved_name, const std::map<std::string, std::string>& saved,
                                 const std::string& what) const {
  std::vector<std::string> differences;
  const auto mine_all = section("model");
  if (saved_name != value_of(config_, "model.name")) {
    differences.push_back("model.name: checkpoint '" + saved_name + "', this run '" + value_of(config_, "model.name") + "'");
  } else {
    const ComponentInfo* model = registry_.find(LOOM_KIND_MODEL, saved_name);
    const auto spec_of = [&](const std::string& key) -> const OptionSpec* {
      if (!model) return nullptr;
      for (const auto& o : model->options)
        if (o.key == key) return &o;
      return nullptr;
    };
    const auto same = [&](const std::string& key, const std::string& a, const std::string& b) {
      const OptionSpec* spec = spec_of(key);
      return spec ? same_value(*spec, a, b) : a == b;
    };
    for (const auto& [key, value] : saved) {
      auto it = mine_all.find(key);
      const std::string mine = it == mine_all.end() ? "(unset)" : it->second;
      if (!same(key, mine, value)) differences.push_back("model." + key + ": checkpoint " + value + ", this run " + mine);
    }
    // An option the checkpoint does not name is younger than it: the model was trained as the
    // plugin behaved before the option existed, which is the option's default (the rule for
    // plugin authors, docs/writing-a-plugin.md; `loom eval` rebuilds such a checkpoint's model
    // with the default too). A run that sets it otherwise would resume another model.
    for (const auto& [key, mine] : mine_all) {
      const OptionSpec* spec = key == "name" || saved.count(key) ? nullptr : spec_of(key);
      if (spec && spec->required())  // a required option cannot have come later
        differences.push_back("model." + key + ": not in the checkpoint, this run " + mine);
      else if (spec && !same_value(*spec, mine, spec->default_value))
        differences.push_back("model." + key + ": not in the checkpoint (written before the option existed, so " +
                              "trained as its default " + (spec->default_value.empty() ? "''" : spec->default_value) + "), this run " + mine);
    }
  }
  if (!differences.empty())
    throw ResumeRefused("refusing to resume from " + what + ": the model configuration differs (" + join(differences, "; ") +
                "). Use the checkpoint's model settings, or start a new run");
}

void Trainer::restore_model(const sdk::TensorMap& tensors, const std::string& what) {
  // Everything is checked before anything is copied, so a damaged file leaves the model as it
  // was. The model's configuration was compared before (check_model_config): a missing tensor,
  // another shape or dtype, or a NaN in a weight is damage (--resume auto falls back to an older
  // checkpoint), not a model to train on.
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;
  auto check = [&](const std::string& key, const at::Tensor& into) {
    auto it = tensors.find(key);
    if (it == tensors.end()) throw Error(what + " is damaged or of another model: it has no tensor '" + key + "'");
    const at::Tensor& from = it->second;
    if (from.sizes() != into.sizes()) {
      const std::string detail = "tensor '" + key + "' has shape " + c10::str(from.sizes()) + " in the checkpoint, " +
                                 c10::str(into.sizes()) + " in this model";
      throw ShapeDiffers(what + " is damaged or of another model: " + detail, detail);
    }
    if (from.scalar_type() != into.scalar_type())
      throw Error(what + " is damaged: tensor '" + key + "' is " + c10::toString(from.scalar_type()) + " in the checkpoint, " +
                  c10::toString(into.scalar_type()) + " in this model");
    // (a buffer may hold infinities, an attention mask's -inf; a parameter may not)
    const bool parameter = key.rfind("param.", 0) == 0;
    if (at::isFloatingType(from.scalar_type()) &&
        !detail::all_finite(from, /*nan_only=*/!parameter).item<bool>())
      throw Error(what + " is damaged: tensor '" + key + "' holds NaN" + (parameter ? " or infinite values" : ""));
    copies.emplace_back(into, from);
  };
  for (const auto& item : model_->module().named_parameters()) check("param." + item.key(), item.value());
  for (const auto& item : model_->module().named_buffers()) check("buffer." + item.key(), item.value());
  at::NoGradGuard no_grad;
  for (auto& [into, from] : copies) into.copy_(from);
}

std::map<std::string, std::string> checkpoint_run_config(const fs::path& checkpoint) {
  // A step folder's state.json, or a weights file's metadata (the best callback's), read with
  // the same checks as a resume: damage is named, never a JSON library's exception.
  std::map<std::string, std::string> out;
  json model, data;
  const fs::path file = fs::is_directory(checkpoint) ? checkpoint / "state.json" : checkpoint;
  try {
    if (fs::is_directory(checkpoint)) {
      const json s = detail::parse_json<json>(read_file(file));
      if (!s.is_object() || !s.contains("format") || s.at("format") != 1)  // as a resume checks it (saved_state.cpp)
        throw Error(file.string() + " has state format " +
                    (s.is_object() && s.contains("format") ? s.at("format").dump() : std::string("(none)")) +
                    "; this Loom reads format 1: it is damaged, or written by another version of Loom");
      if (s.contains("step") && s.at("step").is_number_integer()) check_step_folder_name(checkpoint, s.at("step").get<int64_t>());
      model = s.at("model");
      data = s.at("data");
    } else {
      const sdk::TextMap metadata = load_safetensors_metadata(checkpoint);  // (the header: not the weights)
      if (!metadata.count("model") || !metadata.count("data"))
        throw Error(checkpoint.string() + " carries no model configuration; pass a checkpoint folder or a best_*.safetensors Loom wrote");
      model = detail::parse_json<json>(metadata.at("model"));
      data = detail::parse_json<json>(metadata.at("data"));
    }
    for (const auto& [key, value] : model.at("config").items()) out["model." + key] = value.get<std::string>();
    for (const auto& [key, value] : data.at("config").items()) out["data." + key] = value.get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    throw Error(file.string() + ": the model and data configuration it records is damaged (" + printable(e.what(), 300) +
                ")");
  }
  return out;
}

TrainedIn checkpoint_trained_in(const fs::path& checkpoint) {
  TrainedIn out;
  try {
    if (fs::is_directory(checkpoint)) {
      const json s = detail::parse_json<json>(read_file(checkpoint / "state.json"));
      if (s.contains("precision") && s.at("precision").is_object() && s.at("precision").contains("name") &&
          s.at("precision").at("name").is_string())
        out.precision = printable(s.at("precision").at("name").get<std::string>(), 64);
      if (s.contains("device") && s.at("device").is_string()) out.device = printable(s.at("device").get<std::string>(), 64);
    } else {
      const sdk::TextMap metadata = load_safetensors_metadata(checkpoint);
      // (the file's text, said in messages: shown short, without a terminal's escape sequences)
      if (const auto it = metadata.find("precision"); it != metadata.end()) out.precision = printable(it->second, 64);
      if (const auto it = metadata.find("device"); it != metadata.end()) out.device = printable(it->second, 64);
    }
  } catch (const std::exception&) {
  }  // (damage is checkpoint_run_config's and the load's to name: here it only says nothing)
  return out;
}

bool Trainer::init_first() const {
  if (options_.init_from.empty()) return false;
  std::error_code ec;
  return (options_.resume == "none" && options_.resume_from.empty()) ||
         (options_.resume == "auto" && !options_.name.empty() && !fs::exists(fs::path(options_.work_dir) / options_.name, ec));
}

void Trainer::init_weights(const std::string& from) {
  std::error_code ec;
  const fs::path path = fs::path(from).lexically_normal();
  if (!fs::exists(path, ec))
    throw no_such_checkpoint("trainer.init_from", from);
  if (fs::is_directory(path / "checkpoints", ec))  // (a run folder: which of its weights is the user's to say)
    throw Error("trainer.init_from = " + from + " is a run folder; name one of its checkpoints: " +
                (path / "checkpoints" / "best_<metric>.safetensors").string() + ", or a step folder in " +
                (path / "checkpoints").string());
  try {
    load_weights(path);
  } catch (const ShapeDiffers& e) {
    throw Error("trainer.init_from = " + from + ": its model does not fit this one: " + e.detail +
                "; the settings that size the model (layers, widths, vocabulary, the data's users and items) must be the "
                "checkpoint's");
  } catch (const std::exception& e) {  // (a damaged file: its own words, said as this key's; a file of another kind: what to name)
    throw Error("trainer.init_from = " + from + (path.extension() == ".safetensors" || fs::is_directory(path, ec) ? ": " + std::string(e.what())
                : " is no checkpoint (not a safetensors file): name a run's step folder, or a .safetensors weights file"));
  }
  log::info("weights from ", path.string(), " (trainer.init_from): the optimizer, the schedule and the step start afresh");
}

void Trainer::load_weights(const fs::path& checkpoint) {
  try {
    if (fs::is_directory(checkpoint)) {
      const Checkpoint c = CheckpointStore::load_weights(checkpoint);
      restore_model(c.model, checkpoint.string());
    } else {
      restore_model(load_safetensors(checkpoint), checkpoint.string());
    }
  } catch (const ShapeDiffers& e) {
    // (loom eval, loom recommend: with the checkpoint's settings, a shape follows the data's files
    // that changed since, a recommender's users and items; it was called damage alone)
    throw ShapeDiffers(checkpoint.string() + ": its weights do not fit this model (" + e.detail + "): the data the model "
                       "is sized by changed in its files since it trained (more users or items, another vocabulary), the "
                       "settings that size the model differ from the checkpoint's, or it is of another model or damaged",
                       e.detail);
  }
}

}  // namespace loom::core
