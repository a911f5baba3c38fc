// Fuzz target: a plugin file's fingerprint note, as the loader reads it before loading the file
// (plugin_fingerprint.hpp): the bytes are the whole file, read through libelf, the note's text
// parsed and compared with the host's. A bad file must give PluginRefused, nothing else.
#include "plugin_fingerprint.hpp"

#include <cstdint>
#include <string>
#include <sys/mman.h>
#include <unistd.h>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // An anonymous in-memory file, named through /proc as the loader names a plugin's path.
  const int fd = ::memfd_create("note_fuzz", MFD_CLOEXEC);
  if (fd < 0) return 0;
  for (size_t done = 0; done < size;) {
    const ssize_t n = ::write(fd, data + done, size - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  try {
    if (const auto note = loom::core::read_fingerprint_note("/proc/self/fd/" + std::to_string(fd)))
      loom::core::check_fingerprint(loom::core::parse_fingerprint(*note));
  } catch (const loom::core::PluginRefused&) {
  }
  ::close(fd);
  return 0;
}
