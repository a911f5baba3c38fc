// The command table and the helpers commands share.
#include "cli.hpp"

#include <loom/core/config.hpp>
#include <loom/core/error.hpp>
#include <loom/core/files.hpp>
#include <loom/core/log.hpp>
#include <loom/core/text.hpp>
#include <loom/core/stop_signals.hpp>
#include <loom/sdk/files.hpp>
#include <loom/sdk/options.hpp>

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <map>
#include <new>
#include <set>
#include <sstream>
#include <utility>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

namespace loom::cli {

const std::vector<Command>& commands() {
  static const std::vector<Command> table = {
      {"train", "train a model (default: the lightweight transformer on Fashion-MNIST)",
       "loom train [-c FILE]... [--set section.key=value]... [--resume auto]", true,
       [](po::options_description& d) {
         d.add_options()("resume", po::value<std::string>()->value_name("auto"),
                         "auto: continue the newest checkpoint of the run (of the newest run without --set trainer.name)");
       },
       cmd_train},
      {"eval", "evaluate a checkpoint on the test split", "loom eval [--checkpoint] PATH [-c FILE] [--set ...]", true,
       [](po::options_description& d) {
         d.add_options()("checkpoint", po::value<std::string>()->value_name("PATH"),
                         "a step folder (runs/<name>/checkpoints/step_...), a run folder (its newest step) or a "
                         "best_*.safetensors file; the result is printed on stdout");
       },
       cmd_eval},
      {"recommend", "a recommender checkpoint's top items for a user (their known items left out)",
       "loom recommend [--checkpoint] PATH --user ID [--top 10] [-c FILE] [--set ...]", true,
       [](po::options_description& d) {
         d.add_options()("checkpoint", po::value<std::string>()->value_name("PATH"),
                         "a step folder (runs/<name>/checkpoints/step_...), a run folder (its newest step) or a "
                         "best_*.safetensors file")(
             "user", po::value<std::string>()->value_name("ID"), "the user, by the data's own id")(
             "top", po::value<int64_t>()->default_value(10), "items listed");
       },
       cmd_recommend},
      {"launch", "start this node's processes of a multi-process job (parallel = ddp), watch them, stop all if one fails",
       "loom launch --nproc-per-node N [--nnodes M --node-rank R --master-addr HOST --master-port P] -- train ...",
       false,
       [](po::options_description& d) {
         d.add_options()("nproc-per-node", po::value<int64_t>()->required(), "processes on this node (one per GPU)")(
             "nnodes", po::value<int64_t>()->default_value(1), "nodes in the job")(
             "node-rank", po::value<int64_t>()->default_value(0), "this node's place, 0 ... nnodes - 1")(
             "master-addr", po::value<std::string>()->default_value("127.0.0.1"), "rank 0's host, as every node reaches it")(
             "master-port", po::value<int64_t>()->default_value(0),
             "rank 0's port (0: a free one, on one node only)")(
             "grace", po::value<double>()->default_value(10.0),
             "seconds the others get to stop (SIGTERM) when one rank failed, before SIGKILL (a Ctrl-C or SIGTERM "
             "to the launcher goes on to every rank, with no deadline: a second stops them at once)");
       },
       cmd_launch},
      {"memory", "estimate a run's memory per device, or suggest the batch that fits a target",
       "loom memory estimate [-c FILE] [--devices N] [--batch B] | loom memory suggest --target 8GiB [--devices N] [--batch B]",
       true,
       [](po::options_description& d) {
         d.add_options()("devices", po::value<int64_t>()->default_value(1), "devices the batch is spread over")(
             "batch", po::value<int64_t>(), "global batch: estimate's (default: trainer.batch_size); suggest: the plan of it that fits (without "
                             "it, suggest answers the largest batch that fits, whatever trainer.batch_size is)")(
             "target", po::value<std::string>()->value_name("SIZE"), "suggest: memory per device, e.g. 8GiB");
       },
       cmd_memory},
      {"bench", "run configurations for a few steps each and compare batch, memory and speed",
       "loom bench configs A.ini B.ini ... [--steps 100] [--repeats 1]", true,
       [](po::options_description& d) {
         d.add_options()("steps", po::value<int64_t>()->default_value(100), "steps per configuration")(
             "repeats", po::value<int64_t>()->default_value(1),
             "rounds, each running every configuration once in order; medians, ranges and each round's ratio "
             "to the first configuration");
       },
       cmd_bench},
      {"profile", "profile training steps: a Chrome trace with Loom's phases, the top operators by self time",
       "loom profile [-c FILE]... [--set ...] [--steps 20] [--warmup 5] [--trace PATH] [--top 25] [--shapes] [--memory]",
       true,
       [](po::options_description& d) {
         d.add_options()("steps", po::value<int64_t>()->default_value(20), "profiled training steps")(
             "warmup", po::value<int64_t>()->default_value(5), "steps run before profiling starts")(
             "trace", po::value<std::string>()->value_name("PATH"),
             "the Chrome trace to write (default: loom-profile-<time>.json here); never replaced")(
             "top", po::value<int64_t>()->default_value(25), "operators listed")(
             "shapes", po::bool_switch(), "one row per operator and input shapes (`aten::mm [2048, 96], [96, 288]`)")(
             "memory", po::bool_switch(),
             "record every allocation and free (in the trace too) and list the operators that allocate the most");
       },
       cmd_profile},
      {"doctor", "what this machine offers: devices, memory, versions, TF32/bf16 support", "loom doctor", false,
       nullptr, cmd_doctor},
      {"plugins", "list the loaded components and the refused plugin files; inspect or check one plugin",
       "loom plugins [inspect FILE|COMPONENT | check FILE|COMPONENT [--dataset NAME] [--set SECTION.COMPONENT.OPTION=VALUE]... [--check-timeout SECONDS]]", false,
       [](po::options_description& d) {
         d.add_options()("dataset", po::value<std::string>(),
                         "check: the dataset a model is checked with (default: its plugin's own, else the first of synthetic, "
                         "synthetic_tokens, fashion_mnist it accepts)")(
             "set", po::value<std::vector<std::string>>()->composing(),
             "check: an option a component is built with, e.g. data.my_dataset.root=/data (repeatable)")(
             "check-timeout", po::value<std::string>(),
             "check: the seconds one check may take before it is stopped and failed (default 300); the checks run in a "
             "child process, and one that hangs or crashes fails alone");
       },
       cmd_plugins},
      {"config", "show the merged run configuration and where each value comes from, or every key it accepts",
       "loom config [show|keys] [-c FILE] [--set section.key=value] ... [--resume auto]", true,
       [](po::options_description& d) {
         d.add_options()("resume", po::value<std::string>()->value_name("auto"),
                         "auto: what `loom train --resume auto` would train with (the run's own settings where this "
                         "command leaves them out)");
       },
       cmd_config},
  };
  return table;
}

po::options_description global_options() {
  po::options_description global("Options of every command");
  global.add_options()
      ("help,h", "show help (of the command, after its name)")
      ("log-level", po::value<std::string>()->default_value("info"),
       "trace, debug, info, warn, error or off")
      ("plugin-dir", po::value<std::vector<std::string>>()->composing(),
       "another folder (or file) of plugins, searched before LOOM_PLUGIN_PATH and Loom's own; repeatable");
  return global;
}

po::options_description run_config_options() {
  po::options_description run("Run configuration");
  run.add_options()
      ("config,c", po::value<std::vector<std::string>>()->composing(),
       "INI file (may name `base = other.ini`); repeatable, later wins")
      ("set", po::value<std::vector<std::string>>()->composing(),
       "section.key=value, applied last; repeatable");
  po::options_description seeds("Seed-style flags (aliases of keys)");
  for (const auto& alias : loom::core::aliases()) {
    const std::string help = std::string(alias.help) + " [" + alias.key + "]";
    if (alias.switch_to != nullptr)
      seeds.add_options()(alias.flag, help.c_str());
    else
      seeds.add_options()(alias.flag, po::value<std::string>()->value_name("V"), help.c_str());
  }
  run.add(seeds);
  return run;
}

po::options_description command_options(const Command& command, const std::string& caption) {
  po::options_description described(caption);
  po::options_description own("Options");
  if (command.add_options) command.add_options(own);
  if (!own.options().empty()) described.add(own);
  if (command.takes_run_config) described.add(run_config_options());
  described.add(global_options());
  return described;
}

std::vector<std::string> dashed_flags(const Command& command, const std::vector<std::string>& args) {
  const po::options_description all = command_options(command, "");
  std::vector<std::string> words = args;
  for (auto& word : words) {
    if (word == "--") break;
    if (word.rfind("--", 0) != 0) continue;
    const size_t end = std::min(word.find('='), word.size());
    std::string name = word.substr(2, end - 2);
    if (name.find('_') == std::string::npos) continue;
    std::replace(name.begin(), name.end(), '_', '-');
    if (all.find_nothrow(name, /*approx=*/false) != nullptr) word = "--" + name + word.substr(end);
  }
  return words;
}

po::variables_map parse_command_line(const Command& command, const std::vector<std::string>& args) {
  po::options_description all;
  all.add(command_options(command, "")).add_options()("args", po::value<std::vector<std::string>>()->composing(), "");
  po::positional_options_description positional;
  positional.add("args", -1);
  const std::vector<std::string> words = dashed_flags(command, args);
  // No guessing from a prefix: `--batch-siz 8` was --batch-size, `--resume auto` became
  // --resume-from on a command without --resume, in silence (an unknown flag is said, with the
  // closest one: main.cpp).
  const int style = po::command_line_style::default_style & ~po::command_line_style::allow_guessing;
  po::variables_map options;
  po::store(po::command_line_parser(words).options(all).positional(positional).style(style).run(), options);
  // A path's leading ~ after '=' (--checkpoint=~/x) is not the shell's to expand: it is the home folder here too.
  for (const char* path : {"checkpoint", "trace", "resume"})
    if (options.count(path)) options.at(path).value() = core::home_expanded(options[path].as<std::string>(), true);
  for (const char* paths : {"config", "plugin-dir"})
    if (options.count(paths)) {
      auto& all = boost::any_cast<std::vector<std::string>&>(options.at(paths).value());
      for (auto& p : all) p = core::home_expanded(p, /*alone_too=*/std::string(paths) == "plugin-dir");
    }
  if (!options.count("help")) po::notify(options);  // (`launch --help` needs no --nproc-per-node)
  return options;
}

core::Config config_from(const po::variables_map& options) {
  core::Config config;
  if (options.count("config"))
    for (const auto& file : options["config"].as<std::vector<std::string>>()) config.load_file(core::find_config(file));
  // A key given twice on the command line: --set wins over a flag, a later --set over an earlier
  // one, and the value replaced is never checked, so a mistyped one would pass unseen: said (once
  // per process: `loom bench` reads the command line once per file and repeat).
  static std::set<std::string> warned;
  std::map<std::string, std::vector<std::pair<std::string, std::string>>> given_as;  // key: (value, as given), in order
  auto replacing = [&](const std::string& key, const std::string& value, const std::string& given) {
    given_as[key].emplace_back(value, given);
  };
  auto flag = [&](const std::string& key, const std::string& value, const std::string& given) {
    replacing(key, value, given);
    config.set(key, value, core::Origin{given.substr(0, given.find(' ')), {}, 0});
  };
  for (const auto& alias : core::aliases()) {
    if (!options.count(alias.flag)) continue;
    if (alias.switch_to != nullptr) {
      flag(alias.key, alias.switch_to, std::string("--") + alias.flag);
    } else {
      const std::string value = options[alias.flag].as<std::string>();
      flag(alias.key, value, std::string("--") + alias.flag + " " + value);
    }
  }
  if (options.count("resume")) {  // loom train's
    const std::string value = options["resume"].as<std::string>();
    flag("trainer.resume", value, "--resume " + value);
  }
  if (options.count("set"))
    for (const auto& assignment : options["set"].as<std::vector<std::string>>()) {
      if (const auto eq = assignment.find('='); eq != std::string::npos)
        replacing(std::string(sdk::trim(assignment.substr(0, eq))), std::string(sdk::trim(assignment.substr(eq + 1))),
                  "--set " + assignment);
      config.set_assignment(assignment);
    }
  for (const auto& [key, all] : given_as) {
    std::vector<std::string> how, lost;
    for (const auto& [value, given] : all) {
      how.push_back(given);
      if (value != all.back().first && std::find(lost.begin(), lost.end(), value) == lost.end()) lost.push_back(value);
    }
    if (lost.empty() || !warned.insert(key).second) continue;
    core::log::warn(key, " is given ", all.size() == 2 ? std::string("twice") : std::to_string(all.size()) + " times",
                    " on the command line (", core::join(how, ", "), "): ", all.back().first,
                    " is used (--set wins over a flag, a later --set over an earlier one), ", core::join(lost, ", "),
                    lost.size() == 1 ? " is not" : " are not");
  }
  return config;
}

void scan_plugins(core::PluginRegistry& registry, const po::variables_map& options, bool log_refusals) {
  // A folder, or a plugin file; anything else (a FIFO, /dev/zero) is passed over, and said.
  const auto check = [](const std::string& given, const std::string& dir) {
    if (const std::string what = sdk::what_is_at(dir); what == "no such file")
      core::log::warn(given, ": no such folder or file; no plugin is loaded from it");
    else if (!what.empty() && what != "a folder")
      core::log::warn(given, what.rfind("cannot", 0) == 0 ? " " : " is ", what,
                      ", not a folder or a plugin file; no plugin is loaded from it");
  };
  if (const char* env = std::getenv("LOOM_PLUGIN_PATH")) {
    std::stringstream entries(env);
    for (std::string dir; std::getline(entries, dir, ':');)
      if (!dir.empty()) check("LOOM_PLUGIN_PATH's " + dir, dir);
  }
  std::vector<std::filesystem::path> extra;
  if (options.count("plugin-dir"))
    for (const auto& dir : options["plugin-dir"].as<std::vector<std::string>>()) {
      check("--plugin-dir " + dir, dir);
      extra.emplace_back(dir);
    }
  registry.set_log_refusals(log_refusals);
  registry.scan(core::PluginRegistry::search_path(extra));
}

std::string switch_value_hint(const Invocation& invocation, const std::string& refused) {
  const auto& line = invocation.command_line;
  for (size_t i = 1; i < line.size(); ++i) {
    if (line[i] != refused) continue;
    for (const auto& alias : core::aliases())
      if (alias.switch_to != nullptr && line[i - 1] == std::string("--") + alias.flag)
        return "; " + line[i - 1] + " is a switch: it sets " + alias.key + " = " + alias.switch_to +
               " and takes no value; to give one, --set " + alias.key + "=" + line[i];
  }
  return {};
}

std::string message_of(const std::exception& e) {
  if (const auto* torch = dynamic_cast<const c10::Error*>(&e)) return loom::explained(*torch);
  if (const auto* file = dynamic_cast<const std::filesystem::filesystem_error*>(&e)) return loom::explained(*file);
  // (`loom profile --memory` of 1000 steps under `ulimit -v 4G` ended in "std::bad_alloc" alone)
  if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr && dynamic_cast<const std::bad_array_new_length*>(&e) == nullptr) {
    rlimit space{};
    if (::getrlimit(RLIMIT_AS, &space) == 0 && space.rlim_cur != RLIM_INFINITY)
      return "the host refused memory (" + std::string(e.what()) + ") within this process's `ulimit -v " +
             std::to_string(space.rlim_cur / 1024) + "` (" + core::format_bytes(static_cast<int64_t>(space.rlim_cur)) +
             " of address space): raise the limit, or ask for less (a smaller batch, fewer loader workers)";
    return "the host's memory ran out (" + std::string(e.what()) + "): free memory, or ask for less (a smaller batch, "
           "fewer loader workers)";
  }
  return e.what();
}

