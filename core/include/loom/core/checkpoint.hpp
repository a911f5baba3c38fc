// Checkpoints: one folder per saved step, <run>/checkpoints/step_00000300/, holding
//   model.safetensors      the module's parameters and buffers
//   optimizer.safetensors  optimizer state, precision state (loss scale), RNG states
//   state.json             step, loader position, plan, schedule, precision manifest, the model's
//                          and data's configuration, metrics
// A folder is written as .step_00000300.tmp, every file fsynced, then renamed into place, so a
// folder named step_* is always complete: a run killed at any moment loses only the step in
// progress. Pruning renames a folder to .step_*.deleting before deleting it, for the same reason. Weights files sit beside them (the best callback's best_<metric>.safetensors).
#pragma once

#include <loom/sdk/types.hpp>

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace loom::core {

struct Checkpoint {
  std::filesystem::path dir;
  sdk::TensorMap model;
  sdk::TensorMap extra;  ///< optimizer.safetensors
  std::string state_json;
};

class CheckpointStore {
 public:
  /// Makes <run_dir>/checkpoints, and clears what an interrupted save left (recover()).
  explicit CheckpointStore(std::filesystem::path run_dir);

  /// What an interrupted save left in <run_dir>/checkpoints: partial .step_*.tmp folders go; a step
  /// folder set aside to be replaced by a new save of its step (.step_*.replaced) goes back where
  /// the new one never arrived. Before a resume lists the steps (the run's lock held).
  static void recover(const std::filesystem::path& run_dir);

  /// Where <run_dir>/checkpoints is a link (to a larger disk): that folder is this run's alone.
  /// Throws Error where it is another run's (its checkpoints folder, its run folder, or a folder
  /// a run of another folder claimed: its file .loom-run names the run); else claims it. Two runs
  /// linked to one folder resumed each other's steps and wrote over each other's best weights.
  static void claim_link(const std::filesystem::path& run_dir);

  const std::filesystem::path& dir() const { return dir_; }

  /// Writes step `step` atomically; then keeps only the newest `keep_last` step folders.
  std::filesystem::path save(int64_t step, const sdk::TensorMap& model, const sdk::TensorMap& extra,
                             const std::string& state_json, int64_t keep_last);

  /// Writes <checkpoints>/<file_name> (a plain *.safetensors name): the model's tensors with
  /// `metadata`, atomically. The best checkpoint is one (best_<metric>.safetensors).
  std::filesystem::path save_weights(const std::string& file_name, const sdk::TensorMap& model,
                                     const sdk::TextMap& metadata);
  /// Throws where `file_name` is no plain *.safetensors name save_weights takes (checked on every
  /// rank before rank 0 writes: one rank's refusal alone left the others in the next collective).
  static void check_weights_name(const std::string& file_name);

  /// Complete step folders, oldest first.
  std::vector<std::filesystem::path> list() const;
  /// The complete step folders of the run in `run_dir`, oldest first, without creating anything.
  static std::vector<std::filesystem::path> list_run(const std::filesystem::path& run_dir);

  /// Reads a checkpoint folder. Throws loom::Error naming the file and the problem.
  static Checkpoint load(const std::filesystem::path& dir);
  /// The model's weights and state.json only (`loom eval`, `loom recommend`): optimizer.safetensors
  /// is read, where it is there, only to check state.json against the checksum it records; a step
  /// folder copied without it (or with it damaged) still evaluates, with a warning.
  static Checkpoint load_weights(const std::filesystem::path& dir);

 private:
  std::filesystem::path dir_;
};

/// The step folder name for a step: step_00000300.
std::string step_dir_name(int64_t step);

/// Why a callback may not call save_checkpoint() from the hook `hook` (empty: it may). Mid-step
/// (on_after_backward, on_before_optimizer_step) the state is no step's; from on_checkpoint_saved
/// a save would save again without end. The trainer and `loom plugins check` refuse alike.
std::string save_refused_in(const std::string& hook);
/// The step of a step folder (step_00000300: 300), or -1 for another name.
int64_t step_of(const std::filesystem::path& step_dir);

/// Throws when `dir` is a step folder of a run (checkpoints/step_<digits>) whose state.json holds
/// another step than its name: a copy of another checkpoint put in its place, which a resume
/// must not take for that step (it would write over the real one's steps) nor eval report as it.
void check_step_folder_name(const std::filesystem::path& dir, int64_t step);

}  // namespace loom::core
