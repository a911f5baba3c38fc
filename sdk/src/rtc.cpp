// Note [Kernels compiled at run time]
// A few of Loom's kernels are its own (the fused cross-entropy, cross_entropy.cpp): ATen has no
// operator that does their work in one pass. They are CUDA C++ source in libloom_sdk, compiled on
// first use by NVRTC for the architecture of the device they run on, and loaded with the driver
// API into that device's primary context (the one the CUDA runtime, and so LibTorch, uses).
// Why not nvcc at build time: the machines that build Loom (CI, a user's laptop with a CUDA wheel)
// need no CUDA compiler and no GPU, one libloom_sdk serves every architecture, and no second
// CUDA runtime enters the process (a static cudart beside the wheel's shared one). Why not
// ATen's jiterator: its NVRTC stub's header is not in the wheel's include folder.
// NVRTC and libcuda are opened with dlopen: the libnvrtc of the CUDA LibTorch in the process
// (site-packages/nvidia/*/lib/libnvrtc.so.<major>), or one on the loader's path. Whatever fails
// (no libnvrtc, a compiler error, no driver) is an Error the caller turns into ATen's path.
#include "rtc.hpp"

#include <loom/sdk/error.hpp>

#include <c10/core/CPUAllocator.h>

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>

namespace loom::sdk::rtc {

namespace {

namespace fs = std::filesystem;

template <class F> void bind(void* library, const char* name, F& slot, std::string& missing) {
  slot = reinterpret_cast<F>(::dlsym(library, name));
  if (slot == nullptr) missing += std::string(missing.empty() ? "" : ", ") + name;
}

struct Nvrtc {
  int (*create)(void**, const char*, const char*, int, const char* const*, const char* const*) = nullptr;
  int (*compile)(void*, int, const char* const*) = nullptr;
  int (*log_size)(void*, size_t*) = nullptr;
  int (*log)(void*, char*) = nullptr;
  int (*cubin_size)(void*, size_t*) = nullptr;
  int (*cubin)(void*, char*) = nullptr;
  int (*destroy)(void**) = nullptr;
  const char* (*error_string)(int) = nullptr;
  std::string why_not;  // "" once loaded
  std::string path;     // the file loaded

