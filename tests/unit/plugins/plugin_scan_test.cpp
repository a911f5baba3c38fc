// Plugins that crash, abort, exit or hang while loading are refused by name, through the scanner's
// child process, and the other plugins still load; the verdicts are cached by file.
#include <loom/core/log.hpp>
#include <loom/core/plugin_registry.hpp>
#include <loom/sdk/precision.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>
#include <csignal>
#include <functional>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

namespace fs = std::filesystem;

namespace {

/// The Loom plugin files mapped into this process (loaded), by file name.
std::set<std::string> mapped_plugins() {
  std::set<std::string> out;
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    const auto slash = line.rfind('/');
    if (slash == std::string::npos) continue;
    const std::string name = line.substr(slash + 1);
    if (name.rfind("libloom_", 0) == 0 && name.size() > 3 && name.compare(name.size() - 3, 3, ".so") == 0) out.insert(name);
  }
  return out;
}

class PluginScan : public testing::Test {
 protected:
  void SetUp() override {
    cache_ = fs::temp_directory_path() / ("loom_plugin_scan_" + std::to_string(::getpid()));
    fs::remove_all(cache_);
    ::setenv("LOOM_CACHE", cache_.c_str(), 1);
    ::setenv("LOOM_PLUGIN_SCAN_TIMEOUT", "3", 1);
  }
  void TearDown() override { fs::remove_all(cache_); }

  /// Scans the crashing plugins and the real plugin folder; the refusals by file name.
  static std::map<std::string, loom::core::PluginRefusal> scan(loom::core::PluginRegistry& r) {
    r.set_log_refusals(false);
    r.scan({fs::path(LOOM_BINARY_DIR) / "tests" / "crashing", fs::path(LOOM_BINARY_DIR) / "lib" / "loom" / "plugins"});
    std::map<std::string, loom::core::PluginRefusal> out;
    for (const auto& refusal : r.refusals()) out[refusal.file.filename().string()] = refusal;
    return out;
  }

  fs::path cache_;
};

