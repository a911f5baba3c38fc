// The plugin registry: the loading stages of plugin_registry.hpp, and component creation.
#include <loom/core/crash_report.hpp>
#include <loom/core/kinds.hpp>
#include <loom/core/log.hpp>
#include <loom/core/plugin_registry.hpp>
#include <loom/core/text.hpp>
#include "plugin_descriptor.hpp"
#include "plugin_fingerprint.hpp"
#include "plugin_scan.hpp"

#include <loom/sdk/files.hpp>
#include <loom/sdk/options.hpp>

#include <string>
#include <vector>
#ifndef BOOST_DLL_USE_STD_FS
#define BOOST_DLL_USE_STD_FS
#endif
#include <boost/dll/shared_library.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <elf.h>
#include <fstream>
#include <mutex>
#include <set>
#include <unistd.h>

namespace fs = std::filesystem;

namespace loom::core {

namespace {

[[noreturn]] void refuse_now(std::string stage, std::string reason, std::string hint = {}) {
  throw PluginRefused{std::move(stage), std::move(reason), std::move(hint)};
}

/// Every library the loader opened, kept until the process ends. Exceptions, tensors (their
/// deleters), autograd nodes and LibTorch registrations may point into a plugin long after the
/// registry and every component are gone, so nothing is ever unloaded. Deliberately leaked:
/// no destructor runs at exit, so no dlclose either.
void keep_loaded(std::shared_ptr<boost::dll::shared_library> library) {
  static auto* libraries = new std::vector<std::shared_ptr<boost::dll::shared_library>>();
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  libraries->push_back(std::move(library));
}

#if defined(__x86_64__)
constexpr uint16_t kNativeMachine = EM_X86_64;
constexpr const char* kNativeElf = "x86-64, 64-bit";
#elif defined(__aarch64__)
constexpr uint16_t kNativeMachine = EM_AARCH64;
constexpr const char* kNativeElf = "aarch64, 64-bit";
#else
constexpr uint16_t kNativeMachine = 0;  // (unchecked here: the loader's own refusal stands)
constexpr const char* kNativeElf = "this machine";
#endif

/// How an ELF file's header says it was built, where not for this machine ("for aarch64"); ""
/// for a native one or a file that is no ELF (the library reader names that). Boost's reader took
/// an aarch64 plugin for a native one, and the loader then said "No such file or directory".
std::string foreign_elf(const fs::path& file) {
  if (kNativeMachine == 0) return {};
  unsigned char header[20] = {};
  std::ifstream in(file, std::ios::binary);
  if (!in.read(reinterpret_cast<char*>(header), sizeof header) || std::memcmp(header, ELFMAG, SELFMAG) != 0) return {};
  if (header[EI_CLASS] != ELFCLASS64) return header[EI_CLASS] == ELFCLASS32 ? "for 32 bits" : "of an unknown class";
  if (header[EI_DATA] != ELFDATA2LSB) return "big-endian";
  const auto machine = static_cast<uint16_t>(header[18] | (header[19] << 8));
  if (machine == kNativeMachine) return {};
  switch (machine) {
    case EM_X86_64: return "for x86-64";
    case EM_AARCH64: return "for aarch64";
    case EM_386: return "for i386";
    case EM_RISCV: return "for RISC-V";
    case EM_PPC64: return "for POWER";
    default: return "for machine type " + std::to_string(machine);
  }
}

/// Where this executable lives (for the plugin folder beside it).
std::optional<fs::path> executable_dir() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return std::nullopt;
  return exe.parent_path();
}

}  // namespace


std::string PluginRefusal::line() const {
  std::string out = "plugin refused: " + file.string() + " [" + stage + "] " + reason;
  if (!hint.empty()) out += "; " + hint;
  return out;
}

