// Deliberately broken test plugins, one shared library per case, selected by a BROKEN_* macro
// (see tests/plugins/CMakeLists.txt). Each must be refused by the loader with its own reason
// while the good plugin in the same folder loads. Most cases write the Tier-0 descriptor by
// hand, as a plugin built with a buggy or foreign toolchain would.
#if defined(BROKEN_CXX11_ABI)
// What -D_GLIBCXX_USE_CXX11_ABI=0 on the command line does, set here so that no flag of the
// LibTorch target (which sets it to 1) comes after it.
#undef _GLIBCXX_USE_CXX11_ABI
#define _GLIBCXX_USE_CXX11_ABI 0
#endif
#if defined(BROKEN_TORCH_VERSION)
// "built against LibTorch 1.13.1": a real LibTorch that no host of Loom can be (the GPU machine's
// 2.11 once matched an earlier choice of 2.11.0 and accepted the plugin). The fingerprint note
// says it; the build's own value comes from the command line.
#undef LOOM_TORCH_BUILD
#define LOOM_TORCH_BUILD "1.13.1"
#endif
#include <loom/sdk/sdk.hpp>

#include <array>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <unistd.h>

#if defined(BROKEN_TORCH_VERSION) || defined(BROKEN_SANITIZED)
// A static initializer with a visible effect: it writes the file LOOM_TEST_INITIALIZER_MARKER
// names. The loader must refuse these plugins from their fingerprint note, before loading them,
// so the file must never appear (tests/unit/plugins/abi_test.cpp).
namespace {
const int kInitializerRan = [] {
  if (const char* path = std::getenv("LOOM_TEST_INITIALIZER_MARKER"))
    if (std::FILE* f = std::fopen(path, "w")) {
      std::fputs(BROKEN_NAME "\n", f);
      std::fclose(f);
    }
  return 1;
}();
}  // namespace
#endif

#if defined(BROKEN_INIT_DAEMON)
// A static initializer that starts a process that lives on (a daemon, a server a library starts),
// in the scanner only: the process keeps the scanner's output open after the scanner ended. Its
// pid goes to the file LOOM_TEST_DAEMON_PID names, for the test to end it.
namespace {
const int kDaemonStarted = [] {
  if (std::getenv("LOOM_SCANNER_PARENT") == nullptr) return 0;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::sleep(120);
    ::_exit(0);
  }
  if (const char* path = std::getenv("LOOM_TEST_DAEMON_PID"))
    if (std::FILE* f = std::fopen(path, "w")) {
      std::fprintf(f, "%d\n", static_cast<int>(pid));
      std::fclose(f);
    }
  return 1;
}();
}  // namespace
#endif

