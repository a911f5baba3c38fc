// loom: parse the command line, run the command, report errors. The commands live in cmd_*.cpp.
#include "cli.hpp"

#include <loom/core/crash_report.hpp>
#include <loom/core/error.hpp>
#include <loom/core/link_check.hpp>
#include <loom/core/log.hpp>
#include <loom/core/stop_signals.hpp>
#include <loom/core/text.hpp>
#include <loom/sdk/version.hpp>


#include <algorithm>
#include <csignal>
#include <cstring>
#include <cstdio>
#include <cerrno>
#include <cstdlib>
#include <exception>
#include <fcntl.h>
#include <iostream>
#include <string>
#include <unistd.h>

namespace po = boost::program_options;

namespace {

void print_usage(std::ostream& out) {
  out << "loom " LOOM_SDK_VERSION " - train models on LibTorch with run-time plugins\n\n"
      << "Usage: loom <command> [options]\n\nCommands:\n";
  for (const auto& c : loom::cli::commands())
    out << "  " << c.name << std::string(10 - std::min<size_t>(9, std::strlen(c.name)), ' ')
        << c.summary << "\n";
  out << "\n" << loom::cli::global_options() << "\n`loom <command> --help` shows a command's options.\n";
}

/// What to write instead of an unknown flag (`--batch-siz`, `--d_model` of a model, the seeds'
/// `--gpu-ids`, `--options k=v`): the closest of the command's flags, or where the setting is.
std::string unknown_flag_hint(const std::string& given, const po::options_description& described) {
  std::string name = given.rfind("--", 0) == 0 ? given.substr(2) : given.rfind('-', 0) == 0 ? given.substr(1) : given;
  std::replace(name.begin(), name.end(), '_', '-');
  if (name == "gpu-ids" || name == "gpus" || name == "gpu")
    return "\nThe device is trainer.device (--set trainer.device=cuda:1); several devices: --set parallel.name=data_parallel "
           "--set parallel.devices=cuda:0,cuda:1, or loom launch for ddp";
  if (name == "options" || name == "cfg-options")
    return "\nA setting by its key: --set section.key=value (repeatable; `loom config keys` lists the keys)";
  std::vector<std::string> flags;
  for (const auto& option : described.options())
    if (!option->long_name().empty()) flags.push_back(option->long_name());
  if (name == "data-dir" || name == "data-path" || name == "data-root")
    return "\nThe data's folder is a dataset's own option: --set data.path=DIR (fashion_mnist), data.root (movielens)";
  if (const auto close = loom::core::closest(name, flags)) return "\nDid you mean --" + *close + "?";
  return "\nA component's option has no flag: --set section.key=value (`loom config keys` lists the keys)";
}

}  // namespace

