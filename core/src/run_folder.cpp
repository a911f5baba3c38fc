// The run folder: which folder a run writes, claimed for this process alone, what it resumes from, and
// config.json. Nothing one run wrote is overwritten or pruned by another:
//   - a new run refuses a folder that already holds a run (choose another name, or resume it); a run
//     without a name gets a fresh one, never shared with a run started in the same second;
//   - a lock (flock of the folder and its lock file: never stale) keeps a second process out of a folder in use;
//   - resuming from an older checkpoint of a run moves its newer step folders (and the best files and
//     metrics of that abandoned timeline) aside, where nothing resumes or prunes them;
//   - --resume auto resumes the newest run that has a checkpoint it can load; a named run that wrote
//     files but no checkpoint (killed before its first) starts again with those files moved aside;
//   - a resumed run keeps the checkpoints its run kept: trainer.keep_last left at its default takes
//     the value the run's config.json records, so that a resume without the flag the run started
//     with does not prune what that flag kept.
#include <loom/core/checkpoint.hpp>
#include <loom/core/files.hpp>
#include <loom/core/log.hpp>
#include <loom/core/safetensors.hpp>
#include <loom/core/text.hpp>
#include <loom/core/trainer.hpp>
#include <loom/sdk/files.hpp>
#include "json_limits.hpp"
#include "trainer_internal.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <ctime>
#include <unistd.h>
#include <limits>
#include <optional>
#include <map>
#include <set>

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace loom::core {
using namespace detail;
namespace {

std::string timestamp() {
  const std::time_t now = std::time(nullptr);
  char buffer[32];
  std::strftime(buffer, sizeof buffer, "%Y%m%d-%H%M%S", std::localtime(&now));
  return buffer;
}

/// A new folder `stem`, or `stem-2`, `stem-3`... in `parent`, made by this call (two set-asides a second apart too).
fs::path claim_aside(const fs::path& parent, const std::string& stem) {
  fs::create_directories(parent);
  for (int i = 1;; ++i) {
    const fs::path dir = parent / (i == 1 ? stem : stem + "-" + std::to_string(i));
    std::error_code ec;
    if (fs::create_directory(dir, ec)) return dir;
    if (ec) throw Error("cannot create " + dir.string() + ": " + ec.message());
  }
}

/// Removes `dir` if it holds nothing but its lock file.
void remove_if_only_lock(const fs::path& dir) {  // (and the empty checkpoints/ the store made)
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
    if (it->path().filename() != ".lock" && (it->path().filename() != "checkpoints" || !fs::is_empty(it->path(), ec))) return;
  if (ec) return;
  for (const fs::path& p : {dir / "checkpoints", dir / ".lock", dir}) fs::remove(p, ec);
}

/// A name of the form <time>[-N] whose folder this call created (two runs in one second: two folders).
std::string claim_fresh_name(const fs::path& work_dir) {
  fs::create_directories(work_dir);
  const std::string base = timestamp();
  for (int i = 1;; ++i) {
    const std::string name = i == 1 ? base : base + "-" + std::to_string(i);
    std::error_code ec;
    if (fs::create_directory(work_dir / name, ec)) return name;
    if (ec) throw Error("cannot create a run folder in " + work_dir.string() + ": " + ec.message());
  }
}

/// `--resume auto` of a name no run has starts it: said, with a close run's name (a typo trained afresh unsaid).
void say_named_run_starts(const fs::path& work_dir, const std::string& name) {
  auto others = runs_newest_first(work_dir);
  std::erase(others, name);
  if (const auto close = closest(name, others); close && close->size() == name.size())  // (exp10 beside exp1: no typo)
    log::warn("resume = auto: no run named '", name, "' in ", work_dir.string(), ", so it starts; did you mean '", *close, "'?");
  else
    log::info("resume = auto: no run named '", name, "' in ", work_dir.string(), " yet; starting it");
}

/// The steps of `folder`'s config.until_step_N.json records, by N.
std::map<int64_t, fs::path> until_records(const fs::path& folder) {
  std::map<int64_t, fs::path> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(folder, ec)) {
    const std::string name = entry.path().filename().string();
    int64_t until = -1;
    const char* end = name.c_str() + name.size() - 5;
    if (name.rfind("config.until_step_", 0) == 0 && name.size() >= 24 && name.compare(name.size() - 5, 5, ".json") == 0 &&
        std::from_chars(name.c_str() + 18, end, until).ptr == end)
      out[until] = entry.path();
  }
  return out;
}

/// The step whose verdict `file` (a run's summary.json) holds: -1 where there is none, a large
/// number where it cannot be read (it goes aside with a newer timeline as if of it).
int64_t summary_step(const fs::path& file) {
  std::error_code ec;
  if (!fs::is_regular_file(file, ec)) return -1;
  try {
    return detail::parse_json<json>(read_file(file, int64_t{1} << 20)).at("step").get<int64_t>();
  } catch (const std::exception&) {
    return std::numeric_limits<int64_t>::max();
  }
}

/// The record of how `folder`'s run trained up to `step`: the config.until_step_N.json of the
/// first N at or past it (a resume from an older step), else config.json.
fs::path record_until(const fs::path& folder, int64_t step) {
  const auto records = until_records(folder);
  const auto it = records.lower_bound(step);
  return it == records.end() ? folder / "config.json" : it->second;
}

}  // namespace

