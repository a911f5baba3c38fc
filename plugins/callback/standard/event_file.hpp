// TensorBoard event files, written without protobuf or TensorFlow: scalars as Summary values
// with simple_value, each record framed and checksummed as TFRecord (CRC-32C) and flushed. The
// format: research/libtorch-api.md section 13.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

namespace loom::callbacks {

/// CRC-32C (Castagnoli), as TFRecord framing needs.
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);

/// Appends `bytes` to `out` (open on `path`, appending) and flushes. A write that fails (a full
/// disk, a file-size limit) cuts the file back to where it was, so that it never ends in half a
/// record or line, which its readers refuse, and throws an error naming the file and the cause.
void append_whole(std::ofstream& out, const std::filesystem::path& path, const std::string& bytes);

/// A TensorBoard event file: events.out.tfevents.<time>.<host> in `dir`.
class EventFileWriter {
 public:
  explicit EventFileWriter(const std::filesystem::path& dir);
  /// Marks a restart at `step`: TensorBoard drops earlier events from `step` on (what Python's
  /// SummaryWriter(purge_step=...) writes when a run resumes).
  void purge_from(int64_t step);
  void scalar(const std::string& tag, int64_t step, double value);
  const std::filesystem::path& path() const { return path_; }

 private:
  void write_event(const std::string& event);
  std::filesystem::path path_;
  std::ofstream out_;
};

}  // namespace loom::callbacks
