// Loading a plugin file first in a child process (private to the core). Loading runs the
// plugin's code (static initializers, init); a plugin that crashes, exits or hangs there must not
// take the host down with it. As GStreamer does, the registry first has `loom-plugin-scanner`
// load the files; only a file the scanner loaded and returned from is loaded in-process, and only
// when a component of it is first created: the scanner also reports what each file holds (its
// descriptor, as to_json(LoadReport)), from which the registry lists its components. Verdicts and
// reports are cached by path, size and modification time ($LOOM_CACHE/plugin-scan.tsv), so the
// scanner runs once per new or changed file.
#pragma once

#include <filesystem>
#include <map>
#include <vector>
#include <string>

namespace loom::core {

struct ScanVerdict {
  bool ok = true;
  std::string reason;  ///< why not: "crashed with SIGSEGV while loading (...)"
  /// When ok: what the scanner found in the file, as to_json(LoadReport) wrote it (empty when it
  /// said nothing; the host then loads the file to find out).
  std::string report;
  bool timed_out = false;  ///< refused for its time: cached with the limit, a larger one scans it again
  bool cached = true;      ///< false: not the file's own doing for sure (a signal from outside: the OOM killer, a user)
};

/// The verdict for each of `files`, from the cache or from scanner processes: one process loads
/// the files one after another and says before and after each; when it dies or hangs on one, that
/// file gets the verdict and a new process goes on with the rest. Every file is `ok` without
/// running anything when isolation is off (LOOM_PLUGIN_SCANNER=off) or there is no scanner.
std::map<std::filesystem::path, ScanVerdict> scan_in_child(const std::vector<std::filesystem::path>& files);

/// Drops `file`'s cached verdict: the file, loaded, did not match what the scan said of it (a cache
/// edited or damaged, a file changed within its key), and the next command scans it again.
void forget_scan(const std::filesystem::path& file);

}  // namespace loom::core