bool Trainer::resume_newest(const fs::path& dir, std::vector<std::string>& problems) {
  const auto all = CheckpointStore::list_run(dir);
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    try {
      load_checkpoint(*it);
    } catch (const ResumeRefused&) {
      throw;
    } catch (const std::exception& e) {  // any damage: unreadable files, bad JSON, bad tensors
      log::warn("cannot resume from ", it->string(), ": ", e.what(), "; trying an older checkpoint");
      problems.push_back(it->filename().string() + ": " + e.what());
      continue;
    }
    // The newer ones that could not be loaded are kept, out of the way: this timeline would write
    // its own steps of those numbers over them, and pruning would count them; so is a best file
    // written after the newest checkpoint by a run that then died. (Outside the try: a failure to
    // move them is no damage of the checkpoint that loaded.)
    set_aside_newer_steps(*it);
    return true;
  }
  return false;
}

void Trainer::set_aside_newer_steps(const fs::path& checkpoint) {
  const int64_t from = step_;  // the loaded checkpoint's (its folder may have any name)
  const fs::path dir = checkpoint.parent_path();
  std::vector<fs::path> newer;
  for (const auto& step : CheckpointStore::list_run(run_dir_))
    if (step_of(step) > from) newer.push_back(step);
  // A newer step folder that is no checkpoint (its state.json lost or torn) is not listed; the
  // resumed timeline would save its step over it: it goes aside with the listed ones.
  std::vector<fs::path> incomplete;
  {
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(run_dir_ / "checkpoints", ec))
      if (entry.is_directory(ec) && step_of(entry.path()) > from &&
          std::find(newer.begin(), newer.end(), entry.path()) == newer.end())
        incomplete.push_back(entry.path());
    std::sort(incomplete.begin(), incomplete.end());
  }
  newer.insert(newer.end(), incomplete.begin(), incomplete.end());
  // A best file written at a step up to the checkpoint's is the resumed timeline's best so far: it
  // stays (a copy goes aside). One written after it holds weights of steps this timeline will not
  // have (a newer checkpoint's, or those of a run that died before its next checkpoint): `loom eval
  // best_...` would evaluate them, so it goes aside until the resumed run writes its own.
  std::error_code ec;
  std::vector<fs::path> best_kept, best_newer;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (entry.path().filename().string().rfind("best_", 0) != 0) continue;
    int64_t written_at = -1;  // unknown (a plugin's file without "step", damaged metadata): kept, as before
    try {
      const auto metadata = load_safetensors_metadata(entry.path());
      if (auto it = metadata.find("step"); it != metadata.end()) written_at = std::stoll(it->second);
    } catch (const std::exception&) {
    }
    (written_at <= from ? best_kept : best_newer).push_back(entry.path());
  }
  // A session after the checkpoint that saved none (every step skipped, say) left its summary and
  // its config.json's record: they go aside too, not dropped by the resume's rewrite in silence.
  const int64_t summarised = summary_step(run_dir_ / "summary.json");  // (a damaged one alone is no such session)
  const bool summary_newer = summarised > from && summarised != std::numeric_limits<int64_t>::max();
  if (newer.empty() && best_newer.empty() && !summary_newer) return;
  const fs::path aside = claim_aside(dir, "abandoned-" + timestamp() + "-from-" + checkpoint.filename().string());
  std::vector<std::string> moved, best_moved;
  for (const auto& step : newer) {
    rename_durable(step, aside / step.filename());
    const bool whole = std::find(incomplete.begin(), incomplete.end(), step) == incomplete.end();
    moved.push_back(step.filename().string() + (whole ? "" : " (no whole checkpoint: its state.json is missing or damaged)"));
  }
  for (const auto& file : best_kept) fs::copy_file(file, aside / file.filename(), ec);
  for (const auto& file : best_newer) {
    rename_durable(file, aside / file.filename());
    best_moved.push_back(file.filename().string());
  }
  for (const char* record : {"metrics.jsonl", "config.json"})  // (the configuration that trained those steps too)
    if (fs::exists(run_dir_ / record, ec)) fs::copy_file(run_dir_ / record, aside / record, ec);
  // The record of the steps up to the checkpoint's stays here (config.until_step_<its step>.json,
  // from the record that covered them); those of later steps are that timeline's, and go with it.
  const fs::path kept = run_dir_ / ("config.until_step_" + std::to_string(from) + ".json");
  if (const fs::path covering = record_until(run_dir_, from); covering != kept && fs::is_regular_file(covering, ec))
    write_file_atomic(kept, read_file(covering));
  for (const auto& [until, file] : until_records(run_dir_))
    if (until > from) rename_durable(file, aside / file.filename());
  if (summary_step(run_dir_ / "summary.json") > from) rename_durable(run_dir_ / "summary.json", aside / "summary.json");
  const std::string best_said =
      best_moved.empty() ? std::string()
                         : join(best_moved, ", ") + " held weights of steps after " + checkpoint.filename().string() +
                               ": moved there, and this timeline's best is written again (by the best callback)";
  if (newer.empty())  // (the aside folder named before what went there: one sentence each)
    log::warn("resuming from ", checkpoint.filename().string(), " of ", run_dir_.string(), ": moved to ", aside.string(),
              ": ", best_said.empty() ? "the steps after it that saved no checkpoint (their summary, metrics and config.json)" : best_said);
  else
    log::warn("resuming from ", checkpoint.filename().string(), " of ", run_dir_.string(), ", which has newer checkpoints (",
              join(moved, ", "), "): they are moved to ", aside.string(),
              " with that timeline's best files, metrics and config.json; nothing resumes or prunes them there",
              best_said.empty() ? std::string() : "; " + best_said);
}

