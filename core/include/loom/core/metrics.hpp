// What a run reports: metrics per step as JSON lines and as TensorBoard event files (written
// here, without protobuf or TensorFlow), and a live progress line on the terminal.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

namespace loom::core {

/// CRC-32C (Castagnoli), as TFRecord framing needs.
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);

/// A TensorBoard event file: events.out.tfevents.<time>.<host> in `dir`. Scalars are Summary
/// values with simple_value; each record is framed and checksummed as TFRecord, and flushed.
class EventFileWriter {
 public:
  explicit EventFileWriter(const std::filesystem::path& dir);
  /// Marks a restart at `step`: TensorBoard drops earlier events from `step` on (what Python's
  /// SummaryWriter(purge_step=...) writes when a run resumes).
  void purge_from(int64_t step);
  void scalar(const std::string& tag, int64_t step, double value);
  void flush();
  const std::filesystem::path& path() const { return path_; }

 private:
  void write_event(const std::string& event);
  std::filesystem::path path_;
  std::ofstream out_;
};

/// Metrics of a run: one JSON object per line in metrics.jsonl (`{"step": .., "loss": .., ...}`)
/// and the same numbers as TensorBoard scalars.
class MetricsWriter {
 public:
  /// Opens (appends to) the run folder's metrics. When resuming at `resume_step`, lines of later
  /// steps, written by the run that was interrupted, are dropped first.
  MetricsWriter(const std::filesystem::path& run_dir, int64_t resume_step);
  void write(int64_t step, const std::map<std::string, double>& values);
  const std::filesystem::path& jsonl_path() const { return jsonl_path_; }
  const std::filesystem::path& tensorboard_dir() const { return tb_dir_; }

 private:
  std::filesystem::path jsonl_path_, tb_dir_;
  std::ofstream jsonl_;
  EventFileWriter events_;
};

/// The live progress line: redrawn in place on a terminal, plain lines (at most one every few
/// seconds) otherwise.
class Progress {
 public:
  explicit Progress(int64_t total_steps);
  void update(int64_t step, const std::string& fields);
  /// Ends the live line before other output.
  void finish();
  bool interactive() const { return tty_; }

 private:
  int64_t total_;
  bool tty_;
  bool live_ = false;
  double last_plain_ = -1e9;
};

/// "1h02m", "3m05s", "12s".
std::string format_duration(double seconds);

}  // namespace loom::core
