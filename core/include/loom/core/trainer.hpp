// The trainer: builds a run from its validated configuration and the loaded plugins, then runs
// the step loop (data flow in DESIGN.md, "The run").
//
// Build steps, in order, each a method so tests can run a part: parallel strategy (device) ->
// dataset -> model -> precision -> plan -> optimizer -> loaders -> run folder and resume. Then
// per optimizer step:
//   for each of `accumulation` micro-batches: forward (precision guard) -> loss sum -> backward
//   -> sync gradients and counts across ranks -> divide by the global count -> unscale -> clip
//   -> step (skipped on non-finite gradients) -> schedule -> metrics
// The step's state (loader position, RNG, step counter) is explicit (StepState), so a step can
// be replayed from where it started and a checkpoint restores it exactly.
#pragma once

#include <loom/core/config.hpp>
#include <loom/core/device_memory.hpp>
#include <loom/core/estimator.hpp>
#include <loom/core/data_loader.hpp>
#include <loom/core/parameters.hpp>
#include <loom/core/plugin_registry.hpp>
#include <loom/core/stop_signals.hpp>
#include <loom/core/throughput.hpp>

#include <loom/sdk/callback.hpp>
#include <loom/sdk/dataset.hpp>
#include <loom/sdk/memory_policy.hpp>
#include <loom/sdk/model.hpp>
#include <loom/sdk/optimizer.hpp>
#include <loom/sdk/parallel.hpp>
#include <loom/sdk/precision.hpp>

#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace loom::core {

class CheckpointStore;
class FileLock;
class StepGraphs;
class GradientSync;
class Replicas;

/// The [trainer] and [data] loader settings, read once from the resolved configuration.
struct TrainerOptions {
  std::string name, work_dir, device;
  int64_t seed = 0, threads = 0, epochs = 1, max_steps = 0, batch_size = 128, accumulation = 1;
  double bucket_mb = -1;  ///< parallel.bucket_mb: gradient buckets reduced during backward (0: after it; -1: auto)
  std::string optimizer = "adamw", schedule = "constant";  ///< component names (schedule resolved from auto)
  double lr = 1e-3, clip_grad_norm = 1.0;
  bool device_step = true;  ///< Note [The step on the device]
  int64_t stop_after_skipped = 100;  ///< steps in a row with non-finite gradients that stop the run (0: none)
  bool cuda_graph = false;  ///< step.cuda_graph: Note [The step as a CUDA graph]
  int64_t cuda_graph_warmup = 3;
  int64_t reference_batch = 0;
  int64_t eval_every = 0, log_every = 10, checkpoint_every = 0, keep_last = 3;
  double peak_tflops = 0;  ///< trainer.peak_tflops: the device's peak for the MFU (0: from the card's name)
  std::string best_metric = "accuracy";
  std::string resume = "none", resume_from;
  std::string init_from;  ///< a checkpoint whose model weights a new run starts from
  bool allow_precision_change = false;
  int64_t device_memory_limit = 0;  ///< bytes; 0: none
  std::string memory_snapshot;      ///< CUDA: write a snapshot here at the end (or at a fatal OOM)
  bool snapshot_on_oom = false;
  bool estimate_memory = true;
  int64_t num_workers = 2, prefetch = 2;
  bool pin_memory = true, shuffle = true;
  double validation_fraction = 0.1;

  static TrainerOptions from(const Resolved& config);
};

struct StepResult {
  int64_t step = 0;      ///< the step just taken (1-based)
  double loss = 0;       ///< mean loss over the global batch
  double lr = 0;
  double grad_norm = 0;
  bool skipped = false;  ///< non-finite gradients: no update
  int64_t samples = 0;   ///< the global batch: known on the host, read or not
  int64_t terms = 0;     ///< what the loss averages over (the model's count: samples, tokens, ...)
  std::map<std::string, double> metrics;  ///< e.g. accuracy of the batch
  bool read = true;      ///< false: loss, metrics, grad_norm, skipped, samples stayed on the device
};

/// One evaluation over a whole split (the callbacks' EvalReport).
using EvalResult = sdk::EvalReport;

struct TrainSummary {
  int64_t steps = 0;
  double seconds = 0;             ///< training time, evaluation excluded
  double samples_per_second = 0;
  std::optional<EvalResult> final_eval;
  int64_t peak_memory = -1;       ///< bytes: peak allocated on the device (CPU: Loom's allocator)
  int64_t peak_resident = -1;     ///< bytes: peak resident set of the process
  int64_t predicted_peak = -1;    ///< the estimator's prediction at the final plan, if it ran
  int64_t oom_recoveries = 0;
  double recovery_seconds = 0;    ///< time spent unwinding and re-planning (replays excluded)
  std::string stop_reason;        ///< why the run stopped before its end (a callback, a signal), else empty
  int signal = 0;                 ///< the stop signal (SIGINT, SIGTERM, SIGHUP, SIGPIPE) that ended it, else 0
  std::filesystem::path run_dir;
  bool wrote_summary = false;     ///< this run wrote run_dir/summary.json (its final evaluation)
};