// A finished run resumed to train further (trainer.max_steps raised) kept its summary.json, of the
// end it had, until the new end wrote one: killed at step 1850 of 5000, the run read as finished at
// 50 to a script (probe). Once a step trains past it, the summary is that step's record only, kept
// beside config.until_step_<N>.json, as the configuration's record is.
void Trainer::set_aside_earlier_summary() {
  if (parallel_->rank() != 0) return;
  const fs::path file = run_dir_ / "summary.json";
  const int64_t at = summary_step(file);
  if (at < 0 || at >= step_ || at == std::numeric_limits<int64_t>::max()) return;  // (none, this step's, unreadable)
  const fs::path aside = run_dir_ / ("summary.until_step_" + std::to_string(at) + ".json");
  rename_durable(file, aside);
  log::info("summary.json was of step ", at, ", an end this run has trained past: it is now ", aside.filename().string(),
            "; the run's end writes summary.json again");
}

void Trainer::set_aside_files_without_checkpoint() {
  std::error_code ec;
  std::vector<fs::path> files;
  for (const char* name : {"config.json", "metrics.jsonl", "tensorboard", "summary.json"})
    if (fs::exists(fs::symlink_status(run_dir_ / name, ec))) files.push_back(run_dir_ / name);
  // A step folder that is no whole checkpoint (its state.json lost) goes too: the new timeline saved
  // its step over it, the weights in it gone (probe).
  bool incomplete = false;
  for (const auto& entry : fs::directory_iterator(run_dir_ / "checkpoints", ec))
    if (const std::string name = entry.path().filename().string(); name.rfind("best_", 0) == 0) {
      files.push_back(entry.path());
    } else if (step_of(entry.path()) >= 0 && entry.is_directory(ec)) {
      files.push_back(entry.path());
      incomplete = true;
    }
  if (files.empty()) return;
  const fs::path aside = claim_aside(run_dir_ / "checkpoints", "abandoned-" + timestamp() + "-without-checkpoint");
  std::vector<std::string> moved;
  for (const auto& file : files) {
    rename_durable(file, aside / file.filename());
    moved.push_back(file.filename().string() + (step_of(file) >= 0 ? " (no whole checkpoint: its state.json is missing)" : ""));
  }
  log::warn("resume = auto: ", run_dir_.string(), " holds files of a run that wrote no ", incomplete ? "whole " : "",
            "checkpoint (", join(moved, ", "), "): they are moved to ", aside.string(), ", and the run starts from step 0");
}

