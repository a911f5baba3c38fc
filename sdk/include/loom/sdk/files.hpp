// What is at a path that is not a regular file, for messages that name it, a bounded reader of a
// whole small file, and the durable writer of a whole file. Header-only, so that the host's plugin
// loader, checkpoints, writers and datasets name a FIFO or a device, and replace a file, the same way.
#pragma once

#include <loom/sdk/error.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace loom::sdk {

/// What is at `path` when it is not a regular file (a symlink followed), for a message that names
/// it: "a FIFO", "a folder", "a character device", "a symbolic link to nothing", "no such file",
/// "cannot be read (Permission denied)"...; empty for a regular file. Reading a FIFO waits for a
/// writer and a device never ends, so a file Loom reads or appends to is checked first.
inline std::string what_is_at(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  switch (status.type()) {
    case fs::file_type::regular: return "";
    case fs::file_type::not_found: {
      std::error_code link_ec;
      return fs::is_symlink(fs::symlink_status(path, link_ec)) ? "a symbolic link to nothing" : "no such file";
    }
    case fs::file_type::directory: return "a folder";
    case fs::file_type::fifo: return "a FIFO";
    case fs::file_type::character: return "a character device";
    case fs::file_type::block: return "a block device";
    case fs::file_type::socket: return "a socket";
    default: return ec ? "cannot be read (" + ec.message() + ")" : "not a regular file";
  }
}

/// `path` opened as read_regular_file opens it, for a reader that reads it a part at a time (a
/// large file parsed as it is read, whose first damaged line is found without reading the rest):
/// the descriptor (close-on-exec; the caller closes it) of a regular file of at most `most` bytes
/// now, or read_regular_file's error (a symbolic link to nothing is named as one, with its target).
/// `size`, where given, receives the size the file has now.
inline int open_regular_file(const std::filesystem::path& path, int64_t most, const std::string& prefix,
                             const std::string& missing, const std::string& fix = "", int64_t* size = nullptr) {
  const std::string then = fix.empty() ? std::string() : "; " + fix;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int error = errno;
    if (error == ENOENT) {
      // A link whose target is gone is there ("no ratings.csv" beside `ls` showing it misleads).
      std::error_code ec;
      if (std::filesystem::is_symlink(std::filesystem::symlink_status(path, ec)))
        throw Error(prefix + path.string() + " is a link to " + std::filesystem::read_symlink(path, ec).string() +
                    ", which is not there" + then);
      throw Error(prefix + "no " + path.string() + " (" + missing + ")" + then);
    }
    throw Error(prefix + "cannot open " + path.string() + ": " + std::strerror(error) + then);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    const std::string is = what_is_at(path);
    throw Error(prefix + path.string() + " is " + (is.empty() ? "" : is + ", ") + "not a regular file" + then);
  }
  if (st.st_size > most) {
    ::close(fd);
    throw Error(prefix + path.string() + " is " + std::to_string(st.st_size) + " bytes, more than such a file has (at most " +
                std::to_string(most) + "): it is damaged or another file" + then);
  }
  if (size != nullptr) *size = static_cast<int64_t>(st.st_size);
  return fd;
}

/// The bytes of the regular file `path`, read whole, of at most `most` bytes: a data or
/// configuration file a reader parses. Opened without blocking and checked on the open descriptor,
/// so a FIFO or a device (even one put there after a check) is an error, never a wait; a larger
/// file is refused unread; a failed open or read names its cause (EACCES is not "no such file").
/// Each message starts with `prefix` ("gpt2 tokenizer: ") and ends with `fix` where one is given;
/// `missing` says, for a file that is not there, what should be.
inline std::string read_regular_file(const std::filesystem::path& path, int64_t most, const std::string& prefix,
                                     const std::string& missing, const std::string& fix = "") {
  const std::string then = fix.empty() ? std::string() : "; " + fix;
  int64_t size = 0;
  const int fd = open_regular_file(path, most, prefix, missing, fix, &size);
  // Read to the end, not to st_size: a file whose size the kernel does not know (a /proc or sysfs
  // file says 0) or one that grows while read is read whole, and still held to `most`.
  // (room past st_size from the start: the read that finds the end needs no larger copy of the file)
  std::string out(static_cast<size_t>(size) + 65536, '\0');
  size_t done = 0;
  const size_t limit = static_cast<size_t>(most);
  for (;;) {
    if (out.size() - done < 4096) out.resize(std::min(2 * out.size(), limit + 65536));  // (done <= limit here: it grows)
    const ssize_t got = ::read(fd, out.data() + done, out.size() - done);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      const int error = errno;
      ::close(fd);
      throw Error(prefix + "reading " + path.string() + " failed: " + std::strerror(error) + then);
    }
    if (got == 0) break;  // the end (a file cut while read is shorter: what was read is parsed and checked)
    done += static_cast<size_t>(got);
    if (done > limit) {
      ::close(fd);
      throw Error(prefix + path.string() + " holds more than " + std::to_string(most) +
                  " bytes, more than such a file has: it is damaged or another file" + then);
    }
  }
  ::close(fd);
  out.resize(done);
  return out;
}

