// The run folder's lock: a run folder claimed for this process alone (lock_run), and checked at
// each step for having moved or gone from its path while the run trains (check_run_folder).
#include <loom/core/checkpoint.hpp>
#include <loom/core/files.hpp>
#include <loom/core/text.hpp>
#include <loom/core/trainer.hpp>
#include <loom/sdk/files.hpp>
#include "trainer_internal.hpp"

#include <cerrno>
#include <unistd.h>

namespace fs = std::filesystem;

namespace loom::core {
using namespace detail;

void Trainer::check_run_folder() const {
  // A run folder renamed or removed while its run went on (a user tidying up): whatever wrote at
  // its old path after it (a checkpoint, the TensorBoard folder, summary.json) made the path again,
  // and the run trained to its end into a second, partial folder there, its config.json and its
  // earlier checkpoints in the moved one, exiting 0. It stops instead, writing nothing more.
  if (!run_lock_) return;
  const FileLock::Whereabouts w = run_lock_->whereabouts();
  if (!w.gone) return;
  std::error_code probe;
  const bool another = fs::exists(run_dir_, probe);  // (a copy put in its place, say)
  const std::string name = shell_word(run_dir_.filename().string());
  const std::string what = "run folder " + run_dir_.string() + " was " + (w.removed ? "removed" : "moved") +
                           (w.now.empty() ? std::string() : " to " + w.now.string()) + " while the run went on" +
                           (another ? " (the folder at that path now is another)" : "") + ": the run stops at step " +
                           std::to_string(step_) + ", and writes nothing more (at that path it would write into " +
                           (another ? "a folder this run did not lock" : "a second, partial run folder") + ")";
  if (w.removed)
    throw RunFolderGone(what + "; its checkpoints went with it" +
                        (another ? "; where the folder there is a copy of it, continue that with --resume auto "
                                   "--set trainer.name=" + name : std::string()));
  if (w.now.empty())
    throw RunFolderGone(what + "; the checkpoints written before are where it went: put it back, and continue with "
                        "--resume auto --set trainer.name=" + name);
  std::error_code ec;
  const bool same_work_dir = fs::equivalent(w.now.parent_path(), run_dir_.parent_path(), ec);
  throw RunFolderGone(what + "; the checkpoints written before are where it went: continue from its newest there with " +
                      "--resume auto --set trainer.name=" + shell_word(w.now.filename().string()) +
                      (same_work_dir ? std::string() : " --set trainer.work_dir=" + shell_word(w.now.parent_path().string())));
}

bool Trainer::lock_run(const fs::path& dir) {
  fs::create_directories(dir);
  std::error_code probe;
  const bool had_lock = fs::exists(fs::symlink_status(dir / ".lock", probe));
  const auto release = [&] { unlock_run(dir, !had_lock); };  // (a refusal below wrote nothing: nor the lock file)
  try {
    run_lock_ = std::make_unique<FileLock>(dir / ".lock");
  } catch (const FileLock::Locked& e) {
    throw RunInUse("run folder " + dir.string() + " is in use by " + e.what() +
                   "; wait for that run to end, or choose another trainer.name");
  }
  CheckpointStore::recover(dir);  // (a save again that a kill cut: its older step folder back before a resume lists them)
  remove_orphan_temporaries(dir);  // (and the temporary files of writes a kill cut off)
  // A folder, a FIFO or a device where the run writes config.json: named with its fix now, before
  // a resume moves anything, not as "cannot rename into" once it has. (A dangling link is replaced.)
  const std::string there = sdk::what_is_at(dir / "config.json");
  if (there == "a folder" || there == "a FIFO" || there == "a socket" || there.ends_with(" device")) {
    release();
    throw Error((dir / "config.json").string() + " is " + there + ", not the run's configuration, which Loom writes " +
                "there; move it out of the run folder and run the command again");
  }
  // A checkpoints folder this process cannot write in (a read-only mount, its permissions): said
  // now, not at the first save, once the steps before it were trained for nothing.
  const fs::path checkpoints = dir / "checkpoints";
  try {  // a link to another run's checkpoints: the resume pruned and wrote over them
    CheckpointStore::claim_link(dir);
  } catch (const Error&) {
    release();
    throw;
  }
  if (std::error_code ec; fs::is_directory(checkpoints, ec) && ::access(checkpoints.c_str(), W_OK | X_OK) != 0) {
    const int code = errno;
    release();
    throw Error(explained(fs::filesystem_error("cannot write in", checkpoints, std::error_code(code, std::generic_category()))) +
                "; the run's checkpoints go there (nothing was written)");
  }
  return !had_lock;
}

void Trainer::unlock_run(const fs::path& dir, bool made) {
  std::error_code ec;
  if (made) fs::remove(dir / ".lock", ec);  // (removed while still held: no other process took it in between)
  run_lock_.reset();
}

}  // namespace loom::core