/// Where a step starts: enough to replay it, or to resume there.
struct StepState {
  int64_t step = 0;
  DataLoader::Position loader;
  at::Tensor cpu_rng;
  at::Tensor device_rng;
  std::vector<at::Tensor> buffers;  ///< the model's buffers, in named_buffers() order
  int64_t peak = 0;  ///< the device's peak allocation when the step began (the run's so far)
};

/// The run folder was renamed or removed while the run went on: the run stopped, writing nothing
/// at its old path; what() says where it went and how to continue there.
struct RunFolderGone : Error {
  using Error::Error;
};

class Trainer {
 public:
  /// `config` is the validated configuration (validate(run_schema(...))); `registry` provides
  /// the components and must outlive the trainer.
  Trainer(Resolved config, const PluginRegistry& registry);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  /// Runs every build step and the resume, and logs the start-up report.
  void setup();

  /// The build steps evaluation needs (no optimizer, no run folder).
  void setup_for_evaluation();

  /// Loads only the model's weights from a checkpoint folder or a best_<metric>.safetensors file.
  void load_weights(const std::filesystem::path& checkpoint);
  /// loom eval, loom recommend: warns where a split of this run's data holds another number of
  /// samples than the checkpoint's run recorded (ratings changed in place, the ids the same): its
  /// figures would be of other data, in silence. Nothing for a checkpoint older than the record.
  void warn_if_data_sizes_differ(const std::filesystem::path& checkpoint) const;

  /// Trains to the end (max_steps or epochs, or until a callback asks to stop), evaluating every
  /// trainer.eval_every steps; the callbacks write, checkpoint and report (sdk/callback.hpp).
  TrainSummary train();

  /// One optimizer step. With `read_values` false (and the update on the device, Note [The step
  /// on the device]) the step's loss, metrics and norm stay on the device, added to the log
  /// window, and the host does not wait for the device: the result's values are NaN (read false).
  StepResult train_step(bool read_values = true);

  /// One optimizer step that survives running out of memory: the step unwinds (no update is
  /// applied), memory is freed, the memory policies re-plan (oom_recovery halves the
  /// micro-batch), and the step replays from its saved state. When no policy can help, throws
  /// loom::Error with advice.
  StepResult step_with_recovery(bool read_values = true);

  /// Peak memory of a forward and backward at micro-batch `b` (model states included), with no
  /// trace left: gradients zeroed, RNG restored, weights and optimizer untouched. Throws
  /// c10::OutOfMemoryError past the cap. See sdk::PlanContext::probe.
  /// `train` false: an evaluation forward's peak (no gradients, evaluation mode, test samples).
  int64_t probe_peak(int64_t b, bool train = true);
  /// probe_peak under a cap of `most` bytes on the CPU (where past the machine's memory there is no
  /// exception to catch), the run's own cap restored after; elsewhere probe_peak.
  int64_t probe_peak_within(int64_t b, bool train, int64_t most);

  /// Parameter, gradient and optimizer-state bytes of this run.
  ModelStates model_states() const;

  /// Activation fit for predicting micro-batch `micro`: probes at micro/4 and micro/2 (at least
  /// 1 and 2), halved while they run out of memory. nullopt when even 1 and 2 fail.
  std::optional<ActivationFit> activation_fit(int64_t micro);

  /// Builds what the estimator needs (device, memory, data, model, precision, optimizer).
  void setup_for_estimate();

  /// The samples a run trains on: the training split less what data.validation_fraction holds
  /// out (none where the dataset has a validation split of its own). After setup_for_estimate().
  int64_t training_samples() const;
  /// The samples of the largest split an evaluation reads (test, or validation: the dataset's own,
  /// or what is held out of train); an evaluation's batch is no larger.
  int64_t evaluated_samples() const;

  /// Evaluates on a split (kValidation: the dataset's own, or the share of train held out by
  /// data.validation_fraction; kTest), at the training plan's micro-batch (smaller where the
  /// memory policies re-plan it after running out of memory; then it starts again). An empty
  /// result (0 samples) when the run has no such split.
  EvalResult evaluate(sdk::Split split = sdk::Split::kTest);

