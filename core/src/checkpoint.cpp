// Checkpoint folders. See checkpoint.hpp.
#include <loom/core/checkpoint.hpp>
#include <loom/core/error.hpp>
#include <loom/core/files.hpp>
#include <loom/core/log.hpp>
#include <loom/core/safetensors.hpp>
#include <loom/core/text.hpp>
#include <loom/sdk/options.hpp>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <set>
#include <cstdio>

namespace fs = std::filesystem;

namespace loom::core {

std::string step_dir_name(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step_%08lld", static_cast<long long>(step));
  return name;
}

std::string save_refused_in(const std::string& hook) {
  // Mid-step (after backward, before the update) the weights are the last step's and the data
  // position the next one's: a resume from that state would skip a batch.
  static const std::string where = "save from on_step_end, on_evaluation_end, on_log or on_run_end";
  if (hook == "on_after_backward" || hook == "on_before_optimizer_step")
    return "save_checkpoint() from " + hook + " is refused: in the middle of a step the state is no step's (a resume "
           "from it would skip a batch); " + where;
  if (hook == "on_checkpoint_saved")
    return "save_checkpoint() from on_checkpoint_saved is refused: it would save again each time it is told of a save; " +
           where;
  return {};
}

CheckpointStore::CheckpointStore(fs::path run_dir) : dir_(std::move(run_dir) / "checkpoints") {
  fs::create_directories(dir_);
  recover(dir_.parent_path());
}

void CheckpointStore::claim_link(const fs::path& run_dir) {
  const fs::path link = run_dir / "checkpoints";
  std::error_code ec;
  if (!fs::is_symlink(link, ec)) return;
  const fs::path target = fs::canonical(link, ec), run = fs::canonical(run_dir, ec);
  if (target.empty() || run.empty()) return;  // (a link to nothing: the store makes it, or names why not)
  const auto refuse = [&](const std::string& whose) {
    throw Error(link.string() + " is a link to " + target.string() + ", " + whose + ", which this run would prune and " +
                "write over; copy them (cp -r) into a checkpoints folder of its own, or link one of its own");
  };
  if (target == run / "checkpoints") return;  // (a link to itself is no link: the store names a loop)
  if (fs::exists(target / ".lock", ec)) refuse("another run's folder");
  if (target.filename() == "checkpoints" && fs::exists(target.parent_path() / ".lock", ec) && target.parent_path() != run)
    refuse("another run's checkpoints");
  const fs::path owner_file = target / ".loom-run";
  if (fs::exists(owner_file, ec)) {
    const std::string owner = std::string(sdk::trim(read_file(owner_file, 4096)));
    if (owner != run.string())  // (a run folder moved: its new path goes in the file)
      refuse("the checkpoints of the run " + owner + " (its .loom-run says so; if that run is this one moved here, "
             "write " + run.string() + " in that file)");
    return;
  }
  if (!CheckpointStore::list_run(run_dir).empty() && !fs::exists(run_dir / "config.json", ec))
    refuse("checkpoints this run did not write (it has no config.json)");
  write_file_atomic(owner_file, run.string() + "\n");
}

void CheckpointStore::recover(const fs::path& run_dir) {
  const fs::path dir = run_dir / "checkpoints";
  std::error_code ec;
  std::vector<fs::path> leftovers;
  for (const auto& entry : fs::directory_iterator(dir, ec))
    if (entry.path().filename().string().rfind(".step_", 0) == 0) leftovers.push_back(entry.path());
  const std::string replaced = ".replaced";
  for (const auto& path : leftovers) {
    const std::string name = path.filename().string();
    if (name.size() > replaced.size() && name.compare(name.size() - replaced.size(), replaced.size(), replaced) == 0) {
      const fs::path step = dir / name.substr(1, name.size() - 1 - replaced.size());
      if (!fs::exists(step, ec)) {
        fs::rename(path, step, ec);
        if (!ec) continue;
      }
    }
    fs::remove_all(path, ec);
  }
}

std::vector<fs::path> CheckpointStore::list() const { return list_run(dir_.parent_path()); }

std::vector<fs::path> CheckpointStore::list_run(const fs::path& run_dir) {
  // Only step_<digits> folders are Loom's: a user's step_00000030.bak or step_10_keep is neither
  // resumed from nor pruned. In step order, not name order (step_99999999 < step_100000000).
  std::vector<std::pair<int64_t, fs::path>> steps;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(run_dir / "checkpoints", ec))
    if (const int64_t step = step_of(entry.path());
        step >= 0 && entry.is_directory(ec) && fs::exists(entry.path() / "state.json", ec))
      steps.emplace_back(step, entry.path());
  std::sort(steps.begin(), steps.end());
  std::vector<fs::path> out;
  for (auto& [step, path] : steps) out.push_back(std::move(path));
  return out;
}

int64_t step_of(const fs::path& step_dir) {
  const std::string name = step_dir.filename().string();
  if (name.rfind("step_", 0) != 0 || name.size() <= 5) return -1;
  int64_t step = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || step > (int64_t{1} << 50)) return -1;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

