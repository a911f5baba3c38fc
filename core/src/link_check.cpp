// Where std::filesystem resolved: see link_check.hpp.
#include <loom/core/link_check.hpp>

#include <dlfcn.h>
#include <link.h>
#include <filesystem>

namespace loom::core {

std::string std_filesystem_provider() {
  // The address of a function of a shared library is the one the dynamic linker chose for the
  // whole process (the canonical address), so dladdr names the library that won.
  using RemoveAll = std::uintmax_t (*)(const std::filesystem::path&, std::error_code&);
  const RemoveAll f = &std::filesystem::remove_all;
  return library_of(reinterpret_cast<const void*>(f));
}

std::string library_of(const void* address) {
  Dl_info info{};
  if (::dladdr(address, &info) == 0 || info.dli_fname == nullptr) return "(unknown)";
  std::error_code ec;
  const auto canonical = std::filesystem::canonical(info.dli_fname, ec);
  return ec ? std::string(info.dli_fname) : canonical.string();
}

std::string loaded_library(const std::string& prefix) {
  struct Search {
    const std::string& prefix;
    std::string found;
  } search{prefix, {}};
  ::dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        auto* s = static_cast<Search*>(data);
        if (info->dlpi_name == nullptr) return 0;
        const std::filesystem::path path(info->dlpi_name);
        if (path.filename().string().rfind(s->prefix, 0) != 0) return 0;
        std::error_code ec;
        const auto canonical = std::filesystem::canonical(path, ec);
        s->found = ec ? path.string() : canonical.string();
        return 1;
      },
      &search);
  return search.found;
}

}  // namespace loom::core
