// What callbacks see of a run (sdk::RunContext), implemented over the trainer. Private to the
// core; the hooks' dispatch and the callbacks' state in checkpoints: trainer_callbacks.cpp.
#pragma once

#include <loom/core/text.hpp>
#include <loom/core/trainer.hpp>

namespace loom::core {

class Trainer::Context final : public sdk::RunContext {
 public:
  explicit Context(Trainer& trainer) : t_(trainer) {}

  std::filesystem::path run_dir() const override { return t_.run_dir_; }
  bool is_main() const override { return t_.parallel_->rank() == 0; }
  int64_t step() const override { return t_.step_; }
  int64_t total_steps() const override { return t_.total_steps_; }
  int64_t steps_per_epoch() const override {
    return std::max<int64_t>(1, t_.train_loader_->batches_per_epoch() / t_.plan_.accumulation);
  }
  int64_t resumed_at() const override { return t_.resumed_at_; }
  const std::map<std::string, sdk::MetricSpec>& metrics() const override { return t_.metric_specs_; }
  std::string format_metric(const std::string& name, double value) const override { return t_.format_metric(name, value); }
  int64_t eval_every() const override { return t_.eval_every_; }
  int64_t checkpoint_every() const override { return t_.options_.checkpoint_every; }
  std::string best_metric() const override { return t_.options_.best_metric; }
  sdk::Split selection_split() const override { return t_.selection_split(); }
  std::filesystem::path save_checkpoint() override { return t_.save_checkpoint_for_callback(); }
  std::filesystem::path save_weights(const std::string& file_name, const sdk::TextMap& metadata) override {
    return t_.save_weights(file_name, metadata);
  }
  void request_stop(const std::string& reason) override {
    // (for people and summary.json: no control characters, UTF-8, a line; a 20 MB one was logged whole)
    if (t_.stop_reason_.empty()) t_.stop_reason_ = reason.empty() ? "a callback asked to stop" : printable(reason, 1000);
  }
  bool stop_requested() const override { return !t_.stop_reason_.empty(); }

 private:
  Trainer& t_;
};

}  // namespace loom::core