  /// Saves a checkpoint of the current step; returns its folder.
  std::filesystem::path save_checkpoint();

  /// Restores a checkpoint folder (model, optimizer, precision, RNG, loader, step), after
  /// checking that it fits this run (model configuration, precision manifest).
  void load_checkpoint(const std::filesystem::path& dir);

  StepState capture() const;
  void restore(const StepState& state);
  /// Copies of the model's buffers (BatchNorm statistics, ...), and putting them back: probes
  /// and replayed steps leave them as they were.
  std::vector<at::Tensor> save_buffers() const;
  void restore_buffers(const std::vector<at::Tensor>& saved);

  /// Called every step with the gradients once they are summed over ranks and divided by the
  /// global count, before unscaling and clipping (before the callbacks' on_after_backward): for
  /// tests that inject faults (an inf or a NaN).
  void set_gradient_hook(std::function<void(const std::vector<at::Tensor>&)> hook) { gradient_hook_ = std::move(hook); }
  /// Whether the steps' division by the count and clipping go into the update (Note [One pass
  /// over the gradients], trainer_step.cpp): on the device, and no callback or hook looks at the
  /// gradients.
  bool divides_in_update() const { return step_on_device_ && !callbacks_read_gradients_ && !gradient_hook_; }

  sdk::PrecisionStrategy& precision() { return *precision_; }
  int64_t skipped_steps() const { return skipped_steps_; }
  /// This process's steps, and those of them that skipped their update (since the checkpoint a
  /// resumed run started from).
  int64_t session_steps() const { return step_ - std::max<int64_t>(resumed_at_, 0); }
  int64_t session_skipped() const { return skipped_steps_ - skipped_at_resume_; }
  /// The first of the model's parameters holding NaN or an infinity, or buffers holding NaN, as
  /// "parameter 'w' holds NaN or infinite values" ("" if none). One read of the device.
  std::string nonfinite_weights() const;
  sdk::DeviceMemory& memory() { return *memory_; }
  int64_t probes_run() const { return probes_run_; }
  int64_t predicted_peak() const { return predicted_peak_; }
  /// Note [Model FLOPs in the log]: the model's FLOPs per loss term (0: not declared) and the
  /// device's peak for the run's precision (tflops 0: unknown).
  double model_flops_per_term() const { return flops_per_term_; }
  const PeakFlops& peak_flops() const { return peak_; }
  int64_t oom_recoveries() const { return oom_recoveries_; }
  /// step.cuda_graph: the step's captures so far (0 without graphs).
  int64_t graph_captures() const;

  int64_t step() const { return step_; }
  int64_t total_steps() const { return total_steps_; }
  /// The final evaluation's loss that summary.json records for this step (the checkpoint's, in a
  /// run resumed at its end or after its early stop): nothing where no summary is of this step.
  std::optional<double> recorded_final_loss() const;
  /// The checkpoint's step (or, after train(), the last step) was to be evaluated when a stop cut
  /// the evaluation short: train() runs it first (and the test split after it, at the last step).
  bool evaluation_pending() const {
    return evaluation_pending_ || (evaluation_cut_at_ >= 0 && evaluation_cut_at_ == step_);
  }
  /// Resumed at the run's end, validated, but its test evaluation did not run (a stop or a failure
  /// cut it short; rank 0's summary.json says "not run"): train() runs it alone and records it there.
  bool test_evaluation_pending() const { return test_pending_; }
  /// After train(): summary.json (rank 0's) says the run's test evaluation did not run, and a resume
  /// of the run runs it (trained to its end, validated, its checkpoints written).
  bool test_evaluation_left_pending() const;
  const sdk::BatchPlan& plan() const { return plan_; }
  c10::Device device() const { return device_; }
  sdk::Model& model() { return *model_; }
  /// The model's outputs for `inputs` (Model::predict, 2.1): moved to the device, evaluation
  /// mode, no gradients, the precision's forward guard; the outputs on the CPU. Throws Error
  /// naming the model when it has no predict path.
  sdk::Batch predict(const sdk::Batch& inputs);
  sdk::Dataset& dataset() { return *dataset_; }
  /// The dataset's shared tables (Dataset::tables, 1.2; empty for an older dataset).
  sdk::TensorMap dataset_tables() const;
  const sdk::DataSpec& data_spec() const { return data_spec_; }
  const std::filesystem::path& run_dir() const { return run_dir_; }
  /// When no step trained: setup() failed after the folder opened, train() failed before its first
  /// step (a callback that refused the run in on_run_begin, say), or a stop came before it. A run
  /// folder this command made, with no step trained and no checkpoint, is removed, so that the name
  /// is free for the corrected command; in a folder of the user's that --resume-from started a run
  /// in, only what this command wrote goes. Says so in the log; returns whether anything went.
  bool discard_if_nothing_trained();
  const TrainerOptions& options() const { return options_; }
  /// The run's callbacks by name, in trainer.callbacks order (after setup).
  const std::vector<std::pair<std::string, std::shared_ptr<sdk::Callback>>>& callbacks() const { return callbacks_; }
  /// The metrics of this run's model, "loss" included (after setup).
  const std::map<std::string, sdk::MetricSpec>& metric_specs() const { return metric_specs_; }
  /// "accuracy 88.89 %", "RMSE 0.8123": a metric's value as its spec says to show it.
  std::string format_metric(const std::string& name, double value) const;
  /// Replaces each metric mean in `values` (keys `prefix` + name) by the value the model reports
  /// for it (Model::metric_value, 2.1: RMSE from the mean squared error). Means are what steps,
  /// windows and evaluations add up; the values are what is shown and written.
  void finish_metrics(std::map<std::string, double>& values, const std::string& prefix = "") const;
  /// The devices the batch is spread over, this process's (replicas included) on every rank
  /// (after set-up; `loom memory` estimates for them).
  int64_t devices_in_world() const { return parallel_->world_size() * local_devices(); }