void check_step_folder_name(const fs::path& dir, int64_t step) {
  const int64_t named = step_of(dir);
  if (named < 0 || named == step || dir.parent_path().filename() != "checkpoints") return;
  throw Error(dir.string() + " holds step " + std::to_string(step) + " (its state.json) under the name of step " +
              std::to_string(named) + ": a copy of another checkpoint put in its place; give it its own name (" +
              step_dir_name(step) + "), or move it out of the checkpoints folder");
}

fs::path CheckpointStore::save(int64_t step, const sdk::TensorMap& model, const sdk::TensorMap& extra,
                               const std::string& state_json, int64_t keep_last) {
  const fs::path final_dir = dir_ / step_dir_name(step);
  const fs::path tmp = dir_ / (std::string(".").append(step_dir_name(step)).append(".tmp"));
  // (the folder it is in replaced by a FIFO or a loop of links: no partial folder was made; one left
  // by a process killed in its save is one)
  std::error_code probe;
  bool made = fs::exists(fs::symlink_status(tmp, probe));
  try {
    fs::remove_all(tmp);
    // (its checkpoints folder again where it was removed by hand, but never the run folder: one
    // moved away mid-run was made again at its old path, a second, partial run there)
    fs::create_directory(dir_);
    fs::create_directory(tmp);
    made = true;
    // The safetensors files carry their own checksums (Note [Checkpoint checksums]); state.json's
    // is kept in both, so a flipped byte in any of the three is found at load, and so is a file
    // of another save (another step's weights copied in).
    const sdk::TextMap bound{{"state_json_crc32", crc32_hex(state_json)}};
    save_safetensors(tmp / "model.safetensors", model, bound);
    save_safetensors(tmp / "optimizer.safetensors", extra, bound);
    write_file_atomic(tmp / "state.json", state_json);
  } catch (const std::exception& e) {
    // A full disk (or a quota): the half-written folder goes, so it holds no space the user must
    // find; the step folders written before are untouched.
    std::error_code removed, ec;
    if (made) fs::remove_all(tmp, removed);
    std::string why = e.what();
    if (const auto* file = dynamic_cast<const fs::filesystem_error*>(&e)) why = explained(*file);
    if (const auto* torch = dynamic_cast<const c10::Error*>(&e)) why = explained(*torch);  // (no backtrace)
    const fs::space_info space = fs::space(dir_, ec);
    const bool limit = why.find(std::strerror(EFBIG)) != std::string::npos;  // (the space is not what is short)
    throw Error("the checkpoint of step " + std::to_string(step) + " could not be written to " + dir_.string() + ": " +
                why +
                (limit ? " (raise the file-size limit, or lift it: `ulimit -f unlimited`)"
                 : ec  ? std::string()
                       : " (" + format_bytes(static_cast<int64_t>(space.available)) + " free there)") +
                (removed ? "; its partial folder " + tmp.string() + " could not be removed (" + removed.message() +
                               "): delete it by hand"
                         : std::string(made ? "; its partial folder is removed" : "")));
  }
  // The same step saved again (a replayed run): the older folder is renamed out of the step_*
  // names first, so a process killed here leaves one of the two whole, never neither (the older
  // one as .step_*.replaced, which the next store puts back where no new folder arrived).
  const fs::path replaced = dir_ / (std::string(".").append(step_dir_name(step)).append(".replaced"));
  if (fs::exists(final_dir)) {
    fs::remove_all(replaced);
    fs::rename(final_dir, replaced);
  }
  try {
    rename_durable(tmp, final_dir);
  } catch (...) {
    std::error_code back;
    fs::rename(replaced, final_dir, back);
    throw;
  }
  std::error_code gone;
  fs::remove_all(replaced, gone);
  const auto all = list();
  if (keep_last > 0 && static_cast<int64_t>(all.size()) > keep_last)
    for (size_t i = 0; i + static_cast<size_t>(keep_last) < all.size(); ++i) {
      // Renamed out of the step_* names first, in one step: a process killed while deleting
      // leaves a .step_*.deleting folder, which the next run removes, never a step folder with
      // half of its files.
      std::error_code ec;
      const fs::path doomed = dir_ / (std::string(".").append(all[i].filename().string()).append(".deleting"));
      fs::rename(all[i], doomed, ec);
      const fs::path going = ec ? all[i] : doomed;
      fs::remove_all(going, ec);
      // (a folder that cannot go, made immutable or not the run's user's: they piled up, unsaid, until the disk was full)
      if (std::error_code exists; ec || fs::exists(going, exists)) {
        static std::set<std::string> said;  // (once per folder: each later save tries again)
        if (said.insert(going.string()).second)
          log::warn("keep_last: cannot remove the older checkpoint ", going.string(), " (",
                    ec ? ec.message() : std::string("still there"), "): it stays and keeps its space; remove it by hand ",
                    "(its permissions, or chattr -i, allow that)");
      }
    }
  return final_dir;
}