namespace {

/// Keys a resume changes as a matter of course (how long, how often, where, with what), said at
/// info level; the rest change what is trained, and are warned about. Keys compared with the
/// checkpoint itself (model, data, precision, seed, schedule, the global batch) are said there.
enum class Change { kSaidElsewhere, kRoutine, kTraining };
Change kind_of_change(const std::string& key) {
  static const std::set<std::string> elsewhere = {"trainer.resume", "trainer.resume_from", "trainer.name", "trainer.seed",
                                                  "trainer.schedule", "trainer.init_from",
                                                  "trainer.batch_size", "trainer.gradient_accumulation_steps",
                                                  "trainer.keep_last"};
  static const std::set<std::string> routine = {
      "trainer.epochs", "trainer.max_steps", "trainer.eval_every", "trainer.log_every", "trainer.checkpoint_every",
      "trainer.threads", "trainer.device", "trainer.device_step", "trainer.stop_after_skipped", "trainer.callbacks", "trainer.peak_tflops", "trainer.work_dir", "trainer.best_metric"};
  for (const char* prefix : {"model.", "data.", "precision."})
    if (key.rfind(prefix, 0) == 0) return Change::kSaidElsewhere;
  if (elsewhere.count(key)) return Change::kSaidElsewhere;
  for (const char* prefix : {"callback.", "memory.", "parallel.", "step.", "log."})
    if (key.rfind(prefix, 0) == 0) return Change::kRoutine;
  return routine.count(key) ? Change::kRoutine : Change::kTraining;
}

}  // namespace

// A resume against the record of how its checkpoint was trained: the config.json of the
// checkpoint's run folder, or, in this folder, the config.until_step_N.json of the first N at or
// past the step (a resume from an older step compares with what trained up to it, not with what
// trained the steps set aside). A key this resume does not set whose default would undo the run's
// choice (keep_last: pruning what the run kept) takes the recorded value; every other difference
// is said, and the record of the steps before is kept beside the new config.json.
void Trainer::read_the_runs_config() {
  const fs::path folder = resumed_from_.parent_path().parent_path();
  const bool here = fs::weakly_canonical(folder) == fs::weakly_canonical(run_dir_);
  const fs::path record = record_until(folder, step_);
  std::error_code ec;
  // The record of the steps up to this one stays beside the new config.json (a copy; both written once a step trains).
  const fs::path until = run_dir_ / ("config.until_step_" + std::to_string(step_) + ".json");
  if (here) pending_record_.dir = run_dir_;
  const auto keep_record = [&] {
    if (here && record != until && fs::is_regular_file(record, ec) && !fs::exists(until, ec))
      pending_record_.until = until, pending_record_.until_text = read_file(record);
  };
  json manifest;
  try {
    manifest = detail::parse_json<json>(read_file(record));
    if (!manifest.is_object()) throw Error("not Loom's record");
  } catch (const std::exception& e) {
    if (fs::exists(record, ec) || here)
      log::warn("cannot compare this resume with how the run was trained: ", record.string(), " is ",
                fs::exists(record, ec) ? "unreadable (" + printable(detail::json_reason(e), 300) + ")" : std::string("missing"));
    keep_record();
    return;
  }
  const auto recorded = [&](const std::string& key) -> std::optional<std::string> {
    const auto it = manifest.find(key);
    if (it == manifest.end() || !it->is_object() || !it->contains("value") || !it->at("value").is_string()) return {};
    std::string value = it->at("value").get<std::string>();
    for (char& c : value)  // (quoted in a terminal: no escape sequences from a file)
      if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
    return value;
  };
  auto& mine = config_.at("trainer.keep_last");
  int64_t value = 0;
  if (const auto kept = recorded("trainer.keep_last"); here && kept && mine.origin.source == "default") {
    const auto [end, error] = std::from_chars(kept->data(), kept->data() + kept->size(), value);
    if (error == std::errc() && end == kept->data() + kept->size() && value >= 0 && value != options_.keep_last) {
      log::info("trainer.keep_last = ", value, ", as the run recorded it in config.json (this resume does not set it; ",
                "the default, ", options_.keep_last, ", would prune what the run kept)");
      options_.keep_last = value;
      mine = ConfigValue{*kept, Origin{detail::kRunRecordOrigin, {}, 0}};
    }
  }
  std::vector<std::string> routine, training;
  bool given = options_.resume_from.empty();  // (every training change given by this --resume auto command)
  for (const auto& [key, now] : config_) {
    const auto was = recorded(key);  // (none: a key of a component the run did not use, or of an older Loom)
    if (!was || same_value(*was, now.value)) continue;
    const Change change = kind_of_change(key);
    if (change == Change::kSaidElsewhere) continue;
    given = given && (change == Change::kRoutine || (now.origin.source != "default" && now.origin.source != kRunRecordOrigin));
    (change == Change::kRoutine ? routine : training)
        .push_back(key + " " + *was + " -> " + now.value + " (" + now.origin.describe() + ")");
  }
  if (!routine.empty()) log::info("resumed with ", join(routine, "; "));
  if (!training.empty())
    log::warn("this resume trains otherwise than the run did until step ", step_, " (", record.string(), "): ",
              join(training, "; "), ". To go on as it was, ",
              given ? "leave these out of the command (--resume auto takes the run's own)"
                    : "give the -c files and --set of the run's first command");
  if (!routine.empty() || !training.empty()) keep_record();
}