 private:
  /// Threads, seed, parallel strategy, data, device memory, model, precision (and optimizer).
  void build_components(bool with_optimizer);
  void build_parallel();
  void build_memory();
  void build_data();
  void build_model();
  /// The model's plugin's object, set up and given the dataset's tables, on the CPU.
  Created<sdk::Model> make_model();
  /// A strategy with several devices in this process (data_parallel): the model's replicas.
  void build_replicas();
  /// Devices this process trains on (replicas included).
  int64_t local_devices() const;
  void build_precision();
  void build_throughput();
  void build_plan();
  /// A resume whose memory policies chose another global batch than the checkpoint's (another
  /// device, another cap) takes the checkpoint's, re-split at the micro-batch that fits here.
  void adopt_global_batch(int64_t global);
  /// What a checkpoint records of an out-of-memory re-plan: the configuration (config_key), the
  /// device with its cap (memory_identity), the accumulation the run was configured with.
  struct OomRecord {
    std::string config, device;
    int64_t accumulation = -1;
  };
  /// A resume on the device and configuration its checkpoint's run ran out of memory with starts at
  /// that run's re-plan (`saved`, of the same global batch), not at the plan that ran out; each rank
  /// by its own device, then agree_resumed_plan once the ranks meet (trainer_memory.cpp).
  void adopt_oom_plan(const sdk::BatchPlan& saved, const OomRecord& record);
  void agree_resumed_plan();
  void use_plan(const sdk::BatchPlan& plan);  // a re-plan of the same global batch, the loader's too
  /// Asks the memory policies in order to re-plan after an out-of-memory; the name of the one
  /// that did (as memory.policies names it), or "" where none did.
  std::string replan_on_oom(sdk::OomContext& context);
  void build_optimizer();
  void build_schedule();
  /// step.cuda_graph: checks that the step can be captured (Note [The step as a CUDA graph]).
  void build_step_graphs();
  /// The loaders; `training` false (eval, recommend): the validation and test loaders only, so a
  /// checkpoint of a small dataset is evaluated whatever the batch size (none of it trains).
  void build_loaders(bool training = true);
  void build_callbacks();
  /// Chooses, claims and locks the run folder, resumes (run_folder.cpp).
  void open_run();
  std::filesystem::path save_checkpoint_for_callback();  // RunContext::save_checkpoint: not mid-step, not re-entrant
  void write_run_summary();  // rank 0, an evaluation at the run's end: summary.json
  void say_checkpoint_unsaved_in_summary(const std::string& why);  // this step's summary.json, its save failing
  void open_run_here();  // rank 0 (or a single process): chooses, locks and writes the run folder
  void join_run();       // other ranks: rank 0's run folder and checkpoint, nothing written
  // Several ranks (trainer_parallel.cpp): what every rank must agree on.
  void broadcast_model();         // rank 0's parameters and buffers on every rank
  void seed_rank();               // ranks > 0 draw their own dropout, seeded anew at each step
  void sync_buffers();            // the buffers a step changed become rank 0's on every rank
  bool any_rank(bool local);      // true on every rank when it is true on one
  sdk::BatchPlan agree_plan(const sdk::BatchPlan& mine);  // the plan of the smallest micro-batch
  int stop_signal();              // a stop signal any rank received (agreed once per step)
  void check_replicas();          // at the end: every rank's weights are rank 0's
  void build_gradient_sync();
  DataLoader::Position position_for_world(int64_t epoch, int64_t offset, int64_t saved_world) const;
  /// A resume's position and length (Note [An epoch of whole steps]); whether an epochs-based run is at its end.
  bool on_the_steps_grid(DataLoader::Position& position);
  /// Locks `dir` (made where missing) as this run's; whether it made the lock file (it had none).
  bool lock_run(const std::filesystem::path& dir);
  /// Lets go of `dir`'s lock, and removes its lock file where lock_run made it (`made`): a folder passed over keeps none.
  void unlock_run(const std::filesystem::path& dir, bool made);
  /// Throws RunFolderGone where the locked run folder is no longer at run_dir_ (rank 0; a stat).
  void check_run_folder() const;
  void refuse_training_alone_among_ranks() const;  // RANK/WORLD_SIZE say several, the strategy trains alone
  /// Loads the newest checkpoint of a run folder that loads; false (with the reasons added to
  /// `problems`) when none does. A checkpoint that does not fit this run (ResumeRefused) throws.
  bool resume_newest(const std::filesystem::path& dir, std::vector<std::string>& problems);
  /// The data keys this run sets otherwise than the checkpoint's state.json records them, as
  /// "data.seed = 9 (the checkpoint's: 3)".
  std::vector<std::string> changed_data(const std::string& state_json) const;
  /// What a checkpoint records of the data's splits (JSON: the samples per split, the held-out
  /// samples' fingerprint where the dataset gives one; null where a size cannot be read).
  std::string data_sizes_json() const;
  /// After resuming from an older checkpoint of this run: its newer step folders move aside.
  void set_aside_newer_steps(const std::filesystem::path& checkpoint);
  /// --resume auto in a folder whose run wrote files but no checkpoint: they move aside.
  void set_aside_files_without_checkpoint();
  /// Rank 0, once a step of a resumed run trained: a summary.json of an earlier step (a run resumed
  /// past the end it summarised) goes to summary.until_step_<N>.json; the run's end writes its own.
  void set_aside_earlier_summary();
  /// A resume, against the record of how its checkpoint was trained: keep_last left at its
  /// default takes the recorded value; other differences are said, and the record kept.
  void read_the_runs_config();