void CheckpointStore::check_weights_name(const std::string& file_name) {
  // (a NUL: the name passed as ".safetensors" and the file system stopped at the NUL, "a")
  const bool plain = !file_name.empty() && file_name.front() != '.' && file_name.find('/') == std::string::npos &&
                     file_name.find('\0') == std::string::npos &&
                     file_name.size() > 12 && file_name.ends_with(".safetensors") && file_name.rfind("step_", 0) != 0;
  if (!plain)
    throw Error("cannot save weights as '" + printable(file_name, 200) + "': a weights file is a plain name ending in .safetensors, "
                "not starting with '.' or 'step_', without '/' or a NUL byte");
}

fs::path CheckpointStore::save_weights(const std::string& file_name, const sdk::TensorMap& model,
                                      const sdk::TextMap& metadata) {
  check_weights_name(file_name);
  const fs::path path = dir_ / file_name;
  save_safetensors(path, model, metadata);
  return path;
}

namespace {

// The three files of a step folder are of one save: each safetensors file records state.json's
// checksum (model.safetensors since 0.1: older ones record nothing, and are not checked). The
// file that disagrees with the other two is named: a state.json changed after the save, or a
// weights or optimizer file of another save copied in.
void check_one_save(const fs::path& dir, const std::string& state, const sdk::TextMap& model, const sdk::TextMap& optimizer) {
  const auto recorded = [](const sdk::TextMap& m) {
    const auto it = m.find("state_json_crc32");
    return it == m.end() ? std::optional<std::string>() : it->second;
  };
  const auto by_model = recorded(model), by_optimizer = recorded(optimizer);
  const bool model_fits = !by_model || *by_model == state, optimizer_fits = !by_optimizer || *by_optimizer == state;
  if (model_fits && optimizer_fits) return;
  const std::string damaged = "; the checkpoint is damaged";
  if (!by_model || !by_optimizer) {  // one record: which of the two files changed is not known
    const std::string file = by_model ? "model.safetensors" : "optimizer.safetensors";
    throw Error((dir / "state.json").string() + " has checksum " + state + ", " + file + " recorded " +
                (by_model ? *by_model : *by_optimizer) + ": one of the two changed after Loom wrote it, or is of another "
                "save" + damaged);
  }
  if (*by_model == *by_optimizer)
    throw Error((dir / "state.json").string() + " has checksum " + state + ", the checkpoint recorded " + *by_model +
                ": it changed after Loom wrote it" + damaged);
  if (!model_fits && !optimizer_fits)
    throw Error("the files of " + dir.string() + " are of three different saves (state.json's checksum " + state +
                ", model.safetensors records " + *by_model + ", optimizer.safetensors " + *by_optimizer + ")" + damaged);
  const std::string file = model_fits ? "optimizer.safetensors" : "model.safetensors";
  throw Error((dir / file).string() + " is not of this step folder's save: it records state.json's checksum as " +
              (model_fits ? *by_optimizer : *by_model) + ", state.json has " + state +
              ", as the folder's other file records (a file of another step or run copied in?)" + damaged);
}

Checkpoint load_step_folder(const fs::path& dir, bool with_optimizer) {
  if (!fs::is_directory(dir))
    throw Error("checkpoint " + dir.string() + " is not a folder; pass a step folder such as runs/<name>/checkpoints/step_00000300" +
                (with_optimizer && dir.extension() == ".safetensors"
                     ? " (a weights file holds no optimizer, schedule or step to resume: trainer.init_from = " + dir.string() +
                           " starts a new run from its weights)"
                     : std::string()));
  for (const char* file : {"state.json", "model.safetensors", "optimizer.safetensors"})
    if ((with_optimizer || std::string_view(file) != "optimizer.safetensors") && !fs::exists(dir / file))
      throw Error("checkpoint " + dir.string() + " has no " + file + "; it is incomplete or not a Loom checkpoint");
  Checkpoint c;
  c.dir = dir;
  sdk::TextMap model_metadata;
  c.model = load_safetensors(dir / "model.safetensors", &model_metadata);
  sdk::TextMap metadata;
  if (with_optimizer) {
    c.extra = load_safetensors(dir / "optimizer.safetensors", &metadata);
  } else if (!fs::exists(dir / "optimizer.safetensors")) {
    log::warn("checkpoint ", dir.string(), " has no optimizer.safetensors: its state.json (the model's configuration) ",
              "is checked against model.safetensors' record of it alone (a checkpoint before 0.1's has none)");
  } else {
    try {
      metadata = load_safetensors_metadata(dir / "optimizer.safetensors");  // its header: the optimizer is not used
    } catch (const Error& e) {
      log::warn("state.json of ", dir.string(), " cannot be checked (", e.what(), "); it is used as it is");
    }
  }
  c.state_json = read_file(dir / "state.json", 64 << 20);
  check_one_save(dir, crc32_hex(c.state_json), model_metadata, metadata);
  return c;
}

}  // namespace

Checkpoint CheckpointStore::load(const fs::path& dir) { return load_step_folder(dir, /*with_optimizer=*/true); }

Checkpoint CheckpointStore::load_weights(const fs::path& dir) { return load_step_folder(dir, /*with_optimizer=*/false); }

}  // namespace loom::core