// With several ranks, rank 0 alone chooses, locks and writes the run folder; it hands the folder
// and the checkpoint it resumed from to the others, which load that checkpoint and write nothing.
void Trainer::open_run() {
  if (parallel_->world_size() <= 1) return open_run_here();
  if (parallel_->rank() != 0) return join_run();
  try {
    open_run_here();
  } catch (...) {
    try {
      from_rank0(*parallel_, std::nullopt);  // the others stop now, not at the timeout
    } catch (...) {
    }
    throw;
  }
  from_rank0(*parallel_, run_dir_.string() + "\n" + (resumed_at_ >= 0 ? resumed_from_.string() : std::string()));
}

void Trainer::join_run() {
  const std::optional<std::string> shared = from_rank0(*parallel_, std::nullopt);
  if (!shared)
    throw Error("rank 0 could not open the run folder (its log says why); rank " + std::to_string(parallel_->rank()) +
                " stops with it");
  const size_t cut = shared->find('\n');
  run_dir_ = shared->substr(0, cut);
  const std::string checkpoint = cut == std::string::npos ? std::string() : shared->substr(cut + 1);
  if (!checkpoint.empty()) {
    load_checkpoint(checkpoint);
    notify("on_checkpoint_loaded", [&](sdk::Callback& c, sdk::RunContext& run) { c.on_checkpoint_loaded(run, resumed_from_); });
  }
}

