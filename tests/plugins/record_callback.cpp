// A callback for tests: logs every hook it gets, in order ("record: on_step_begin 3"), keeps
// state (how many steps it saw, as text, and the sum of their losses, as a tensor) so tests can
// check that a resume restores it, and on request asks the run to stop or throws in a hook.
#include <loom/sdk/sdk.hpp>

#include <ATen/ops/full.h>

#include <sys/resource.h>

namespace {

class RecordCallback final : public loom::sdk::Callback {
 public:
  static constexpr loom_option_spec kOptions[] = {
      loom::sdk::option_int("stop_at", "0", "ask to stop in on_step_end of this step (0: never)"),
      loom::sdk::option_string("fail_in", "", "throw in this hook (e.g. on_log)"),
      loom::sdk::option_int("stop_main_at", "0", "on the main rank only, ask to stop in this step (0: never)"),
      loom::sdk::option_enum("stop_main_in", "on_step_begin", "on_step_begin|on_log|on_step_end|on_run_begin",
                             "the hook stop_main_at stops in (on_run_begin: where the run's next step is stop_main_at)"),
      loom::sdk::option_int("fail_other_at", "0", "on ranks but the main one, throw in on_step_begin of this step (0: never)"),
      loom::sdk::option_string("save_in", "", "call save_checkpoint() in this hook (e.g. on_checkpoint_saved)"),
      loom::sdk::option_enum("odd_text", "none", "none|state|stop_reason|weights_name|best_name",
                             "bytes that are not UTF-8 in its state, in its stop reason at stop_at, a NUL in a weights "
                             "file's name, or the best callback's name (save_weights at stop_at)"),
      loom::sdk::option_int("move_run_at", "0", "in on_step_end of this step, move_run the run folder, as a user might "
                            "mid-run (0: never)"),
      loom::sdk::option_enum("move_run", "rename", "rename|remove|replace",
                             "rename: to <its name>.moved; remove: delete it; replace: by a copy of it"),
      loom::sdk::option_int("limit_files_at", "0", "in on_step_end of this step, lower this process's file-size limit "
                            "(ulimit -f, soft) to limit_files_to bytes: a full disk from then on (0: never; the test "
                            "ignores SIGXFSZ and restores the limit)"),
      loom::sdk::option_int("limit_files_to", "4096", "the file-size limit limit_files_at sets, in bytes"),
  };

  explicit RecordCallback(const loom::sdk::Options& o)
      : stop_at_(o.get_int("stop_at")), fail_in_(o.get_string("fail_in")), stop_main_at_(o.get_int("stop_main_at")),
        stop_main_in_(o.get_string("stop_main_in")), fail_other_at_(o.get_int("fail_other_at")),
        save_in_(o.get_string("save_in")), odd_text_(o.get_string("odd_text")),
        move_run_at_(o.get_int("move_run_at")), move_run_(o.get_string("move_run")),
        limit_files_at_(o.get_int("limit_files_at")), limit_files_to_(o.get_int("limit_files_to")) {}

