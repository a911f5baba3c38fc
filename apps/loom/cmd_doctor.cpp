// `loom doctor`: what this machine offers a training run (seed 002's check_gpu_memory, and more):
// devices and their memory, allocator settings, LibTorch and CUDA versions, TF32 and bfloat16
// support, threads, the plugins and the default data set.
#include "cli.hpp"

#include <loom/core/device_memory.hpp>
#include <loom/core/link_check.hpp>
#include <loom/core/text.hpp>
#include <loom/core/plugin_registry.hpp>
#include <loom/sdk/cross_entropy.hpp>
#include <loom/sdk/files.hpp>
#include <loom/sdk/version.hpp>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/cuda.h>
#if LOOM_TORCH_CUDA
#include <ATen/DeviceAccelerator.h>
#include <ATen/cuda/CUDAContextLight.h>
#endif

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>
#include <unistd.h>

namespace loom::cli {

namespace {

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown CPU";
}

void row(const std::string& what, const std::string& value) {
  std::cout << "  " << what << std::string(what.size() < 22 ? 22 - what.size() : 1, ' ') << value << "\n";
}

}  // namespace

int cmd_doctor(const Invocation& invocation) {
  if (!invocation.args.empty())
    throw Error("loom doctor takes no arguments (got '" + invocation.args[0] + "')");
  const auto& host = core::host_fingerprint();
  std::cout << "Loom " << LOOM_SDK_VERSION << " (plugin ABI " << LOOM_ABI_MAJOR << "." << LOOM_ABI_MINOR << ")\n";
  row("LibTorch", host.at("libtorch") + " (commit " + host.at("libtorch_git").substr(0, 12) + ", CUDA " + host.at("cuda") + ")");
  // Where the LibTorch this process runs comes from: the RUNPATH of the binary decides, set when
  // it was built (docs/install.md says how to point an installed Loom at another LibTorch).
  row("  loaded from", core::library_of(reinterpret_cast<const void*>(&at::get_num_threads)));
  row("SDK library", core::loaded_library("libloom_sdk.so"));  // the one home of the SDK's type info
  row("compiler", host.at("compiler") + ", C++" + host.at("cxx_standard").substr(2));  // 2020: C++20
  row("plugin fingerprint", host.at("stdlib") + " " + host.at("stdlib_version") + " (" + host.at("stdlib_abi") +
                                "), sanitizers " + host.at("sanitizers") + ", value-type layout " + host.at("layout"));
  const std::string provider = core::std_filesystem_provider();
  row("C++ library", !core::is_libtorch_library(provider)
                         ? provider
                         : provider + " (LibTorch's copies of std::filesystem won over libstdc++'s; rebuild Loom, whose"
                                      " executables link libstdc++ first)");

  std::cout << "\nCPU\n";
  row("model", cpu_model());
  row("cores", std::to_string(std::thread::hardware_concurrency()) + " (LibTorch uses " +
                   std::to_string(at::get_num_threads()) + " threads; trainer.threads changes it)");
  row("memory", core::format_bytes(core::physical_memory()) + " (" + core::format_bytes(core::available_memory()) +
                    " available)");

  std::cout << "\nCUDA\n";
  const bool cuda = torch::cuda::is_available();
  if (!cuda) {
    row("devices", "none visible: training runs on the CPU (precision fp32 or bf16_amp)");
  } else {
#if LOOM_TORCH_CUDA
    const auto count = static_cast<int>(torch::cuda::device_count());
    row("devices", std::to_string(count));
    for (int i = 0; i < count; ++i) {
      const auto* p = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(i));
      const auto [free, total] = at::accelerator::getMemoryInfo(static_cast<c10::DeviceIndex>(i));
      const int cc = p->major * 10 + p->minor;
      std::cout << "  cuda:" << i << "  " << p->name << "\n";
      row("  memory", core::format_bytes(static_cast<int64_t>(total)) + " (" +
                          core::format_bytes(static_cast<int64_t>(free)) + " free)");
      row("  compute capability", std::to_string(p->major) + "." + std::to_string(p->minor));
      row("  TF32", cc >= 80 ? "yes (precision tf32, --allow-tf32)" : "no (needs compute capability 8.0)");
      row("  bfloat16", cc >= 80 ? "yes: the default AMP is bf16_amp" : "no: the default AMP is fp16_amp");
    }
#else
    row("devices", "visible, but this LibTorch has no CUDA");
#endif
  }