  /// What callbacks see of the run (trainer_callbacks.cpp).
  class Context;
  /// The steps since values were last logged: their means are what on_log records. Part of a
  /// checkpoint, so that the first values logged after a resume are those of the run that never
  /// stopped.
  struct LogWindow {
    double seconds = 0, loss = 0;
    int64_t steps = 0, samples = 0, terms = 0;  ///< samples of every step; the loss's terms of those read
    std::map<std::string, double> metrics;
    // Steps whose values stayed on the device: [loss mean, loss terms, metric means..., skipped]
    // summed, until flush_window() reads them.
    at::Tensor device_sums;
    std::vector<std::string> device_metrics;
    int64_t device_steps = 0;
    void add(const StepResult& r, double dt);
    /// Adds the window's means to `values` and starts a new window.
    std::map<std::string, double> take(std::map<std::string, double> values);
  };
  LogWindow window_;
  /// Reads the window's device sums into it (one wait), counts and reports the skipped steps.
  void flush_window();
  /// Throws once trainer.stop_after_skipped steps in a row skipped their update.
  void stop_if_skipping() const;
  bool read_every_step_ = true;  ///< some callback reads every step's values (Callback 1.1)
  bool callbacks_read_gradients_ = true;  ///< some callback reads the gradients (Callback 1.2)
  std::string step_readers_;     ///< which ones, for the start-up report
  /// Calls `hook` on each callback in order; an error names the callback and the hook.
  void notify(const char* hook, const std::function<void(sdk::Callback&, sdk::RunContext&)>& call);
  /// The split evaluations during training use: validation when the run has one, else test.
  sdk::Split selection_split() const;
  /// Evaluates `split` if the run has it, then logs and tells the callbacks. Whether it ran.
  bool evaluate_and_report(sdk::Split split);
  /// The values the callbacks' on_log gets for a window of steps ending with `last`.
  std::map<std::string, double> step_values(const StepResult& last) const;
  sdk::StepReport step_report(const StepResult& r, double seconds) const;
  /// The summary, the callbacks' on_run_end, the memory snapshot.
  TrainSummary finish_run(int64_t first_step, double train_seconds);
  /// Saves the model's weights as <run>/checkpoints/<file_name> (RunContext::save_weights).
  std::filesystem::path save_weights(const std::string& file_name, const sdk::TextMap& metadata);