std::vector<fs::path> PluginRegistry::search_path(const std::vector<fs::path>& extra) {
  // The folder named for this command first, Loom's own last: a plugin built in --plugin-dir is the
  // one used, not its installed copy (which loaded first, and refused the new build, before).
  std::vector<fs::path> dirs(extra.begin(), extra.end());
  if (const char* env = std::getenv("LOOM_PLUGIN_PATH")) {
    std::stringstream ss(env);
    std::string item;
    while (std::getline(ss, item, ':'))
      if (!item.empty()) dirs.emplace_back(item);
  }
  if (auto exe = executable_dir()) dirs.push_back((*exe / ".." / "lib" / "loom" / "plugins").lexically_normal());
  return dirs;
}

void PluginRegistry::scan(const std::vector<fs::path>& folders) {
  std::vector<fs::path> files;
  for (const fs::path& folder : folders) {
    std::error_code ec;
    searched_.push_back(folder);
    const size_t place = searched_.size();
    if (fs::is_regular_file(folder, ec)) {
      files.push_back(folder);
      folder_of_.emplace(fs::weakly_canonical(folder, ec), place);
      continue;
    }
    if (!fs::is_directory(folder, ec)) {
      log::debug("plugin folder ", folder.string(), " does not exist; skipped");
      continue;
    }
    // Everything named *.so: what is not a regular file (a FIFO, a folder, a device, a broken or
    // looping link) is refused by name in load()'s first stage, not passed over in silence.
    std::vector<fs::path> here;
    for (const auto& entry : fs::directory_iterator(folder, ec)) {
      if (entry.path().extension() == ".so") here.push_back(entry.path());
    }
    std::sort(here.begin(), here.end());
    for (const auto& file : here) folder_of_.emplace(fs::weakly_canonical(file, ec), place);  // (load()'s name; the first folder)
    files.insert(files.end(), here.begin(), here.end());
  }
  prescan(files);  // one scanner process for all of them, not one per file
  for (const auto& file : files) load(file);
}

void PluginRegistry::prescan(const std::vector<fs::path>& files, bool even_seen) {
  if (!isolation_) return;
  std::vector<fs::path> pending;
  for (const auto& f : files) {
    std::error_code ec;
    if (!fs::is_regular_file(f, ec)) continue;  // refused by load() by name; a FIFO would block the scanner
    fs::path file = fs::weakly_canonical(f, ec);
    if (ec) file = f;
    if (!scanned_.count(file) && (even_seen || std::find(seen_files_.begin(), seen_files_.end(), file) == seen_files_.end()))
      pending.push_back(file);
  }
  if (pending.empty()) return;
  for (const auto& [file, verdict] : scan_in_child(pending)) {
    scanned_[file] = verdict.ok ? "" : verdict.reason;
    if (verdict.ok && !verdict.report.empty()) scan_reports_[file] = verdict.report;
  }
}

void PluginRegistry::refuse(LoadReport& report, std::string stage, std::string reason,
                            std::string hint) {
  // (a reason may quote the file's own bytes, a fingerprint note's: printed as text, one line)
  PluginRefusal refusal{report.file, std::move(stage), printable(reason, 4 * LOOM_MAX_TEXT), std::move(hint), {}};
  for (const auto& c : report.components) refusal.components.emplace_back(c.kind, c.name);
  if (log_refusals_) log::warn(refusal.line());
  else log::debug(refusal.line());
  report.refusal = refusal;
  report.accepted = false;
  refusals_.push_back(std::move(refusal));
}