  std::string message(int result) const { return error_string != nullptr ? error_string(result) : std::to_string(result); }
};

// libnvrtc.so.<major> files to try, the torch wheel's own first.
std::vector<std::string> nvrtc_candidates() {
  std::vector<std::string> out;
  std::string major;
#ifdef LOOM_TORCH_CUDA_VERSION
  major = std::string(LOOM_TORCH_CUDA_VERSION).substr(0, std::string(LOOM_TORCH_CUDA_VERSION).find('.'));
#endif
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(&c10::GetCPUAllocator), &info) != 0 && info.dli_fname != nullptr) {
    std::error_code ec;
    const fs::path nvidia = fs::path(info.dli_fname).parent_path() / ".." / ".." / "nvidia";  // torch/lib/libc10.so
    for (const auto& entry : fs::directory_iterator(nvidia, ec)) {
      for (const std::string& m : {major, std::string("13"), std::string("12")}) {
        if (m.empty() || m == "none") continue;
        const fs::path file = entry.path() / "lib" / ("libnvrtc.so." + m);
        if (fs::exists(file, ec)) out.push_back(file.lexically_normal().string());
      }
    }
  }
  for (const char* name : {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"}) out.emplace_back(name);
  return out;
}

const Nvrtc& nvrtc() {
  static const Nvrtc api = [] {
    Nvrtc a;
    void* library = nullptr;
    std::string tried;
    for (const std::string& candidate : nvrtc_candidates()) {
      library = ::dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (library != nullptr) break;
      tried += (tried.empty() ? "" : ", ") + candidate;
    }
    if (library == nullptr) {
      a.why_not = "libnvrtc not found (tried " + tried + ")";
      return a;
    }
    std::string missing;
    bind(library, "nvrtcCreateProgram", a.create, missing);
    bind(library, "nvrtcCompileProgram", a.compile, missing);
    bind(library, "nvrtcGetProgramLogSize", a.log_size, missing);
    bind(library, "nvrtcGetProgramLog", a.log, missing);
    bind(library, "nvrtcGetCUBINSize", a.cubin_size, missing);
    bind(library, "nvrtcGetCUBIN", a.cubin, missing);
    bind(library, "nvrtcDestroyProgram", a.destroy, missing);
    bind(library, "nvrtcGetErrorString", a.error_string, missing);
    if (!missing.empty()) a.why_not = "libnvrtc lacks " + missing;
    Dl_info info{};
    if (a.create != nullptr && ::dladdr(reinterpret_cast<void*>(a.create), &info) != 0 && info.dli_fname != nullptr)
      a.path = fs::path(info.dli_fname).lexically_normal().string();
    return a;
  }();
  return api;
}

struct Driver {
  int (*init)(unsigned) = nullptr;
  int (*device_get)(int*, int) = nullptr;
  int (*attribute)(int*, int, int) = nullptr;
  int (*primary_retain)(void**, int) = nullptr;
  int (*get_current)(void**) = nullptr;
  int (*set_current)(void*) = nullptr;
  int (*module_load)(void**, const void*) = nullptr;
  int (*get_function)(void**, void*, const char*) = nullptr;
  int (*launch)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**, void**) = nullptr;
  int (*error_string)(int, const char**) = nullptr;
  std::string why_not;

  std::string message(int result) const {
    const char* text = nullptr;
    if (error_string != nullptr) error_string(result, &text);
    return text != nullptr ? text : "CUDA driver error " + std::to_string(result);
  }
  void check(int result, const char* what) const {
    if (result != 0) throw Error(std::string(what) + ": " + message(result));
  }
};

const Driver& driver() {
  static const Driver api = [] {
    Driver d;
    void* library = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
      d.why_not = "libcuda.so.1 (the NVIDIA driver) not found";
      return d;
    }
    std::string missing;
    bind(library, "cuInit", d.init, missing);
    bind(library, "cuDeviceGet", d.device_get, missing);
    bind(library, "cuDeviceGetAttribute", d.attribute, missing);
    bind(library, "cuDevicePrimaryCtxRetain", d.primary_retain, missing);
    bind(library, "cuCtxGetCurrent", d.get_current, missing);
    bind(library, "cuCtxSetCurrent", d.set_current, missing);
    bind(library, "cuModuleLoadData", d.module_load, missing);
    bind(library, "cuModuleGetFunction", d.get_function, missing);
    bind(library, "cuLaunchKernel", d.launch, missing);
    bind(library, "cuGetErrorString", d.error_string, missing);
    if (!missing.empty()) d.why_not = "libcuda.so.1 lacks " + missing;
    else if (const int r = d.init(0); r != 0) d.why_not = "cuInit: " + d.message(r);
    return d;
  }();
  return api;
}

}  // namespace

std::string nvrtc_unavailable() { return nvrtc().why_not; }

std::string nvrtc_path() { return nvrtc().path; }

std::string disabled_by_environment(const std::string& op) {
  const char* value = std::getenv("LOOM_FUSED_KERNELS");
  if (value == nullptr) return "";
  const std::string text = value;
  if (text == "1" || text == "all") return "";
  if (text == "0" || text == "none" || text.empty()) return "LOOM_FUSED_KERNELS=" + text;
  bool listed = false;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t end = std::min(text.find(',', start), text.size());
    const std::string name = text.substr(start, end - start);
    if (name != "cross_entropy" && name != "embedding" && name != "layer_norm" && name != "linear" && name != "mlp")
      throw Error("LOOM_FUSED_KERNELS=" + text + ": no fused operation '" + name +
                  "' (there are cross_entropy, embedding, layer_norm, linear and mlp; 0 for none, unset for all)");
    listed = listed || name == op;
    start = end + 1;
  }
  return listed ? "" : "LOOM_FUSED_KERNELS=" + text;
}

