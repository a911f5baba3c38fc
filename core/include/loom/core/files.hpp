// Files: writing so that a crash never leaves a half-written one (a temporary file beside the
// target, fsync, rename over the target, fsync of the folder), reading only regular files of a
// bounded size, and the lock that keeps two processes out of one run folder.
#pragma once

#include <cstdint>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace loom::core {

/// Atomically replaces `path` with `bytes`. Throws loom::Error naming the path on failure.
void write_file_atomic(const std::filesystem::path& path, std::string_view bytes);

/// The same with the file's bytes given in parts, written one after the other and never joined
/// in memory (a checkpoint's tensors: a copy of them all would double the process's memory).
void write_file_atomic(const std::filesystem::path& path, const std::vector<std::string_view>& parts);

/// A regular file mapped into memory (copy-on-write: writes stay private) while the object
/// lives: read_file's refusals (missing, a FIFO, a device, a socket), without its size cap and
/// without a copy.
class MappedFile {
 public:
  explicit MappedFile(const std::filesystem::path& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  const char* data_ = nullptr;
  size_t size_ = 0;
};

/// Reads a whole regular file of at most `max_bytes`; throws loom::Error naming the path for a
/// missing file, a FIFO, a device or a socket (refused before reading, so nothing hangs or reads
/// without end), or a larger file.
std::string read_file(const std::filesystem::path& path, int64_t max_bytes = int64_t{1} << 30);

/// CRC-32 (zlib's) of `bytes` as 8 hex digits: the checksums of checkpoint files.
std::string crc32_hex(std::string_view bytes);

/// "a FIFO", "a character device", ...: a st_mode's file type for messages.
const char* file_type_name(unsigned mode);

/// An exclusive advisory lock (flock) on a file and on the folder that holds it, held while the
/// object lives. The lock ends with the process, so a lock file left by a killed process is never
/// stale; one removed by hand leaves the folder locked.
class FileLock {
 public:
  /// Another process holds the lock; what() names it ("process 4242").
  struct Locked : std::runtime_error {
    using std::runtime_error::runtime_error;
  };
  /// Takes the lock or throws Locked; loom::Error when the file cannot be opened.
  explicit FileLock(const std::filesystem::path& path);
  ~FileLock();
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

  /// Whether the locked folder is no longer at its path (renamed or removed while held), and where
  /// it went: `now` is its path now ("" where it was removed, or the system does not say).
  struct Whereabouts {
    bool gone = false, removed = false;
    std::filesystem::path now;
  };
  /// (one stat and one fstat; never gone where the folder could not be locked)
  Whereabouts whereabouts() const;

 private:
  void release_folder();

  std::filesystem::path path_;
  int fd_ = -1;
  int folder_fd_ = -1;  ///< the folder's lock, or -1 where the folder could not be locked
};

/// fsyncs a folder (after a rename into it).
void fsync_dir(const std::filesystem::path& dir);

/// Removes the temporary files (sdk::write_file_durably's "<file>.tmp.<host>.<pid>.<n>") in
/// `run_dir` and its checkpoints folder that a process of this host left when it was killed mid-
/// write: never read back, they piled up (space a full disk needs). One of another host, or of a
/// process that runs, is left.
void remove_orphan_temporaries(const std::filesystem::path& run_dir);

/// The folder scratch files go in: $TMPDIR, or /tmp where it is unset or empty. Throws a
/// loom::Error naming TMPDIR where it is no folder (std::filesystem's said neither).
std::filesystem::path temp_folder();

/// `path` with a leading "~/" taken as $HOME/ (where HOME is set), as the shell does with a word's
/// own: `--set trainer.work_dir=~/runs` and `--checkpoint=~/x.safetensors` reach Loom with the ~,
/// which made a folder named "~" in the current one. Anything else is returned as it is, "~" alone
/// too (a text option's value may be one) unless `alone_too` (a value that is a path: the work
/// folder, a flag's path).
std::string home_expanded(const std::string& path, bool alone_too = false);

/// Renames `from` to `to` and fsyncs the folders: atomically on one filesystem; across two (a
/// folder linked onto another disk), a durable copy under a temporary name, then the original removed.
void rename_durable(const std::filesystem::path& from, const std::filesystem::path& to);

}  // namespace loom::core