  EvalResult evaluate_once(DataLoader& loader);
  /// One micro-batch, the same for a training step, an evaluation and a memory probe: forward
  /// under the precision strategy's guard and, when `train`, the scaled loss's backward.
  sdk::ModelOutput run_micro_batch(const sdk::Batch& batch, bool train);
  /// run_micro_batch over every device of this process: the batch cut across the replicas
  /// (Note [Replicas in one process]); the primary model alone without replicas.
  sdk::ModelOutput run_spread(const sdk::Batch& batch, bool train);
  DataLoader* eval_loader(sdk::Split split) const;
  /// Per metric: (sum, count) over the micro-batches so far.
  using MetricSums = std::map<std::string, std::pair<at::Tensor, at::Tensor>>;
  void add_metrics(MetricSums& sums, const sdk::ModelOutput& out) const;
  /// Adds a step's packed report (pack_report, then the norm and found-inf) to the log window's
  /// device sums.
  void add_unread(const at::Tensor& packed, const MetricSums& metric_sums);
  /// What a step's micro-batches leave for its update: the packed report, reduced across ranks,
  /// and the gradients, divided by the global count.
  struct StepWork {
    at::Tensor totals;
    MetricSums metric_sums;
    std::vector<at::Tensor> grads, flats;
    bool divided = true;  ///< the gradients are divided by the count (else the update divides them)
  };
  /// Forward and backward over the step's micro-batches (`batch_of(i)` gives micro-batch i),
  /// the reduction, the division; the device work a CUDA graph captures up to the update.
  StepWork forward_backward(const std::function<sdk::Batch(int64_t)>& batch_of);
  /// The update on the device (Note [The step on the device]): unscale, clip, the fused update
  /// that skips itself on non-finite gradients, the scaler; returns the packed report
  /// [totals, norm, found-inf, rate]. Queues device work only.
  at::Tensor queue_update(const StepWork& work);
  /// The host's side of a step on the device: reads the packed report (`read`) or adds it to the
  /// log window's device sums. Whether the update was taken (true when not read).
  bool finish_on_device(StepResult& result, const at::Tensor& packed, const MetricSums& metric_sums, bool read);
  /// The update on the host: read, check, then step. Whether the update was taken.
  bool update_on_host(StepResult& result, const StepWork& work);
  /// The table of the schedule's rates the device looks the step's rate up in (made before the
  /// commit point and outside a capture).
  void ensure_rate_table();
  /// A step with step.cuda_graph: warm-up, capture or replay (Note [The step as a CUDA graph]).
  bool graphed_step(StepResult& result, bool read);
  std::vector<std::string> metric_names() const;
  double current_lr() const;
  /// The schedule's learning rate after `taken` updates (checked: finite, >= 0).
  double rate_after(int64_t taken) const;
  std::string state_json() const;
  sdk::TensorMap model_tensors() const;
  /// "model 'name'", for the model's errors, saying so where a parameter's shape changed since set-up.
  std::string model_who() const;
  /// Throws where a parameter holds NaN or an infinity: `what` (the checkpoint, best_x.safetensors) is not written.
  void check_weights_before_saving(const std::string& what) const;
  void restore_model(const sdk::TensorMap& tensors, const std::string& what);
  void init_weights(const std::string& from);  // trainer.init_from
  bool init_first() const;  ///< init_from loads before the run folder is made: the run is surely new
  void check_model_config(const std::string& saved_name, const std::map<std::string, std::string>& saved_config,
                          const std::string& what) const;
  std::map<std::string, std::string> section(const std::string& name) const;
  void report_startup() const;
  void note_pending_test();  // test_pending_ from summary.json (rank 0's), after a resume at the run's end
  bool writes_checkpoints() const;  // trainer.callbacks has 'checkpoint'

  Resolved config_;
  const PluginRegistry& registry_;
  TrainerOptions options_;

  Created<sdk::ParallelStrategy> parallel_;  // with its interface version: start_all_reduce_sum needs 1.1
  Created<sdk::Dataset> dataset_;  // with its interface version: kValidation needs 1.1
  Created<sdk::Model> model_;      // with its interface version: use_tables, metric_value and predict need 2.1
  std::unique_ptr<GradientSync> sync_;
  std::unique_ptr<Replicas> replicas_;  // data_parallel: the model on the other devices of this process
  std::vector<std::unique_ptr<sdk::DeviceMemory>> replica_memory_;  // their memory, for the per-device line (CUDA)  // several ranks: buckets reduced during backward (gradient_sync.hpp)
  std::shared_ptr<sdk::PrecisionStrategy> precision_;
  std::vector<std::shared_ptr<sdk::MemoryPolicy>> memory_policies_;
  sdk::DataSpec data_spec_;
  std::map<std::string, sdk::MetricSpec> metric_specs_;
  c10::Device device_{c10::kCPU};

