// Finding configuration files: a path, or one of Loom's configurations by its bare name, in
// LOOM_CONFIG_PATH's folders and <prefix>/share/loom/configs.
#include <loom/core/config.hpp>
#include <loom/core/error.hpp>
#include <loom/core/log.hpp>
#include <loom/core/text.hpp>
#include <loom/sdk/files.hpp>

#include <algorithm>
#include <cstdlib>
#include <set>
#include <sstream>

namespace fs = std::filesystem;

namespace loom::core {

std::vector<fs::path> config_search_path() {
  std::vector<fs::path> dirs;
  if (const char* env = std::getenv("LOOM_CONFIG_PATH")) {
    std::stringstream in(env);
    static std::set<std::string> said;  // (once per entry: the path is searched for each base = NAME)
    for (std::string item; std::getline(in, item, ':');) {
      if (item.empty()) continue;
      // (a file or a missing folder was listed among those "searched", in silence, as LOOM_PLUGIN_PATH's are not)
      if (const std::string what = sdk::what_is_at(item); what == "a folder") dirs.emplace_back(item);
      else if (!said.insert(item).second) continue;
      else if (what == "no such file") log::warn("LOOM_CONFIG_PATH's ", item, ": no such folder; it is passed over");
      else
        log::warn("LOOM_CONFIG_PATH's ", item, what.rfind("cannot", 0) == 0 ? " " : " is ", what.empty() ? "a file" : what,
                  ", not a folder of configurations; it is passed over");
    }
  }
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) dirs.push_back((exe.parent_path() / ".." / "share" / "loom" / "configs").lexically_normal());
  return dirs;
}

std::optional<fs::path> shipped_config(const std::string& name) {
  std::error_code ec;
  for (const fs::path& dir : config_search_path())
    for (const fs::path& candidate : {dir / name, dir / (name + ".ini")})
      if (fs::is_regular_file(candidate, ec)) return candidate;
  return std::nullopt;
}

std::string shipped_hint(const fs::path& file) {
  // (`-c configs/debug.ini`, README's command, run outside Loom's checkout: the installed one is found by name)
  if (file.extension() != ".ini" || !file.has_parent_path() || file.is_absolute()) return "";
  const auto shipped = shipped_config(file.stem().string());
  std::error_code ec;
  return shipped ? " (from " + fs::current_path(ec).string() + "); Loom's own " + file.filename().string() + " is " +
                       shipped->string() + ", given by its name alone: " + file.stem().string()
                 : "";
}

fs::path find_config(const std::string& name) {
  if (name.empty()) throw Error("a configuration's name is empty: name a file, or one of Loom's configurations (debug, fashion_mnist, ...)");
  std::error_code ec;
  // A file here, or a path (load_file reports what is wrong with it); `cfg/named` is cfg/named.ini
  // where only that is there, as `base = named` finds it beside a file.
  // (a folder named so, `-c cfg/exp` beside cfg/exp/ and cfg/exp.ini, is no configuration: the .ini is meant)
  if (fs::is_regular_file(name, ec)) return name;
  if (name.find('/') != std::string::npos)
    return (!fs::exists(fs::symlink_status(name, ec)) || fs::is_directory(name, ec)) && fs::is_regular_file(name + ".ini", ec)
               ? name + ".ini"
               : name;
  if (auto shipped = shipped_config(name)) {
    // (a `base = debug` beside a debug.ini takes that file: here the name is Loom's, so say which)
    if (const fs::path here = name + ".ini"; fs::is_regular_file(here, ec) && !fs::equivalent(here, *shipped, ec))
      log::warn("config '", name, "' is Loom's ", shipped->string(), ", not ", here.string(), " here; give -c ./", here.string(),
                " for that one");
    return *shipped;
  }
  std::vector<std::string> available, searched;
  for (const fs::path& dir : config_search_path()) {
    searched.push_back(dir.string());
    for (const auto& entry : fs::directory_iterator(dir, ec))
      if (entry.path().extension() == ".ini") available.push_back(entry.path().stem().string());
  }
  // Something here that is not a regular file (a FIFO; a folder, where no name.ini is beside it): load_file says what it is.
  if (fs::exists(fs::symlink_status(name, ec)) && !(fs::is_directory(name, ec) && fs::is_regular_file(name + ".ini", ec)))
    return name;
  std::sort(available.begin(), available.end());
  std::string message = "config file '" + name + "' not found: not a file here, and not one of Loom's configurations";
  if (!available.empty()) message += " (" + join(available, ", ") + ")";
  if (!searched.empty()) message += " in " + join(searched, ", ");
  message += "; give a path, or add a folder to LOOM_CONFIG_PATH";
  if (auto close = closest(name, available)) message += ". Did you mean '" + *close + "'?";
  throw Error(message);
}

}  // namespace loom::core