namespace {

/// Stages 3 to 5 in this process: load, resolving every symbol now and keeping the plugin's
/// symbols to itself; read the descriptor into `report`; compare the fingerprint and the
/// interfaces; run init. Throws PluginRefused.
std::shared_ptr<boost::dll::shared_library> load_in_process(const fs::path& file, LoadReport& report) {
  // The fingerprint note, read from the file before any of its code runs (ABI 1.4 and newer),
  // unless load() read and checked it already (a note always says its "format").
  if (report.fingerprint.count("format") == 0)
    if (const auto text = read_fingerprint_note(file)) {
      report.fingerprint = parse_fingerprint(*text);
      check_fingerprint(report.fingerprint);
    }
  const bool note = report.fingerprint.count("format") != 0;

  // Stage 3: load, resolving every symbol now, keeping the plugin's symbols to itself.
  log::trace("loading plugin file ", file.string());
  auto library = std::make_shared<boost::dll::shared_library>();
  try {
    library->load(file, boost::dll::load_mode::rtld_now | boost::dll::load_mode::rtld_local);
  } catch (const std::exception& e) {
    const auto [why, hint] = why_not_loaded(file, e.what());
    refuse_now("load", why, hint);
  }
  keep_loaded(library);
  if (!library->has(LOOM_ENTRY_SYMBOL))
    refuse_now("load", "no entry symbol " LOOM_ENTRY_SYMBOL " is exported",
               "a Loom plugin ends with LOOM_PLUGIN(...) and is built with loom_add_plugin()");
  auto entry = library->get<const loom_plugin_descriptor*()>(LOOM_ENTRY_SYMBOL);

  // Stage 4: the descriptor.
  const loom_plugin_descriptor* d = entry();
  read_descriptor(d, report);

  // Stage 4: the fingerprint of a plugin older than ABI 1.4, from its descriptor. Past this point
  // the plugin's C++ is trusted.
  if (!note) {
    if (d->abi_minor >= 4)
      refuse_now("fingerprint", "an ABI 1." + std::to_string(d->abi_minor) + " plugin without its fingerprint note (" LOOM_NOTE_SECTION ")",
                 "build the plugin with LOOM_PLUGIN (C++) or LOOM_C_PLUGIN (C) and loom_add_plugin()");
    check_legacy_fingerprint(d->fingerprint);
    report.fingerprint["tier"] = "cxx";
  }
  const bool c_plugin = report.fingerprint["tier"] == "c";
  for (const auto& c : report.components) {
    if (c.c_tier() != c_plugin)
      refuse_now("interface",
                 kind_name(c.kind) + " '" + c.name + "' is a " + (c.c_tier() ? "C-tier" : "C++") + " component in a " +
                     (c_plugin ? "C-tier" : "C++") + " plugin",
                 "a plugin is written in one tier: LOOM_C_PLUGIN lists C components, LOOM_PLUGIN C++ ones");
    const KindInfo* kind = find_kind(c.kind);
    const uint32_t host_major = c.c_tier() ? kind->c_interface_major : kind->interface_major;
    const uint32_t host_minor = c.c_tier() ? kind->c_interface_minor : kind->interface_minor;
    const std::string what = kind_name(c.kind) + " '" + c.name + "' implements " + (c.c_tier() ? "the C " : "") +
                             kind_name(c.kind) + " interface " + std::to_string(c.interface_major) + "." +
                             std::to_string(c.interface_minor) + ", host has " + std::to_string(host_major) + "." +
                             std::to_string(host_minor);
    if (host_major == 0)
      refuse_now("interface", kind_name(c.kind) + " '" + c.name + "': this Loom has no C tier for " + kind_name(c.kind) + "s",
                 "write it in C++ with LOOM_PLUGIN");
    if (c.interface_major != host_major) refuse_now("interface", what, kRebuildHint);
    // A newer minor may call a method of a host-implemented interface, or rely on one the host
    // does not call: refused like a newer ABI.
    if (c.interface_minor > host_minor)
      refuse_now("interface", what + ": the plugin is newer than this Loom",
                 "upgrade Loom, or rebuild the plugin against this Loom's SDK");
  }

  // Stage 5: init.
  if (d->init != nullptr) {
    loom_error error{};
    error.struct_size = sizeof(loom_error);
    error.capacity = LOOM_ERROR_CAPACITY;
    int32_t rc = 0;
    try {
      rc = d->init(host_api(), &error);
    } catch (const std::exception& e) {
      refuse_now("init", std::string("init threw an exception: ") + e.what(),
                 "a plugin's init must return an error code, not throw across the C boundary");
    } catch (...) {
      refuse_now("init", "init threw an exception",
                 "a plugin's init must return an error code, not throw across the C boundary");
    }
    if (rc != 0) {
      error.message[LOOM_ERROR_CAPACITY - 1] = '\0';
      refuse_now("init",
                 "init failed (code " + std::to_string(rc) + ")" +
                     (error.message[0] ? std::string(": ") + error.message : std::string()),
                 "see the plugin's documentation for what its init needs");
    }
  }
  return library;
}

}  // namespace

