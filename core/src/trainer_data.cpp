// What a checkpoint records of its run's data, and what differs from it now: the data's settings,
// the samples per split and the held-out samples' fingerprint (Note [The data's sizes]).
#include <loom/core/checkpoint.hpp>
#include <loom/core/files.hpp>
#include <loom/core/log.hpp>
#include <loom/core/safetensors.hpp>
#include <loom/core/text.hpp>
#include <loom/core/trainer.hpp>
#include "json_limits.hpp"
#include "trainer_internal.hpp"

#include <nlohmann/json.hpp>
#include <torch/nn/module.h>

#include <algorithm>
#include <cstdlib>
#include <set>
#include <utility>

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace loom::core {

using namespace detail;

namespace {

/// A dataset's samples per split, as a checkpoint records them (Note [The data's sizes]), and its
/// held-out samples' fingerprint where its spec gives one (`splits.fingerprint`); null where a size
/// cannot be read (a dataset that throws for it: the checkpoint is written without).
json data_sizes(const Created<sdk::Dataset>& dataset, const sdk::DataSpec& spec, const Created<sdk::Model>& model) {
  try {
    // (the validation split only of a Dataset 1.1: a 1.0 one, a C tier's, refuses the split it does not know)
    json sizes = {{"train", dataset->size(sdk::Split::kTrain)},
                  {"validation", dataset.implements(1) ? dataset->size(sdk::Split::kValidation) : 0},
                  {"test", dataset->size(sdk::Split::kTest)}};
    if (const auto it = spec.attributes.find("splits.fingerprint"); it != spec.attributes.end() && !invalid_utf8(it->second))
      sizes["held_out"] = it->second;
    // (any other "<what>.fingerprint" a dataset gives, the interactions datasets' items.text one)
    for (const auto& [name, value] : spec.attributes)
      if (name.ends_with(".fingerprint") && name != "splits.fingerprint" && !invalid_utf8(name) && !invalid_utf8(value))
        sizes["fingerprints"][name] = value;  // (UTF-8 only: state.json is JSON, and a save that throws saves nothing)
    // The files a model reads besides its weights (Model 2.3: a tokenizer), recorded beside the data's
    // (a model's failure here costs its own entries only, not the data's record: said once).
    if (model && model.implements(3)) {
      try {
        for (const auto& [name, value] : model->fingerprints())
          if (!invalid_utf8(name) && !invalid_utf8(value)) sizes["fingerprints"]["model." + name + ".fingerprint"] = value;
      } catch (...) {  // (`throw 42` too: it ended the run at an evaluation, blamed on callback 'best')
        std::string why = "it threw a value that is not an exception";
        try {
          throw;
        } catch (const std::exception& e) {
          why = e.what();
        } catch (...) {
        }
        static bool said = false;
        if (!std::exchange(said, true))
          log::warn("the model's fingerprints() failed (", why,
                    "): checkpoints record no fingerprint of its files");
      }
    }
    return sizes;
  } catch (...) {
    return json();
  }
}

/// The model's files (Model 2.3) that changed since `recorded` (a checkpoint's data.sizes).
std::vector<std::string> model_files_differ(const json& recorded, const json& sizes) {
  std::vector<std::string> out;
  const auto fingerprints = recorded.is_object() ? recorded.find("fingerprints") : recorded.end();
  if (!recorded.is_object() || fingerprints == recorded.end() || !fingerprints->is_object() || !sizes.contains("fingerprints"))
    return out;
  for (const auto& [name, value] : sizes.at("fingerprints").items())
    if (const auto it = fingerprints->find(name); name.rfind("model.", 0) == 0 && name.size() > 18 && it != fingerprints->end() && *it != value)
      out.push_back("the model's " + name.substr(6, name.size() - 18) + " files changed since (fingerprint " +
                    value.get<std::string>() + ", the run's " + (it->is_string() ? it->get<std::string>() : it->dump()) + ")");
  return out;
}

/// Each split whose size differs from `recorded`'s (a checkpoint's data.sizes); none where it has none.
std::vector<std::string> sizes_differ(const json& recorded, const Created<sdk::Dataset>& dataset, const sdk::DataSpec& spec,
                                      const Created<sdk::Model>& model) {
  std::vector<std::string> out;
  if (!recorded.is_object()) return out;
  const json sizes = data_sizes(dataset, spec, model);  // (not in the loop's head: items() of a temporary outlives it)
  for (const auto& [split, size] : sizes.items())
    if (const auto it = recorded.find(split); it != recorded.end() && *it != size && size.is_number_integer() && it->is_number_integer())
      out.push_back("the " + split + " split holds " + size.dump() + " samples (the checkpoint's run: " + it->dump() + ")");
  // (the same sizes, other samples: a model scored on what it trained on)
  if (out.empty() && sizes.contains("held_out")) {
    if (const auto it = recorded.find("held_out"); it == recorded.end())
      out.push_back("the checkpoint records no fingerprint of the samples its run held out (written before its dataset "
                    "gave one: the interactions datasets' splits stopped following the order of the file's lines on "
                    "2026-11-30), so its validation and test samples may be others than the run's, some of them trained on");
    else if (!it->is_string() || *it != sizes.at("held_out"))
      out.push_back("its validation and test samples are others than the run's (the same counts; fingerprint " +
                    sizes.at("held_out").get<std::string>() + ", the run's " + (it->is_string() ? it->get<std::string>() : it->dump()) +
                    "), some of them trained on");
  }
  // (the same samples, other contents: an item's text edited in place, which its text vector reads)
  if (const auto fingerprints = recorded.find("fingerprints"); fingerprints != recorded.end() && fingerprints->is_object() && sizes.contains("fingerprints"))
    for (const auto& [name, value] : sizes.at("fingerprints").items())
      if (const auto it = fingerprints->find(name); name.rfind("model.", 0) != 0 && it != fingerprints->end() && *it != value)
        out.push_back("its " + name.substr(0, name.size() - 12) + " changed since (fingerprint " + value.get<std::string>() +
                      ", the run's " + (it->is_string() ? it->get<std::string>() : it->dump()) + ")");
  // (the model's files: whatever else changed, as the weights read them)
  for (std::string& differ : model_files_differ(recorded, sizes)) out.push_back(std::move(differ));
  return out;
}

}  // namespace

std::string Trainer::data_sizes_json() const { return data_sizes(dataset_, data_spec_, model_).dump(); }

std::vector<std::string> Trainer::changed_data(const std::string& state_json) const {
  std::vector<std::string> out;
  try {
    const json j = detail::parse_json<json>(state_json);
    const json& saved = j.at("data");
    const auto mine = section("data");
    if (saved.at("name").get<std::string>() != value_of(config_, "data.name"))
      return {"data.name = " + value_of(config_, "data.name") + " (the checkpoint's: " + saved.at("name").get<std::string>() + ")"};
    for (const auto& [key, value] : saved.at("config").items()) {
      // (the loader's threads and buffers change neither the samples nor their order)
      if (key == "num_workers" || key == "prefetch" || key == "pin_memory") continue;
      const auto it = mine.find(key);
      if (it != mine.end() && value.is_string() && it->second != value.get<std::string>())
        out.push_back("data." + key + " = " + it->second + " (the checkpoint's: " + value.get<std::string>() + ")");
    }
    // The seed orders the samples and, where validation is held out of train, picks those: another
    // one validates on samples the model trained on (its val figures rise without it learning).
    if (j.contains("loader") && j.at("loader").contains("seed") && j.at("loader").at("seed").get<int64_t>() != options_.seed)
      out.push_back("trainer.seed = " + std::to_string(options_.seed) + " (the checkpoint's: " +
                    std::to_string(j.at("loader").at("seed").get<int64_t>()) + "; it orders the samples" +
                    (held_out_ > 0 ? std::string(" and picks those held out for validation, which may now include ") +
                                         "samples the model trained on)"
                                   : std::string(")")));
    // (the data's files changed, its settings not, or only where they are: a copy is compared too;
    // where other settings changed, the sizes follow them)
    if (std::all_of(out.begin(), out.end(), [](const std::string& c) {
          const std::string key = c.substr(0, c.find(' '));
          return key.ends_with(".root") || key.ends_with(".path");
        }))
      for (std::string& differ : sizes_differ(saved.value("sizes", json()), dataset_, data_spec_, model_)) out.push_back(std::move(differ));
    else  // (the model's files, whatever else changed)
      for (std::string& differ : model_files_differ(saved.value("sizes", json()), data_sizes(dataset_, data_spec_, model_)))
        out.push_back(std::move(differ));
  } catch (const json::exception&) {
  }  // an older or damaged state.json: parse_state_json judges it
  return out;
}

// Note [The data's sizes]: a checkpoint records how many samples each split of its run's data
// held (state.json's and a weights file's "data"). A recommender's ratings changed in place keep
// its ids, which its own check compares, and its evaluation then ranked items the model trained on
// as the held-out ones, figures of other data said as the run's (probe H). A dataset whose spec
// gives `splits.fingerprint` (a hash of which samples it holds out; the recommender's datasets) has
// that recorded and compared too: the same counts of other held-out samples are said as well.
void Trainer::warn_if_data_sizes_differ(const fs::path& checkpoint) const {
  try {
    const json data = fs::is_directory(checkpoint)
                          ? detail::parse_json<json>(read_file(checkpoint / "state.json", int64_t{64} << 20)).at("data")
                          : detail::parse_json<json>(load_safetensors_metadata(checkpoint).at("data"));
    // (the dataset's own folder key, data.<name>.path or .root: fashion_mnist's was named data.root, movielens')
    std::string folder;
    for (const auto& [key, value] : config_)
      if (key.rfind("data.", 0) == 0 && (key.ends_with(".path") || key.ends_with(".root"))) folder += key + ", ";
    if (const auto differ = sizes_differ(data.value("sizes", json()), dataset_, data_spec_, model_); !differ.empty())
      log::warn("this data is not the data ", checkpoint.string(), " was trained on: ", join(differ, "; "),
                "; its figures are of these inputs (point ", folder, "the data's settings and the model's files at what it "
                "trained on for the run's)");
  } catch (const std::exception&) {
  }  // (an older checkpoint without the record, or a weights file of another tool: nothing to compare)
}

namespace detail {

std::string uneven_batch(int64_t batch, bool given, int64_t accumulation, int64_t world) {
  const int64_t per_step = accumulation * world;
  std::string text = "trainer.batch_size " + std::to_string(batch) + (given ? "" : " (the default)") +
                     " is not divisible by trainer.gradient_accumulation_steps " + std::to_string(accumulation) +
                     " x world size " + std::to_string(world) + "; the global batch must split evenly into micro-batches: ";
  // (it said no more; the nearest that work, both ways: a probe)
  const int64_t below = batch / per_step * per_step, above = below + per_step;
  text += "trainer.batch_size " + (below > 0 ? std::to_string(below) + " or " : std::string()) + std::to_string(above);
  std::vector<std::string> fit;
  for (int64_t a = 1; a <= std::min<int64_t>(batch / world, 65536) && batch % world == 0; ++a)
    if ((batch / world) % a == 0 && a != accumulation) fit.push_back(std::to_string(a));
  if (!fit.empty()) {  // the divisors nearest to the given accumulation, at most four
    std::stable_sort(fit.begin(), fit.end(), [&](const std::string& x, const std::string& y) {
      return std::abs(std::stoll(x) - accumulation) < std::abs(std::stoll(y) - accumulation);
    });
    fit.resize(std::min<size_t>(fit.size(), 4));
    std::sort(fit.begin(), fit.end(), [](const std::string& x, const std::string& y) { return std::stoll(x) < std::stoll(y); });
    text += ", or trainer.gradient_accumulation_steps " + join(fit, ", ");
  }
  return text;
}

void check_split_sizes(const std::string& name, const std::function<int64_t(sdk::Split)>& size, bool has_validation) {
  for (const sdk::Split split : {sdk::Split::kTrain, sdk::Split::kValidation, sdk::Split::kTest}) {
    if (split == sdk::Split::kValidation && !has_validation) continue;
    // (asked twice: the host asks again as it plans, and a size that grew planned 115 held out of
    // 1920 where 10 % was of an earlier answer, then read past the dataset's end; a probe)
    const int64_t first = size(split), again = size(split);
    const std::string said = "dataset '" + name + "' says its " + sdk::split_name(split) + " split has " + std::to_string(first) + " samples";
    if (constexpr int64_t kMost = int64_t{1} << 40; first < 0 || first > kMost)
      throw Error(said + ", outside [0, 2^40]: its size() is wrong (a bug of the plugin's: report it to its author)");
    if (again != first)
      throw Error(said + ", then " + std::to_string(again) + ": its size() must give one number for the whole run (a bug "
                  "of the plugin's: report it to its author)");
  }
}

void check_module_holds(const std::string& model, const torch::nn::Module& module, const std::vector<at::Tensor>& trained) {
  std::set<const void*> held;
  for (const auto& p : module.parameters()) held.insert(p.unsafeGetTensorImpl());
  const auto gone = std::count_if(trained.begin(), trained.end(), [&](const at::Tensor& p) { return !held.count(p.unsafeGetTensorImpl()); });
  if (gone > 0)
    throw Error("model '" + model + "': its module() no longer holds " + std::to_string(gone) + " of the " +
                std::to_string(trained.size()) + " parameters it was set up with, which the run trains: module() must "
                "return the same module for the whole run (a bug of the plugin's: report it to its author); nothing is "
                "written from it");
}

void check_spec_keys(const std::string& name, const sdk::DataSpec& spec) {
  for (const auto& [role, key] : {std::pair{"input_key", &spec.input_key}, std::pair{"target_key", &spec.target_key}}) {
    if (spec.fields.count(*key)) continue;
    std::string fields;
    for (const auto& field : spec.fields) fields += (fields.empty() ? "" : ", ") + field.first;
    throw Error("dataset '" + name + "': its spec() names field '" + printable(*key, 64) + "' as its " + role +
                ", but it has no such field (its fields: " + (fields.empty() ? "none" : fields) +
                "): a bug of the plugin's (`loom plugins check` finds it too): report it to its author");
  }
}

void say_validation_fraction_unused(const Resolved& config, int64_t native) {
  // (not a default, nor a resume's copy of the run's setting, said when it started, nor a 0 that asks for none)
  const auto it = config.find("data.validation_fraction");
  if (it == config.end() || it->second.origin.source == "default" || it->second.origin.source == "checkpoint" ||
      it->second.origin.source == kRunRecordOrigin || std::strtod(it->second.value.c_str(), nullptr) <= 0)
    return;
  log::warn("data.validation_fraction = ", it->second.value, " (", it->second.origin.describe(), ") holds out nothing: dataset '",
            value_of(config, "data.name"), "' has its own validation split (", native, " samples), which the run validates "
            "on; the whole training split trains (remove the setting to silence this)");
}

int64_t steps_per_epoch(const DataLoader& loader, const sdk::BatchPlan& plan, int64_t world, bool held_out, bool kept) {
  const int64_t per_epoch = loader.batches_per_epoch() / plan.accumulation;
  if (per_epoch < 1) throw Error(no_step_in_an_epoch(plan.global(), loader.size() / world * world, held_out, kept));
  return per_epoch;
}

void say_plan_leaves_out(const DataLoader& loader, const sdk::BatchPlan& plan, const Resolved& config,
                         int64_t accumulation, bool resumed) {
  // (auto_batch's 673 on 1843 samples trained 1346 of them an epoch, and nothing said so)
  const int64_t per_epoch = loader.batches_per_epoch() / plan.accumulation;
  const int64_t samples = loader.size(), left = samples - per_epoch * plan.global();
  if (per_epoch >= 1 && left > 0 && left * 10 >= samples)
    log::warn("each epoch trains on ", samples - left, " of the ", samples, " training samples: the global batch ",
              plan.global(), " fits in them ", per_epoch, per_epoch == 1 ? " time" : " times", " (a step takes a sample once), ",
              "so ", left, " are left out of each epoch (others each epoch where the order is shuffled); a global batch "
              "that divides ", samples, ", or a smaller one, trains on them all");
  // (a resume keeps its run's global batch, and a re-plan after an out-of-memory: the user's
  // --gradient-accumulation-steps then went unsaid)
  // (only where the batch is the run's: one the user gives the resume, a policy splits as it would any)
  const auto batch = config.find("trainer.batch_size");
  const bool runs_batch = batch == config.end() || batch->second.origin.source == "default" ||
                          batch->second.origin.source == kRunRecordOrigin;
  if (const auto it = config.find("trainer.gradient_accumulation_steps");
      resumed && runs_batch && it != config.end() && it->second.origin.source != "default" &&
      it->second.origin.source != kRunRecordOrigin && plan.accumulation != accumulation)
    log::warn("gradient_accumulation_steps = ", it->second.value, " (", it->second.origin.describe(), ") is not this resume's: ",
              "it trains the run's global batch ", plan.global(), " as micro-batch ", plan.micro_batch, " x accumulation ",
              plan.accumulation, " (--batch-size with --gradient-accumulation-steps sets another batch)");
}

std::string no_step_in_an_epoch(int64_t global, int64_t samples, bool held_out, bool kept) {
  return "the global batch, " + std::to_string(global) +
         (kept ? " (the checkpoint's, which a resume that gives none keeps)" : " (trainer.batch_size)") + ", is more than the " +
         std::to_string(samples) + " samples an epoch of the training split has: one step would see some of them twice; " +
         (kept ? "give a smaller one with --batch-size" : "lower trainer.batch_size") +
         (held_out ? ", or hold out less for validation (data.validation_fraction)" : "");
}

}  // namespace detail

}  // namespace loom::core
