// Which runs a work folder holds, the one last active first, and whether this process can read
// what they hold: a folder it cannot read was taken for no run (--resume auto resumed an older run
// past it) and a step folder it cannot read for no checkpoint (a new timeline was written over it).
#include <loom/core/checkpoint.hpp>
#include <loom/core/text.hpp>
#include "trainer_internal.hpp"

#include <algorithm>

#include <sys/stat.h>
#include <unistd.h>

namespace fs = std::filesystem;

namespace loom::core {

namespace {

/// Why `dir` cannot be read (listed, or its entries looked at), or "" where it can or is not there.
std::string unreadable(const fs::path& dir) {
  std::error_code ec;
  fs::directory_iterator it(dir, ec);  // (read permission)
  if (!ec) (void)fs::symlink_status(dir / ".", ec);  // (search permission: a step's files cannot be looked at)
  if (!ec || ec == std::errc::no_such_file_or_directory || ec == std::errc::not_a_directory) return "";
  return ec.message();
}

/// The first folder of `run_dir`'s checkpoints this process cannot read (its checkpoints folder, a
/// step folder), with why, or "".
std::string unreadable_checkpoints(const fs::path& run_dir) {
  if (const std::string why = unreadable(run_dir / "checkpoints"); !why.empty()) return (run_dir / "checkpoints").string() + " (" + why + ")";
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(run_dir / "checkpoints", ec))
    if (step_of(entry.path()) >= 0 && entry.is_directory(ec))
      if (const std::string why = unreadable(entry.path()); !why.empty()) return entry.path().string() + " (" + why + ")";
  return "";
}

/// When the run in `dir` was last active: the later of its newest checkpoint and its config.json
/// (written when it starts, and again when it resumes).
fs::file_time_type last_active(const fs::path& dir, const std::vector<fs::path>& checkpoints) {
  std::error_code ec;
  auto last = fs::file_time_type::min();
  if (!checkpoints.empty()) last = std::max(last, fs::last_write_time(checkpoints.back(), ec));
  if (const auto config = fs::last_write_time(dir / "config.json", ec); !ec) last = std::max(last, config);
  return last;
}

}  // namespace

bool detail::holds_a_run(const fs::path& dir) {
  std::error_code ec;
  for (const char* name : {"config.json", "metrics.jsonl", "summary.json", "tensorboard"})
    if (fs::exists(fs::symlink_status(dir / name, ec))) return true;
  for (const auto& entry : fs::directory_iterator(dir / "checkpoints", ec))
    if (entry.path().filename().string().rfind("best_", 0) == 0) return true;
  return !CheckpointStore::list_run(dir).empty();
}

/// A run stopped before its first checkpoint counts too: --resume auto must not pass over it to an
/// older run and change that; nor over a folder it cannot read, changed after the newest run it can
/// (that one may be the newest run): refused where `strict`.
std::vector<std::string> detail::runs_newest_first(const fs::path& work_dir, bool strict) {
  std::vector<std::pair<fs::file_time_type, std::string>> runs, unread;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(work_dir, ec)) {
    if (!entry.is_directory(ec)) continue;
    // A folder, or a run's checkpoints, this user cannot read: a run of its own (another user's
    // folder in a shared work folder, a file system's lost+found, is none of its runs).
    struct stat owner {};
    const bool own = ::stat(entry.path().c_str(), &owner) == 0 && owner.st_uid == ::geteuid();
    std::string why = unreadable(entry.path());
    if (!why.empty()) why = entry.path().string() + " (" + why + ")";
    else why = unreadable_checkpoints(entry.path());
    if (!why.empty()) {
      if (own) unread.emplace_back(fs::last_write_time(entry.path(), ec), why);
      continue;
    }
    if (!holds_a_run(entry.path())) continue;
    const auto all = CheckpointStore::list_run(entry.path());
    // (without a checkpoint, only a folder a Loom run opened, its lock file there: an exported
    // folder with a config.json of its own is no run to start again in)
    if (all.empty() && !fs::exists(fs::symlink_status(entry.path() / ".lock", ec))) continue;
    runs.emplace_back(last_active(entry.path(), all), entry.path().filename().string());
  }
  std::sort(runs.rbegin(), runs.rend());
  std::sort(unread.rbegin(), unread.rend());
  // (with no run it can read, none would be changed in its place: a new run starts)
  if (strict && !unread.empty() && !runs.empty() && unread.front().first > runs.front().first)
    throw Error("resume = auto: " + unread.front().second + " cannot be read, and it changed after the newest run this "
                "process can read, " + runs.front().second + ": it may be the newest run, which this resume would pass "
                "over (an older one changed in its place). Give this user access to it (chmod -R u+rwX, or run as its "
                "owner), move it out of " + work_dir.string() + ", or name the run to resume: --set trainer.name=NAME "
                "(nothing was written)");
  std::vector<std::string> out;
  for (const auto& [time, name] : runs) out.push_back(name);
  return out;
}

void detail::refuse_unreadable_checkpoints(const fs::path& run_dir) {
  std::string why = unreadable(run_dir);
  why = why.empty() ? unreadable_checkpoints(run_dir) : run_dir.string() + " (" + why + ")";
  if (why.empty()) return;
  throw Error("resume = auto: " + why + " cannot be read: a checkpoint there would be taken for none, and a new timeline "
              "written over it. Give this user access (chmod -R u+rwX, or run as its owner), or move it out of " +
              run_dir.string() + " (nothing was written)");
}

}  // namespace loom::core
