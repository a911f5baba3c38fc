// Writing a plugin: the component table and the LOOM_PLUGIN macro that emits the entry point.
//
//   class Bf16Amp final : public loom::sdk::PrecisionStrategy {
//    public:
//     static constexpr loom_option_spec kOptions[] = {
//         loom::sdk::option_bool("cache", "true", "cache casts of weights within a step")};
//     explicit Bf16Amp(const loom::sdk::Options& options);
//     ...
//   };
//   LOOM_PLUGIN("bf16_amp", "1.0.0",
//               loom::sdk::component<Bf16Amp>("bf16_amp", "autocast to bfloat16, no loss scaling"))
//
// `component<T>` needs T to derive from one of the SDK interfaces (which fixes the kind and
// the interface version), to be constructible from `const Options&`, and optionally to have a
// static `kOptions` array (its schema). The factory it emits catches every exception and turns
// it into the error the host reports; nothing throws across the C boundary.
#pragma once

#include <loom/sdk/abi.h>
#include <loom/sdk/fingerprint.hpp>
#include <loom/sdk/log.hpp>
#include <loom/sdk/options.hpp>

#include <c10/util/Exception.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <iterator>
#include <type_traits>

namespace loom::sdk {
namespace detail {

inline void write_error(loom_error* error, const char* message) noexcept {
  if (error == nullptr || error->capacity == 0) return;
  const size_t capacity = error->capacity < LOOM_ERROR_CAPACITY ? error->capacity
                                                                 : LOOM_ERROR_CAPACITY;
  std::snprintf(error->message, capacity, "%s", message);
}

template <class T>
void* create(const loom_create_args* args, loom_error* error) noexcept {
  using Interface = typename T::Interface;
  try {
    const Options options(args);
    Interface* object = new T(options);
    return static_cast<void*>(object);
  } catch (const c10::Error& e) {
    write_error(error, e.what_without_backtrace());
  } catch (const std::exception& e) {
    write_error(error, e.what());
  } catch (...) {
    write_error(error, "the factory threw an exception that is not a std::exception");
  }
  return nullptr;
}

template <class T>
void destroy(void* object) noexcept {
  delete static_cast<typename T::Interface*>(object);
}

template <class T>
constexpr const loom_option_spec* options_of() {
  if constexpr (requires { T::kOptions; }) return T::kOptions;
  else return nullptr;
}

template <class T>
constexpr uint32_t option_count_of() {
  if constexpr (requires { T::kOptions; }) return static_cast<uint32_t>(std::size(T::kOptions));
  else return 0;
}

inline int32_t init(const loom_host_api* host, const char* plugin_name, loom_error* error) noexcept {
  if (host == nullptr || host->struct_size < sizeof(loom_host_api)) {
    write_error(error, "the host passed no host_api table, or one older than this plugin's SDK");
    return 1;
  }
  g_host = host;
  g_plugin_name = plugin_name;
  return 0;
}

}  // namespace detail

/// A component table entry for class T (see the file comment).
template <class T>
constexpr loom_component component(const char* name, const char* summary) {
  using Interface = typename T::Interface;
  static_assert(std::is_base_of_v<Interface, T>, "T must derive from an SDK interface");
  static_assert(std::is_constructible_v<T, const Options&>,
                "T must be constructible from const loom::sdk::Options&");
  return loom_component{sizeof(loom_component),
                        Interface::kKind,
                        name,
                        summary,
                        Interface::kInterfaceMajor,
                        Interface::kInterfaceMinor,
                        detail::options_of<T>(),
                        detail::option_count_of<T>(),
                        0,  // flags: a Tier-1 C++ component
                        &detail::create<T>,
                        &detail::destroy<T>};
}

}  // namespace loom::sdk

/// Emits the plugin's descriptor, its entry point `loom_plugin_entry_v1` (exported, in the ELF
/// section `loom`) and its build fingerprint as an ELF note (LOOM_NOTE_SECTION, read by the host
/// before it loads the file). Use once, at namespace scope, at the end of one source file.
#define LOOM_PLUGIN(NAME, VERSION, ...)                                                        \
  namespace {                                                                                  \
  __attribute__((section(LOOM_NOTE_SECTION), used, aligned(4)))                                \
  const ::loom::sdk::detail::FingerprintNote loom_plugin_fingerprint_note_ =                   \
      ::loom::sdk::detail::fingerprint_note();                                                 \
  constexpr loom_component loom_plugin_components_[] = {__VA_ARGS__};                          \
  int32_t loom_plugin_init_(const loom_host_api* host, loom_error* error) noexcept {           \
    return ::loom::sdk::detail::init(host, NAME, error);                                       \
  }                                                                                            \
  constexpr loom_plugin_descriptor loom_plugin_descriptor_{                                    \
      LOOM_ABI_MAGIC,                                                                          \
      sizeof(loom_plugin_descriptor),                                                          \
      LOOM_ABI_MAJOR,                                                                          \
      LOOM_ABI_MINOR,                                                                          \
      static_cast<uint32_t>(std::size(loom_plugin_components_)),                               \
      NAME,                                                                                    \
      VERSION,                                                                                 \
      &::loom::sdk::kBuildFingerprint,                                                         \
      loom_plugin_components_,                                                                 \
      &loom_plugin_init_};                                                                     \
  }                                                                                            \
  extern "C" __attribute__((visibility("default"), used, section(LOOM_ENTRY_SECTION)))         \
  const loom_plugin_descriptor* loom_plugin_entry_v1(void) noexcept {                          \
    return &loom_plugin_descriptor_;                                                           \
  }