bool set_range_from_choices(OptionSpec& spec) {
  if (spec.type != LOOM_OPTION_INT && spec.type != LOOM_OPTION_FLOAT) return true;
  if (spec.choices.empty()) return true;
  const auto range = sdk::parse_range(spec.choices);
  if (!range) return false;
  spec.min = range->lo;
  spec.max = range->hi;
  // An int's bound past the 64-bit integers, "0..1e30", bounds nothing a value can be (and a
  // fractional range with one, "0.5..1e30", was rounded into a bound of -2^63).
  if (spec.type == LOOM_OPTION_INT && (!within_int64(spec.min) || !within_int64(spec.max))) return false;
  // An int's bounds in fractions, "0.5..2.5", are the whole numbers within them, "1..2", written so
  // (it was shown as [0, 2] in one place and 0.5..2.5 in another, and 0 refused as outside [0, 2]).
  const auto whole = [](const std::optional<double>& v) { return !v || !std::isfinite(*v) || *v == std::floor(*v); };
  if (spec.type == LOOM_OPTION_INT && (!whole(spec.min) || !whole(spec.max))) {
    if (spec.min) spec.min = std::ceil(*spec.min);
    if (spec.max) spec.max = std::floor(*spec.max);
    if (spec.min && spec.max && *spec.min > *spec.max) return false;  // (no whole number within)
    const auto text = [](const std::optional<double>& v) {
      return !v ? std::string() : *v >= 9223372036854775808.0 ? std::string("9223372036854775807") : std::to_string(std::llround(*v));
    };
    spec.choices = text(spec.min) + ".." + text(spec.max);
  }
  return true;
}

