// Loading a plugin file first in a child process (plugin_scan.hpp).
#include "plugin_scan.hpp"

#include <loom/core/child_process.hpp>
#include <loom/core/files.hpp>
#include <loom/core/kinds.hpp>
#include <loom/core/log.hpp>
#include <loom/core/stop_signals.hpp>

#include <loom/sdk/files.hpp>
#include <loom/sdk/options.hpp>
#include <loom/sdk/version.hpp>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <algorithm>
#include <optional>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

namespace fs = std::filesystem;

namespace loom::core {

namespace {

/// The scanner: $LOOM_PLUGIN_SCANNER, else loom-plugin-scanner beside this executable (the
/// build tree and an install both put it there).
fs::path scanner() {
  if (const char* s = std::getenv("LOOM_PLUGIN_SCANNER"); s != nullptr && *s != '\0') {  // empty: as unset
    if (std::string(s) == "off") return {};
    if (sdk::what_is_at(s).empty() && ::access(s, X_OK) == 0) return s;
    static std::once_flag said;
    std::call_once(said, [&] {
      log::warn("LOOM_PLUGIN_SCANNER=", s, " is not an executable file (", std::strerror(errno), "): plugins are ",
                "loaded in this process, unchecked, and one that crashes while loading takes the command down; unset ",
                "it (loom-plugin-scanner beside loom is used), or set it to off to say so");
    });
    return {};
  }
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return {};
  const fs::path beside = self.parent_path() / "loom-plugin-scanner";
  return ::access(beside.c_str(), X_OK) == 0 ? beside : fs::path();
}

fs::path cache_file() {
  if (const char* c = std::getenv("LOOM_CACHE"); c != nullptr && *c != '\0')  // (empty: as unset)
    return fs::path(c) / "plugin-scan.tsv";
  if (const char* h = std::getenv("HOME")) return fs::path(h) / ".cache" / "loom" / "plugin-scan.tsv";
  return {};
}

/// The cache key: what must not change for a verdict to still hold.
std::string key_of(const fs::path& file) {
  struct stat st {};
  if (::stat(file.c_str(), &st) != 0) return {};
  std::ostringstream k;
  // "report-4": the format of the cached reports (2: component flags, the fingerprint note; 3: made
  // by a scanner that reports on a descriptor of its own, where an "ok" a plugin printed on its
  // stdout was taken for the scanner's; 4: options normalized, enum choices once, a list default's
  // stray commas); entries of an older format are scanned again.
  // The inode and the change time too: `cp -p`, rsync -a, tar and reproducible builds keep a file's
  // size and modification time, but a file written again, or replaced, gets a new change time
  // (no call can set it back), and a replaced one a new inode.
  k << file.string() << '|' << st.st_size << '|' << st.st_mtim.tv_sec << '.' << st.st_mtim.tv_nsec << '|' << st.st_ino
    << '|' << st.st_ctim.tv_sec << '.' << st.st_ctim.tv_nsec << '|' << LOOM_SDK_VERSION << "|report-4|";
  // The host's interface versions: a host rebuilt with a newer interface under the same SDK
  // version must not reuse a verdict ("the plugin is newer than this Loom") made by the older one.
  for (const auto& kind : kinds()) k << kind.interface_major << '.' << kind.interface_minor << ',';
  return k.str();
}

std::mutex cache_mutex;

std::map<std::string, std::string> read_cache(const fs::path& path) {
  std::map<std::string, std::string> out;
  std::string text;
  try {
    text = read_file(path, 16 << 20);
  } catch (const std::exception&) {
    return out;  // none yet, or unreadable: scan again
  }
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (const auto tab = line.find('\t'); tab != std::string::npos) out[line.substr(0, tab)] = line.substr(tab + 1);
  return out;
}

double timeout_seconds();

void remember(const std::map<fs::path, std::string>& keys, const std::map<fs::path, ScanVerdict>& verdicts) {
  const fs::path path = cache_file();
  if (path.empty() || verdicts.empty()) return;
  std::lock_guard<std::mutex> lock(cache_mutex);
  try {
    fs::create_directories(path.parent_path());
    auto entries = read_cache(path);  // merge: other processes may have added theirs
    for (const auto& [file, v] : verdicts) {
      const auto& key = keys.at(file);
      // (a tab or a line break in a file's name split its line of the cache in two: never cached)
      if (key.empty() || file.string().find_first_of("\t\n\r") != std::string::npos) continue;
      // The file's entries of before (written again, replaced, of another Loom): one each time it
      // changed, and the cache grew without end.
      const std::string prefix = file.string() + "|";
      for (auto it = entries.lower_bound(prefix); it != entries.end() && it->first.rfind(prefix, 0) == 0;)
        it = it->first == key ? std::next(it) : entries.erase(it);
      entries[key] = v.ok          ? (v.report.empty() ? std::string("ok") : "ok\t" + v.report)
                       : v.timed_out ? "timeout\t" + std::to_string(timeout_seconds()) + "\t" + v.reason
                                     : "refused\t" + v.reason;
    }
    std::string text;
    for (const auto& [k, value] : entries) text += k + "\t" + value + "\n";
    write_file_atomic(path, text);
  } catch (const std::exception& e) {
    // Each command would scan every plugin again (20 s for one that hangs), unsaid.
    static bool said = false;
    if (!said) log::warn("cannot write the plugin scan cache ", path.string(), " (", e.what(), "): every command scans the plugins again; ",
                         "point LOOM_CACHE at a folder you can write");
    said = true;
  }
}

/// The limit a cached timeout was measured under ("timeout\t20\t<reason>"), or nullopt.
std::optional<double> cached_timeout(const std::string& entry) {
  if (entry.rfind("timeout\t", 0) != 0 || entry.find('\t', 8) == std::string::npos) return std::nullopt;
  return sdk::parse_float(entry.substr(8, entry.find('\t', 8) - 8));
}

double timeout_seconds() {
  constexpr double kDefault = 20;
  const char* t = std::getenv("LOOM_PLUGIN_SCAN_TIMEOUT");
  if (t == nullptr || *t == '\0') return kDefault;
  const auto v = sdk::parse_float(t);
  // Below a second the scanner is killed while it loads LibTorch, before it checks any plugin.
  if (v && *v >= 1 && *v <= 3600) return *v;
  static bool said = false;  // (once per process: each scan asks)
  if (!said) log::warn("LOOM_PLUGIN_SCAN_TIMEOUT=", t, " is not a number of seconds from 1 to 3600; ", kDefault, " s are used");
  said = true;
  return kDefault;
}

/// One scanner process over `files`: on its report descriptor it says "begin N" before loading
/// file N and "ok N" after. Returns the verdicts it reached; files it did not reach are left out;
/// none where it could not start (`why_none` then says why).
std::map<fs::path, ScanVerdict> run_scanner(const fs::path& exe, const std::vector<fs::path>& files, std::string& why_none) {
  std::map<fs::path, ScanVerdict> out;
  ChildProcess child;
  child.exe = exe;
  child.args.push_back(exe.string());
  for (const auto& f : files) child.args.push_back(f.string());
  // The scanner ends itself once this process is gone (its parent's pid: a parent of pid 1, a
  // container's loom, is no sign of an orphan).
  child.environment = "LOOM_SCANNER_PARENT=" + std::to_string(::getpid());
  // Its report on a descriptor of its own (a plugin that printed "ok 0" on stdout, then crashed,
  // was passed and crashed the command), in a process group of its own (a plugin's kill(0,
  // SIGTERM) ended the command; what a plugin started goes with the scanner).
  child.quiet = true;
  child.own_group = true;
  // The limit is per file, from its "begin": the scanner's own start (it maps LibTorch, seconds
  // on a loaded machine) gets a minute or more, or a short LOOM_PLUGIN_SCAN_TIMEOUT would time
  // out before the first file and leave every plugin to load in this process, unchecked.
  const double limit = timeout_seconds();
  child.limit = limit;
  child.first_limit = std::max(limit, 120.0);
  std::map<int, std::string> reports;  // index -> the report line's JSON
  int current = -1;  // the file the scanner is loading
  // The lines in their order only ("begin N" for the next file, then "report N ..." and "ok N"
  // for it): anything else is not the scanner's, and is no progress either. A file's "ok" holds
  // once the scanner has gone on to the next file, or ended well after it: plugin code in the
  // scanner that wrote one on the report descriptor, then crashed or hung, is that file's failure.
  int next = 0, unconfirmed = -1;
  // A file that takes seconds to load is named while it does: three plugins that hung as they
  // loaded held a command silent for a minute, their refusals said only at the end (probe).
  auto began = std::chrono::steady_clock::now();
  int said_for = -1;
  const auto say_waiting = [&] {
    if (current < 0 || said_for == current) return false;
    const double after = std::min(5.0, limit / 2);
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count() < after) return false;
    said_for = current;
    char so_far[32];
    std::snprintf(so_far, sizeof so_far, "%g", after);
    log::info("plugin scan: waiting for ", files[static_cast<size_t>(current)].string(), " to load (", so_far,
              " s so far; refused at ", static_cast<int>(limit), " s, LOOM_PLUGIN_SCAN_TIMEOUT)");
    return false;  // (never stops the scan: the limit does)
  };
  const ChildEnd end = run_child_process(child, [&](const std::string& line) {
    const size_t space = line.find(' ');
    const std::string word = line.substr(0, space);
    const size_t digits = space == std::string::npos ? 0 : line.find_first_not_of("0123456789", space + 1);
    const std::string number = space == std::string::npos ? "" : line.substr(space + 1, digits == std::string::npos ? digits : digits - space - 1);
    if (number.empty() || number.size() > 9) return false;
    const int index = std::stoi(number);
    const bool ends = digits == std::string::npos;
    if (word == "begin" && ends && index == next && current < 0 && index < static_cast<int>(files.size())) {
      if (unconfirmed >= 0) out[files[static_cast<size_t>(unconfirmed)]] = {true, {}, reports[unconfirmed]};
      unconfirmed = -1;
      current = index;
      began = std::chrono::steady_clock::now();
      return true;
    }
    if (word == "report" && !ends && line[digits] == ' ' && index == current) {
      reports[index] = line.substr(digits + 1);
      return false;
    }
    if (word == "ok" && ends && index == current) {
      unconfirmed = index;
      current = -1;
      next = index + 1;
      return true;
    }
    return false;
  }, say_waiting);
  if (end.spawn_error != 0) {  // (no verdict: none is cached, and the next command tries again)
    why_none = std::string("it could not be started: ") + std::strerror(end.spawn_error);
    return {};
  }
  const bool timed_out = end.timed_out;
  const int status = end.status;
  if (unconfirmed >= 0 && !timed_out && WIFEXITED(status) && WEXITSTATUS(status) == 0)
    out[files[static_cast<size_t>(unconfirmed)]] = {true, {}, reports[unconfirmed]};
  else if (unconfirmed >= 0)
    current = unconfirmed;  // (its "ok", then the scanner's failure: the file's)
  if (current >= 0) {  // it did not come back from this file
    ScanVerdict v{false, {}, {}};
    if (timed_out) {
      v.reason = "did not finish loading within " + std::to_string(static_cast<int>(limit)) +
                 " s in the scanner (does its initialization hang? on a busy machine, a larger "
                 "LOOM_PLUGIN_SCAN_TIMEOUT tries it again)";
      v.timed_out = true;
    } else if (WIFSIGNALED(status) && (is_crash_signal(WTERMSIG(status)) || WTERMSIG(status) == SIGKILL)) {
      v.cached = WTERMSIG(status) != SIGKILL;  // (SIGKILL not from this process: the OOM killer's, say)
      v.reason = "crashed with " + signal_name(WTERMSIG(status)) +
                 " while loading in the scanner (in its static initializers or its init)";
    } else if (WIFSIGNALED(status)) {  // (SIGTERM: a plugin that signals its process group, the scanner's own)
      v.cached = false;  // (or a signal from outside, a user's or the OOM killer's: the next command scans it again)
      v.reason = "ended the scanner by " + signal_name(WTERMSIG(status)) +
                 " while loading (does its initialization signal its process group, or its parent?)";
    } else if (WIFEXITED(status) && WEXITSTATUS(status) == kReportLost) {
      v.reason = "closed or replaced the scanner's report descriptor (100) while loading, so the scanner could not say "
                 "how its loading ended";
    } else if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {  // (it wrote its lines, and they did not come)
      v.reason = "ended the scanner before it reported on the file (does its initialization redirect descriptor 100, "
                 "or call exit(0)?)";
    } else if (WIFEXITED(status)) {
      v.reason = "ended the scanner with exit status " + std::to_string(WEXITSTATUS(status)) +
                 " while loading (does its initialization call exit()?)";
    } else {
      v.reason = "ended the scanner while loading";
    }
    out[files[static_cast<size_t>(current)]] = v;
  }
  return out;
}

}  // namespace