TEST_F(PluginScan, CrashingExitingAndHangingPluginsAreRefusedByNameAndTheOthersLoad) {
  loom::core::PluginRegistry registry;
  const auto start = std::chrono::steady_clock::now();
  std::map<std::string, loom::core::PluginRefusal> refused;
  {
    // A file that takes seconds to load is named while it does (three that hung held a command
    // silent for a minute, probe): at half the limit here.
    const loom::core::log::Capture capture(LOOM_LOG_INFO);
    refused = scan(registry);
    EXPECT_TRUE(capture.contains("plugin scan: waiting for " +
                                 (fs::path(LOOM_BINARY_DIR) / "tests" / "crashing" / "libloom_dataset_crashing_init_hang.so").string() +
                                 " to load (1.5 s so far; refused at 3 s, LOOM_PLUGIN_SCAN_TIMEOUT)"))
        << ::testing::PrintToString(capture.lines());
  }
  const std::map<std::string, std::string> expected = {
#if defined(__SANITIZE_ADDRESS__)
      // Under AddressSanitizer the scanner's SEGV handler reports the crash and exits with 1.
      {"libloom_dataset_crashing_init_segv.so", "ended the scanner with exit status 1 while loading"},
#else
      {"libloom_dataset_crashing_init_segv.so", "crashed with SIGSEGV while loading in the scanner"},
#endif
      {"libloom_dataset_crashing_init_abort.so", "crashed with SIGABRT while loading in the scanner"},
      {"libloom_dataset_crashing_init_exit.so", "ended the scanner with exit status 3 while loading"},
      {"libloom_dataset_crashing_init_hang.so", "did not finish loading within 3 s in the scanner"},
      // (its stdout, the scanner's report pipe, closed before it hangs: the scan waited for ever)
      {"libloom_dataset_crashing_init_close_hang.so", "did not finish loading within 3 s in the scanner"},
      // (after printing "ok 0" on stdout: it was passed, and crashed the command; "begin 0", again
      // and again: every line of it held the limit off)
      {"libloom_dataset_crashing_init_chatty_abort.so", "crashed with SIGABRT while loading in the scanner"},
      {"libloom_dataset_crashing_init_chatty_hang.so", "did not finish loading within 3 s in the scanner"},
      // (kill(0, SIGTERM): the scanner was in this process's group, which it ended)
      {"libloom_dataset_crashing_init_kills_group.so", "ended the scanner by SIGTERM while loading"},
  };
  for (const auto& [file, reason] : expected) {
    auto it = refused.find(file);
    ASSERT_NE(it, refused.end()) << file << " was not refused";
    EXPECT_EQ(it->second.stage, "scan") << file;
    EXPECT_NE(it->second.reason.find(reason), std::string::npos) << file << ": " << it->second.reason;
  }
  EXPECT_EQ(refused.size(), expected.size()) << "only the crashing plugins are refused";
  EXPECT_NE(registry.find(LOOM_KIND_MODEL, "lightweight_transformer"), nullptr);
  EXPECT_NE(registry.find(LOOM_KIND_CALLBACK, "early_stopping"), nullptr);
  const double first = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  // The verdicts are cached by path, size and time: a second scan runs no child for them and
  // says the verdict is the cached one; a timeout with the limit it was measured under.
  // (A scan that waited for the hang again would take 3 s more: the bound tells that apart.)
  loom::core::PluginRegistry again;
  const auto start2 = std::chrono::steady_clock::now();
  const auto cached = scan(again);
  const double second = std::chrono::duration<double>(std::chrono::steady_clock::now() - start2).count();
  ASSERT_EQ(cached.size(), expected.size());
  for (const auto& [file, reason] : expected) {
    // (a SIGTERM may be a user's or a scheduler's, not the plugin's: scanned again, never cached)
    const bool again = file == "libloom_dataset_crashing_init_kills_group.so";
    EXPECT_EQ(cached.at(file).reason.find("(cached verdict)") == std::string::npos, again) << file << ": " << cached.at(file).reason;
    EXPECT_NE(cached.at(file).reason.find(reason), std::string::npos) << file << ": " << cached.at(file).reason;
  }
  EXPECT_NE(cached.at("libloom_dataset_crashing_init_hang.so").hint.find("a larger LOOM_PLUGIN_SCAN_TIMEOUT tries it again"),
            std::string::npos);
  EXPECT_LT(second, first) << "a cached scan waits for no timeout";
  // A larger limit tries it again (a plugin slow once on a busy machine was refused for good).
  ::setenv("LOOM_PLUGIN_SCAN_TIMEOUT", "4", 1);
  loom::core::PluginRegistry larger;
  const auto retried = scan(larger);
  EXPECT_NE(retried.at("libloom_dataset_crashing_init_hang.so").reason.find("did not finish loading within 4 s"), std::string::npos)
      << retried.at("libloom_dataset_crashing_init_hang.so").reason;
  EXPECT_EQ(retried.at("libloom_dataset_crashing_init_hang.so").reason.find("(cached verdict)"), std::string::npos);
}

TEST_F(PluginScan, AnOkThatPluginCodeWritesForItselfBeforeCrashingIsNotTheVerdict) {
  // Its init writes "ok 0" on the scanner's report descriptor, then aborts: the scan took the
  // "ok", cached it, and every command crashed loading the plugin in its own process.
  loom::core::PluginRegistry registry;
  registry.set_log_refusals(false);
  registry.scan({fs::path(LOOM_BINARY_DIR) / "tests" / "forging"});
  ASSERT_EQ(registry.refusals().size(), 1u);
  EXPECT_NE(registry.refusals().front().reason.find("crashed with SIGABRT while loading in the scanner"), std::string::npos)
      << registry.refusals().front().reason;
}

TEST_F(PluginScan, APluginWhoseInitializerStartsAProcessThatLivesOnIsScannedWithoutWaitingForIt) {
  // That process holds the scanner's output open after the scanner ended: the scan read on until
  // its time limit (every command waited 20 s). Here the limit is 120 s, as is the process's life.
  ::setenv("LOOM_PLUGIN_SCAN_TIMEOUT", "120", 1);
  fs::create_directories(cache_);
  const fs::path pid_file = cache_ / "daemon.pid";
  ::setenv("LOOM_TEST_DAEMON_PID", pid_file.c_str(), 1);
  loom::core::PluginRegistry registry;
  registry.set_log_refusals(false);
  const auto start = std::chrono::steady_clock::now();
  registry.scan({fs::path(LOOM_BINARY_DIR) / "tests" / "forking"});
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ::unsetenv("LOOM_TEST_DAEMON_PID");
  int daemon = 0;
  if (std::FILE* f = std::fopen(pid_file.c_str(), "r")) {
    if (std::fscanf(f, "%d", &daemon) != 1) daemon = 0;
    std::fclose(f);
  }
  if (daemon > 0) ::kill(daemon, SIGKILL);
  EXPECT_GT(daemon, 0) << "the plugin's initializer did not run in the scanner";
  EXPECT_TRUE(registry.refusals().empty());
  EXPECT_NE(registry.find(LOOM_KIND_DATASET, "forking_init_daemon"), nullptr);
  EXPECT_LT(took, 60.0) << "the scan waited for the process the plugin started";
}

