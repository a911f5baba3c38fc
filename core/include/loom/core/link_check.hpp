#pragma once
// Which library this process's C++ standard library calls land in (link_check.cpp).

#include <string>

namespace loom::core {

/// The file of the first loaded library (in the dynamic linker's search order) that defines
/// std::filesystem::remove_all: where an unversioned reference to it binds. Some LibTorch
/// wheels export their own copies of std::filesystem's functions (torch 2.11's libtorch.so: a
/// copy that crashes in remove_all); an executable that lists a LibTorch library before
/// libstdc++ binds to them. Loom's executables link libstdc++ first (cmake/LoomTorch.cmake), so
/// this names libstdc++.so.6, or, where the toolchain put libstdc++'s code into Loom's own
/// libraries (the GPU machine's: its libloom_sdk.so defines 121 std::filesystem functions and
/// lists no libstdc++.so.6 as needed), the first of those: GCC's code either way.
std::string std_filesystem_provider();

/// Whether `provider` (std_filesystem_provider()) is one of LibTorch's libraries (libtorch*,
/// libc10*), whose copies of std::filesystem are the ones that crash.
bool is_libtorch_library(const std::string& provider);

/// The file of the library (or executable) that holds `address`, as the dynamic linker loaded it.
std::string library_of(const void* address);

/// The path of the loaded library whose file name starts with `prefix` ("libloom_sdk.so"), or "".
std::string loaded_library(const std::string& prefix);

}  // namespace loom::core
