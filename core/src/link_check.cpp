// Where std::filesystem resolved: see link_check.hpp.
#include <loom/core/link_check.hpp>

#include <dlfcn.h>
#include <link.h>
#include <filesystem>

namespace loom::core {

std::string std_filesystem_provider() {
  // The dynamic linker binds a reference to the first object of the global scope that defines
  // the symbol, in load order (the executable, then its libraries breadth-first). The address of
  // the function as this code sees it is no answer: a position-dependent executable that takes
  // it gets a stub of its own (the H100 machine's loom reported itself). So walk the loaded
  // objects in order and ask each whether it defines the symbol itself.
  struct Search {
    std::string found;
  } search;
  ::dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        auto* s = static_cast<Search*>(data);
        if (info->dlpi_name == nullptr || info->dlpi_name[0] == '\0') return 0;  // the executable, the vDSO
        void* handle = ::dlopen(info->dlpi_name, RTLD_LAZY | RTLD_NOLOAD);
        if (handle == nullptr) return 0;
        // std::filesystem::remove_all(const path&, error_code&)
        void* symbol = ::dlsym(handle, "_ZNSt10filesystem10remove_allERKNS_7__cxx114pathERSt10error_code");
        ::dlclose(handle);
        Dl_info where{};
        // dlsym also searches the object's dependencies: count it only where this object defines it.
        if (symbol == nullptr || ::dladdr(symbol, &where) == 0 || where.dli_fname == nullptr ||
            std::string(where.dli_fname) != info->dlpi_name)
          return 0;
        std::error_code ec;
        const auto canonical = std::filesystem::canonical(info->dlpi_name, ec);
        s->found = ec ? std::string(info->dlpi_name) : canonical.string();
        return 1;
      },
      &search);
  return search.found.empty() ? "(not loaded)" : search.found;
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

bool is_libtorch_library(const std::string& provider) {
  const std::string file = std::filesystem::path(provider).filename().string();
  return file.rfind("libtorch", 0) == 0 || file.rfind("libc10", 0) == 0;
}

}  // namespace loom::core