#if LOOM_TORCH_CUDA
  // Loom's own CUDA kernels (GPT-2's cross-entropy and LayerNorm; docs/gpu.md): compiled at first use
  const std::string compiler = loom::sdk::nn::fused_kernels_compiler();
  row("Loom's kernels", compiler.rfind("unavailable", 0) == 0
                            ? compiler + " (GPT-2's cross-entropy and LayerNorm take ATen's slower path)"
                            : "compiled at first use by NVRTC, " + compiler);
#endif
  for (const char* var : {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUDA_VISIBLE_DEVICES", "LOOM_FUSED_KERNELS"}) {
    const char* v = std::getenv(var);
    std::string shown = v ? core::printable(v, 300) : "(unset)";
    // A name LOOM_FUSED_KERNELS does not know stops a run on a GPU at its first step: said here first.
    if (v != nullptr && std::string_view(var) == "LOOM_FUSED_KERNELS") try {
        (void)sdk::nn::fused_cross_entropy_unavailable(at::empty({0}));
      } catch (const std::exception& e) {
        shown = core::printable(e.what(), 400);
      }
    row(var, shown);
  }

  std::cout << "\nPlugins\n";
  core::PluginRegistry registry;
  scan_plugins(registry, invocation.options, /*log_refusals=*/false);
  row("loaded", std::to_string(registry.components().size()) + " components from " +
                    std::to_string(registry.plugins().size()) + " files");
  row("refused", std::to_string(registry.refusals().size()) + (registry.refusals().empty() ? "" : " (loom plugins says why)"));
  {  // Where the plugin scans and auto_batch's answers are kept ($LOOM_CACHE), and whether they can be.
    const char* given = std::getenv("LOOM_CACHE");
    const char* home = std::getenv("HOME");
    const std::filesystem::path cache = given && *given ? std::filesystem::path(given)
                                        : home           ? std::filesystem::path(home) / ".cache" / "loom"
                                                         : std::filesystem::path();
    std::error_code ec;
    // (missing, it is made now, as a first use would: the row said "(made at first use)" of /proc/x,
    // below the scan's warning that it cannot be)
    std::error_code made;
    if (!cache.empty() && sdk::what_is_at(cache) == "no such file") std::filesystem::create_directories(cache, made);
    const std::string there = cache.empty() ? "" : sdk::what_is_at(cache);
    row("cache", cache.empty() ? "none: neither LOOM_CACHE nor HOME is set (plugin scans and auto_batch answers are not kept)"
                 : made ? cache.string() + ": cannot be made (" + made.message() + "); point LOOM_CACHE at a folder you can write"
                 : !std::filesystem::is_directory(cache, ec) ? cache.string() + ": " + (there.empty() ? std::string("a file") : there) + ", not a folder; point LOOM_CACHE at a folder"
                 : ::access(cache.c_str(), W_OK) != 0 ? cache.string() + ": not writable; point LOOM_CACHE at a folder you can write"
                                                      : cache.string() + (given && *given ? " ($LOOM_CACHE)" : ""));
    // (a relative LOOM_CACHE is a cache per working folder: `loom doctor` showed "relative ($LOOM_CACHE)")
    if (cache.is_relative() && !cache.empty())
      row("", "relative: taken from the folder a command runs in (here " + std::filesystem::absolute(cache, ec).string() +
                  "), so each folder has its own; set LOOM_CACHE to an absolute path to share one");
  }

  std::cout << "\nData\n";
  const bool fmnist = std::filesystem::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz");
  row("Fashion-MNIST", fmnist ? "/usr/share/datasets/fashion-mnist" : "missing: scripts/setup.sh installs dataset-fashion-mnist");
  return 0;
}

}  // namespace loom::cli
