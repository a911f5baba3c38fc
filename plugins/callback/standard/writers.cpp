// The callbacks that write what a run reports: the progress line, metrics.jsonl, TensorBoard.
#include "standard.hpp"

#include <loom/sdk/files.hpp>
#include <loom/sdk/helpers.hpp>
#include <loom/sdk/log.hpp>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iostream>
#include <limits>
#include <optional>
#include <sstream>
#include <string_view>
#include <sys/mman.h>
#include <unistd.h>
#include <vector>

namespace fs = std::filesystem;

namespace loom::callbacks {

namespace {

/// `path` is absent or a regular file (through symlinks) that this process can read, else one error
/// naming it: a FIFO would block the run for ever, a device (/dev/zero) would be read without end,
/// a directory cannot be written, and an unreadable file must not be taken for an empty one (the
/// metrics it holds would be replaced).
void require_regular_file(const fs::path& path, const char* what) {
  const std::string there = sdk::what_is_at(path);
  if (there.empty() || there == "no such file") return;
  if (there.rfind("cannot", 0) == 0) throw sdk::Error(path.string() + " (" + what + ") " + there);
  throw sdk::Error(path.string() + " is " + there + ", not " + what +
                   (there == "a symbolic link to nothing" ? "; remove it" : "; move it out of the run folder") +
                   ", and Loom writes the file there");
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double value_or_nan(const std::map<std::string, double>& values, const std::string& key) {
  auto it = values.find(key);
  return it == values.end() || std::isnan(it->second) ? std::nan("") : it->second;  // (never "-nan" on the line)
}

/// A JSON string literal.
std::string quoted(const std::string& text) {
  std::string out = "\"";
  for (const char ch : text) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      char escape[8];
      std::snprintf(escape, sizeof escape, "\\u%04x", ch);
      out += escape;
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

/// The shortest text that reads back as the same double; null for NaN and infinities (JSON has
/// neither).
std::string number(double v) {
  if (!std::isfinite(v)) return "null";
  char buffer[32];
  const auto [end, error] = std::to_chars(buffer, buffer + sizeof buffer, v);
  return error == std::errc() ? std::string(buffer, end) : "null";
}

}  // namespace

// ---- progress ------------------------------------------------------------------------------

namespace {

/// " | cuda:0 1.2 GiB (peak 3.4 GiB), cuda:1 ...": each device's memory where the host reports
/// several (memory/<device>/..._bytes, data_parallel on GPUs); empty otherwise.
std::string per_device_memory(const std::map<std::string, double>& values) {
  std::string out;
  const std::string prefix = "memory/", suffix = "/peak_bytes";
  for (const auto& [key, peak] : values) {
    if (key.size() <= prefix.size() + suffix.size() || key.compare(0, prefix.size(), prefix) != 0 ||
        key.compare(key.size() - suffix.size(), suffix.size(), suffix) != 0)
      continue;
    const std::string device = key.substr(prefix.size(), key.size() - prefix.size() - suffix.size());
    std::string shown = device;
    std::replace(shown.begin(), shown.end(), '_', ':');
    out += (out.empty() ? " | " : ", ") + shown + " " +
           sdk::format_bytes(static_cast<int64_t>(value_or_nan(values, prefix + device + "/allocated_bytes"))) + " (peak " +
           sdk::format_bytes(static_cast<int64_t>(peak)) + ")";
  }
  return out;
}

}  // namespace

void Progress::on_run_begin(RunContext&) { tty_ = ::isatty(STDERR_FILENO) != 0; }

void Progress::on_step_end(RunContext&, const sdk::StepReport& report) {
  train_seconds_ += report.seconds;
  ++steps_timed_;
}

void Progress::on_log(RunContext& run, int64_t step, const std::map<std::string, double>& values) {
  if (!run.is_main() || !values.count("train/loss")) return;
  const int64_t total = run.total_steps();
  // The step being logged has not reached on_step_end yet: count it in the ETA's average.
  const double per_step = train_seconds_ / static_cast<double>(std::max<int64_t>(1, steps_timed_));
  const double eta = static_cast<double>(total - step) * per_step;
  const std::string width = std::to_string(std::to_string(total).size());
  // A loss over something else than samples (gpt2_lm: tokens) adds that rate: "8 samples/s (8192 loss terms/s)".
  char rate[96];
  const auto terms = values.find("train/loss_terms_per_s");
  if (terms != values.end())
    std::snprintf(rate, sizeof rate, "%.0f samples/s (%.0f loss terms/s)", value_or_nan(values, "train/samples_per_s"), terms->second);
  else
    std::snprintf(rate, sizeof rate, "%.0f samples/s", value_or_nan(values, "train/samples_per_s"));
  // The model's TFLOP/s per device and its MFU, where the model declares its FLOPs (Model 2.2)
  // and the device's peak is known: "| 354 TFLOP/s, MFU 35.8 %".
  char flops[64] = "";
  if (const auto tflops = values.find("train/tflops"); tflops != values.end()) {
    const auto mfu = values.find("train/mfu");
    if (mfu != values.end())
      std::snprintf(flops, sizeof flops, " | %.3g TFLOP/s, MFU %.1f %%", tflops->second, 100 * mfu->second);
    else
      std::snprintf(flops, sizeof flops, " | %.3g TFLOP/s", tflops->second);
  }
  char line[464];
  std::snprintf(line, sizeof line,
                ("step %" + width + "lld/%lld | loss %.4f | lr %.2e | %s%s | ETA %s | mem %s (peak %s)").c_str(),
                static_cast<long long>(step), static_cast<long long>(total), value_or_nan(values, "train/loss"),
                value_or_nan(values, "train/lr"), rate, flops,
                steps_timed_ > 0 ? sdk::format_duration(eta).c_str() : "?",
                sdk::format_bytes(static_cast<int64_t>(value_or_nan(values, "memory/allocated_bytes"))).c_str(),
                sdk::format_bytes(static_cast<int64_t>(value_or_nan(values, "memory/peak_bytes"))).c_str());
  std::string text = line + per_device_memory(values);
  if (tty_) {
    std::cerr << "\r\033[2K" << text << std::flush;
    live_ = true;
    return;
  }
  const double now = now_seconds();
  if (now - last_plain_ < 5.0 && step != total) return;
  last_plain_ = now;
  std::cerr << text << "\n" << std::flush;
}

// The host logs the evaluation's line just before this hook; on a terminal the log line replaced
// the live line (see the host's logger), so there is none to end.
void Progress::on_evaluation_end(RunContext&, const sdk::EvalReport&) { live_ = false; }

void Progress::on_run_end(RunContext&, const sdk::RunReport&) { finish(); }

void Progress::finish() {
  if (live_) std::cerr << "\n" << std::flush;
  live_ = false;
}

// ---- jsonl ---------------------------------------------------------------------------------

namespace {

/// The step of a metrics row, {"step": N, ...} however it is spaced and wherever the key is (a
/// file rewritten with sorted keys has it after "eval/..."); nullopt for any other line.
std::optional<int64_t> row_step(std::string_view line) {
  const auto blank = [](char c) { return c == ' ' || c == '\t' || c == '\r'; };
  size_t first = 0;
  while (first < line.size() && blank(line[first])) ++first;
  if (first == line.size() || line[first] != '{') return std::nullopt;
  for (size_t at = line.find("\"step\"", first); at != std::string::npos; at = line.find("\"step\"", at + 1)) {
    size_t before = at;  // a key: after the '{' or a ','
    while (before > first && blank(line[before - 1])) --before;
    if (before == 0 || (line[before - 1] != '{' && line[before - 1] != ',')) continue;
    size_t i = at + 6;
    while (i < line.size() && blank(line[i])) ++i;
    if (i == line.size() || line[i] != ':') continue;
    ++i;
    while (i < line.size() && blank(line[i])) ++i;
    int64_t step = 0;
    if (std::from_chars(line.data() + i, line.data() + line.size(), step).ec == std::errc()) return step;
  }
  return std::nullopt;
}

}  // namespace

void Jsonl::on_run_begin(RunContext& run) {
  if (!run.is_main()) return;
  path_ = run.run_dir() / "metrics.jsonl";
  require_regular_file(path_, "the run's metrics (metrics.jsonl)");
  // A link to a file elsewhere (another run's, in a copy made with links): a resume cuts the rows
  // after its checkpoint, which must not happen to that file. The run writes its own copy, said.
  if (std::error_code ec; run.resumed_at() >= 0 && fs::is_symlink(path_, ec))
    sdk::log::warn("metrics.jsonl of ", run.run_dir().string(), " is a link to ", fs::read_symlink(path_, ec).string(),
                   ": this run writes its own copy from here, and leaves that file as it is");
  if (run.resumed_at() >= 0 && fs::exists(path_)) {
    // Keep what the interrupted run wrote up to the checkpoint; a torn last line is dropped. The
    // file is read through a map and written back as pieces of it: a long run's (hundreds of MB,
    // a row per step) was held in memory three times over.
    int64_t bytes = 0;
    const int fd = sdk::open_regular_file(path_, std::numeric_limits<int64_t>::max(), "", "",
                                          "resuming keeps the metrics it holds up to the checkpoint; make it readable, or "
                                          "move it away", &bytes);
    const auto size = static_cast<size_t>(bytes);
    void* map = size == 0 ? nullptr : ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    std::string copy;  // (where the file cannot be mapped, on a FUSE mount with direct I/O: read whole, as before)
    if (map == MAP_FAILED) {
      map = nullptr;
      copy.resize(size);
      for (size_t done = 0; done < size;) {
        const ssize_t got = ::read(fd, copy.data() + done, size - done);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) {
          const int error = got < 0 ? errno : EIO;
          ::close(fd);
          throw sdk::Error("cannot read " + path_.string() + " (" + std::strerror(error) + "): nothing in it was changed");
        }
        done += static_cast<size_t>(got);
      }
    }
    ::close(fd);
    const std::unique_ptr<void, std::function<void(void*)>> unmap(map, [size](void* m) { ::munmap(m, size); });
    const std::string_view text = map ? std::string_view(static_cast<const char*>(map), size) : std::string_view(copy);
    // Rows of later steps go (the resumed run writes them again); every other line stays: rows
    // rewritten by another tool ({"step": 4, ...} from Python's json.dumps) and lines a user
    // added were dropped with the later rows, the whole history of a file so rewritten.
    // NUL bytes (the zero-filled tail a crash leaves on ext4) are no one's line: kept, they made
    // the file no JSON Lines for every reader. (Other control bytes may be a user's: jq --seq's.)
    std::vector<std::string_view> kept;  // (pieces of `text`, the lines next to each other as one)
    const auto keep = [&](std::string_view piece) {
      if (!kept.empty() && kept.back().data() + kept.back().size() == piece.data())
        kept.back() = std::string_view(kept.back().data(), kept.back().size() + piece.size());
      else
        kept.push_back(piece);
    };
    int64_t foreign = 0, dropped = 0;
    for (size_t at = 0; at < text.size();) {
      const size_t end = std::min(text.find('\n', at), text.size());
      const bool whole = end < text.size();  // (a last line without its newline: cut by a kill)
      const std::string_view line = text.substr(at, end - at);
      const auto keep_line = [&] {
        keep(text.substr(at, end - at + (whole ? 1 : 0)));
        if (!whole) keep("\n");
      };
      if (line.find('\0') != std::string_view::npos) {
        ++dropped;
      } else if (const auto step = row_step(line)) {
        if (*step <= run.resumed_at() && (whole || line.back() == '}')) keep_line();
      } else if (!whole && line.rfind('{', 0) == 0) {
        // a torn row: dropped
      } else if (!line.empty()) {
        keep_line();
        ++foreign;
      }
      at = end + 1;
    }
    if (foreign > 0)
      sdk::log::info("metrics.jsonl: ", foreign, " line(s) that are no step's row are kept as they are");
    if (dropped > 0)
      sdk::log::warn("metrics.jsonl: ", dropped, " line(s) holding NUL bytes (what a crash leaves at a file's end) are "
                     "dropped");
    try {
      sdk::write_file_durably(path_, kept);
    } catch (const sdk::Error& e) {
      throw sdk::Error(std::string(e.what()) + "; free space or make the run folder writable, then resume again");
    }
  }
  // A fresh run starts the file anew (a folder reused after an attempt that never checkpointed),
  // its own: truncating through a link emptied the file it pointed at.
  if (std::error_code ec; run.resumed_at() < 0 && fs::is_symlink(path_, ec)) {
    sdk::log::warn("metrics.jsonl of ", run.run_dir().string(), " is a link to ", fs::read_symlink(path_, ec).string(),
                   ": this run writes its own file in its place, and leaves that file as it is");
    fs::remove(path_);
  }
  out_.open(path_, run.resumed_at() >= 0 ? std::ios::app : std::ios::trunc);
  if (!out_) throw sdk::Error("cannot write " + path_.string());
}

void Jsonl::on_log(RunContext& run, int64_t step, const std::map<std::string, double>& values) {
  if (!run.is_main()) return;
  std::string line = "{\"step\":" + std::to_string(step);
  for (const auto& [key, value] : values) line += "," + quoted(key) + ":" + number(value);
  append_whole(out_, path_, line + "}\n");  // (a line a full disk cut would end the file in half a JSON object)
}

// ---- tensorboard ---------------------------------------------------------------------------

void TensorBoard::on_run_begin(RunContext& run) {
  if (!run.is_main()) return;
  const fs::path dir = run.run_dir() / "tensorboard";
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec))
    throw sdk::Error(dir.string() + " is not a directory; move it out of the run folder, and Loom writes TensorBoard's "
                     "event files in a folder of that name");
  // A link into another run's folder (a copy made with links): a resume cuts the events after its
  // checkpoint, which must not happen there. The run writes its own folder, said. (A link to a
  // folder of its own elsewhere, a shared log folder or a larger disk, is the run's.)
  if (const fs::path target = fs::canonical(dir, ec);
      fs::is_symlink(dir, ec) && !target.empty() && fs::exists(target.parent_path() / ".lock", ec) &&
      target.parent_path() != fs::canonical(run.run_dir(), ec)) {
    sdk::log::warn("tensorboard of ", run.run_dir().string(), " is a link to ", fs::read_symlink(dir, ec).string(),
                   ": this run writes its own event files in a folder in its place, and leaves that folder as it is");
    fs::remove(dir);
  }
  // (the folder now, and whether it takes files: a run that cannot write them fails before its
  // first step, not at its first log step)
  std::error_code made;
  fs::create_directories(dir, made);
  if (made || ::access(dir.c_str(), W_OK | X_OK) != 0)
    throw sdk::Error("cannot write TensorBoard's event files in " + dir.string() + " (" +
                     (made ? made.message() : std::string(std::strerror(errno))) +
                     "); make it writable, or leave tensorboard out of trainer.callbacks");
  writer_.reset();
  dir_ = dir;
  purge_from_ = run.resumed_at() >= 0 ? run.resumed_at() + 1 : -1;
}

// A side channel: where its folder went (replaced by a file mid-run) or its file cannot be written,
// the run goes on without it, said once (it ended the run, the steps since the last checkpoint
// lost with it; probe). The folder was checked before the first step (on_run_begin).
void TensorBoard::on_log(RunContext&, int64_t step, const std::map<std::string, double>& values) {
  if (dir_.empty()) return;
  try {
    if (!writer_) {
      writer_ = std::make_unique<EventFileWriter>(dir_);
      if (purge_from_ >= 0) writer_->purge_from(purge_from_);
    }
    for (const auto& [key, value] : values) writer_->scalar(key, step, value);
  } catch (const std::exception& e) {  // (the writer's "then resume the run" is not this run's case)
    std::string why = e.what();
    if (const auto then = why.find(", then resume"); then != std::string::npos) why.erase(then);
    sdk::log::warn("tensorboard: ", why, ": the run goes on without TensorBoard's events from step ", step,
                   " (its other records, its checkpoints and metrics, as they were)");
    writer_.reset();
    dir_.clear();
  }
}

}  // namespace loom::callbacks