LoadReport PluginRegistry::load(const fs::path& file_in) {
  LoadReport report;
  std::error_code ec;
  fs::path file = fs::weakly_canonical(file_in, ec);
  std::error_code regular_ec;
  if (ec || !fs::is_regular_file(file, regular_ec)) file = file_in;  // refused under the name it was found by
  report.file = file;
  if (std::find(seen_files_.begin(), seen_files_.end(), file) != seen_files_.end()) {
    for (const auto& c : components_)
      if (c.plugin->file == file) report.components.push_back(c);
    report.accepted = std::any_of(plugins_.begin(), plugins_.end(),
                                  [&](const auto& p) { return p->file == file; });
    return report;
  }
  seen_files_.push_back(file);

  try {
    // Stage 1: a static read of the file, without running any of its code, and only of a regular file.
    if (const std::string what = sdk::what_is_at(file); !what.empty()) {
      const bool missing = what == "no such file" || what == "a symbolic link to nothing";
      refuse_now("static-check", missing || what.rfind("cannot", 0) == 0 ? what : what + ", not a plugin file",
                 missing ? "give the path of a plugin's .so file; `loom plugins` lists the loaded ones"
                         : "found in a plugin folder: move it out (a plugin folder holds plugin files); named by itself: "
                           "give a plugin's .so file");
    }
    if (const std::string other = foreign_elf(file); !other.empty())
      refuse_now("static-check", "an ELF file built " + other + ", not for this machine (" + kNativeElf + ")",
                 "build the plugin for this machine, with this Loom's SDK (find_package(LoomSDK))");
    // (read with libelf: a damaged section header is refused, where Boost's reader crashed)
    switch (find_entry_symbol(file)) {
      case EntrySymbol::in_section:
      case EntrySymbol::elsewhere:
      case EntrySymbol::no_symbols:  // (no table to read: the load stage decides)
        break;
      case EntrySymbol::absent:
        refuse_now("static-check", "no entry symbol " LOOM_ENTRY_SYMBOL,
                   "a Loom plugin ends with LOOM_PLUGIN(...) and is built with loom_add_plugin(); is this a Loom plugin?");
      case EntrySymbol::absent_program:
        refuse_now("static-check", "a program, not a shared library (no entry symbol " LOOM_ENTRY_SYMBOL ")",
                   "it is a program, not a plugin: give a plugin's .so (built with loom_add_plugin())");
    }

    // The fingerprint note (ABI 1.4): a plugin built for another LibTorch, standard library or
    // sanitizer is refused here, before the scanner or this process runs any of its code.
    if (const auto note = read_fingerprint_note(file)) {
      report.fingerprint = parse_fingerprint(*note);
      check_fingerprint(report.fingerprint);
    }

    // Stage 2: the scanner loads it in a child process first (plugin_scan.hpp): a plugin that
    // crashes, exits or hangs while loading is refused by name instead of taking the host down.
    if (isolation_) {
      if (!scanned_.count(file)) prescan({file}, /*even_seen=*/true);  // load() of one file (inspect, check)
      if (const std::string& reason = scanned_[file]; !reason.empty())
        refuse_now("scan", reason,
                   reason.rfind("did not finish loading", 0) == 0
                       ? "the plugin's static initializers or init must return; on a busy machine a larger "
                         "LOOM_PLUGIN_SCAN_TIMEOUT tries it again (the verdict is cached for this limit)"
                       : "the plugin's static initializers or init must return; fix or remove the file (the verdict "
                         "is cached until the file changes)");
    }

    // Stages 3 to 5: unless the scanner already said what the file holds, load it here.
    std::shared_ptr<boost::dll::shared_library> library;
    const auto scanned = isolation_ && scan_reports_.count(file) ? load_report_from_json(scan_reports_[file]) : std::nullopt;
    if (scanned) {
      // Registered from the scanner's report: the file is loaded in this process only when a
      // component of it is first created (materialize), so a run loads the plugins it selects.
      report.plugin_name = scanned->plugin_name;
      report.plugin_version = scanned->plugin_version;
      report.fingerprint = scanned->fingerprint;
      report.components = scanned->components;
      if (scanned->refusal) refuse_now(scanned->refusal->stage, scanned->refusal->reason, scanned->refusal->hint);
    } else {
      library = load_in_process(file, report);
    }

    // Stage 6: register. A component a file of an earlier folder of the search already provides
    // is passed over here (the copy found first is the one used: a new build in --plugin-dir
    // before its installed copy, a user's `progress` callback before Loom's), the file's other
    // components are registered; a file all of whose components are provided so is passed over
    // whole. One a file of the same folder (or a file loaded by name) provides is refused.
    std::vector<std::string> shadowed;
    std::set<std::string> by;
    std::vector<bool> used(report.components.size(), true);
    for (size_t i = 0; i < report.components.size(); ++i) {
      const ComponentInfo& c = report.components[i];
      const ComponentInfo* other = find(c.kind, c.name);
      if (other == nullptr) continue;
      const auto mine = folder_of_.find(file), theirs = folder_of_.find(other->plugin->file);
      if (mine == folder_of_.end() || theirs == folder_of_.end() || theirs->second >= mine->second)
        refuse_now("register",
                   kind_name(c.kind) + " '" + c.name + "' is already provided by " + other->plugin->file.string(),
                   "remove one of the two files from the plugin folders, or rename the component");
      shadowed.push_back(kind_name(c.kind) + " '" + c.name + "'");
      by.insert(other->plugin->file.string());
      used[i] = false;
    }
    const bool whole = shadowed.size() == report.components.size();
    if (!shadowed.empty()) {
      PluginRefusal passed{file, "shadowed",
                           join(shadowed, ", ") + " come" + (shadowed.size() == 1 ? "s" : "") + " from " +
                               join(std::vector<std::string>(by.begin(), by.end()), ", ") +
                               ", found earlier in the search order (--plugin-dir, LOOM_PLUGIN_PATH, then Loom's own "
                               "plugin folder)" + (whole ? "" : "; the file's other components are used"),
                           whole ? "the copy found first is the one used; remove this one to use the other everywhere"
                                 : "the copy found first is the one used; rename one of the two to have both",
                           {}};
      for (size_t i = 0; i < report.components.size(); ++i)
        if (!used[i]) passed.components.emplace_back(report.components[i].kind, report.components[i].name);
      if (log_refusals_) log::info("plugin ", file.string(), " passed over: ", passed.reason);
      else log::debug("plugin ", file.string(), " passed over: ", passed.reason);
      if (whole) report.refusal = passed;
      passed_over_.push_back(std::move(passed));
      if (whole) return report;
    }
    auto plugin = std::make_shared<LoadedPlugin>();
    plugin->file = file;
    plugin->name = report.plugin_name;
    plugin->version = report.plugin_version;
    plugin->sdk_version = report.fingerprint.count("sdk") ? report.fingerprint["sdk"] : "";
    plugin->library = library;  // null until materialize() when registered from the scan
    plugins_.push_back(plugin);
    for (size_t i = 0; i < report.components.size(); ++i) {
      report.components[i].plugin = plugin;
      if (used[i]) components_.push_back(report.components[i]);
    }
    report.accepted = true;
    log::debug("plugin ", plugin->name, " ", plugin->version, library ? " loaded from " : " registered from the scan of ",
               file.string(), " (", report.components.size(), " component(s))");
  } catch (const PluginRefused& r) {  // (a link in a plugin folder is named as the user put it there)
    const bool linked = file != file_in && file != fs::absolute(file_in, ec).lexically_normal();
    refuse(report, r.stage, linked ? r.reason + " (found as " + file_in.string() + ")" : r.reason, r.hint);
  }
  return report;
}

