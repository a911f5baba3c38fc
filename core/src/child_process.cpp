// A child process reporting on a pipe, watched with a time limit (child_process.hpp).
#include <loom/core/child_process.hpp>
#include <loom/core/stop_signals.hpp>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <fcntl.h>
#include <poll.h>
#include <spawn.h>
#include <string_view>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <system_error>
#include <thread>
#include <unistd.h>

extern char** environ;

namespace loom::core {

namespace {

constexpr size_t kChunk = 4096;

/// The child's environment: this process's, with `setting` over the variable it names.
std::vector<std::string> environment_with(const std::string& setting) {
  std::vector<std::string> out;
  if (!setting.empty()) out.push_back(setting);
  const std::string prefix = setting.substr(0, setting.find('=') + 1);
  for (char** e = environ; *e != nullptr; ++e)
    if (prefix.empty() || std::string_view(*e).rfind(prefix, 0) != 0) out.emplace_back(*e);
  return out;
}

std::vector<char*> pointers(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (auto& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

}  // namespace

ChildEnd run_child_process(const ChildProcess& child, const std::function<bool(const std::string&)>& on_line,
                           const std::function<bool()>& stop) {
  ChildEnd out;
  // A command started with SIGCHLD ignored (by a daemon, a job runner) has its children reaped by
  // the kernel: their end would never be seen, and their exit status is lost.
  if (struct sigaction chld {}; ::sigaction(SIGCHLD, nullptr, &chld) == 0 && chld.sa_handler == SIG_IGN) {
    chld.sa_handler = SIG_DFL;
    ::sigaction(SIGCHLD, &chld, nullptr);
  }
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    out.spawn_error = errno;
    return out;
  }
  if (fds[1] == child.report_fd) ::fcntl(fds[1], F_SETFD, 0);  // (dup2 onto itself would keep close-on-exec)
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  if (fds[1] != child.report_fd) posix_spawn_file_actions_adddup2(&actions, fds[1], child.report_fd);  // (clears close-on-exec)
  if (child.quiet) {
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
  }
  posix_spawnattr_t attributes;
  posix_spawnattr_init(&attributes);
  if (child.own_group) {
    posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETPGROUP);
    posix_spawnattr_setpgroup(&attributes, 0);
  }
  std::vector<std::string> args = child.args;
  std::vector<std::string> environment = environment_with(child.environment);
  const std::vector<char*> argv = pointers(args), envp = pointers(environment);
  pid_t pid = 0;
  const int spawned = args.empty() ? ENOENT
                                   : posix_spawn(&pid, child.exe.c_str(), &actions, &attributes, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attributes);
  ::close(fds[1]);
  if (spawned != 0) {
    ::close(fds[0]);
    out.spawn_error = spawned;
    return out;
  }
  // The limit holds after the pipe closed (a plugin may close it, then hang); once the child has
  // ended, the pipe is read to its end, or a little past what a pipe holds where a process it
  // started keeps it open (a daemon that writes on), then no more.
  // At the end, or on an exception from on_line or stop: the pipe closed, the child ended and reaped.
  if (child.own_group) note_child_group(pid);
  const auto finish = [&] {
    ::close(fds[0]);
    if (child.own_group) ::kill(-pid, SIGKILL);  // what is left in its group (never another: a group's id is its first pid)
    ::kill(pid, SIGKILL);  // the child if it still runs, wherever plugin code moved it
    while (::waitpid(pid, &out.status, 0) < 0 && errno == EINTR) {
    }
    if (child.own_group) note_child_group(0);
  };
  try {
    bool ended = false, pipe_open = true;
    auto since = std::chrono::steady_clock::now();
    int continuations = job_continuations();
    std::string buffer;
    size_t read_after = 0;
    while (true) {
      const bool ended_before = ended;  // (seen ended before this poll: a quiet pipe now is all it wrote)
      int ready = 0;
      if (pipe_open) {
        pollfd p{fds[0], POLLIN, 0};
        ready = ::poll(&p, 1, 50);
      } else {
        ::usleep(50000);
      }
      if (ready > 0) {
        char chunk[kChunk];
        const ssize_t n = ::read(fds[0], chunk, sizeof chunk);
        if (n <= 0) {
          pipe_open = false;
        } else {
          buffer.append(chunk, static_cast<size_t>(n));
          if (buffer.size() > (16u << 20) && buffer.find('\n') == std::string::npos) buffer.clear();  // not the child's
        }
        for (size_t nl; (nl = buffer.find('\n')) != std::string::npos; buffer.erase(0, nl + 1)) {
          if (on_line(buffer.substr(0, nl))) {
            out.heard = true;
            since = std::chrono::steady_clock::now();
          }
        }
      } else if (ready < 0 && errno != EINTR) {
        pipe_open = false;
      }
      // Ended, not reaped: a group of its own cannot be another's while it is a zombie.
      siginfo_t info{};
      // (ECHILD: reaped by the kernel, where SIGCHLD was ignored after all)
      const int waited_for = ended ? 0 : ::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT);
      if (!ended && ((waited_for == 0 && info.si_pid == pid) || (waited_for < 0 && errno == ECHILD))) {
        ended = true;
        read_after = 0;
      }
      if (ended && !pipe_open) break;  // (its end of the pipe closed: everything it wrote is read)
      if (ended_before && (ready == 0 || (ready > 0 && (read_after += kChunk) > (1u << 20)))) break;
      if (const int now = job_continuations(); now != continuations) {  // (stopped with the child: Ctrl-Z, then fg)
        continuations = now;
        out.paused = true;
        since = std::chrono::steady_clock::now();
      }
      if (stop && stop()) {
        out.stopped = true;
        break;
      }
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
      if (!ended && waited > (out.heard ? child.limit : child.first_limit)) {
        out.timed_out = true;
        break;
      }
    }
  } catch (...) {
    finish();
    throw;
  }
  finish();
  return out;
}

void end_with_parent(int parent) {
  const pid_t self = ::getpid();
  const bool leads = ::getpgrp() == self;  // (as run_child_process starts it: never a shell's group)
  // Its own group is a background one at the terminal: under `stty tostop` its first line on the
  // terminal (a warning, a plugin's print) would stop it with SIGTTOU, a hang its parent ends at
  // the limit. Ignored, the write goes through.
  if (leads) ::signal(SIGTTOU, SIG_IGN);
  try {
    std::thread([parent, self, leads] {
      while (::getppid() == parent) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      if (leads) ::kill(-self, SIGKILL);
      ::kill(self, SIGKILL);
    }).detach();
  } catch (const std::system_error&) {  // (at the limit of threads: this process at least goes with its parent)
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::kill(self, SIGKILL);
  }
}

}  // namespace loom::core
