// The run folder: which folder a run writes (its name, or the newest run for --resume auto),
// what it resumes from, and config.json.
#include <loom/core/checkpoint.hpp>
#include <loom/core/files.hpp>
#include <loom/core/log.hpp>
#include <loom/core/trainer.hpp>
#include "trainer_internal.hpp"

#include <nlohmann/json.hpp>

#include <ctime>

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace loom::core {

using namespace detail;

namespace {

std::string default_run_name() {
  const std::time_t now = std::time(nullptr);
  char buffer[32];
  std::strftime(buffer, sizeof buffer, "%Y%m%d-%H%M%S", std::localtime(&now));
  return buffer;
}

}  // namespace

void Trainer::open_run() {
  fs::path work_dir = options_.work_dir;
  fs::path checkpoint;
  std::string name = options_.name;
  if (!options_.resume_from.empty()) {
    checkpoint = options_.resume_from;
    if (!fs::exists(checkpoint)) throw Error("trainer.resume_from = " + options_.resume_from + ": no such checkpoint");
    if (fs::exists(checkpoint / "checkpoints")) {  // a run folder: its newest checkpoint
      const auto all = CheckpointStore(checkpoint).list();
      if (all.empty()) throw Error(options_.resume_from + " holds no checkpoint to resume from");
      checkpoint = all.back();
    }
    if (name.empty()) name = checkpoint.parent_path().parent_path().filename().string();
  } else if (options_.resume == "auto") {
    if (name.empty() && fs::is_directory(work_dir)) {
      // The most recent run in the work folder that has a checkpoint.
      fs::file_time_type newest{};
      for (const auto& entry : fs::directory_iterator(work_dir)) {
        const fs::path cp = entry.path() / "checkpoints";
        if (!fs::is_directory(cp)) continue;
        const auto all = CheckpointStore(entry.path()).list();
        if (all.empty()) continue;
        const auto t = fs::last_write_time(all.back());
        if (name.empty() || t > newest) {
          newest = t;
          name = entry.path().filename().string();
        }
      }
    }
  }
  if (name.empty()) name = default_run_name();
  run_dir_ = work_dir / name;
  fs::create_directories(run_dir_);
  checkpoints_ = std::make_unique<CheckpointStore>(run_dir_);

  if (checkpoint.empty() && options_.resume == "auto") {
    // Newest first; a damaged checkpoint (a disk that filled up, a file edited by hand) is
    // skipped with a warning in favour of the one before it.
    auto all = checkpoints_->list();
    for (auto it = all.rbegin(); it != all.rend(); ++it) {
      try {
        load_checkpoint(*it);
        checkpoint = *it;
        break;
      } catch (const ResumeRefused&) {
        throw;
      } catch (const Error& e) {
        log::warn("cannot resume from ", it->string(), ": ", e.what(), "; trying an older checkpoint");
      }
    }
    if (checkpoint.empty()) log::info("resume = auto: no checkpoint in ", run_dir_.string(), "; starting fresh");
  } else if (!checkpoint.empty()) {
    load_checkpoint(checkpoint);
  }
  if (!checkpoint.empty() && resumed_at_ >= 0)
    notify("on_checkpoint_loaded", [&](sdk::Callback& c, sdk::RunContext& run) { c.on_checkpoint_loaded(run, checkpoint); });
  json manifest;
  for (const auto& [key, value] : config_) manifest[key] = {{"value", value.value}, {"origin", value.origin.describe()}};
  write_file_atomic(run_dir_ / "config.json", manifest.dump(2) + "\n");
}

}  // namespace loom::core