void Trainer::open_run_here() {
  if (init_first()) {  // (before the folder: a misfit leaves none behind)
    init_weights(options_.init_from);
    stop_if_signalled_in_setup(parallel_->world_size(), "while trainer.init_from was read");
  }
  const fs::path work_dir = options_.work_dir;
  std::string name = options_.name;
  fs::path checkpoint;
  if (!options_.resume_from.empty()) {
    // "runs/x/checkpoints/step_00000006/" as a shell completes it names the step folder too
    checkpoint = fs::path(options_.resume_from).lexically_normal();
    if (!checkpoint.has_filename() && checkpoint.has_parent_path()) checkpoint = checkpoint.parent_path();
    if (!fs::exists(checkpoint)) throw no_such_checkpoint("trainer.resume_from", options_.resume_from);
    if (fs::exists(checkpoint / "checkpoints")) {  // a run folder: its newest checkpoint
      const auto all = CheckpointStore::list_run(checkpoint);
      if (all.empty()) throw Error(options_.resume_from + " holds no checkpoint to resume from");
      checkpoint = all.back();
    }
    if (name.empty() && checkpoint.parent_path().filename() == "checkpoints")  // (one in abandoned-...: a new run)
      name = checkpoint.parent_path().parent_path().filename().string();
  }

  std::vector<std::string> problems;
  bool resumed = false;
  if (options_.resume == "auto" && name.empty()) {
    const std::vector<std::string> runs = runs_newest_first(work_dir, /*strict=*/true);
    // The newest run is the one to continue; an older one is taken only past a newest whose
    // checkpoints are all damaged. A newest in progress elsewhere, or finished without checkpoints,
    // is no run to continue: a new one starts (never an older run changed in its place).
    std::string passed;
    // The run whose settings --resume auto took (with_run_settings: the newest with a checkpoint):
    // no other run is touched with them (an older one past it was resumed with the newer's rate).
    std::optional<fs::path> settings_from;
    for (const auto& [key, v] : config_)
      if (v.origin.source == detail::kRunRecordOrigin && !v.origin.file.empty()) settings_from = v.origin.file.parent_path();
    const auto same_folder = [](const fs::path& a, const fs::path& b) {
      std::error_code ec;
      const bool same = fs::equivalent(a, b, ec);
      return ec ? a.lexically_normal() == b.lexically_normal() : same;
    };
    for (const auto& candidate : runs) {
      run_dir_ = work_dir / candidate;
      if (settings_from && !same_folder(run_dir_, *settings_from))
        throw Error("resume = auto: no checkpoint of " + settings_from->string() + " can be loaded (" + join(problems, "; ") +
                    "), and this resume took its settings (its config.json); the older run " + run_dir_.string() +
                    " is next. To continue it with its own settings, name it: --set trainer.name=" + candidate +
                    "; to start the newest again, move its folder away (nothing was written)");
      refuse_unreadable_checkpoints(run_dir_);  // (before its lock: a folder it cannot read gets none)
      bool made_lock = false;  // (a candidate passed over keeps no lock file it had not: a copied run folder)
      try {
        made_lock = lock_run(run_dir_);  // (it also puts back a step folder whose save again a kill interrupted)
      } catch (const RunInUse&) {
        if (!CheckpointStore::list_run(run_dir_).empty()) throw;  // (a run with checkpoints in use: refused, as by name)
        passed = run_dir_.string() + " is in progress in another process (no checkpoint yet)";
        break;
      }
      const bool saved = !CheckpointStore::list_run(run_dir_).empty();
      if (std::error_code ec; !saved && fs::exists(run_dir_ / "summary.json", ec)) {
        unlock_run(run_dir_, made_lock);
        passed = run_dir_.string() + " finished without checkpoints";
        break;
      }
      if (!saved) {  // stopped before its first checkpoint: it starts again, as by name
        name = candidate;
        std::string older;
        for (const auto& other : runs)
          if (other != candidate && !CheckpointStore::list_run(work_dir / other).empty()) {
            older = other;
            break;
          }
        log::warn("resume = auto: the newest run, ", run_dir_.string(), ", stopped before its first checkpoint, so it ",
                  "starts again", older.empty() ? std::string() : " (to continue the older run " + older +
                  " instead, name it: --set trainer.name=" + older + ")");
        break;
      }
      if ((resumed = resume_newest(run_dir_, problems))) {
        name = candidate;
        break;
      }
      log::warn("resume = auto: no checkpoint of ", run_dir_.string(), " can be loaded; looking at older runs");
      unlock_run(run_dir_, made_lock);
    }
    if (settings_from && !resumed)
      throw Error("resume = auto: no checkpoint of " + settings_from->string() + " can be loaded (" + join(problems, "; ") +
                  "), and this resume took its settings (its config.json), so no other run starts or goes on with "
                  "them; move its folder away to start again (nothing was written)");
    if (!passed.empty())
      log::info("resume = auto: starting a new run: the newest, ", passed);
    else if (!resumed && name.empty())
      log::info("resume = auto: no run in ", work_dir.string(), " to resume; starting a new one");
  }
  bool made_here = name.empty();
  if (name.empty()) name = claim_fresh_name(work_dir);
  run_dir_ = work_dir / name;
  bool lock_made = false;
  // (before its lock, whose recovery of a killed save's folders writes: "nothing was written")
  if (options_.resume == "auto" && checkpoint.empty()) refuse_unreadable_checkpoints(run_dir_);
  if (!run_lock_) {
    std::error_code ec;
    made_here = made_here || !fs::exists(run_dir_, ec);
    lock_made = lock_run(run_dir_);
  }
  // A folder this command made for a run it then refuses (a checkpoint of another model, say) is
  // taken away again: a name left holding only a lock file would look taken. Anything else in it
  // stays; in a folder that was there, the lock file it made goes ("nothing was written").
  struct TakeAway {
    const fs::path& dir;
    bool armed, made, lock_made;
    ~TakeAway() {
      std::error_code ec;
      if (armed && made) remove_if_only_lock(dir);
      else if (armed && lock_made) fs::remove(dir / ".lock", ec);
    }
  } take_away{run_dir_, true, made_here, lock_made};

  if (!checkpoint.empty()) {
    const bool same_run = fs::weakly_canonical(checkpoint.parent_path().parent_path()) == fs::weakly_canonical(run_dir_);
    if (!same_run && holds_a_run(run_dir_))
      throw Error("trainer.resume_from starts run '" + name + "' from " + checkpoint.string() + ", but " + run_dir_.string() +
                  " already holds a run; choose another trainer.name (nothing was written)");
    load_checkpoint(checkpoint);
    // (a new run left empty; an older step of this run had its newer steps set aside, then "nothing to train")
    const auto saved = CheckpointStore::list_run(run_dir_);
    const bool newer = std::any_of(saved.begin(), saved.end(), [&](const fs::path& p) { return step_of(p) > step_; });
    if (step_ >= total_steps_ && (!same_run || newer))
      throw Error("trainer.resume_from " + checkpoint.string() + " is at step " + std::to_string(step_) +
                  ", and this run ends at step " + std::to_string(total_steps_) + " (trainer.max_steps or " +
                  "trainer.epochs): nothing to train. Raise trainer.max_steps to train further from it, or evaluate " +
                  "it: loom eval " + checkpoint.string() + " (nothing was moved or written)");
    if (!same_run && !made_here) {  // (the user's own folder: what this command adds goes again if nothing trains)
      entries_before_.emplace();
      for (const auto& entry : fs::directory_iterator(run_dir_)) entries_before_->insert(entry.path().filename().string());
    }
    if (same_run) set_aside_newer_steps(checkpoint);
  } else if (options_.resume == "auto" && !resumed) {
    if (!CheckpointStore::list_run(run_dir_).empty() && !resume_newest(run_dir_, problems))
      throw Error("resume = auto: none of the checkpoints of " + run_dir_.string() + " can be loaded (" +
                  join(problems, "; ") + "); move the folder away to start again, or choose another trainer.name");
    if (resumed_at_ < 0) {
      if (!made_here) log::info("resume = auto: no checkpoint in ", run_dir_.string(), "; starting fresh");
      else if (!options_.name.empty()) say_named_run_starts(work_dir, name);
      set_aside_files_without_checkpoint();
    }
  } else if (options_.resume != "auto" && !options_.name.empty() && holds_a_run(run_dir_)) {
    const size_t saved = CheckpointStore::list_run(run_dir_).size();
    throw Error("run folder " + run_dir_.string() + " already holds a run named '" + name + "' (" + std::to_string(saved) +
                (saved == 1 ? " checkpoint); " : " checkpoints); ") +
                (saved > 0 ? "continue it with --resume auto"
                           : "it has no checkpoint to continue from: --resume auto starts it again, with its files moved "
                             "aside") +
                ", or choose another trainer.name (nothing was written)");
  }
  // A resume that trains nothing (its run complete, no evaluation pending) changes no record.
  const bool trains = resumed_at_ < 0 || step_ < total_steps_ || evaluation_pending_;
  if (resumed_at_ >= 0 && trains) read_the_runs_config();
  checkpoints_ = std::make_unique<CheckpointStore>(run_dir_);
  if (resumed_at_ >= 0)
    notify("on_checkpoint_loaded", [&](sdk::Callback& c, sdk::RunContext& run) { c.on_checkpoint_loaded(run, resumed_from_); });
  json manifest;
  for (const auto& [key, value] : config_) manifest[key] = {{"value", value.value}, {"origin", value.origin.describe()}};
  const std::string record  // (values are UTF-8, Config::set; an origin's path may not be: made valid)
      = manifest.dump(2, ' ', false, json::error_handler_t::replace) + "\n";
  if (trains && !pending_record_.dir.empty()) pending_record_.config = record;  // (at the first step)
  else if (trains) write_file_atomic(run_dir_ / "config.json", record);
  take_away.armed = false;
  made_run_dir_ = made_here;  // (a new run, or one --resume-from starts from another run's checkpoint)
}

}  // namespace loom::core