namespace {

class Dummy final : public loom::sdk::Dataset {
 public:
#if defined(BROKEN_BAD_RANGE)
  static constexpr loom_option_spec kOptions[] = {loom::sdk::option_int("size", "3", "a size", "5..1")};
#elif defined(BROKEN_FRACTION_RANGE)
  static constexpr loom_option_spec kOptions[] = {loom::sdk::option_int("every", "1", "how often", "0.5..2.5")};
#elif defined(BROKEN_STRAY_COMMA)
  static constexpr loom_option_spec kOptions[] = {loom::sdk::option_list("items", ",,a b,", "some items")};
#elif defined(BROKEN_REPEATED_CHOICE)
  static constexpr loom_option_spec kOptions[] = {loom::sdk::option_enum("mode", "a", "a|a||b", "a mode")};
#elif defined(BROKEN_DEFAULT_OUT_OF_RANGE)
  static constexpr loom_option_spec kOptions[] = {loom::sdk::option_float("rate", "2", "a rate", "0..1")};
#elif defined(BROKEN_LONG_DEFAULT)
  // A default past LOOM_MAX_TEXT (1024 bytes): it was read as none, and runs used ''.
  static constexpr auto kLong = [] {
    std::array<char, 1101> text{};
    for (size_t i = 0; i < 1100; ++i) text[i] = 'x';
    return text;
  }();
  static constexpr loom_option_spec kOptions[] = {loom::sdk::option_string("path", kLong.data(), "a path")};
#elif defined(BROKEN_INT64_RANGE)
  // An int's range past the 64-bit integers: taken, and with a fraction, shown as "1..-9223372036854775808".
  static constexpr loom_option_spec kOptions[] = {loom::sdk::option_int("count", "3", "a count", "0.5..1e30")};
#elif defined(BROKEN_PRINTED_TEXT)
  // Text `loom plugins` prints, with a line break, a carriage return and terminal escapes in it.
  static constexpr loom_option_spec kOptions[] = {loom::sdk::option_int("size", "3", "a size\n[12:00:00 E] forged\r\x1b[2K")};
#endif
  explicit Dummy(const loom::sdk::Options&) {
#if defined(BROKEN_FACTORY_THROWS)
    throw loom::sdk::Error("dataset 'exploding' cannot be built: the planted failure of this test plugin");
#endif
  }
  void setup() override {}
  loom::sdk::DataSpec spec() const override { return {}; }
  int64_t size(loom::sdk::Split) const override { return 0; }
  loom::sdk::Batch get_batch(loom::sdk::Split, const std::vector<int64_t>&) const override { return {}; }
};

#if defined(BROKEN_DUPLICATE)
// The good plugin already provides dataset 'counting'.
constexpr const char* kComponentName = "counting";
#elif defined(BROKEN_FACTORY_THROWS)
constexpr const char* kComponentName = "exploding";
#else
constexpr const char* kComponentName = BROKEN_NAME;
#endif

#if defined(BROKEN_LONG_SUMMARY)
constexpr auto kLongText = [] {
  std::array<char, 1101> text{};
  for (size_t i = 0; i < 1100; ++i) text[i] = 's';
  return text;
}();
#endif

constexpr loom_component make_component() {
#if defined(BROKEN_PRINTED_TEXT)
  loom_component c = loom::sdk::component<Dummy>(kComponentName, "ok\n[12:00:00 E] loom: forged\x1b[31m red\xc2\x9b");
#elif defined(BROKEN_LONG_SUMMARY)
  // A summary past LOOM_MAX_TEXT (1024 bytes): it was cut at 1024, though abi.h says such a string is refused.
  loom_component c = loom::sdk::component<Dummy>(kComponentName, kLongText.data());
#else
  loom_component c = loom::sdk::component<Dummy>(kComponentName, "a test component");
#endif
#if defined(BROKEN_NEWER_MINOR)
  c.interface_minor = loom::sdk::Dataset::kInterfaceMinor + 1;  // built against a newer SDK
#elif defined(BROKEN_UNKNOWN_FLAGS)
  c.flags = 0x10;  // a flag of a future ABI
#endif
  return c;
}

constexpr loom_component kComponents[] = {make_component()};

int32_t init_fails(const loom_host_api*, loom_error* error) {
  loom::sdk::detail::write_error(error, "the GPU this plugin was told to use does not exist");
  return 7;
}

// Inits that take the process down or never return: the scanner must catch each in a child.
int32_t init_segv(const loom_host_api*, loom_error*) {
  std::raise(SIGSEGV);
  return 0;
}
int32_t init_abort(const loom_host_api*, loom_error*) { std::abort(); }
int32_t init_exit(const loom_host_api*, loom_error*) { std::exit(3); }
int32_t init_hang(const loom_host_api*, loom_error*) {
  while (true) ::pause();
}
// Closes the scanner's report pipe (its stdout), then hangs: the scan still times out on it.
int32_t init_close_hang(const loom_host_api*, loom_error*) {
  ::close(STDOUT_FILENO);
  while (true) ::pause();
}

// Inits that print what the scanner's report lines look like on the standard output (a library
// that logs to it), then crash or hang; and one that signals its process group (a plugin's
// clean-up of its workers gone wrong): each is refused by name, and the command goes on.
int32_t init_chatty_abort(const loom_host_api*, loom_error*) {
  std::printf("ok 0\nok, starting up\nreport 0 {}\n");
  std::fflush(stdout);
  std::abort();
}
int32_t init_chatty_hang(const loom_host_api*, loom_error*) {
  for (;;) {
    std::printf("begin 0\nbeginning work\n");
    std::fflush(stdout);
    ::usleep(200000);
  }
}
// Writes the scanner's own "ok" for itself on the scanner's report descriptor (100), then aborts:
// the scanner's failure after that "ok" is still the file's.
int32_t init_forges_ok(const loom_host_api*, loom_error*) {
  const char line[] = "ok 0\n";
  if (::write(100, line, sizeof line - 1) < 0) std::abort();
  std::abort();
}
int32_t init_kills_group(const loom_host_api*, loom_error*) {
  ::kill(0, SIGTERM);
  while (true) ::pause();
}

// Not noexcept on purpose: an init that lets an exception out.
int32_t init_throws(const loom_host_api*, loom_error*) { throw std::runtime_error("boom from init"); }

const loom_build_fingerprint kFingerprint = loom::sdk::kBuildFingerprint;

loom_plugin_descriptor make_descriptor() {
  loom_plugin_descriptor d{LOOM_ABI_MAGIC, sizeof(loom_plugin_descriptor), LOOM_ABI_MAJOR, LOOM_ABI_MINOR,
                           1, BROKEN_NAME, "0.0.1", &kFingerprint, kComponents, nullptr};
#if defined(BROKEN_BAD_MAGIC)
  d.magic = 0xDEADBEEF;
#elif defined(BROKEN_SMALL_STRUCT)
  d.struct_size = 24;
#elif defined(BROKEN_ABI_MAJOR)
  d.abi_major = LOOM_ABI_MAJOR + 1;
#elif defined(BROKEN_ABI_MINOR)
  d.abi_minor = LOOM_ABI_MINOR + 1;
#elif defined(BROKEN_INIT_FAILS)
  d.init = &init_fails;
#elif defined(BROKEN_INIT_THROWS)
  d.init = &init_throws;
#elif defined(BROKEN_INIT_SEGV)
  d.init = &init_segv;
#elif defined(BROKEN_INIT_ABORT)
  d.init = &init_abort;
#elif defined(BROKEN_INIT_EXIT)
  d.init = &init_exit;
#elif defined(BROKEN_INIT_HANG)
  d.init = &init_hang;
#elif defined(BROKEN_INIT_CLOSE_HANG)
  d.init = &init_close_hang;
#elif defined(BROKEN_INIT_CHATTY_ABORT)
  d.init = &init_chatty_abort;
#elif defined(BROKEN_INIT_CHATTY_HANG)
  d.init = &init_chatty_hang;
#elif defined(BROKEN_INIT_KILLS_GROUP)
  d.init = &init_kills_group;
#elif defined(BROKEN_INIT_FORGES_OK)
  d.init = &init_forges_ok;
#elif defined(BROKEN_CONTROL_VERSION)
  d.version = "1.0\r\x1b[2Kfake";
#endif
  return d;
}

const loom_plugin_descriptor kDescriptor = make_descriptor();

}  // namespace