void forget_scan(const fs::path& file) {
  const fs::path path = cache_file();
  if (path.empty()) return;
  std::lock_guard<std::mutex> lock(cache_mutex);
  try {
    auto entries = read_cache(path);
    const std::string prefix = file.string() + "|";
    bool dropped = false;
    for (auto it = entries.lower_bound(prefix); it != entries.end() && it->first.rfind(prefix, 0) == 0; dropped = true)
      it = entries.erase(it);
    if (!dropped) return;
    std::string text;
    for (const auto& [k, value] : entries) text += k + "\t" + value + "\n";
    write_file_atomic(path, text);
  } catch (const std::exception& e) {
    log::warn("cannot drop ", file.string(), "'s entry from the plugin scan cache ", path.string(), " (", e.what(),
              "); remove that file, and the next command scans every plugin again");
  }
}

std::map<fs::path, ScanVerdict> scan_in_child(const std::vector<fs::path>& files) {
  std::map<fs::path, ScanVerdict> out;
  const fs::path exe = scanner();
  if (exe.empty()) {
    log::trace("no plugin scanner; loading plugins in-process without isolation");
    for (const auto& f : files) out[f] = {};
    return out;
  }
  std::vector<fs::path> pending;
  std::map<fs::path, std::string> keys;
  {
    std::lock_guard<std::mutex> lock(cache_mutex);
    const auto entries = read_cache(cache_file());
    for (const auto& f : files) {
      keys[f] = key_of(f);
      auto it = entries.find(keys[f]);
      if (it != entries.end() && it->second == "ok") out[f] = {};
      else if (it != entries.end() && it->second.rfind("ok\t", 0) == 0) out[f] = {true, {}, it->second.substr(3)};
      else if (it != entries.end() && it->second.rfind("refused\t", 0) == 0 && it->second.size() > 8) out[f] = {false, it->second.substr(8) + " (cached verdict)", {}};
      else if (const auto limit = cached_timeout(it == entries.end() ? std::string() : it->second); limit && *limit >= timeout_seconds())
        out[f] = {false, it->second.substr(it->second.find('\t', 8) + 1) + " (cached verdict)", {}, true};
      else pending.push_back(f);  // (a timeout under a smaller limit than now: tried again)
    }
  }
  std::map<fs::path, ScanVerdict> fresh;
  while (!pending.empty()) {
    log::trace("scanning ", pending.size(), " plugin file(s) in ", exe.string(), ", from ", pending.front().string());
    std::string why_none = "it failed to start or to report";
    auto verdicts = run_scanner(exe, pending, why_none);
    if (verdicts.empty()) {  // it reached no file: give up isolation rather than loop
      log::warn("the plugin scanner ", exe.string(), " checked none of ", pending.size(), " plugin file(s) (from ",
                pending.front().string(), "): ", why_none, "; they are loaded in this process, unchecked");
      for (const auto& f : pending) out[f] = {};
      break;
    }
    std::vector<fs::path> rest;
    for (const auto& f : pending) {
      if (auto it = verdicts.find(f); it == verdicts.end()) rest.push_back(f);
      else if (out[f] = it->second; it->second.cached) fresh[f] = it->second;  // (a timeout with its limit: a larger one tries again)
    }
    pending = std::move(rest);
  }
  remember(keys, fresh);
  return out;
}

}  // namespace loom::core
