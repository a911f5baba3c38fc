// `loom plugins`: what loaded and what was refused; `loom plugins inspect FILE`: one file's
// descriptor and options, as far as the loader could read it; `loom plugins check FILE`: the
// conformance suite of each of its components (core/conformance.hpp), pass or fail per check.
#include "cli.hpp"
#include "plugins_check_child.hpp"

#include <loom/core/child_process.hpp>
#include <loom/core/conformance.hpp>
#include <loom/core/error.hpp>
#include <loom/core/kinds.hpp>
#include <loom/core/text.hpp>
#include <loom/sdk/options.hpp>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iomanip>
#include <fcntl.h>
#include <iostream>
#include <stdlib.h>
#include <unistd.h>

namespace loom::cli {

namespace {

std::string shorten(const std::filesystem::path& file) {
  std::error_code ec;
  // lexically: a symbolic link is shown by its own name, not its target's
  const auto rel = std::filesystem::absolute(file, ec).lexically_relative(std::filesystem::current_path(ec));
  if (!ec && !rel.empty() && rel.native().size() < file.native().size()) return rel.string();
  return file.string();
}

void print_table(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width;
  for (const auto& row : rows)
    for (size_t i = 0; i < row.size(); ++i) {
      if (width.size() <= i) width.push_back(0);
      width[i] = std::max(width[i], row[i].size());
    }
  for (const auto& row : rows) {
    for (size_t i = 0; i < row.size(); ++i) {
      std::cout << row[i];
      if (i + 1 < row.size()) std::cout << std::string(width[i] - row[i].size() + 2, ' ');
    }
    std::cout << "\n";
  }
}

void print_options(const core::ComponentInfo& c) {
  if (c.options.empty()) {
    std::cout << "    (no options)\n";
    return;
  }
  std::vector<std::vector<std::string>> rows;
  for (const auto& o : c.options) {
    std::string type = sdk::type_name(o.type);
    if (o.type == LOOM_OPTION_ENUM) type += " (" + o.choices + ")";
    if ((o.type == LOOM_OPTION_INT || o.type == LOOM_OPTION_FLOAT) && (o.min || o.max)) {
      type += ' ';  // appended: GCC 12's -Wrestrict misreads " " + std::string&& (bug 105329)
      type += core::range_text(o);
    }
    rows.push_back({"    " + o.key, type, o.default_value.empty() ? "-" : o.default_value, o.help});
  }
  print_table(rows);
}

/// The file `loom plugins inspect` reads: the argument when it names a file, else the plugin
/// that provides a component of that name (`loom plugins inspect adamw`).
std::filesystem::path inspected_file(const Invocation& invocation) {
  const std::string& arg = invocation.args[1];
  const std::string verb = "loom plugins " + invocation.args[0];
  std::error_code ec;
  if (std::filesystem::exists(arg, ec) || arg.find('/') != std::string::npos || arg.ends_with(".so")) return arg;
  core::PluginRegistry registry;
  scan_plugins(registry, invocation.options, /*log_refusals=*/false);
  std::vector<std::filesystem::path> files;
  for (const auto& c : registry.components())
    if (c.name == arg && std::find(files.begin(), files.end(), c.plugin->file) == files.end())
      files.push_back(c.plugin->file);
  if (files.size() == 1) return files.front();
  if (files.empty())
    throw Error(verb + ": '" + arg + "' is neither a file nor the name of a loaded component; "
                "`loom plugins` lists the components and their files");
  throw Error(verb + ": several plugins provide a component '" + arg + "' (" + files[0].string() +
              ", " + files[1].string() + "); give the file");
}

/// The components of `file` that another plugin on the search path (or --plugin-dir) also
/// provides: the file loads alone, but a run that finds both uses one only. Whichever of the two
/// the scan of the search path took, the other is in its refusals or passed over. A clash is a
/// file of the same folder (a run refuses one); another copy of the same file (an older build
/// installed, a newer one here) or a file of another folder (one replaces the other) is a note.
struct Clashes {
  std::vector<std::string> clashes, copies;
};

Clashes clashes(const Invocation& invocation, const std::filesystem::path& file,
                const std::vector<core::ComponentInfo>& components) {
  core::PluginRegistry others;
  scan_plugins(others, invocation.options, /*log_refusals=*/false);
  std::error_code ec;
  const auto self = std::filesystem::weakly_canonical(file, ec);
  Clashes out;
  auto add = [&](const core::ComponentInfo& c, const std::filesystem::path& other) {
    if (std::filesystem::weakly_canonical(other, ec) == self) return;
    const std::string what = core::kind_name(c.kind) + " '" + c.name + "'";
    const char* order = "a run takes each component from the file it finds first (--plugin-dir, LOOM_PLUGIN_PATH, then "
                        "Loom's own plugin folder)";
    if (other.filename() == file.filename())
      out.copies.push_back(what + ": another copy of this plugin is at " + other.string() + "; " + order);
    // Two files of one folder: a run refuses the second, a defect to fix. In two folders, the one
    // searched first replaces the other (a user's own `progress`): said, for a name taken by mistake.
    else if (std::filesystem::weakly_canonical(other, ec).parent_path() == self.parent_path())
      out.clashes.push_back(what + " is also provided by " + other.string() +
                            ", in the same folder: a run refuses the second of the two it finds; rename the component");
    else
      out.copies.push_back(what + " is also provided by " + other.string() + "; " + order +
                           ", so one replaces the other: rename the component unless that is what you mean");
  };
  for (const auto& c : components) {
    if (const core::ComponentInfo* other = others.find(c.kind, c.name)) add(c, other->plugin->file);
    for (const auto* list : {&others.refusals(), &others.passed_over()})
      for (const auto& r : *list)
        if ((r.stage == "register" || r.stage == "shadowed") &&
            std::find(r.components.begin(), r.components.end(), std::make_pair(c.kind, c.name)) != r.components.end())
          add(c, r.file);
  }
  return out;
}

int inspect(const Invocation& invocation) {
  if (invocation.args.size() != 2)
    throw Error("usage: loom plugins inspect FILE|COMPONENT (a plugin's .so file, or a component's name)");
  const std::filesystem::path file = inspected_file(invocation);
  core::PluginRegistry registry;
  registry.set_log_refusals(false);
  const auto report = registry.load(file);
  std::cout << "file:      " << core::printable(report.file.string(), 4096) << "\n";
  if (!report.plugin_name.empty())
    std::cout << "plugin:    " << report.plugin_name << " " << report.plugin_version << "\n";
  for (const auto& [field, value] : report.fingerprint)
    std::cout << "  " << std::left << std::setw(18) << field << value << "\n";
  const Clashes clashing = report.accepted ? clashes(invocation, file, report.components) : Clashes{};
  std::cout << "status:    "
            << (!report.accepted ? "refused" : clashing.clashes.empty() ? "accepted" : "accepted alone; clashes with another plugin on the search path (below)")
            << "\n";
  if (report.refusal) {
    std::cout << "  stage:   " << report.refusal->stage << "\n  reason:  " << core::printable(report.refusal->reason, 1 << 16)
              << "\n";
    if (!report.refusal->hint.empty()) std::cout << "  hint:    " << core::printable(report.refusal->hint, 1 << 16) << "\n";
  }
  for (const auto& line : clashing.clashes) std::cout << "  clash:   " << core::printable(line, 1 << 16) << "\n";
  for (const auto& line : clashing.copies) std::cout << "  note:    " << core::printable(line, 1 << 16) << "\n";
  for (const auto& c : report.components) {
    std::cout << "\n" << core::kind_name(c.kind) << " '" << c.name << (c.c_tier() ? "' (C interface " : "' (interface ")
              << c.interface_major << "." << c.interface_minor << "): " << c.summary << "\n";
    print_options(c);
  }
  return report.accepted && clashing.clashes.empty() ? 0 : 1;
}

const char* outcome_word(core::ConformanceCheck::Outcome o) {
  return o == core::ConformanceCheck::Outcome::kPass ? "pass" : o == core::ConformanceCheck::Outcome::kFail ? "FAIL" : "skip";
}

int check(const Invocation& invocation) {
  // (in the child: its pipe to the parent is not for the scanner, nor a process a plugin starts;
  // and it goes with its parent from before it loads plugin code: "FIRST:PARENT:SCRATCH")
  if (const char* child = std::getenv(kCheckChildVariable); child != nullptr) {
    ::fcntl(kCheckChildFd, F_SETFD, FD_CLOEXEC);
    const char* parent = std::strchr(child, ':');
    if (parent != nullptr && std::atoi(parent + 1) > 0 && ::getppid() == std::atoi(parent + 1))
      core::end_with_parent(std::atoi(parent + 1));
  }
  if (invocation.args.size() != 2)
    throw Error("usage: loom plugins check FILE|COMPONENT [--dataset NAME] [--set SECTION.COMPONENT.OPTION=VALUE]... (a "
                "plugin's .so file, or a component's name)");
  const std::filesystem::path file = inspected_file(invocation);
  core::PluginRegistry registry;
  registry.set_log_refusals(false);
  const auto loaded = registry.load(file);
  if (!loaded.accepted) {
    std::cout << core::printable(file.string(), 4096) << ": refused at stage " << loaded.refusal->stage << ": "
              << core::printable(loaded.refusal->reason, 1 << 16) << "\n";
    if (!loaded.refusal->hint.empty()) std::cout << "  hint: " << core::printable(loaded.refusal->hint, 1 << 16) << "\n";
    return 1;
  }
  scan_plugins(registry, invocation.options, /*log_refusals=*/false);  // the datasets a model is checked with
  core::ConformanceOptions options;
  if (invocation.options.count("dataset")) {
    options.dataset = invocation.options["dataset"].as<std::string>();
    registry.require(LOOM_KIND_DATASET, options.dataset);  // a name no plugin has: one error, as `loom train` gives it
  }
  // A component's options (a dataset of the user's files needs its folder): the skip said "check it
  // with its options", and nothing took them.
  if (invocation.options.count("set"))
    for (const auto& assignment : invocation.options["set"].as<std::vector<std::string>>()) {
      const size_t eq = assignment.find('='), first = assignment.find('.'), last = assignment.rfind('.', eq);
      if (eq == std::string::npos || first == std::string::npos || first == last || last > eq)
        throw Error("--set '" + assignment + "': loom plugins check takes a component's option as "
                    "SECTION.COMPONENT.OPTION=VALUE, e.g. data.my_dataset.root=/data");
      const std::string section = assignment.substr(0, first);
      const std::string component = assignment.substr(first + 1, last - first - 1);
      const std::string option = assignment.substr(last + 1, eq - last - 1);
      // (a component or an option the file does not have was never applied, and the check passed)
      const auto section_of = [](const core::ComponentInfo& c) {
        const core::KindInfo* kind = core::find_kind(c.kind);
        return kind != nullptr ? std::string(kind->section) : std::string();
      };
      auto it = std::find_if(loaded.components.begin(), loaded.components.end(), [&](const core::ComponentInfo& c) {
        return c.name == component && section_of(c) == section;
      });
      if (const auto other = std::find_if(loaded.components.begin(), loaded.components.end(),
                                          [&](const core::ComponentInfo& c) { return c.name == component; });
          it == loaded.components.end() && other != loaded.components.end())
        throw Error("--set " + assignment + ": '" + component + "' is a " + core::kind_name(other->kind) +
                    ", whose options are " + section_of(*other) + "." + component + ".OPTION");
      std::vector<std::string> names;
      if (it == loaded.components.end()) {
        for (const auto& c : loaded.components) names.push_back(c.name);
        throw Error("--set " + assignment + ": " + file.string() + " has no component '" + component + "' (it has " +
                    core::join(names, ", ") + ")");
      }
      for (const auto& o : it->options) names.push_back(o.key);
      if (std::find(names.begin(), names.end(), option) == names.end()) {
        const auto close = core::closest(option, names);
        throw Error("--set " + assignment + ": '" + component + "' has no option '" + option + "'" +
                    (close           ? "; did you mean '" + *close + "'?"
                     : names.empty() ? std::string(" (it has none)")
                                     : " (it has " + core::join(names, ", ") + ")"));
      }
      options.options[component][option] = assignment.substr(eq + 1);
    }
  double seconds = 300;  // a check: the longest in-tree one takes seconds on a loaded CPU
  if (invocation.options.count("check-timeout")) {
    const std::string given = invocation.options["check-timeout"].as<std::string>();
    const auto parsed = sdk::parse_float(given);
    if (!parsed || !(*parsed >= 1 && *parsed <= 86400))
      throw Error("--check-timeout " + given + ": give the seconds one check may take, from 1 to 86400 (default 300)");
    seconds = *parsed;
  }
  const char* child = std::getenv(kCheckChildVariable);
  if (child != nullptr) return run_check_child(registry, file, options, child);
  // (with the user's scan cache)
  const Clashes clashing = clashes(invocation, file, loaded.components);
  std::cout << "plugin " << loaded.plugin_name << " " << loaded.plugin_version << " (" << core::printable(file.string(), 4096) << ")\n" << std::flush;
  int passed = 0, failed = 0, skipped = 0;
  if (!clashing.clashes.empty() || !clashing.copies.empty()) {
    std::cout << "\nthe plugin's names\n";
    for (const auto& line : clashing.clashes) std::cout << "  FAIL  unique name: " << core::printable(line, 1 << 16) << "\n";
    for (const auto& line : clashing.copies) std::cout << "  note  " << core::printable(line, 1 << 16) << "\n";
    failed += static_cast<int>(clashing.clashes.size());
  }
  // Each component's checks as its suite ends (a later one that hangs or crashes loses none).
  options.on_report = [&](const core::ConformanceReport& r) {
    std::cout << "\n" << r.kind << " '" << r.component << "'" << (r.context.empty() ? "" : " (" + r.context + ")") << "\n";
    for (const auto& c : r.checks) {
      std::cout << "  " << outcome_word(c.outcome) << "  " << c.name << (c.reason.empty() ? "" : ": " + c.reason) << "\n";
      (c.outcome == core::ConformanceCheck::Outcome::kPass ? passed : c.outcome == core::ConformanceCheck::Outcome::kFail ? failed : skipped)++;
    }
    std::cout << std::flush;
  };
  // In a child process, so that a check which hangs is stopped and one which crashes fails alone;
  // where none can start, here.
  if (!check_in_children(loaded.plugin_name, seconds, options.on_report)) {
    // Components that cache answers (auto_batch) write to a scratch folder, not the user's cache
    // (nothing reads that cache after the checks: it is not set back).
    const ScratchFolder scratch("loom-check");
    ::setenv("LOOM_CACHE", scratch.path().c_str(), 1);
    core::check_plugin(registry, file, options);
  }
  // (every check skipped, none passed: nothing is known, and a CI gate took it for "conforms")
  const bool unchecked = failed == 0 && passed == 0;
  std::cout << "\n" << passed + failed + skipped << " checks: " << passed << " passed, " << failed << " failed, " << skipped
            << " skipped"
            << (failed      ? ""
                : unchecked ? "; nothing was checked: give what the skipped ones need (--set SECTION.COMPONENT.OPTION=VALUE)"
                            : "; the plugin conforms")
            << "\n";
  return failed || unchecked ? 1 : 0;
}

}  // namespace

int cmd_plugins(const Invocation& invocation) {
  // (`loom plugins --check-timeout 0` was taken, and did nothing)
  if (invocation.args.empty() || invocation.args[0] != "check")
    for (const char* option : {"dataset", "set", "check-timeout"})
      if (invocation.options.count(option))
        throw Error(std::string("--") + option + " is an option of loom plugins check FILE; `loom plugins" +
                    (invocation.args.empty() ? "" : " " + invocation.args[0]) + "` takes none");
  if (!invocation.args.empty()) {
    if (invocation.args[0] == "inspect") return inspect(invocation);
    if (invocation.args[0] == "check") return check(invocation);
    throw Error("loom plugins: unknown argument '" + invocation.args[0] +
                "'; use `loom plugins`, `loom plugins inspect FILE` or `loom plugins check FILE`");
  }
  core::PluginRegistry registry;
  scan_plugins(registry, invocation.options, /*log_refusals=*/false);

  std::vector<std::vector<std::string>> rows = {{"KIND", "NAME", "VERSION", "FILE", "SUMMARY"}};
  std::vector<const core::ComponentInfo*> sorted;
  for (const auto& c : registry.components()) sorted.push_back(&c);
  std::stable_sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) {
    return a->kind != b->kind ? a->kind < b->kind : a->name < b->name;
  });
  for (const auto* c : sorted)
    rows.push_back({core::kind_name(c->kind), c->name, c->plugin->version,
                    core::printable(c->plugin->file.filename().string(), 256), c->summary});
  print_table(rows);
  std::cout << "\n" << sorted.size() << " component(s) from " << registry.plugins().size()
            << " plugin file(s).";
  std::vector<std::string> folders;  // (in the order searched: the first file found of a component is used)
  if (invocation.options.count("plugin-dir"))
    for (const auto& dir : invocation.options["plugin-dir"].as<std::vector<std::string>>())
      folders.push_back(shorten(dir) + " (--plugin-dir)");
  for (const auto& dir : core::PluginRegistry::search_path({})) folders.push_back(shorten(dir));
  std::cout << " Searched: " << core::join(folders, ", ") << "\n";
  if (!registry.passed_over().empty()) {
    std::cout << "\nPassed over (" << registry.passed_over().size() << "):\n";
    for (const auto& r : registry.passed_over())
      std::cout << "  " << core::printable(shorten(r.file), 4096) << "\n    " << core::printable(r.reason, 1 << 16) << "\n";
  }
  if (!registry.refusals().empty()) {
    std::cout << "\nRefused (" << registry.refusals().size() << "):\n";
    for (const auto& r : registry.refusals()) {
      std::cout << "  " << core::printable(shorten(r.file), 4096) << "\n    [" << r.stage << "] " << core::printable(r.reason, 1 << 16) << "\n";
      if (!r.hint.empty()) std::cout << "    hint: " << core::printable(r.hint, 1 << 16) << "\n";
    }
  }
  return 0;
}

}  // namespace loom::cli
