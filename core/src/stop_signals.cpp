// A graceful stop on SIGINT and SIGTERM (Slurm and preemptible machines send SIGTERM before they
// kill a job), SIGHUP (the terminal or ssh session that started the run closed) and SIGPIPE (the
// reader of the run's output went away: `loom train | head`, a `tee` that died): the first signal
// asks the training loop to stop after the step it is in, which then writes a checkpoint and
// reports; a second signal ends the process at once. SIGPIPE never counts as the second: once the
// reader is gone every write to it raises one more, and the checkpoint must still be written
// (those writes fail with EPIPE instead, and the output is lost, not the run).
#include <loom/core/trainer.hpp>

#include <atomic>
#include <csignal>
#include <cstring>
#include <unistd.h>

namespace loom::core {

namespace {

std::atomic<int> received{0};

void on_signal(int sig) {
  if (sig == SIGPIPE) {  // no message: standard error may be the pipe that closed
    int none = 0;
    received.compare_exchange_strong(none, SIGPIPE);
    return;
  }
  if (received.exchange(sig) != 0) {  // the second one: the default action, now
    std::signal(sig, SIG_DFL);
    std::raise(sig);
    return;
  }
  static const char message[] =
      "\nloom: stopping after the current step (a checkpoint is written); send the signal again to stop at once\n";
  const ssize_t written = ::write(STDERR_FILENO, message, sizeof message - 1);
  (void)written;
}

}  // namespace

void install_stop_signals() {
  struct sigaction action {};
  action.sa_handler = &on_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGHUP, &action, nullptr);
  sigaction(SIGPIPE, &action, nullptr);
}

int stop_signal_received() { return received.load(); }

std::string signal_name(int sig) {
  if (sig == SIGINT) return "SIGINT";
  if (sig == SIGTERM) return "SIGTERM";
  if (sig == SIGHUP) return "SIGHUP";
  if (sig == SIGPIPE) return "SIGPIPE";
  return "signal " + std::to_string(sig);
}

}  // namespace loom::core