/// Replaces `path` with the bytes of `parts` (written one after the other, never joined in memory:
/// a checkpoint's tensors) whole or not at all, across a crash or a power loss: a temporary file
/// beside it, made anew (O_EXCL, O_NOFOLLOW: never a FIFO, a device or a link someone left under
/// its name; named by host, process and the time, so no two writers share one, even on a
/// file system several machines share), written, synced, closed, renamed over `path`, and the
/// folder synced. On failure the temporary file goes, `path` is as it was, and the error names the
/// step, the file and the cause ("No space left on device").
inline void write_file_durably(const std::filesystem::path& path, const std::vector<std::string_view>& parts) {
  // The new file is renamed over the path: over a device or a FIFO (as root, /dev/null given as
  // an output) that would replace the special file itself. A symbolic link is replaced, not its
  // target.
  if (struct stat st {}; ::lstat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode) && !S_ISLNK(st.st_mode))
    throw Error("cannot write " + path.string() + ": it is " +
                (S_ISDIR(st.st_mode) ? "a folder" : S_ISFIFO(st.st_mode) ? "a FIFO" : S_ISCHR(st.st_mode) ? "a character device"
                 : S_ISBLK(st.st_mode) ? "a block device" : S_ISSOCK(st.st_mode) ? "a socket" : "not a regular file") +
                ", which Loom does not replace; give the path of a file (or of none yet)");
  char host[64] = {};
  ::gethostname(host, sizeof host - 1);
  std::filesystem::path tmp;
  int fd = -1;
  for (int attempt = 0; fd < 0 && attempt < 8; ++attempt) {  // (EEXIST: a name taken, by chance; another)
    const auto now = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    tmp = path.string() + ".tmp." + host + "." + std::to_string(::getpid()) + "." + std::to_string(now % 1000000007);
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0 && errno != EEXIST) break;
  }
  const auto failed = [&](const std::string& what, int error) {
    // (what stands at the path is said as it is: unchanged, or nothing where there was nothing)
    struct stat st {};
    const bool there = ::lstat(path.c_str(), &st) == 0;
    return Error("cannot " + what + " " + tmp.string() + ": " + std::strerror(error) +
                 (error == EFBIG ? std::string(", the file-size limit of this process (`ulimit -f`)") : std::string()) +
                 " (" + path.string() + (there ? " is unchanged)" : " was not written)"));
  };
  if (fd < 0) throw failed("create", errno);
  // The temporary file goes, and the error names the call's cause, not what close or unlink set.
  const auto give_up = [&](const std::string& what, int error) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    return failed(what, error);
  };
  for (const std::string_view bytes : parts) {
    for (size_t done = 0; done < bytes.size();) {
      const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) throw give_up("write", n < 0 ? errno : ENOSPC);  // (no progress: a full disk)
      done += static_cast<size_t>(n);
    }
  }
  if (::fsync(fd) != 0) throw give_up("sync", errno);
  // A network file system may report a failed write only at close. (EINTR: the descriptor is closed
  // all the same on Linux, and the data was synced above.)
  const int closed = ::close(fd);
  fd = -1;
  if (closed != 0 && errno != EINTR) throw give_up("close", errno);
  if (::rename(tmp.c_str(), path.c_str()) != 0) throw give_up("rename into place", errno);
  const std::filesystem::path folder = path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
  if (const int dir = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
}

inline void write_file_durably(const std::filesystem::path& path, std::string_view bytes) {
  write_file_durably(path, std::vector<std::string_view>{bytes});
}

/// A fingerprint of the contents of `files` (FNV-1a, 64 bits, as 16 hexadecimal digits), each read
/// as read_regular_file reads it, with its name: for Model::fingerprints(), the files a model reads
/// besides its weights. A file that is not there counts as absent (the fingerprint differs).
inline std::string files_fingerprint(const std::vector<std::filesystem::path>& files, int64_t most = int64_t{1} << 30) {
  uint64_t hash = 0xcbf29ce484222325ull;
  const auto mix = [&](std::string_view bytes) {
    for (const unsigned char c : bytes) hash = (hash ^ c) * 0x100000001b3ull;
  };
  for (const auto& file : files) {
    mix(file.filename().string());
    std::error_code ec;
    if (!std::filesystem::exists(file, ec)) {
      mix(std::string_view("\0absent", 7));
      continue;
    }
    mix(read_regular_file(file, most, "", "it"));
    mix(std::string_view("\0", 1));
  }
  char hex[17];
  static const char digits[] = "0123456789abcdef";
  for (int i = 0; i < 16; ++i) hex[i] = digits[(hash >> (60 - 4 * i)) & 15];
  hex[16] = '\0';
  return hex;
}

}  // namespace loom::sdk