void stop_if_signalled(const std::string& command) {
  if (const int sig = core::stop_signal_received())
    throw core::StoppedBySignal(sig, command + ": stopped by " + core::signal_name(sig) +
                                         "; nothing is reported, and its scratch runs are removed");
}

void set_scratch_run(core::Config& config, const std::string& command, const std::filesystem::path& work, int64_t steps) {
  const std::pair<const char*, std::string> settings[] = {{"trainer.work_dir", work.string()},
                                                          {"trainer.max_steps", std::to_string(steps)},
                                                          // (an epochs given was said unused "... set trainer.max_steps = 0 to
                                                          // train by epochs", which a scratch run cannot)
                                                          {"trainer.epochs", "0"},
                                                          {"trainer.resume", "none"},
                                                          {"trainer.resume_from", ""},
                                                          {"trainer.callbacks", ""},
                                                          {"trainer.init_from", ""}};  // (the weights time nothing)
  for (const auto& [key, value] : settings) {
    // (from the command line: a configuration file's max_steps or callbacks are its own run's)
    static std::set<std::string> said;  // (once, not for each configuration of a bench)
    if (const core::ConfigValue* given = config.find(key); given != nullptr && given->value != value &&
        given->origin.source != "file" && given->origin.source != "default" && said.insert(key).second)
      core::log::warn(command, " sets ", key, (std::string(key) == "trainer.max_steps" ? " from --steps" : ""),
                      ": the value given, '", given->value, "' (", given->origin.describe(), "), is not used",
                      std::string(key) == "trainer.callbacks" ? " (a scratch run's steps run without callbacks)" : "");
    config.set(key, value, {command, {}, 0});
  }
}

