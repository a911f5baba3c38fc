// Stop signals (stop_signals.cpp): SIGINT, SIGTERM, SIGHUP and SIGPIPE end a run gracefully.
#pragma once

#include <loom/core/error.hpp>

#include <string>

namespace loom::core {

/// SIGINT, SIGTERM, SIGHUP and SIGPIPE stop training gracefully: the first makes Trainer::train stop after the
/// step it is in (no further evaluation), write a checkpoint through the callbacks and return
/// with TrainSummary::signal set; a second ends the process at once (stop_signals.cpp; a
/// SIGPIPE is never the second). `on_stop` is what the first signal's message promises: a
/// checkpoint; none (a run whose trainer.callbacks has no `checkpoint`); or nothing at all, the
/// command's runs being scratch (loom bench, loom profile), which checks stop_signal_received() itself.
enum class OnStop { kCheckpoint, kNoCheckpoint, kScratch };
void install_stop_signals(OnStop on_stop = OnStop::kCheckpoint);

/// The folder a stop at once (the second signal) removes as it ends the process, as the first
/// signal's message promised of a scratch run; "" for none.
void note_scratch_folder(const std::string& path);
/// A file a stop at once removes too, with its name + ".tmp" (loom profile's trace while it is
/// written, under a name of its own: a stop then left 96 MB behind); "" for none.
void note_scratch_file(const std::string& path);
/// The process group of a child that runs in a group of its own (core::run_child_process), which a
/// stop at once kills before it ends this process (a Ctrl-C no longer reaches that group); 0 for none.
/// While one is noted, Ctrl-Z (SIGTSTP) stops that group before this process, and SIGCONT (`fg`)
/// continues it.
void note_child_group(int group);
/// How many times this process was continued (SIGCONT) after a Ctrl-Z while a child group was
/// noted: a child's time limit does not count the pause.
int job_continuations();
/// What a stop at once (the second SIGINT or SIGTERM) prints as it ends the process: where the run
/// stands and how to continue it, `saved` once a checkpoint of the run was written (this command's,
/// or one it resumed from: note_checkpoint_written), `unsaved` before; "" for nothing. (Under
/// `loom launch` the ranks but rank 0 print neither this nor the signals' other messages: the
/// launcher shows every rank's output, and the same lines came once per rank.)
void note_stop_at_once(const std::string& saved, const std::string& unsaved);
void note_checkpoint_written();
/// The first stop signal received, or 0.
int stop_signal_received();
/// A signal's name: "SIGTERM", "SIGSEGV", ...; "signal 40" for one without a name.
std::string signal_name(int sig);
/// Whether `sig` is one a crashing process gets (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL): its
/// crash report went to stderr, where other endings (SIGTERM, SIGKILL) came from outside.
bool is_crash_signal(int sig);

/// While it lives, a SIGINT, SIGTERM or SIGHUP ends the process at once, by that signal, after
/// printing `message` (a string literal: the handler prints it): for a wait that checks no flag and
/// has nothing to save (a rank joining the others, parallel.timeout long). A signal received before
/// it is made throws StoppedBySignal naming `during`, as set-up's other checks do.
class StopAtOnce {
 public:
  StopAtOnce(const char* message, const std::string& during);
  ~StopAtOnce();
  StopAtOnce(const StopAtOnce&) = delete;
  StopAtOnce& operator=(const StopAtOnce&) = delete;
};

/// While one lives (a run's set-up), loom::sdk::stop_requested() tells plugins of a stop signal,
/// so long work of theirs (a catalogue's text encoded through GPT-2) ends when it is asked to.
class PluginsSeeStops {
 public:
  PluginsSeeStops();
  ~PluginsSeeStops();
  PluginsSeeStops(const PluginsSeeStops&) = delete;
  PluginsSeeStops& operator=(const PluginsSeeStops&) = delete;
};

/// A stop signal ended what was running before it finished: set-up (Trainer::setup, before the
/// first step: nothing trained, nothing to checkpoint) or an evaluation. `signal` is the signal.
class StoppedBySignal : public Error {
 public:
  StoppedBySignal(int sig, const std::string& what) : Error(what), signal(sig) {}
  int signal;
};

}  // namespace loom::core
