#pragma once
// What a checkpoint's state.json holds, read with every field's type and range checked
// (saved_state.cpp). Apart from the trainer so that the fuzz target fuzz/state_json_fuzz.cpp reads
// state.json files the way a resume does.

#include <loom/sdk/types.hpp>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace loom::core {

struct SavedState {
  int64_t step = 0, skipped = 0;
  int64_t total_steps = 0;  ///< the run's length when it was written (0: not recorded)
  std::string model_name;
  std::map<std::string, std::string> model_config, manifest;
  std::map<std::string, std::string> optimizer, precision, schedule;  ///< each one's text state
  std::string schedule_name;
  sdk::BatchPlan plan;
  /// Where `plan` is oom_recovery's re-plan: the configuration (Trainer::config_key) and the
  /// device, with its memory cap, it ran out of memory with (empty otherwise, and in older files).
  std::string oom_config, oom_device;
  int64_t oom_accumulation = -1;  ///< the accumulation that run was configured with
  int64_t epoch = 0, offset = 0;  ///< the data position
  int64_t ranks = 1;              ///< the processes the epoch was shared among (offset is one's share)
  /// The log window at the checkpoint (empty in files of older Loom versions).
  int64_t window_steps = 0, window_samples = 0, window_terms = 0;
  double window_loss = 0, window_seconds = 0;
  std::map<std::string, double> window_metrics;
  bool evaluation_pending = false;  ///< the step's evaluation was cut short by a stop (older files: false)
  nlohmann::ordered_json callbacks = nlohmann::ordered_json::object();  ///< name -> text state
};

/// Parses `text`, the contents of `file`, checking every field's type and range (an offset of at
/// most `samples_per_epoch`). Throws loom::Error naming the file and the field for anything else:
/// the checkpoint is damaged.
SavedState parse_state_json(const std::string& text, const std::filesystem::path& file, int64_t samples_per_epoch);

}  // namespace loom::core

namespace loom::sdk {
class Callback;
}

namespace loom::core {

/// Gives each callback of this run its state from a checkpoint's `saved` callbacks and `extra`
/// tensors. A callback the checkpoint has no state for (added on resume) starts fresh; the state
/// of one this run does not select stays in the checkpoint: it is returned into `unselected_text`
/// and `unselected_tensors`, which the next checkpoints save again (trainer_callbacks.cpp).
void load_callback_states(const std::vector<std::pair<std::string, std::shared_ptr<sdk::Callback>>>& callbacks,
                          const nlohmann::ordered_json& saved, const sdk::TensorMap& extra,
                          const std::filesystem::path& dir, std::map<std::string, sdk::TextMap>& unselected_text,
                          sdk::TensorMap& unselected_tensors);

}  // namespace loom::core
