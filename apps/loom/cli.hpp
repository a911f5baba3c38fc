// The loom command line: the command table and the options every command shares.
#pragma once

#include <loom/core/config.hpp>
#include <loom/core/plugin_registry.hpp>

#include <boost/program_options.hpp>

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

namespace loom::core {
class Trainer;
}  // namespace loom::core

namespace loom::cli {

namespace po = boost::program_options;

/// What a command gets: its parsed options and its positional arguments.
struct Invocation {
  po::variables_map options;
  std::vector<std::string> args;  ///< positional arguments after the command name
  std::vector<std::string> command_line;  ///< every argument after the command name, as given
};

struct Command {
  const char* name;
  const char* summary;
  const char* usage;  ///< "loom plugins [inspect FILE]"
  bool takes_run_config;  ///< accepts --config, --set and the seed-style aliases
  std::function<void(po::options_description&)> add_options;
  std::function<int(const Invocation&)> run;
};

/// All commands, in the order `loom --help` lists them.
const std::vector<Command>& commands();

/// The options of every command (--help, --log-level, --plugin-dir).
po::options_description global_options();
/// A command's options under `caption`: its own, the run configuration's (--config, --set, the
/// seed-style aliases) where it takes one, and those of every command.
po::options_description command_options(const Command& command, const std::string& caption);
/// `args` (the command line less the command's name) as `command` reads them, the positional
/// ones under "args"; throws po::error where they are not its options.
/// `args` with the seeds' Python spellings of the command's flags (--batch_size, --no_amp) written
/// with dashes, in a flag's name only, up to a lone -- (after it: another command's words).
std::vector<std::string> dashed_flags(const Command& command, const std::vector<std::string>& args);
po::variables_map parse_command_line(const Command& command, const std::vector<std::string>& args);

/// --config, --set and the aliases, applied in precedence order to a Config.
core::Config config_from(const po::variables_map& options);

/// An exception's text for the command's error line: a LibTorch error without its backtrace, a
/// filesystem error in plain words (loom::explained), any other one's what().
std::string message_of(const std::exception& e);

/// For the refusal of the positional argument `refused`: where it follows a seed-style switch on the
/// command line (`--use-scheduler maybe`, `--no-amp false`), "; --use-scheduler is a switch ...
/// --set trainer.use_scheduler=maybe"; otherwise empty. A switch takes no value, so its would-be
/// value lands among the arguments.
std::string switch_value_hint(const Invocation& invocation, const std::string& refused);

/// A registry that has scanned the search path (plus --plugin-dir).
void scan_plugins(core::PluginRegistry& registry, const po::variables_map& options,
                  bool log_refusals = true);

/// The checkpoint a command names, by --checkpoint PATH or as its only argument; it must exist.
/// A run folder names its newest step folder; a file in a step folder, that folder.
std::filesystem::path checkpoint_path(const Invocation& invocation);

/// The configuration a checkpoint was trained with (its run's model and data, and its precision
/// where it runs here), then the user's files and flags over it: what `loom eval` and `loom
/// recommend` build. `changed` gets each model and data key the user set to another value than
/// the checkpoint's.
core::Config checkpoint_config(const Invocation& invocation, const std::filesystem::path& checkpoint,
                               const core::PluginRegistry& registry, std::vector<std::string>& changed);

/// trainer.load_weights(checkpoint); a refusal names the keys in `changed` (checkpoint_config's).
void load_weights(core::Trainer& trainer, const std::filesystem::path& checkpoint, const std::vector<std::string>& changed);

/// A folder of its own under the system's temporary folder (mkdtemp: never a folder a crashed
/// earlier command left under the same name), removed with everything in it when this goes out
/// of scope, on success, on an error and on a stop by signal alike: the runs `loom bench` and
/// `loom profile` train for their timings are not the user's to keep.
class ScratchFolder {
 public:
  explicit ScratchFolder(const std::string& prefix);  ///< "loom-bench": /tmp/loom-bench-XXXXXX
  ~ScratchFolder();
  ScratchFolder(const ScratchFolder&) = delete;
  ScratchFolder& operator=(const ScratchFolder&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

/// The settings of a scratch run of `command` (loom bench, loom profile) over `config`: its work
/// folder, `steps` steps, no resume and no callbacks (their hooks are loom train's: a bench or a
/// profile runs steps alone, and listed callbacks read as run). A value the user gave to one of
/// these is said not to be used (`--set trainer.max_steps=abc` was accepted in silence).
void set_scratch_run(core::Config& config, const std::string& command, const std::filesystem::path& work, int64_t steps);

/// After core::install_stop_signals(false): throws core::StoppedBySignal (main exits 128 + the
/// signal) once a stop signal has come, naming `command` ("loom bench").
void stop_if_signalled(const std::string& command);

int cmd_plugins(const Invocation& invocation);
int cmd_config(const Invocation& invocation);
int cmd_train(const Invocation& invocation);
int cmd_eval(const Invocation& invocation);
int cmd_recommend(const Invocation& invocation);
int cmd_launch(const Invocation& invocation);
int cmd_memory(const Invocation& invocation);
int cmd_doctor(const Invocation& invocation);
int cmd_bench(const Invocation& invocation);
int cmd_profile(const Invocation& invocation);

}  // namespace loom::cli
