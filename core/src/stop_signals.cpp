// A graceful stop on SIGINT and SIGTERM (Slurm and preemptible machines send SIGTERM before they
// kill a job), SIGHUP (the terminal or ssh session that started the run closed) and SIGPIPE (the
// reader of the run's output went away: `loom train | head`, a `tee` that died): the first signal
// asks the training loop to stop after the step it is in, which then writes a checkpoint and
// reports (during set-up, before the first step, it ends set-up at its next check: Trainer::setup);
// a second SIGINT or SIGTERM ends the process at once.
//   - SIGPIPE and SIGHUP never count as the second: once the reader is gone every write raises one
//     more SIGPIPE (those writes fail with EPIPE instead: the output is lost, not the run), and a
//     closing ssh session sends SIGHUP twice (bash to its jobs, then the kernel to the terminal's
//     foreground group), a few milliseconds apart.
//   - A SIGPIPE is no reason to kill at once on the next signal: a SIGINT or SIGTERM after it
//     counts as the first (it says so, and the checkpoint is still written).
//   - A second SIGTERM within 2 s of the first is the same stop: a scheduler signals every process
//     of a job, and `loom launch` passes its copy on to the ranks too.
//   - SIGHUP and SIGPIPE ignored on entry stay ignored: `nohup loom train` keeps running when its
//     terminal closes, and a service whose manager ignores SIGPIPE (systemd) keeps running when
//     its log's reader restarts.
#include <loom/core/stop_signals.hpp>
#include <loom/sdk/stop.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <signal.h>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string_view>
#include <sys/syscall.h>
#include <unistd.h>