  std::string describe() const override {
    return "every hook it sees" + (stop_at_ > 0 ? ", a stop at step " + std::to_string(stop_at_) : std::string());
  }
  void on_run_begin(loom::sdk::RunContext& run) override {
    hook("on_run_begin", run.step());
    stop_main(run, "on_run_begin", run.step() + 1);
  }
  void on_step_begin(loom::sdk::RunContext& run, int64_t step) override {
    hook("on_step_begin", step);
    stop_main(run, "on_step_begin", step);
    if (fail_other_at_ > 0 && step == fail_other_at_ && !run.is_main())
      throw loom::sdk::Error("record fails on a rank but the main one at step " + std::to_string(step) + " as asked");
  }
  void on_after_backward(loom::sdk::RunContext& run, const std::vector<at::Tensor>& g) override {
    if (g.empty()) throw loom::sdk::Error("no gradients");
    hook("on_after_backward", run.step() + 1);
    if (save_in_ == "on_after_backward") run.save_checkpoint();
  }
  void on_before_optimizer_step(loom::sdk::RunContext& run, const std::vector<at::Tensor>&) override {
    hook("on_before_optimizer_step", run.step() + 1);
  }
  void on_log(loom::sdk::RunContext& run, int64_t step, const std::map<std::string, double>& values) override {
    hook(values.count("train/loss") ? "on_log train" : "on_log eval", step);
    if (save_in_ == "on_log" && values.count("train/loss")) run.save_checkpoint();
    if (values.count("train/loss")) stop_main(run, "on_log", step);
  }
  void on_evaluation_end(loom::sdk::RunContext&, const loom::sdk::EvalReport& r) override {
    hook(std::string("on_evaluation_end ") + loom::sdk::split_name(r.split), r.step);
  }
  void on_step_end(loom::sdk::RunContext& run, const loom::sdk::StepReport& r) override {
    hook(std::string("on_step_end") + (r.evaluated ? " evaluated" : "") + (r.last ? " last" : ""), r.step);
    ++steps_;
    loss_sum_ += r.loss;
    if (stop_at_ > 0 && r.step == stop_at_ && odd_text_ == "weights_name")
      run.save_weights(std::string("a\0b.safetensors", 15), {});
    if (stop_at_ > 0 && r.step == stop_at_ && odd_text_ == "best_name") run.save_weights("best_loss.safetensors", {});
    if (stop_at_ > 0 && r.step == stop_at_)
      run.request_stop(odd_text_ == "stop_reason" ? "record \xff\xfe asked" : "record asked to stop at step " + std::to_string(r.step));
    stop_main(run, "on_step_end", r.step);
    if (move_run_at_ > 0 && r.step == move_run_at_ && run.is_main()) {
      std::filesystem::path moved = run.run_dir();
      moved += ".moved";
      if (move_run_ != "rename") {
        if (move_run_ == "replace") std::filesystem::copy(run.run_dir(), moved, std::filesystem::copy_options::recursive);
        std::filesystem::remove_all(run.run_dir());
        if (move_run_ == "replace") std::filesystem::rename(moved, run.run_dir());
      } else {
        std::filesystem::rename(run.run_dir(), moved);
      }
    }
    if (limit_files_at_ > 0 && r.step == limit_files_at_) {
      struct rlimit limit {};
      ::getrlimit(RLIMIT_FSIZE, &limit);
      limit.rlim_cur = static_cast<rlim_t>(limit_files_to_);
      if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) throw loom::sdk::Error("record could not lower the file-size limit");
    }
  }
  void on_checkpoint_saved(loom::sdk::RunContext& run, const std::filesystem::path&) override {
    hook("on_checkpoint_saved", run.step());
    if (save_in_ == "on_checkpoint_saved") run.save_checkpoint();
  }
  void on_checkpoint_loaded(loom::sdk::RunContext& run, const std::filesystem::path&) override {
    hook("on_checkpoint_loaded", run.step());
  }
  void on_run_end(loom::sdk::RunContext&, const loom::sdk::RunReport& r) override { hook("on_run_end", r.steps); }

  loom::sdk::State state_dict() const override {
    loom::sdk::State s;
    s.text["steps"] = std::to_string(steps_);
    if (odd_text_ == "state") s.text["odd"] = "\xc3\x28";
    s.tensors["loss_sum"] = at::full({1}, loss_sum_, at::TensorOptions().dtype(at::kDouble));
    return s;
  }
  void load_state_dict(const loom::sdk::State& s) override {
    steps_ = std::stoll(s.text.at("steps"));
    loss_sum_ = s.tensors.at("loss_sum").item<double>();
  }

 private:
  void stop_main(loom::sdk::RunContext& run, const char* in, int64_t step) {
    if (stop_main_at_ > 0 && step == stop_main_at_ && stop_main_in_ == in && run.is_main())
      run.request_stop("record asked rank 0 alone to stop in " + stop_main_in_ + " of step " + std::to_string(step));
  }
  void hook(const std::string& what, int64_t step) {
    if (!fail_in_.empty() && what.rfind(fail_in_, 0) == 0) throw loom::sdk::Error("record fails in " + fail_in_ + " as asked");
    loom::sdk::log::info("record: ", what, " ", step);
  }

  int64_t stop_at_;
  std::string fail_in_;
  int64_t stop_main_at_;
  std::string stop_main_in_;
  int64_t fail_other_at_;
  std::string save_in_;
  std::string odd_text_;
  int64_t move_run_at_;
  std::string move_run_;
  int64_t limit_files_at_;
  int64_t limit_files_to_;
  int64_t steps_ = 0;
  double loss_sum_ = 0;
};

}  // namespace

LOOM_PLUGIN("record_callback", "1.0.0",
            loom::sdk::component<RecordCallback>("record", "test: logs every hook, keeps state, stops or fails on request"))