namespace {

// Note [A library that fails as it loads]
// A shared library whose start-up throws ends the process before main: PyTorch's allocator reads
// PYTORCH_CUDA_ALLOC_CONF as libc10_cuda loads, and a malformed value ("garbage", "a:b,c") fails
// an internal assert there, so every command, `loom doctor` and `--help` included, ended in
// std::terminate's "terminate called after throwing an instance of 'c10::Error'" and a stack
// trace (a probe; `python -c "import torch"` ends the same way). The executable's .preinit_array
// runs before any shared library's initializers: from there a terminate handler says what failed
// and names the settings read at that moment. main puts the previous handler back.
std::terminate_handler previous_terminate = nullptr;

[[noreturn]] void library_failed_to_start() {
  std::string what = "an exception that is not a std::exception";
  try {
    if (const std::exception_ptr thrown = std::current_exception()) std::rethrow_exception(thrown);
    what = "std::terminate without an exception";
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
  }
  what = what.substr(0, std::min<size_t>(what.find('\n'), 400));  // (its first line: c10's messages carry a backtrace)
  std::fprintf(stderr, "loom: could not start: its start-up failed before loom ran (in a library it loads, as a rule): %s\n",
               what.c_str());
  for (const char* variable : {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"})
    if (const char* value = std::getenv(variable); value != nullptr)
      std::fprintf(stderr,
                   "  %s = '%.200s': PyTorch's allocator reads it as it loads, as key:value pairs separated by commas "
                   "(expandable_segments:True,max_split_size_mb:128); correct it, or unset it\n",
                   variable, value);
  std::fflush(stderr);
  std::_Exit(1);
}

void before_the_libraries(int, char**, char**) { previous_terminate = std::set_terminate(library_failed_to_start); }

__attribute__((section(".preinit_array"), used)) void (*const loom_preinit)(int, char**, char**) = before_the_libraries;

int run_loom(int argc, char** argv) {
  std::set_terminate(previous_terminate);  // See Note [A library that fails as it loads]
  loom::core::install_crash_report("loom");
  loom::core::report_exit_calls();
  // A file-size limit (`ulimit -f`) ends a process at its first write past it (SIGXFSZ), without a
  // word and with the file cut; ignored, such a write fails (EFBIG) and is said as a full disk is.
  std::signal(SIGXFSZ, SIG_IGN);
  // Note [libstdc++ first] (cmake/LoomTorch.cmake): where std::filesystem went to a LibTorch copy,
  // torch 2.11's crashes the first time a folder is removed. Say so before that happens.
  if (const std::string provider = loom::core::std_filesystem_provider();
      loom::core::is_libtorch_library(provider))
    loom::core::log::warn("std::filesystem resolves to ", provider,
                          ", LibTorch's copy, not libstdc++'s: this loom was linked with LibTorch before libstdc++ and may crash "
                          "when it removes a folder; rebuild it with Loom's CMake files (`loom doctor` shows the row)");
  std::vector<std::string> args(argv + 1, argv + argc);
  // The command is the first argument that is not an option (or the value of --log-level /
  // --plugin-dir given before it).
  std::string command_name;
  size_t command_at = args.size();
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--log-level" || args[i] == "--plugin-dir" || args[i] == "--log_level" || args[i] == "--plugin_dir") {
      ++i;
      continue;
    }
    if (!args[i].empty() && args[i][0] != '-') { command_name = args[i]; command_at = i; break; }
  }
  if (command_name.empty()) {
    const bool version = std::find(args.begin(), args.end(), "--version") != args.end();
    if (version) { std::cout << "loom " LOOM_SDK_VERSION "\n"; return 0; }
    const bool help = args.empty() || std::find(args.begin(), args.end(), "--help") != args.end() ||
                      std::find(args.begin(), args.end(), "-h") != args.end();
    print_usage(help ? std::cout : std::cerr);
    return help ? 0 : 2;
  }
  const loom::cli::Command* command = nullptr;
  for (const auto& c : loom::cli::commands())
    if (command_name == c.name) command = &c;
  if (command == nullptr) {
    std::vector<std::string> names;
    for (const auto& c : loom::cli::commands()) names.emplace_back(c.name);
    std::cerr << "loom: unknown command '" << command_name << "'";
    if (auto close = loom::core::closest(command_name, names)) std::cerr << "; did you mean '" << *close << "'?";
    std::cerr << "\nRun `loom --help` for the list of commands.\n";
    return 2;
  }

  const po::options_description described = loom::cli::command_options(*command, std::string("Usage: ") + command->usage);
  args.erase(args.begin() + static_cast<std::ptrdiff_t>(command_at));
  args = loom::cli::dashed_flags(*command, args);  // (--batch_size as --batch-size, for all that reads the words)
  loom::cli::Invocation invocation;
  invocation.command_line = args;
  try {
    invocation.options = loom::cli::parse_command_line(*command, args);
  } catch (const po::error& e) {
    // `loom launch --nproc-per-node 2 train -c x`: the command's own options need a -- before it.
    std::string hint;
    if (std::string(command->name) == "launch" && std::find(args.begin(), args.end(), "--") == args.end())
      for (size_t i = 0; i < args.size() && hint.empty(); ++i)
        if (!args[i].empty() && args[i][0] != '-' && (i == 0 || args[i - 1].rfind("--", 0) != 0 || args[i - 1].find('=') != std::string::npos))
          hint = "\nPut -- before the command each process runs: loom launch [launch options] -- " + args[i] + " ...";
    if (const auto* unknown = dynamic_cast<const po::unknown_option*>(&e); unknown != nullptr && hint.empty())
      hint = unknown_flag_hint(unknown->get_option_name(), described);
    // (`--top 9223372036854775808`: "is invalid", without why; a whole number past int64's range)
    if (const std::string what = e.what(); hint.empty() && dynamic_cast<const po::invalid_option_value*>(&e) != nullptr) {
      const size_t from = what.find("('"), to = what.find("')");
      const std::string value = from != std::string::npos && to != std::string::npos && to > from ? what.substr(from + 2, to - from - 2) : "";
      const size_t digits = value.find_first_not_of("+-") == std::string::npos ? 0 : value.find_first_not_of("+-");
      if (!value.empty() && digits <= 1 && value.size() > digits &&
          value.find_first_not_of("0123456789", digits) == std::string::npos && value.size() - digits > 18)
        hint = "\n" + value + " is past the 64-bit integers (-9223372036854775808 to 9223372036854775807)";
    }
    std::cerr << "loom " << command->name << ": " << e.what() << hint << "\nRun `loom " << command->name
              << " --help` for its options.\n";
    return 2;
  }
  if (invocation.options.count("help")) {
    std::cout << command->summary << "\n\n" << described << "\n";
    return 0;
  }
  if (invocation.options.count("args"))
    invocation.args = invocation.options["args"].as<std::vector<std::string>>();

  try {
    loom::core::init_logging(invocation.options["log-level"].as<std::string>());
    return command->run(invocation);
  } catch (const loom::core::StoppedBySignal& stopped) {  // loom bench, loom profile: nothing of theirs to keep
    loom::core::log::warn(stopped.what());
    return 128 + stopped.signal;
  } catch (const std::exception& e) {
    // (LibTorch's own errors carry a C++ backtrace in what(): message_of gives what users need)
    loom::core::log::error(loom::cli::message_of(e));
    return 1;
  } catch (...) {  // (`throw 42;` in a plugin: std::terminate otherwise)
    loom::core::log::error("loom ", command->name, ": a plugin threw a value that is not an exception (not derived from "
                           "std::exception), so what failed is unknown",
                           std::string_view(command->name) == "train" ? "; the checkpoints written before it stand" : "",
                           ". A plugin reports a failure by throwing loom::sdk::Error");
    return 1;
  }
}

}  // namespace

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define LOOM_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define LOOM_SANITIZED 1
#endif
#endif
#ifndef LOOM_SANITIZED
#define LOOM_SANITIZED 0
#endif

