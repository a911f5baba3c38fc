// state.json read field by field: see saved_state.hpp.
#include "saved_state.hpp"

#include <loom/core/error.hpp>
#include <loom/core/text.hpp>
#include "json_limits.hpp"

#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <optional>

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace loom::core {

namespace {

/// The fields of a state.json, each read with its type and range; anything else is damage, named
/// by file and field ("state.json: field 'loader.offset' = -5 is outside [0, 512]").
class StateFields {
 public:
  StateFields(const json& s, fs::path file) : s_(s), file_(std::move(file)) {}

  const json& at(std::initializer_list<const char*> path) const {
    const json* node = &s_;
    for (const char* key : path) {
      if (!node->is_object() || !node->contains(key)) damaged(path, "is missing");
      node = &(*node)[key];
    }
    return *node;
  }
  int64_t integer(std::initializer_list<const char*> path, int64_t lo, int64_t hi) const {
    const json& v = at(path);
    if (!v.is_number_integer()) damaged(path, "is " + v.dump() + ", not an integer");
    const int64_t x = v.get<int64_t>();
    if (x < lo || x > hi) damaged(path, "= " + std::to_string(x) + " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    return x;
  }
  double number(std::initializer_list<const char*> path) const {
    const json& v = at(path);
    if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < 0) damaged(path, "is " + v.dump() + ", not a finite number >= 0");
    return v.get<double>();
  }
  std::string text(std::initializer_list<const char*> path) const {
    const json& v = at(path);
    if (!v.is_string()) damaged(path, "is " + v.dump() + ", not text");
    return v.get<std::string>();
  }
  bool boolean(std::initializer_list<const char*> path) const {
    const json& v = at(path);
    if (!v.is_boolean()) damaged(path, "is " + v.dump() + ", not true or false");
    return v.get<bool>();
  }
  const json& object(std::initializer_list<const char*> path) const {
    const json& v = at(path);
    if (!v.is_object()) damaged(path, "is not an object");
    return v;
  }
  std::map<std::string, std::string> texts(std::initializer_list<const char*> path, bool optional = false) const {
    std::map<std::string, std::string> out;
    if (optional && !has(path)) return out;
    for (const auto& [k, v] : object(path).items()) {
      if (!v.is_string()) damaged(path, "has '" + k + "' = " + v.dump() + ", not text");
      out[k] = v.get<std::string>();
    }
    return out;
  }
  /// A sum the log window carries: any number, or null for NaN (JSON has no NaN or infinity, so a
  /// window that saw a step with a non-finite loss or a metric of no samples is written as null):
  /// Loom's own checkpoints always load.
  static std::optional<double> sum_of(const json& v) {
    if (v.is_null()) return std::nan("");
    if (v.is_number() && std::isfinite(v.get<double>())) return v.get<double>();
    return std::nullopt;
  }
  double sum(std::initializer_list<const char*> path) const {
    const json& v = at(path);
    const auto x = sum_of(v);
    if (!x) damaged(path, "is " + v.dump() + ", not a number");
    return *x;
  }
  std::map<std::string, double> sums(std::initializer_list<const char*> path) const {
    std::map<std::string, double> out;
    for (const auto& [k, v] : object(path).items()) {
      const auto x = sum_of(v);
      if (!x) damaged(path, "has '" + k + "' = " + v.dump() + ", not a number");
      out[k] = *x;
    }
    return out;
  }

  bool has(std::initializer_list<const char*> path) const {
    const json* node = &s_;
    for (const char* key : path) {
      if (!node->is_object() || !node->contains(key)) return false;
      node = &(*node)[key];
    }
    return true;
  }

 private:
  [[noreturn]] void damaged(std::initializer_list<const char*> path, const std::string& why) const {
    std::string field;
    for (const char* key : path) field.append(field.empty() ? "" : ".").append(key);
    throw Error(file_.string() + ": field '" + field + "' " + why + "; the checkpoint is damaged");
  }

  const json& s_;
  fs::path file_;
};

}  // namespace

SavedState parse_state_json(const std::string& text, const fs::path& file, int64_t samples_per_epoch) {
  json s;
  try {
    s = detail::parse_json<json>(text);
  } catch (const std::exception& e) {
    throw Error(file.string() + " is not valid JSON (" + printable(e.what(), 300) + "); the checkpoint is damaged");
  }
  const StateFields f(s, file);
  SavedState out;
  f.integer({"format"}, 1, 1);
  out.step = f.integer({"step"}, 0, int64_t{1} << 40);
  out.skipped = f.integer({"skipped_steps"}, 0, out.step);
  if (f.has({"total_steps"})) out.total_steps = f.integer({"total_steps"}, 0, int64_t{1} << 40);
  out.model_name = f.text({"model", "name"});
  out.model_config = f.texts({"model", "config"});
  out.manifest = f.texts({"precision", "manifest"});
  out.optimizer = f.texts({"optimizer"});
  out.precision = f.texts({"precision", "state"});
  out.schedule = f.texts({"schedule", "state"}, /*optional=*/true);
  out.schedule_name = f.text({"schedule", "name"});
  out.plan = sdk::BatchPlan{f.integer({"plan", "micro_batch"}, 1, int64_t{1} << 40),
                            f.integer({"plan", "accumulation"}, 1, int64_t{1} << 40),
                            f.integer({"plan", "world_size"}, 1, int64_t{1} << 20)};
  // (an accumulation of 1e9 read as a global batch of 32000000000, past what a run may have)
  const double global = static_cast<double>(out.plan.micro_batch) * static_cast<double>(out.plan.accumulation) *
                        static_cast<double>(out.plan.world_size);  // (as doubles: 2^40 x 2^40 overflows)
  if (constexpr int64_t kMaxGlobal = int64_t{1} << 24; global > static_cast<double>(kMaxGlobal)) {
    char text[32];
    std::snprintf(text, sizeof text, "%.0f", global);
    throw Error(file.string() + ": plan gives a global batch of " + text + ", more than " +
                std::to_string(kMaxGlobal) + " (trainer.batch_size's largest); the checkpoint is damaged");
  }
  if (f.has({"plan", "after_oom"})) {
    out.oom_config = f.text({"plan", "after_oom", "config"});
    out.oom_device = f.text({"plan", "after_oom", "device"});
    out.oom_accumulation = f.integer({"plan", "after_oom", "accumulation"}, 1, int64_t{1} << 40);
  }
  out.epoch = f.integer({"loader", "epoch"}, 0, int64_t{1} << 40);
  out.offset = f.integer({"loader", "offset"}, 0, samples_per_epoch);
  // Older files have no "ranks": their plan's world_size was the number of ranks.
  out.ranks = f.has({"loader", "ranks"}) ? f.integer({"loader", "ranks"}, 1, int64_t{1} << 20) : out.plan.world_size;
  if (s.contains("log_window")) {
    out.window_steps = f.integer({"log_window", "steps"}, 0, out.step);
    out.window_samples = f.integer({"log_window", "samples"}, 0, int64_t{1} << 50);
    // Older files counted the loss's terms as samples, and had no "terms".
    out.window_terms = f.has({"log_window", "terms"}) ? f.integer({"log_window", "terms"}, 0, int64_t{1} << 50)
                                                        : out.window_samples;
    out.window_loss = f.sum({"log_window", "loss"});  // (a model's loss may be below 0: a log-likelihood of densities)
    out.window_seconds = f.number({"log_window", "seconds"});
    out.window_metrics = f.sums({"log_window", "metrics"});
  }
  if (s.contains("callbacks")) out.callbacks = f.object({"callbacks"});
  if (s.contains("evaluation_pending")) out.evaluation_pending = f.boolean({"evaluation_pending"});
  return out;
}

}  // namespace loom::core