const ComponentInfo* PluginRegistry::find(uint32_t kind, std::string_view name) const {
  for (const auto& c : components_)
    if (c.kind == kind && c.name == name) return &c;
  return nullptr;
}

const ComponentInfo& PluginRegistry::require(uint32_t kind, std::string_view name) const {
  if (const ComponentInfo* c = find(kind, name)) return *c;
  const std::string what = kind_name(kind) + " '" + std::string(name) + "'";
  // Refused? Either it declared the component, or its file is named after it.
  const std::string expected_file = "libloom_" + kind_name(kind) + "_" + std::string(name) + ".so";
  for (const auto& r : refusals_) {
    const bool declared = std::find(r.components.begin(), r.components.end(),
                                    std::make_pair(kind, std::string(name))) != r.components.end();
    if (declared || r.file.filename() == expected_file)
      throw Error(what + " is not available: its plugin was refused. " + r.line());
  }
  std::vector<std::string> names;
  for (const auto& c : components_)
    if (c.kind == kind) names.push_back(c.name);
  std::string message = "no " + what + " in the loaded plugins.";
  if (auto close = closest(std::string(name), names)) message += " Did you mean '" + *close + "'?";
  message += names.empty() ? " No " + kind_name(kind) + " plugin is loaded."
                           : " Available: " + join(names, ", ") + ".";
  std::vector<std::string> dirs;
  for (const auto& d : searched_) dirs.push_back(d.string());
  if (!dirs.empty()) message += " Searched: " + join(dirs, ", ") + ".";
  message += " Add a folder with --plugin-dir or LOOM_PLUGIN_PATH; `loom plugins` lists what loaded.";
  throw Error(message);
}

void PluginRegistry::check_interface(const ComponentInfo& info, uint32_t host_major) const {
  if (info.interface_major != host_major)
    throw Error(kind_name(info.kind) + " '" + info.name + "' implements interface " +
                std::to_string(info.interface_major) + ".x, the host needs " +
                std::to_string(host_major) + ".x");
}