namespace loom::core {

namespace {

std::atomic<int> received{0};
std::atomic<int> promise{0};  // install_stop_signals' argument (an OnStop): what the first signal's message promises
std::atomic<const char*> at_once{nullptr};  // a StopAtOnce's message while one lives
std::atomic<int64_t> first_at{0};           // when the first stop signal came (CLOCK_MONOTONIC, ns)
std::atomic<int> first_from{-1};            // its sender's pid (0: the kernel, a terminal's Ctrl-C)
char scratch_folder[4096] = "";             // a command's scratch folder, removed on a stop at once too
char scratch_file[4096] = "", scratch_file_tmp[4104] = "";  // note_scratch_file's file and its .tmp
// rm's arguments: the folder and the files noted, in that order, each only where noted (made by the
// note functions, outside the handler)
char* rm_argv[] = {const_cast<char*>("rm"), const_cast<char*>("-rf"), const_cast<char*>("--"), nullptr, nullptr, nullptr, nullptr};
std::atomic<bool> has_scratch{false};
std::atomic<bool> has_folder{false}, has_file{false};

void make_rm_argv() {
  has_scratch.store(false);
  int at = 3;
  if (has_folder.load()) rm_argv[at++] = scratch_folder;
  if (has_file.load()) {
    rm_argv[at++] = scratch_file;
    rm_argv[at++] = scratch_file_tmp;
  }
  rm_argv[at] = nullptr;
  has_scratch.store(at > 3);
}
std::atomic<int> child_group{0};  // note_child_group's: a child's process group, killed on a stop at once
char at_once_saved[8192] = "", at_once_unsaved[8192] = "";  // note_stop_at_once's texts
std::atomic<bool> has_note{false};
std::atomic<bool> checkpoint_written{false};
std::atomic<bool> setting_up_now{false};  // a run's set-up (a PluginsSeeStops lives)
std::atomic<bool> quiet{false};          // a rank but its node's first under loom launch: no messages

void say(const char* text, size_t size) {
  if (quiet.load()) return;
  const ssize_t written = ::write(STDERR_FILENO, text, size);
  (void)written;
}

// A stop at once removes the scratch folder the message promised to (it was left in /tmp): by a
// child `rm -rf`. Not fork(): glibc's takes the allocator's locks, which the thread the signal
// interrupted may hold (a deadlock only SIGKILL ends); a raw clone runs no atfork handler, and the
// child only calls execve, with arguments made before any signal.
void remove_scratch_folder() {
  // (first the child that writes there, loom bench's run: the folder removed under a writer was
  // left half, its owner file gone with the first files)
  if (const int group = child_group.load(); group > 0) ::kill(-group, SIGKILL);
  if (!has_scratch.load()) return;
  if (::syscall(SYS_clone, SIGCHLD, 0, 0, 0, 0) == 0) {
    ::execve("/bin/rm", rm_argv, environ);
    ::_exit(127);
  }
}

std::atomic<int> continued{0};  // SIGCONTs while a child group was noted (job_continuations)

void on_job_stop(int) {
  const int saved = errno;
  if (const int group = child_group.load(); group > 0) ::kill(-group, SIGSTOP);
  ::kill(::getpid(), SIGSTOP);  // (this process stops here; a SIGCONT goes on from here)
  errno = saved;
}

void on_job_continue(int) {
  const int saved = errno;
  if (const int group = child_group.load(); group > 0) ::kill(-group, SIGCONT);
  continued.fetch_add(1);
  errno = saved;
}

int64_t now_ns() {  // (clock_gettime is async-signal-safe)
  timespec t{};
  ::clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}

void on_signal(int sig, siginfo_t* info, void*) {
  // (kill() and raise() give their sender; a terminal's Ctrl-C comes from the kernel: 0)
  const int from = info != nullptr && info->si_code <= 0 ? static_cast<int>(info->si_pid) : 0;
  const int before = received.load();
  if (sig == SIGPIPE) {  // no message: standard error may be the pipe that closed
    if (before == 0) received.store(SIGPIPE);
    return;
  }
  if (const char* message = at_once.load(); message != nullptr) {  // (SIGPIPE: above, as ever)
    say(message, ::strlen(message));
    remove_scratch_folder();
    std::signal(sig, SIG_DFL);
    std::raise(sig);
    return;
  }
  if (before != 0 && before != SIGPIPE) {
    if (sig == SIGHUP) return;  // the session's second hang-up: still the graceful stop
    // A scheduler's SIGTERM to every process of a job reaches a rank twice, directly and passed on
    // by `loom launch`, a moment apart: the same stop, not the second that would lose the checkpoint.
    if (sig == SIGTERM && before == SIGTERM && now_ns() - first_at.load() < 2000000000) return;
    // So is a SIGINT sent to every process at once (`pkill -INT loom`, `scancel -s INT`), the
    // launcher's copy a moment after (probe: a rank stopped at once, losing the stop's checkpoint).
    // Twice from one sender (a user's two Ctrl-C, passed on by the launcher) is the second.
    if (sig == SIGINT && before == SIGINT && from != first_from.load() && now_ns() - first_at.load() < 2000000000) {
      static const char same[] = "\nloom: a SIGINT from another process a moment after the first is taken as the same stop; "
                                 "send one again to stop at once\n";
      say(same, sizeof same - 1);
      return;
    }
    if (has_note.load()) {
      const char* note = checkpoint_written.load() ? at_once_saved : at_once_unsaved;
      say(note, ::strlen(note));
    }
    remove_scratch_folder();
    std::signal(sig, SIG_DFL);  // a second SIGINT or SIGTERM: the default action, now
    std::raise(sig);
    return;
  }
  first_at.store(now_ns());  // (before `received`: a second SIGTERM seeing the first sees its time)
  first_from.store(from);
  received.store(sig);
  static const char message[] =
      "\nloom: stopping after the current step, with a checkpoint; send SIGINT or SIGTERM again to stop at once\n";
  static const char setting_up[] =  // (said at step 10 too, where it spoke of set-up)
      "\nloom: stopping the set-up at its next check (no step trained yet: nothing to save); send SIGINT or SIGTERM "
      "again to stop at once\n";
  static const char unsaved[] =
      "\nloom: stopping after the current step; this run writes no checkpoint (trainer.callbacks has no 'checkpoint'), "
      "so it cannot be continued; send SIGINT or SIGTERM again to stop at once\n";
  static const char scratch[] =
      "\nloom: stopping after the current step; the scratch runs are removed; send SIGINT or SIGTERM again to stop at once\n";
  const int on_stop = promise.load();
  const bool saves = on_stop == static_cast<int>(OnStop::kCheckpoint), unsaving = on_stop == static_cast<int>(OnStop::kNoCheckpoint);
  const bool in_setup = setting_up_now.load() && on_stop != static_cast<int>(OnStop::kScratch);
  const char* text = in_setup ? setting_up : saves ? message : unsaving ? unsaved : scratch;
  const size_t size = in_setup ? sizeof setting_up : saves ? sizeof message : unsaving ? sizeof unsaved : sizeof scratch;
  say(text, size - 1);
}

}  // namespace

void install_stop_signals(OnStop on_stop) {
  promise.store(static_cast<int>(on_stop));
  // A rank but the node's first that loom launch started (which shows every rank of its node); a
  // rank started by hand or by another launcher (a node of its own) is the only one its user sees.
  const char* rank = std::getenv("LOCAL_RANK");
  quiet.store(rank != nullptr && *rank != '\0' && std::string_view(rank) != "0" && std::getenv("LOOM_LAUNCH_CHECKED") != nullptr);
  struct sigaction action {};
  action.sa_sigaction = &on_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART | SA_SIGINFO;
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  for (const int sig : {SIGHUP, SIGPIPE}) {
    struct sigaction inherited {};
    if (sigaction(sig, nullptr, &inherited) == 0 && inherited.sa_handler == SIG_IGN) continue;  // nohup, systemd
    sigaction(sig, &action, nullptr);
  }
  // Started with them blocked (a parent's mask survives exec), no stop signal would ever arrive:
  // Ctrl-C and a scheduler's SIGTERM were held for good (probe M). (After the handlers: one held
  // until now is the graceful stop, not the default action.)
  sigset_t stops;
  sigemptyset(&stops);
  for (const int sig : {SIGINT, SIGTERM, SIGHUP, SIGPIPE}) sigaddset(&stops, sig);
  pthread_sigmask(SIG_UNBLOCK, &stops, nullptr);
}

int stop_signal_received() { return received.load(); }

void note_stop_at_once(const std::string& saved, const std::string& unsaved) {
  has_note.store(false);  // (not printed half-copied by a signal now)
  for (auto [text, buffer] : {std::pair{&saved, at_once_saved}, std::pair{&unsaved, at_once_unsaved}}) {
    const size_t n = std::min(text->size(), sizeof at_once_saved - 1);
    std::memcpy(buffer, text->data(), n);
    buffer[n] = '\0';
  }
  has_note.store(!saved.empty() || !unsaved.empty());
}

void note_checkpoint_written() { checkpoint_written.store(true); }

PluginsSeeStops::PluginsSeeStops() {
  setting_up_now.store(true);
  sdk::detail::set_stop_flag(&received);
}
PluginsSeeStops::~PluginsSeeStops() {
  sdk::detail::set_stop_flag(nullptr);
  setting_up_now.store(false);
}

void note_scratch_folder(const std::string& path) {
  has_folder.store(false);
  make_rm_argv();
  if (path.empty() || path.size() >= sizeof scratch_folder) return;
  std::memcpy(scratch_folder, path.c_str(), path.size() + 1);
  has_folder.store(true);
  make_rm_argv();
}

void note_scratch_file(const std::string& path) {
  has_file.store(false);
  make_rm_argv();
  if (path.empty() || path.size() >= sizeof scratch_file) return;
  std::memcpy(scratch_file, path.c_str(), path.size() + 1);
  std::memcpy(scratch_file_tmp, path.c_str(), path.size());
  std::memcpy(scratch_file_tmp + path.size(), ".tmp", 5);
  has_file.store(true);
  make_rm_argv();
}

void note_child_group(int group) {
  // Job control: a child in a group of its own is not in the terminal's foreground group, so Ctrl-Z
  // stopped this process and left the child running (a benchmark's run measuring on, its GPU
  // busy), and `fg` found it at its limit. While one lives, a stop stops its group first, and a
  // continue continues it. (Not where SIGTSTP was ignored: a shell without job control.)
  static struct sigaction tstp_before {}, cont_before {};
  static bool installed = false;
  if (group > 0 && !installed) {
    struct sigaction inherited {};
    if (::sigaction(SIGTSTP, nullptr, &inherited) == 0 && inherited.sa_handler == SIG_DFL) {
      struct sigaction action {};
      sigemptyset(&action.sa_mask);
      action.sa_flags = SA_RESTART;
      action.sa_handler = &on_job_stop;
      ::sigaction(SIGTSTP, &action, &tstp_before);
      action.sa_handler = &on_job_continue;
      ::sigaction(SIGCONT, &action, &cont_before);
      installed = true;
    }
  }
  child_group.store(group);
  if (group == 0 && installed) {
    ::sigaction(SIGTSTP, &tstp_before, nullptr);
    ::sigaction(SIGCONT, &cont_before, nullptr);
    installed = false;
  }
}

int job_continuations() { return continued.load(); }

StopAtOnce::StopAtOnce(const char* message, const std::string& during) {
  at_once.store(message);  // first: a signal from here on ends the process; one before it is seen below
  if (const int sig = received.load(); sig != 0 && sig != SIGPIPE) {
    at_once.store(nullptr);
    throw StoppedBySignal(sig, "stopped by " + signal_name(sig) + " during set-up (before " + during + "): no step was trained");
  }
}

StopAtOnce::~StopAtOnce() { at_once.store(nullptr); }

std::string signal_name(int sig) {
  const char* abbrev = ::sigabbrev_np(sig);
  return abbrev != nullptr ? "SIG" + std::string(abbrev) : "signal " + std::to_string(sig);
}

bool is_crash_signal(int sig) {
  return sig == SIGSEGV || sig == SIGABRT || sig == SIGBUS || sig == SIGFPE || sig == SIGILL;
}

}  // namespace loom::core
