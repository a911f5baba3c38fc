// divergence_guard: a callback that stops a run whose training loss diverges, instead of letting
// it burn the rest of its budget. It watches the logged training loss (the mean over the last
// trainer.log_every steps) and asks the run to stop when it is not finite, or above `factor`
// times the lowest logged loss so far (after `grace` logs). The lowest loss is its state, so a
// resumed run compares against the same history. The host then saves a checkpoint of the step it
// stopped at (the checkpoint callback) and reports why it stopped.
//
//   loom train --set trainer.callbacks="progress, jsonl, checkpoint, divergence_guard" \
//              --set callback.divergence_guard.factor=2
#include <loom/sdk/sdk.hpp>

#include <cmath>
#include <cstdio>

namespace {

class DivergenceGuard final : public loom::sdk::Callback {
 public:
  static constexpr loom_option_spec kOptions[] = {
      loom::sdk::option_float("factor", "3.0", "stop when the logged training loss exceeds factor x its lowest value", "1..1000000"),
      loom::sdk::option_int("grace", "2", "logged values to see before comparing", "0..1000000"),
  };

  explicit DivergenceGuard(const loom::sdk::Options& o) : factor_(o.get_float("factor")), grace_(o.get_int("grace")) {
    if (!(factor_ >= 1.0)) throw loom::sdk::Error("callback.divergence_guard.factor must be at least 1 (it is a ratio to the lowest loss)");
    if (grace_ < 0) throw loom::sdk::Error("callback.divergence_guard.grace must be >= 0");
  }

  // It reads only on_log's means: the host need not read every step's loss from the device.
  bool reads_every_step() const override { return false; }

  void on_log(loom::sdk::RunContext& run, int64_t step, const std::map<std::string, double>& values) override {
    auto it = values.find("train/loss");
    if (it == values.end()) return;  // an evaluation's values
    const double loss = it->second;
    ++seen_;
    char why[160] = {0};
    if (!std::isfinite(loss)) {
      std::snprintf(why, sizeof why, "divergence_guard: the training loss is %f at step %lld", loss, static_cast<long long>(step));
    } else if (seen_ > grace_ && lowest_ > 0 && loss > factor_ * lowest_) {
      std::snprintf(why, sizeof why, "divergence_guard: training loss %.4g at step %lld is above %.3g x its lowest %.4g",
                    loss, static_cast<long long>(step), factor_, lowest_);
    }
    if (why[0] != 0) {
      loom::sdk::log::warn(why);
      run.request_stop(why);
      return;
    }
    if (lowest_ <= 0 || loss < lowest_) lowest_ = loss;
  }

  loom::sdk::State state_dict() const override {
    return {{}, {{"lowest", std::to_string(lowest_)}, {"seen", std::to_string(seen_)}}};
  }
  void load_state_dict(const loom::sdk::State& state) override {
    if (auto it = state.text.find("lowest"); it != state.text.end()) lowest_ = std::stod(it->second);
    if (auto it = state.text.find("seen"); it != state.text.end()) seen_ = std::stoll(it->second);
  }

  std::string describe() const override {
    char text[96];
    std::snprintf(text, sizeof text, "divergence_guard: stop above %.3g x the lowest training loss", factor_);
    return text;
  }

 private:
  double factor_;
  int64_t grace_;
  double lowest_ = 0;
  int64_t seen_ = 0;
};

}  // namespace

LOOM_PLUGIN("divergence_guard", "1.0.0",
            loom::sdk::component<DivergenceGuard>("divergence_guard", "stop a run whose training loss diverges"))