void PluginRegistry::materialize(const ComponentInfo& info) const {
  LoadedPlugin& plugin = *info.plugin;
  const std::string what = kind_name(info.kind) + " '" + info.name + "'";
  LoadReport fresh;
  fresh.file = plugin.file;
  std::shared_ptr<boost::dll::shared_library> library;
  try {
    library = load_in_process(plugin.file, fresh);
  } catch (const PluginRefused& r) {
    forget_scan(plugin.file);  // (the next command scans it again, and says what it finds)
    throw Error(what + " cannot be loaded: " + PluginRefusal{plugin.file, r.stage, r.reason, r.hint, {}}.line() +
                " (the scanner had accepted the file: did it change since?)");
  }
  // Every component registered from the scan must be in the file now. The registry's own
  // records gain their function tables; they are not const, only this method is.
  for (const ComponentInfo& registered : components_) {
    if (registered.plugin.get() != &plugin) continue;
    auto it = std::find_if(fresh.components.begin(), fresh.components.end(),
                           [&](const ComponentInfo& c) { return c.kind == registered.kind && c.name == registered.name; });
    if (it == fresh.components.end()) {
      forget_scan(plugin.file);  // (its cached report named it: "run the command again" met the same report)
      throw Error(what + ": " + plugin.file.string() + " no longer provides " + kind_name(registered.kind) + " '" +
                  registered.name + "' (the file changed since it was scanned); run the command again");
    }
    const_cast<ComponentInfo&>(registered).raw = it->raw;
  }
  plugin.library = library;
  log::debug("plugin ", plugin.name, " ", plugin.version, " loaded from ", plugin.file.string(), " for ", what);
}

void* PluginRegistry::create_raw(const ComponentInfo& info,
                                 const std::map<std::string, std::string>& values) const {
  if (info.raw == nullptr) materialize(info);
  std::vector<std::string> keys, texts;
  for (const auto& spec : info.options) {
    auto it = values.find(spec.key);
    keys.push_back(spec.key);
    texts.push_back(it != values.end() ? it->second : spec.default_value);
  }
  for (const auto& entry : values) {
    const std::string& key = entry.first;  // a plain reference: clang 14 cannot capture a structured binding
    if (std::none_of(info.options.begin(), info.options.end(),
                     [&](const OptionSpec& s) { return s.key == key; }))
      throw Error(kind_name(info.kind) + " '" + info.name + "' has no option '" + key + "'");
  }
  std::vector<loom_option_value> raw;
  for (size_t i = 0; i < keys.size(); ++i) raw.push_back({keys[i].c_str(), texts[i].c_str()});
  loom_create_args args{sizeof(loom_create_args), static_cast<uint32_t>(raw.size()), raw.data()};
  loom_error error{};
  error.struct_size = sizeof(loom_error);
  error.capacity = LOOM_ERROR_CAPACITY;
  void* object = nullptr;
  try {
    const CrashContext creating(("creating " + kind_name(info.kind) + " '" + info.name + "' of " + info.plugin->file.string()).c_str());
    object = info.raw->create(&args, &error);
  } catch (...) {
    throw ContractBroken(kind_name(info.kind) + " '" + info.name + "' (" + info.plugin->file.string() +
                "): its factory threw across the C boundary; the plugin must be rebuilt with "
                "LOOM_PLUGIN");
  }
  if (object == nullptr) {
    error.message[LOOM_ERROR_CAPACITY - 1] = '\0';
    std::string reason = error.message[0] ? error.message : "its factory gave no reason";
    if (reason == "std::bad_alloc") reason = "not enough host memory for it (std::bad_alloc)";
    if (reason.rfind(info.name + ": ", 0) == 0) reason.erase(0, info.name.size() + 2);  // named once, here
    throw Error(kind_name(info.kind) + " '" + info.name + "' could not be created: " + reason + " (plugin " +
                info.plugin->file.string() + ")");
  }
  return object;
}

void PluginRegistry::check_options(const ComponentInfo& info, const std::map<std::string, std::string>& values) const {
  const KindInfo* kind = find_kind(info.kind);
  if (kind != nullptr && !info.c_tier()) check_interface(info, kind->interface_major);  // C tier: checked at load
  void* object = create_raw(info, values);
  info.raw->destroy(object);
}

}  // namespace loom::core
