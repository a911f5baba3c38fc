// A small text file read whole (internal to libloom_sdk): config.json, vocab.json, merges.txt.
// Opened without blocking and checked on the open descriptor, so a FIFO or a device put there
// (even between a check and the open) is an error, never a wait; a file above `most` bytes is
// refused before it is read; an open that fails names its cause (EACCES is not "no such file").
#pragma once

#include <loom/sdk/error.hpp>
#include <loom/sdk/files.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>

namespace loom::sdk::detail {

/// The bytes of `path`; `what` starts each message ("model.pretrained: ", "gpt2 tokenizer: "), and
/// `missing` is what a file that is not there gets said of it.
inline std::string read_small_file(const std::filesystem::path& path, int64_t most, const std::string& what,
                                   const std::string& missing) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int error = errno;
    if (error == ENOENT) throw Error(what + "no " + path.string() + " (" + missing + ")");
    throw Error(what + "cannot open " + path.string() + ": " + std::strerror(error));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    const std::string is = sdk::what_is_at(path);
    throw Error(what + path.string() + " is " + (is.empty() ? "not a regular file" : is + ", not a regular file"));
  }
  if (st.st_size > most) {
    ::close(fd);
    throw Error(what + path.string() + " is " + std::to_string(st.st_size) + " bytes, more than such a file has (at most " +
                std::to_string(most) + "); it is damaged or another file");
  }
  std::string out(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t got = ::read(fd, out.data() + done, out.size() - done);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      const int error = errno;
      ::close(fd);
      throw Error(what + "reading " + path.string() + " failed: " + std::strerror(error));
    }
    if (got == 0) break;
    done += static_cast<size_t>(got);
  }
  ::close(fd);
  out.resize(done);
  return out;
}

}  // namespace loom::sdk::detail