  sdk::BatchPlan plan_;
  double base_lr_ = 0;
  int64_t total_steps_ = 0;
  int64_t step_ = 0;
  int64_t skipped_steps_ = 0;
  int64_t skipped_in_a_row_ = 0;  ///< the last steps that skipped their update (as far as read)
  bool precision_on_device_ = false;  ///< the precision implements interface 1.1
  bool step_on_device_ = false;  ///< trainer.device_step and both plugins implement interface 1.1
  bool optimizer_divides_ = false;  ///< the optimizer implements step_on_device_dividing (Optimizer 1.2)
  at::Tensor lr_on_device_;      ///< the step's learning rate, for the fused kernels
  at::Tensor last_unread_;       ///< the last unread step's report (its norm, found-inf, rate: a stop logs them)
  at::Tensor lr_table_;          ///< the learning rate after k taken updates, k = 0..total_steps
  at::Tensor taken_on_device_;   ///< updates taken so far ([1], int64): the schedule's position
  std::unique_ptr<StepGraphs> graphs_;  ///< step.cuda_graph
  sdk::BatchPlan graph_plan_;           ///< the plan the graphs were captured at
  int64_t skipped_at_resume_ = 0;  ///< skipped_steps_ when the run resumed
  int64_t scale_descent_ = 0;      ///< steps the resumed loss scale may overflow coming down (loss_scale_descent)
  bool said_zero_gradients_ = false;  ///< a logged step's gradients were all zero: said once
  bool said_no_terms_ = false;        ///< a logged step's loss counted no terms: said once
  Parameters parameters_;
  std::shared_ptr<sdk::Optimizer> optimizer_;
  std::shared_ptr<sdk::Schedule> schedule_;
  std::unique_ptr<DataLoader> train_loader_, val_loader_, test_loader_;
  int64_t held_out_ = 0;  ///< training samples held out for validation
  std::filesystem::path run_dir_;
  std::unique_ptr<CheckpointStore> checkpoints_;
  std::vector<std::pair<std::string, std::shared_ptr<sdk::Callback>>> callbacks_;
  /// The states, in the resumed checkpoint, of callbacks this run does not select (their text by
  /// name; their tensors by "callback.<name>.<key>"): saved again with every checkpoint, so that a
  /// later resume selecting one again continues it (the best callback's best so far, an early
  /// stop's count), as if the runs between had not dropped it.
  std::map<std::string, sdk::TextMap> unselected_callback_text_;
  sdk::TensorMap unselected_callback_tensors_;
  std::unique_ptr<Context> context_;
  std::string stop_reason_;
  std::optional<EvalResult> last_eval_;
  bool wrote_summary_ = false;
  int64_t eval_every_ = 1;
  int64_t resumed_at_ = -1;
  /// The step whose scheduled evaluation a stop signal cut short or skipped (its checkpoint says
  /// so), and whether the checkpoint this run resumed from had one: it runs first on resume.
  int64_t evaluation_cut_at_ = -1;
  int64_t window_saved_at_ = -1;  // the step whose checkpoint holds a log window not yet logged (a resume logs it)
  bool evaluation_pending_ = false;
  bool test_pending_ = false;
  double bucket_mb_ = 0;   // parallel.bucket_mb resolved for the device
  int64_t bucket_bytes_ = 0;  // the gradient buckets' mean size
  std::vector<at::Tensor> buffers_at_setup_;           // copies of the model's buffers, until the first step
  std::optional<std::vector<at::Tensor>> moving_buffers_;  // those the first step changed on some rank
  std::string model_name_;    // model.name, for the model's errors
  std::string precision_name_;  // precision.name, for the precision strategy's errors
  /// Each parameter's shape when the optimizer was set up (model_who).
  std::vector<std::pair<std::string, std::vector<int64_t>>> parameter_shapes_;
  const char* hook_ = nullptr;  // the callback hook being called, if any
  const std::string* callback_ = nullptr;  // the callback being called, if any
  int agreed_signal_ = 0;  // a stop signal of another rank, agreed at the step (stop_signal())
  bool another_rank_stopped_ = false;  // a callback of another rank asked to stop in the step (stop_signal())
  std::filesystem::path resumed_from_;
  std::unique_ptr<FileLock> run_lock_;  ///< held while the trainer lives
  bool made_run_dir_ = false;           ///< this command made run_dir_ (discard_if_nothing_trained)
  /// A run folder that was there, holding no run, that --resume-from starts one in: its entries
  /// before this command (discard_if_nothing_trained removes the others, the user's own stay).
  std::optional<std::set<std::string>> entries_before_;
  /// What a resume in place writes of the run's record, written once a step trained (or its
  /// pending evaluation ran): config.json with this command's settings and the
  /// config.until_step_N.json of the steps before. A resume refused at its first step (the data
  /// changed), stopped before it, or killed in it leaves the record as it was.
  struct PendingRecord {
    std::filesystem::path dir;    ///< the run folder; empty: nothing pending
    std::filesystem::path until;  ///< the config.until_step_N.json to write, if any
    std::string until_text, config;
    void commit();  ///< writes what is pending, once
  } pending_record_;
  std::function<void(const std::vector<at::Tensor>&)> gradient_hook_;
  std::unique_ptr<sdk::DeviceMemory> memory_;
  int64_t probes_run_ = 0;
  bool probed_ = false;  ///< the unmeasured forward before the first probe ran
  int64_t oom_recoveries_ = 0;
  bool plan_after_oom_ = false;  ///< plan_ is an out-of-memory re-plan (this run's, or its checkpoint's)
  double recovery_seconds_ = 0;
  bool committed_ = false;  ///< the running step has begun to change the run's state (no replay)
  bool ranks_agreed_ = false;  ///< the ranks agreed the step's forward and backward went well (no replay)
  int64_t predicted_peak_ = -1;
  int64_t peak_before_replan_ = 0;  ///< the run's peak before its last re-plan (the peak restarts there)
  double flops_per_term_ = 0;
  PeakFlops peak_;
  int64_t eval_micro_batch_cap_ = std::numeric_limits<int64_t>::max();  ///< lowered when evaluation ran out of memory
  std::optional<ActivationFit> fit_;
  std::string oom_advice(const std::string& message) const;
  std::string config_key() const;
  std::string memory_identity() const;  ///< the device and its memory cap, as an out-of-memory re-plan is recorded with
};

