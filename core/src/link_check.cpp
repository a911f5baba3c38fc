// Where std::filesystem resolved: see link_check.hpp.
#include <loom/core/link_check.hpp>

#include <dlfcn.h>
#include <filesystem>

namespace loom::core {

std::string std_filesystem_provider() {
  // The address of a function of a shared library is the one the dynamic linker chose for the
  // whole process (the canonical address), so dladdr names the library that won.
  using RemoveAll = std::uintmax_t (*)(const std::filesystem::path&, std::error_code&);
  const RemoveAll f = &std::filesystem::remove_all;
  Dl_info info{};
  if (::dladdr(reinterpret_cast<const void*>(f), &info) == 0 || info.dli_fname == nullptr) return "(unknown)";
  return info.dli_fname;
}

}  // namespace loom::core
