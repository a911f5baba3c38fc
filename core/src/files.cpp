// Durable file writes: temporary file, fsync, rename, fsync of the folder.
#include <loom/core/error.hpp>
#include <loom/core/files.hpp>
#include <loom/sdk/files.hpp>

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <fstream>
#include <sstream>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <pwd.h>
#include <unistd.h>

namespace fs = std::filesystem;

namespace loom::core {

namespace {

[[noreturn]] void fail(const std::string& what, const fs::path& path) {
  throw Error(what + " " + path.string() + ": " + std::strerror(errno));
}

}  // namespace

void fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) fail("cannot open folder", dir);
  ::fsync(fd);
  ::close(fd);
}

void write_file_atomic(const fs::path& path, std::string_view bytes) { sdk::write_file_durably(path, bytes); }

void write_file_atomic(const fs::path& path, const std::vector<std::string_view>& parts) {
  sdk::write_file_durably(path, parts);
}

namespace {

/// fsync of every file and folder under `path` (and itself).
void fsync_tree(const fs::path& path) {
  std::error_code ec;
  if (fs::is_directory(fs::symlink_status(path, ec)))
    for (const auto& entry : fs::directory_iterator(path, ec)) fsync_tree(entry.path());
  if (fs::is_symlink(fs::symlink_status(path, ec))) return;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail("cannot open", path);
  const int synced = ::fsync(fd);
  ::close(fd);
  if (synced != 0) fail("cannot write", path);
}

}  // namespace

void rename_durable(const fs::path& from, const fs::path& to) {
  if (::rename(from.c_str(), to.c_str()) == 0) return fsync_dir(to.parent_path());
  if (errno != EXDEV) fail("cannot rename " + from.string() + " to", to);
  // Onto another filesystem (a run's checkpoints/ a link onto another disk): a copy under a
  // temporary name, made durable and renamed into place; only then the original goes. A failure
  // on the way leaves the original whole, and no half copy under the final name.
  const fs::path partial = to.parent_path() / (to.filename().string() + ".partial");
  std::error_code ec;
  fs::remove_all(partial, ec);
  fs::copy(from, partial, fs::copy_options::recursive | fs::copy_options::copy_symlinks, ec);
  try {
    if (ec) throw Error("cannot copy " + from.string() + " to " + to.string() + " (another filesystem): " + ec.message());
    fsync_tree(partial);
    if (::rename(partial.c_str(), to.c_str()) != 0) fail("cannot rename " + partial.string() + " to", to);
  } catch (...) {
    fs::remove_all(partial, ec);
    throw;
  }
  fsync_dir(to.parent_path());
  fs::remove_all(from, ec);
  if (ec) throw Error("moved " + from.string() + " to " + to.string() + " (a copy: another filesystem), but cannot remove " +
                      from.string() + ": " + ec.message() + "; remove it by hand");
  fsync_dir(from.parent_path());
}

namespace {

/// Opens `path` for reading if it is a regular file (O_NONBLOCK: opening a FIFO returns at once
/// instead of waiting for a writer; the fstat then refuses anything that is not a regular file,
/// a FIFO or a device behind a symlink); its size in `size`.
int open_regular(const fs::path& path, off_t& size) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) fail("cannot read", path);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    fail("cannot read", path);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error("cannot read " + path.string() + ": not a regular file (" + file_type_name(st.st_mode) +
                "); Loom reads its files only from regular files");
  }
  size = st.st_size;
  return fd;
}

}  // namespace

MappedFile::MappedFile(const fs::path& path) {
  off_t size = 0;
  const int fd = open_regular(path, size);
  size_ = static_cast<size_t>(size);
  if (size_ > 0) {
    // Copy-on-write: a tensor viewing the mapping may be written in place without touching the file.
    void* p = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      fail("cannot map", path);
    }
    data_ = static_cast<const char*>(p);
  }
  ::close(fd);  // the mapping keeps the file
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<char*>(data_), size_);
}