std::string compile(const std::string& source, const std::string& program_name, int major, int minor) {
  const Nvrtc& api = nvrtc();
  if (!api.why_not.empty()) throw Error(api.why_not);
  void* program = nullptr;
  if (const int r = api.create(&program, source.c_str(), program_name.c_str(), 0, nullptr, nullptr); r != 0)
    throw Error("nvrtcCreateProgram: " + api.message(r));
  const std::unique_ptr<void*, void (*)(void**)> destroy(&program, [](void** p) { nvrtc().destroy(p); });
  const std::string arch = "--gpu-architecture=sm_" + std::to_string(major) + std::to_string(minor);
  const char* options[] = {arch.c_str(), "-std=c++17", "-default-device"};
  const int compiled = api.compile(program, 3, options);
  size_t log_size = 0;
  std::string log;
  if (api.log_size(program, &log_size) == 0 && log_size > 1) {
    log.resize(log_size);
    api.log(program, log.data());
    log.resize(log_size - 1);
  }
  if (compiled != 0)
    throw Error("NVRTC could not compile " + program_name + " for sm_" + std::to_string(major) + std::to_string(minor) +
                ": " + api.message(compiled) + (log.empty() ? "" : "\n" + log));
  size_t size = 0;
  std::string cubin;
  if (const int r = api.cubin_size(program, &size); r != 0) throw Error("nvrtcGetCUBINSize: " + api.message(r));
  cubin.resize(size);
  if (const int r = api.cubin(program, cubin.data()); r != 0) throw Error("nvrtcGetCUBIN: " + api.message(r));
  return cubin;
}

struct Kernels::Loaded {
  std::string error;  // "" when loaded
  void* context = nullptr;
  std::map<std::string, void*> functions;
};

Kernels::Kernels(std::string source, std::string program_name, std::vector<std::string> names)
    : source_(kDeviceHelpers + source), program_name_(std::move(program_name)), names_(std::move(names)) {}

std::string Kernels::compile_only(int major, int minor) const {
  try {
    compile(source_, program_name_, major, minor);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::string Kernels::unavailable(int device, const std::string& name) {
  try {
    function(device, name);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

void* Kernels::function(int device, const std::string& name) {
  static std::mutex mutex;
  const std::lock_guard lock(mutex);
  if (device < 0) throw Error("rtc: no CUDA device index");
  if (devices_.size() <= static_cast<size_t>(device)) devices_.resize(static_cast<size_t>(device) + 1, nullptr);
  Loaded*& loaded = devices_[static_cast<size_t>(device)];
  const Driver& d = driver();
  if (loaded == nullptr) {
    loaded = new Loaded;
    try {
      if (!d.why_not.empty()) throw Error(d.why_not);
      int handle = 0, major = 0, minor = 0;
      d.check(d.device_get(&handle, device), "cuDeviceGet");
      d.check(d.attribute(&major, /*CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR*/ 75, handle), "cuDeviceGetAttribute");
      d.check(d.attribute(&minor, /*CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR*/ 76, handle), "cuDeviceGetAttribute");
      const std::string cubin = compile(source_, program_name_, major, minor);
      d.check(d.primary_retain(&loaded->context, handle), "cuDevicePrimaryCtxRetain");
      d.check(d.set_current(loaded->context), "cuCtxSetCurrent");
      void* module = nullptr;
      d.check(d.module_load(&module, cubin.data()), "cuModuleLoadData");
      for (const std::string& n : names_) {
        void* f = nullptr;
        d.check(d.get_function(&f, module, n.c_str()), ("cuModuleGetFunction " + n).c_str());
        loaded->functions[n] = f;
      }
    } catch (const Error& e) {
      loaded->error = e.what();
    }
  }
  if (!loaded->error.empty()) throw Error(loaded->error);
  // The kernel belongs to the device's primary context: make it current on this thread (an
  // autograd worker thread may have none yet).
  void* current = nullptr;
  if (d.get_current(&current) != 0 || current != loaded->context) d.check(d.set_current(loaded->context), "cuCtxSetCurrent");
  const auto it = loaded->functions.find(name);
  if (it == loaded->functions.end()) throw Error("rtc: no kernel " + name + " in " + program_name_);
  return it->second;
}

void Kernels::launch(void* function, unsigned grid_x, unsigned block_x, void* stream, void** args) {
  const Driver& d = driver();
  d.check(d.launch(function, grid_x, 1, 1, block_x, 1, 1, 0, stream, args, nullptr), "cuLaunchKernel");
}

}  // namespace loom::sdk::rtc