TEST_F(PluginScan, TheScannerEndsWithTheCommandThatStartedIt) {
  // A command interrupted while a plugin's initializer spun left the scanner at full CPU for
  // good (its time limit is the command's to enforce). Here the command is a child process that
  // starts the scanner on the hanging plugin and ends.
  const fs::path scanner = fs::path(LOOM_BINARY_DIR) / "bin" / "loom-plugin-scanner";
  const fs::path hang = fs::path(LOOM_BINARY_DIR) / "tests" / "crashing" / "libloom_dataset_crashing_init_hang.so";
  ASSERT_TRUE(fs::exists(scanner) && fs::exists(hang));
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t command = ::fork();
  ASSERT_GE(command, 0);
  if (command == 0) {
    const std::string me = std::to_string(::getpid());
    const pid_t child = ::fork();
    if (child == 0) {
      ::setenv("LOOM_SCANNER_PARENT", me.c_str(), 1);  // as the host names itself
      ::execl(scanner.c_str(), scanner.c_str(), hang.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    const ssize_t n = ::write(fds[1], &child, sizeof child);
    ::usleep(1500 * 1000);  // the scanner is inside the plugin's init by now (or soon)
    ::_exit(n == sizeof child ? 0 : 1);
  }
  ::close(fds[1]);
  pid_t scanner_pid = 0;
  ASSERT_EQ(::read(fds[0], &scanner_pid, sizeof scanner_pid), static_cast<ssize_t>(sizeof scanner_pid));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(command, &status, 0);
  // Gone, or a zombie no one reaps (state Z): either way no longer running.
  const auto running = [&] {
    std::ifstream stat("/proc/" + std::to_string(scanner_pid) + "/stat");
    std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    const auto close = text.rfind(')');
    return close != std::string::npos && close + 2 < text.size() && text[close + 2] != 'Z';
  };
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (running() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const bool still = running();
  if (still) ::kill(scanner_pid, SIGKILL);
  EXPECT_FALSE(still) << "the scanner outlived the command that started it";
}

}  // namespace

namespace {

// A run loads in-process only the plugins it selects: the scanner's report says what each file
// holds, the registry lists every component from it, and a file is loaded (its code mapped and
// run) when one of its components is first created. Checked on what the process has mapped.
TEST_F(PluginScan, OnlyThePluginsARunCreatesAreLoadedInProcess) {
  const fs::path plugins = fs::path(LOOM_BINARY_DIR) / "lib" / "loom" / "plugins";
  for (int round = 0; round < 2; ++round) {  // the first scans, the second reads the cached reports
    SCOPED_TRACE(round == 0 ? "scanned now" : "from the cache");
    loom::core::PluginRegistry registry;
    registry.set_log_refusals(false);
    registry.scan({plugins});
    EXPECT_TRUE(registry.refusals().empty());
    ASSERT_NE(registry.find(LOOM_KIND_PRECISION, "fp32"), nullptr);
    ASSERT_NE(registry.find(LOOM_KIND_MODEL, "lightweight_transformer"), nullptr);
    EXPECT_FALSE(registry.find(LOOM_KIND_MODEL, "lightweight_transformer")->options.empty())
        << "the options come from the scanner's report";
    for (const auto& p : registry.plugins()) EXPECT_FALSE(p->loaded()) << p->file;
    if (round == 0) {
      const auto mapped = mapped_plugins();
      for (const auto& p : registry.plugins())
        EXPECT_EQ(mapped.count(p->file.filename().string()), 0u) << p->file << " is mapped before any use";
    }

    auto precision = registry.create<loom::sdk::PrecisionStrategy>("fp32");
    ASSERT_NE(precision, nullptr);
    EXPECT_FALSE(precision->manifest().empty());
    const auto mapped = mapped_plugins();
    EXPECT_EQ(mapped.count("libloom_precision_fp32.so"), 1u);
    for (const auto& p : registry.plugins()) {
      const bool fp32 = p->file.filename() == "libloom_precision_fp32.so";
      EXPECT_EQ(p->loaded(), fp32) << p->file;
      if (round == 0 && !fp32) {
        EXPECT_EQ(mapped.count(p->file.filename().string()), 0u) << p->file << " was mapped";
      }
    }
  }
}

}  // namespace

namespace {

// `loom plugins inspect FILE` and `loom plugins check FILE` load one file, not a folder: that
// load goes through the scanner too, so a plugin that aborts or hangs while loading is refused
// by name, and the command (here, this test's process) lives on.
TEST_F(PluginScan, ALoadOfOneFileGoesThroughTheScannerToo) {
  const fs::path crashing = fs::path(LOOM_BINARY_DIR) / "tests" / "crashing";
  for (const char* name : {"libloom_dataset_crashing_init_abort.so", "libloom_dataset_crashing_init_hang.so"}) {
    SCOPED_TRACE(name);
    loom::core::PluginRegistry registry;
    registry.set_log_refusals(false);
    const auto report = registry.load(crashing / name);
    ASSERT_FALSE(report.accepted);
    ASSERT_TRUE(report.refusal.has_value());
    EXPECT_EQ(report.refusal->stage, "scan");
    EXPECT_NE(report.refusal->reason.find("in the scanner"), std::string::npos) << report.refusal->reason;
  }
}

/// Writes `from`'s bytes to `to`, padded with zeros to `size` (an ELF file loads the same with
/// bytes after its end), and gives it the modification time `mtime`.
void write_padded(const fs::path& from, const fs::path& to, std::uintmax_t size, const timespec& mtime) {
  std::ifstream in(from, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_LE(bytes.size(), size);
  bytes.resize(size, '\0');
  std::ofstream(to, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  const timespec times[2] = {mtime, mtime};
  ASSERT_EQ(::utimensat(AT_FDCWD, to.c_str(), times, 0), 0);
}

// A verdict is not reused for a file written again under the same size and modification time
// (`cp -p`, rsync -a and tar keep both): the crashing file that replaced an accepted one is
// scanned, and refused, instead of being loaded unchecked on the old file's verdict.
TEST_F(PluginScan, AFileWrittenAgainWithTheSameSizeAndTimeIsScannedAgain) {
  const fs::path good = fs::path(LOOM_BINARY_DIR) / "lib" / "loom" / "plugins" / "libloom_precision_fp32.so";
  const fs::path bad = fs::path(LOOM_BINARY_DIR) / "tests" / "crashing" / "libloom_dataset_crashing_init_abort.so";
  const std::uintmax_t size = std::max(fs::file_size(good), fs::file_size(bad)) + 4096;
  const fs::path folder = cache_ / "plugins";
  fs::create_directories(folder);
  const fs::path file = folder / "libloom_mine.so";
  const timespec mtime{1577836800, 0};  // 2020-01-01
  write_padded(good, file, size, mtime);
  {
    loom::core::PluginRegistry registry;
    registry.set_log_refusals(false);
    registry.scan({folder});
    ASSERT_TRUE(registry.refusals().empty());
    ASSERT_NE(registry.find(LOOM_KIND_PRECISION, "fp32"), nullptr);
  }
  struct stat before {};
  ASSERT_EQ(::stat(file.c_str(), &before), 0);
  write_padded(bad, file, size, mtime);
  struct stat st {};
  ASSERT_EQ(::stat(file.c_str(), &st), 0);
  if (st.st_ctim.tv_sec == before.st_ctim.tv_sec && st.st_ctim.tv_nsec == before.st_ctim.tv_nsec) {
    // A file system with coarse timestamps (whole seconds): a write a second later changes it.
    std::this_thread::sleep_for(std::chrono::milliseconds(1100));
    ASSERT_EQ(::chmod(file.c_str(), 0755), 0);
    ASSERT_EQ(::stat(file.c_str(), &st), 0);
  }
  ASSERT_EQ(static_cast<std::uintmax_t>(st.st_size), size);
  ASSERT_EQ(st.st_mtim.tv_sec, mtime.tv_sec);
  loom::core::PluginRegistry registry;
  registry.set_log_refusals(false);
  registry.scan({folder});
  ASSERT_EQ(registry.refusals().size(), 1u) << "the new content is scanned, not taken from the cache";
  EXPECT_EQ(registry.refusals().front().stage, "scan");
  EXPECT_EQ(registry.find(LOOM_KIND_PRECISION, "fp32"), nullptr);
  // The cache holds the file's new verdict alone: one entry more each time a file changed, for good.
  std::ifstream cache(cache_ / "plugin-scan.tsv");
  int lines = 0;
  for (std::string line; std::getline(cache, line);) lines += line.rfind(file.string() + "|", 0) == 0 ? 1 : 0;
  EXPECT_EQ(lines, 1);
}

/// Rewrites the cache's line of `file` with `edit` (a cache damaged, or edited by hand).
void edit_cache_entry(const fs::path& cache, const fs::path& file, const std::function<std::string(std::string)>& edit) {
  std::ifstream in(cache);
  std::string text;
  for (std::string line; std::getline(in, line);) text += (line.rfind(file.string() + "|", 0) == 0 ? edit(line) : line) + "\n";
  in.close();
  std::ofstream(cache, std::ios::trunc) << text;
}

// A cached report that no longer matches its file (a name it does not provide), or a cached
// refusal without a reason, is scanned again: "run the command again" met the same cached report
// for good (a probe), and the empty refusal blamed the plugin's initializers for nothing.
TEST_F(PluginScan, ACachedVerdictThatDoesNotMatchItsFileIsScannedAgain) {
  const fs::path folder = cache_ / "plugins";
  fs::create_directories(folder);
  const fs::path file = folder / "libloom_mine.so";
  fs::copy_file(fs::path(LOOM_BINARY_DIR) / "lib" / "loom" / "plugins" / "libloom_precision_fp32.so", file);
  const auto registry_of = [&] {
    auto r = std::make_unique<loom::core::PluginRegistry>();
    r->set_log_refusals(false);
    r->scan({folder});
    return r;
  };
  ASSERT_NE(registry_of()->find(LOOM_KIND_PRECISION, "fp32"), nullptr);
  const fs::path cache = cache_ / "plugin-scan.tsv";
  edit_cache_entry(cache, file, [](std::string line) {
    const std::string name = "\"name\":\"fp32\"";
    const auto at = line.find(name);
    return at == std::string::npos ? line : line.replace(at, name.size(), "\"name\":\"fp32x\"");
  });
  {
    auto edited = registry_of();
    ASSERT_NE(edited->find(LOOM_KIND_PRECISION, "fp32x"), nullptr) << "the edited report is read";
    try {
      edited->create<loom::sdk::PrecisionStrategy>("fp32x");
      FAIL() << "a component the file does not provide was created";
    } catch (const loom::Error& e) {
      EXPECT_NE(std::string(e.what()).find("no longer provides precision 'fp32x'"), std::string::npos) << e.what();
    }
  }
  auto again = registry_of();
  EXPECT_NE(again->find(LOOM_KIND_PRECISION, "fp32"), nullptr) << "scanned again: the file's own report";
  EXPECT_EQ(again->find(LOOM_KIND_PRECISION, "fp32x"), nullptr);
  edit_cache_entry(cache, file, [](const std::string& line) {
    return line.substr(0, line.find("\tok\t")) + "\trefused\t";  // (the key, then the verdict)
  });
  auto refused = registry_of();
  EXPECT_TRUE(refused->refusals().empty()) << refused->refusals().front().reason;
  EXPECT_NE(refused->find(LOOM_KIND_PRECISION, "fp32"), nullptr);
}

}  // namespace

TEST_F(PluginScan, EveryBoundOfAnOptionsDeclaredRangeIsAcceptedByItsFactory) {
  // `loom plugins inspect` and the schema's check promise the range: a value inside it that the
  // factory then refuses (auto_batch's margin was declared 0..0.9 and refused above 0.5) is a
  // promise broken. Models and datasets are left out: their bounds meet each other's (a width
  // the heads divide) and are checked at set-up.
  loom::core::PluginRegistry registry;
  registry.set_log_refusals(false);
  registry.scan({fs::path(LOOM_BINARY_DIR) / "lib" / "loom" / "plugins"});
  std::vector<std::string> broken;
  int checked = 0;
  for (const auto& info : registry.components()) {
    if (info.kind == LOOM_KIND_MODEL || info.kind == LOOM_KIND_DATASET) continue;
    for (const auto& option : info.options) {
      if (!option.min || !option.max) continue;
      for (const double bound : {*option.min, *option.max}) {
        char text[64];
        if (option.type == LOOM_OPTION_INT) std::snprintf(text, sizeof text, "%lld", static_cast<long long>(bound));
        else std::snprintf(text, sizeof text, "%.17g", bound);
        ++checked;
        try {
          registry.check_options(info, {{option.key, text}});
        } catch (const std::exception& e) {
          broken.push_back(info.name + "." + option.key + " = " + text + ": " + e.what());
        }
      }
    }
  }
  EXPECT_GT(checked, 10) << "the built-in plugins declare ranges";
  for (const auto& b : broken) ADD_FAILURE() << b;
}