std::string read_file(const fs::path& path, int64_t max_bytes) {
  off_t size = 0;
  const int fd = open_regular(path, size);
  if (size > max_bytes) {
    ::close(fd);
    throw Error("cannot read " + path.string() + ": it is " + std::to_string(size) + " bytes, more than the " +
                std::to_string(max_bytes) + " Loom reads from such a file");
  }
  // To its end, not to the size fstat gave: a file that grew since, or one whose size the kernel
  // reports as 0 (/proc/self/status), is read whole, up to max_bytes.
  std::string out(static_cast<size_t>(size) + 1, '\0');
  size_t done = 0;
  while (true) {
    if (done == out.size()) {
      if (static_cast<int64_t>(done) > max_bytes) {
        ::close(fd);
        throw Error("cannot read " + path.string() + ": it holds more than the " + std::to_string(max_bytes) +
                    " bytes Loom reads from such a file");
      }
      out.resize(std::min<size_t>(out.size() * 2 + 4096, static_cast<size_t>(max_bytes) + 1));
    }
    const ssize_t n = ::read(fd, out.data() + done, out.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      ::close(fd);
      fail("cannot read", path);
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  out.resize(done);
  return out;
}

std::string crc32_hex(std::string_view bytes) {
  uLong crc = crc32(0L, Z_NULL, 0);
  for (size_t done = 0; done < bytes.size();) {
    const size_t chunk = std::min<size_t>(bytes.size() - done, size_t{1} << 30);
    crc = crc32(crc, reinterpret_cast<const Bytef*>(bytes.data() + done), static_cast<uInt>(chunk));
    done += chunk;
  }
  char text[16];
  std::snprintf(text, sizeof text, "%08lx", static_cast<unsigned long>(crc));
  return text;
}

const char* file_type_name(unsigned mode) {
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISDIR(mode)) return "a folder";
  return "not a regular file";
}

FileLock::FileLock(const fs::path& path) : path_(path) {
  // The folder first: a lock file deleted by hand (it looks stale) let a second process make a new
  // one and lock that, and two runs wrote one folder, each exiting 0. (Where a folder cannot be
  // opened, the file's lock stands alone, as before. On NFS a folder's flock holds on one host
  // only, as the file's does.)
  const fs::path folder = path.has_parent_path() ? path.parent_path() : fs::path(".");
  folder_fd_ = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (folder_fd_ >= 0 && ::flock(folder_fd_, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    ::close(folder_fd_);
    folder_fd_ = -1;
    if (error == EWOULDBLOCK) {
      char buffer[64] = {0};
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
      const bool read = fd >= 0 && ::pread(fd, buffer, sizeof buffer - 1, 0) > 0;
      if (fd >= 0) ::close(fd);
      throw Locked(read ? "process " + std::string(buffer)
                        : "another process (its lock file " + path.filename().string() +
                              " is empty or missing: that process is starting or ending, or the file was removed by "
                              "hand; the folder itself stays locked while that process runs)");
    }
  }
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  // (a run folder copied with links, cp -rs: said as "Too many levels of symbolic links")
  if (fd_ < 0 && errno == ELOOP) {
    release_folder();
    throw Error(path.string() + " is a link (a run folder copied with links, cp -rs?): a run's lock file is its own; "
                "remove the link, and Loom makes the file");
  }
  if (fd_ < 0) {
    const int error = errno;
    release_folder();
    errno = error;
    fail("cannot open the lock file", path);
  }
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    std::string holder;
    char buffer[64] = {0};
    if (::pread(fd_, buffer, sizeof buffer - 1, 0) > 0) holder = buffer;
    ::close(fd_);
    fd_ = -1;
    release_folder();
    if (error == EWOULDBLOCK) throw Locked(holder.empty() ? "another process" : "process " + holder);
    errno = error;
    fail("cannot lock", path);
  }
  // Whoever holds it, for the message another process gets. (flock locks end with the process,
  // so a lock file left by a killed run is never stale: the next run simply takes it.)
  const std::string pid = std::to_string(::getpid());
  if (::ftruncate(fd_, 0) == 0) {
    const ssize_t written = ::pwrite(fd_, pid.data(), pid.size(), 0);
    (void)written;  // only for messages
  }
}

FileLock::~FileLock() {
  if (fd_ >= 0) ::close(fd_);
  release_folder();
}

FileLock::Whereabouts FileLock::whereabouts() const {
  Whereabouts w;
  struct stat held {}, there {};
  if (folder_fd_ < 0 || ::fstat(folder_fd_, &held) != 0) return w;
  const fs::path folder = path_.has_parent_path() ? path_.parent_path() : fs::path(".");
  if (::stat(folder.c_str(), &there) == 0 && there.st_dev == held.st_dev && there.st_ino == held.st_ino) return w;
  w.gone = true;
  w.removed = held.st_nlink == 0;
  if (w.removed) return w;
  // (Linux names an open folder's path now; elsewhere, or where it cannot be read, none is said)
  std::error_code ec;
  const fs::path now = fs::read_symlink("/proc/self/fd/" + std::to_string(folder_fd_), ec);
  if (!ec && now.is_absolute()) w.now = now;
  return w;
}

void FileLock::release_folder() {
  if (folder_fd_ >= 0) ::close(folder_fd_);
  folder_fd_ = -1;
}

void remove_orphan_temporaries(const fs::path& run_dir) {
  char host[64] = {};
  ::gethostname(host, sizeof host - 1);
  const std::string mark = std::string(".tmp.") + host + ".";
  for (const fs::path& dir : {run_dir, run_dir / "checkpoints"}) {
    std::error_code ec;  // (best effort: a folder that cannot be read is left, the run opens)
    for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
      const fs::directory_entry& entry = *it;
      const std::string name = entry.path().filename().string();
      const size_t at = name.rfind(mark);
      if (at == std::string::npos || at == 0) continue;
      const std::string tail = name.substr(at + mark.size());  // "<pid>.<n>"
      const size_t dot = tail.find('.');
      if (dot == std::string::npos || dot == 0 || dot + 1 == tail.size() || tail.find_first_not_of("0123456789.") != std::string::npos ||
          tail.find('.', dot + 1) != std::string::npos)
        continue;
      const long pid = dot > 9 ? 0 : std::strtol(tail.c_str(), nullptr, 10);  // (a pid has 9 digits at most; kill(-n) is a group's)
      std::error_code type, removed;
      if (pid <= 0 || ::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH || !entry.is_regular_file(type)) continue;
      fs::remove(entry.path(), removed);
    }
  }
}

fs::path temp_folder() {
  const char* env = std::getenv("TMPDIR");
  const fs::path root = env != nullptr && *env != '\0' ? fs::path(env) : fs::path("/tmp");
  std::error_code ec;
  if (!fs::is_directory(root, ec))
    throw Error("TMPDIR=" + root.string() + " is " + (fs::exists(root, ec) ? "not a folder" : "no such folder") +
                ": scratch files go there; point TMPDIR at a writable folder, or unset it for /tmp");
  return root;
}

std::string home_expanded(const std::string& path, bool alone_too) {
  if (path.rfind("~/", 0) != 0 && (!alone_too || path != "~")) return path;
  const char* home = std::getenv("HOME");
  if (home == nullptr || *home == '\0') {  // (as the shell then: the user's entry in the password database)
    const passwd* user = ::getpwuid(::getuid());
    home = user != nullptr ? user->pw_dir : nullptr;
  }
  if (home == nullptr || *home == '\0')
    throw Error(path + ": a path from the home folder, but this process has none (HOME is unset, and user " +
                std::to_string(::getuid()) + " has no entry with one); write the folder out");
  return home + path.substr(1);
}

}  // namespace loom::core
