// What is at a path that is not a regular file, for messages that name it. Header-only; std only,
// so that the host's plugin loader, writers and datasets name a FIFO or a device the same way.
#pragma once

#include <filesystem>
#include <string>
#include <system_error>

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

}  // namespace loom::sdk