/// Reads the run's configuration into its final form: resolves automatic choices
/// (precision.name = auto: AMP on a GPU, fp32 on CPU; --memory-fraction adds the fraction_cap
/// policy) and validates every key against the core's and the chosen components' schemas.
/// `components`: each chosen component's own checks of its options too (check_components).
Resolved resolve_run(Config config, const PluginRegistry& registry, bool components = true);

/// Each component `resolved` chooses built with its options (its factory's checks: a dataset's
/// folder not set); its error names it. `loom config keys` lists the keys before it says this.
void check_components(const Resolved& resolved, const PluginRegistry& registry);

/// `--resume auto` continues a run as it was given: each setting the run was given (in its
/// config.json, from a file, a flag or --set; not a default or an automatic choice) that this
/// command leaves at its default is the run's, with the origin "the run's config.json". The run is
/// trainer.name's folder in trainer.work_dir, else the newest run there, where it has a checkpoint
/// (the trainer refuses to resume another with these settings). A key the run's components no
/// longer have (another model chosen now, an older Loom's) is left out; the keys that place the run
/// (name, work_dir, resume, resume_from, init_from) and this machine's (device, threads, the
/// loader's workers, a device's memory cap, parallel.*, step.*) are this command's; so are
/// max_steps where it gives epochs, the precision keys where it gives one, the memory fraction
/// where it gives policies (each where its value differs from the run's). Where the run's settings
/// choose a component not loaded now, the error names the run's config.json; a value the run's
/// components refuse names its origin, the run's config.json. Otherwise `config` as it is.
Config with_run_settings(Config config, const PluginRegistry& registry);

/// The model's and data's configuration a checkpoint was trained with (from a step folder's
/// state.json or a best_<metric>.safetensors file's metadata), as config keys ("model.d_model").
std::map<std::string, std::string> checkpoint_run_config(const std::filesystem::path& checkpoint);

/// The precision a checkpoint was trained in and the type of device it trained on ("cpu",
/// "cuda"), from a step folder's state.json or a weights file's metadata; empty where it does not
/// say (the device: checkpoints before 0.1's precision record).
struct TrainedIn {
  std::string precision, device;
};
TrainedIn checkpoint_trained_in(const std::filesystem::path& checkpoint);

/// Peak resident memory of this process, in bytes.
int64_t peak_resident_bytes();

/// Why trainer.threads = `threads` cannot run under a limit of `limit` processes and threads per
/// user (ulimit -u), or "" when it can. Trainer::setup applies it to users the kernel holds to it.
std::string threads_over_process_limit(int64_t threads, uint64_t limit);

}  // namespace loom::core