namespace {

bool stdout_was_closed = false;

/// Standard streams the shell closed (`loom doctor >&-`) get a stand-in before anything opens a
/// file: the next file opened took descriptor 1, and the report went into it (a scan cache, a
/// pipe). A closed stdout gets /dev/full, so that what is printed there fails, and is said.
void stand_in_for_closed_streams() {
  for (const int fd : {STDIN_FILENO, STDOUT_FILENO, STDERR_FILENO}) {
    if (::fcntl(fd, F_GETFD) != -1 || errno != EBADF) continue;
    const int opened = ::open(fd == STDOUT_FILENO ? "/dev/full" : "/dev/null", fd == STDIN_FILENO ? O_RDONLY : O_WRONLY);
    if (opened >= 0 && opened != fd) {  // (the lowest free descriptor is the closed one; else placed there)
      ::dup2(opened, fd);
      ::close(opened);
    }
    if (fd == STDOUT_FILENO) stdout_was_closed = true;
  }
}

/// A report that could not be written (a full disk, a closed stdout) ended with status 0 and no
/// word: the status says so now, and stderr why.
int check_output(int status) {
  std::cout.flush();
  errno = 0;
  const bool failed = std::cout.fail() || std::fflush(stdout) != 0 || std::ferror(stdout);
  if (!failed) return status;
  const int error = errno;
  std::cerr << "loom: could not write to the standard output"
            << (stdout_was_closed ? std::string(" (it was closed)")
                : error != 0      ? std::string(" (") + std::strerror(error) + ")"
                                  : std::string())
            << ": what the command printed there is incomplete\n";
  return status == 0 ? 1 : status;
}

}  // namespace

int main(int argc, char** argv) {
  stand_in_for_closed_streams();
  const int status = check_output(run_loom(argc, argv));
#if LOOM_SANITIZED
  loom::core::command_returning();
  return status;  // the sanitizers' leak check runs in exit()
#else
  // Note [Leaving without the libraries' destructors]
  // Everything Loom wrote is closed by now (the command's objects are gone). What exit() would
  // still run are the shared libraries' own destructors, and those of LibTorch's CUDA libraries
  // page in about 110 MiB on the way out (measured: the resident set went from 504 to 616 MiB
  // inside _dl_fini, after the run's last line), which made the end of every command the peak
  // of its memory. The streams are flushed and the process ends here.
  loom::core::log::flush();
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  std::_Exit(status);
#endif
}