#if defined(BROKEN_NO_ENTRY)
// Exports a function, but not the entry point.
extern "C" __attribute__((visibility("default"))) int loom_not_the_entry(void) { return kDescriptor.magic != 0; }
#elif defined(BROKEN_CXX11_ABI) || defined(BROKEN_FACTORY_THROWS) || defined(BROKEN_SANITIZED)
// Built by the SDK's macro; what is wrong is the compiler flag (-D_GLIBCXX_USE_CXX11_ABI=0,
// -fsanitize=address) or the factory.
LOOM_PLUGIN(BROKEN_NAME, "0.0.1", loom::sdk::component<Dummy>(kComponentName, "a test component"))
#else
#if !defined(BROKEN_NO_NOTE)
// The fingerprint note LOOM_PLUGIN would emit (an ABI 1.4 plugin without one is refused).
__attribute__((section(LOOM_NOTE_SECTION), used, aligned(4)))
const loom::sdk::detail::FingerprintNote kNote = loom::sdk::detail::fingerprint_note();
#endif
extern "C" __attribute__((visibility("default"), used, section(LOOM_ENTRY_SECTION)))
const loom_plugin_descriptor* loom_plugin_entry_v1(void) noexcept {
#if defined(BROKEN_NULL_ENTRY)
  return nullptr;
#else
  return &kDescriptor;
#endif
}
#endif