namespace {

constexpr const char* kScratchOwner = ".loom-scratch-owner";

/// "BOOT PIDNS PID START" of process `pid`: the machine's boot (/proc/sys/kernel/random/boot_id: a
/// TMPDIR other machines share, on NFS, holds their folders too; another boot's processes are
/// gone, but a TMPDIR kept across boots is not this Loom's to clear), its pid namespace (as
/// /proc/self/ns/pid names it), and its start in clock ticks since boot (which tells a pid reused
/// by another process apart); or empty.
std::string process_identity(const std::string& pid) {
  std::ifstream in("/proc/" + pid + "/stat");
  const std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t close = stat.rfind(')');  // (after the command's name, which may hold spaces)
  if (close == std::string::npos) return {};
  std::istringstream fields(stat.substr(close + 1));
  std::string field;
  for (int i = 3; i <= 22 && (fields >> field); ++i) {  // the 22nd field: starttime
  }
  char ns[128] = {};
  if (::readlink("/proc/self/ns/pid", ns, sizeof ns - 1) < 0) return {};
  std::ifstream boot_file("/proc/sys/kernel/random/boot_id");
  std::string boot;
  if (!(boot_file >> boot)) return {};
  return boot + " " + std::string(ns) + " " + pid + " " + field;
}

/// Scratch folders of this user that a loom killed at once (SIGKILL: no clean-up of its) left in
/// `folder`: each holds an owner file naming a process of this pid namespace that has ended.
void remove_scratch_of_ended_processes(const std::filesystem::path& folder) {
  std::error_code ec;
  for (std::filesystem::directory_iterator it(folder, ec), end; !ec && it != end; it.increment(ec)) {
    const std::filesystem::path dir = it->path();
    struct stat st {};
    if (dir.filename().string().rfind("loom-", 0) != 0 || ::lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) ||
        st.st_uid != ::geteuid())
      continue;
    std::ifstream owner(dir / kScratchOwner);
    std::string boot, ns, pid, start;
    if (!(owner >> boot >> ns >> pid >> start) || pid.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string mine = process_identity(std::to_string(::getpid()));
    // (another machine's, another boot's, another pid namespace's: whether its process runs is not known here)
    if (mine.empty() || mine.rfind(boot + " " + ns + " ", 0) != 0) continue;
    if (process_identity(pid) == boot + " " + ns + " " + pid + " " + start) continue;  // (it runs)
    std::error_code removed;
    std::filesystem::remove_all(dir, removed);
    if (!removed) core::log::debug("removed ", dir.string(), ", a scratch folder its loom (pid ", pid, ") left when it was killed");
  }
}

}  // namespace

ScratchFolder::ScratchFolder(const std::string& prefix) {
  remove_scratch_of_ended_processes(core::temp_folder());
  std::string pattern = (core::temp_folder() / (prefix + "-XXXXXX")).string();
  if (::mkdtemp(pattern.data()) == nullptr)
    throw Error("cannot make a scratch folder " + pattern + ": " + std::strerror(errno) +
                " (TMPDIR chooses where; point it at a writable folder)");
  path_ = pattern;
  core::note_scratch_folder(path_.string());
  // (for a later loom to remove it, where this one is killed at once)
  if (std::ofstream owner(path_ / kScratchOwner); owner) owner << process_identity(std::to_string(::getpid())) << "\n";
}

ScratchFolder::~ScratchFolder() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
  core::note_scratch_folder("");  // (after: a stop at once during the removal still removes the rest)
}

}  // namespace loom::cli
