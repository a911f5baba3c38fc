// `loom launch --nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P] --
// train ...`: starts this node's N processes of a multi-process job (parallel = ddp), each with the
// variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
// MASTER_ADDR, MASTER_PORT), forwards their output, and watches them: when one fails, the others
// are stopped (SIGTERM, then SIGKILL after a grace period) and the launcher exits non-zero naming
// the rank, how it ended and its last line. Ctrl-C (SIGINT/SIGTERM) is passed on to every rank; a
// launcher that is killed outright stops its ranks (SIGHUP, through PR_SET_PDEATHSIG: a hang-up is
// the graceful stop, first or after a signal passed on, where a SIGTERM after a SIGINT is the
// second that stops at once).
#include "cli.hpp"

#include <loom/core/error.hpp>
#include <loom/core/log.hpp>
#include <loom/core/trainer.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <iostream>
#include <random>
#include <map>
#include <string>
#include <thread>
#include <vector>

namespace fs = std::filesystem;

namespace loom::cli {

namespace {

volatile std::sig_atomic_t interrupted = 0;   // the last SIGINT or SIGTERM
volatile std::sig_atomic_t signals_received = 0;  // how many
std::atomic<int64_t> counted_at{0};              // when the last one counted arrived (ns, monotonic)
void on_signal(int signal) {
  timespec t{};  // (clock_gettime is async-signal-safe)
  ::clock_gettime(CLOCK_MONOTONIC, &t);
  const int64_t now = static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
  // `timeout -s INT` signals the launcher, then its own process group, the launcher again: passed
  // on, the second stopped the ranks at once, without the stop's checkpoint (6 times in 32). The
  // same signal within half a second is that one stop; a person's second Ctrl-C comes later.
  if (signal == interrupted && now - counted_at.load() < 500000000) return;
  counted_at.store(now);
  interrupted = signal;
  signals_received = signals_received + 1;
}

struct Child {
  int64_t rank = 0;
  pid_t pid = -1;
  int out = -1;          // the read end of its stdout and stderr
  std::string partial;   // a line not yet ended
  std::string last;      // its last complete, non-empty line
  std::string error;     // its last error line ("[hh:mm:ss E rank R] ...")
  bool running = true;
  int status = 0;
  bool killed_by_launcher = false;  // ended after the launcher's SIGKILL (past --grace)
  uint64_t sent = 0;                // each signal the launcher sent it (its own or one passed on), bit 1 << signal
  bool sent_it(int signal) const { return signal > 0 && signal < 64 && (sent >> signal & 1) != 0; }
};

// Set before the first rank starts: what each child resets between fork and exec.
bool pipe_ignored_on_entry = false;  // SIGPIPE (the launcher ignores it: a closed terminal or `| tee` that died)
int null_input = -1;                 // /dev/null, each rank's standard input

/// Whether `port` on the loopback can be bound now (0: the kernel's choice, written back).
bool bindable(int& port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw Error(std::string("loom launch: no socket for choosing a port: ") + std::strerror(errno));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  socklen_t size = sizeof address;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &size) == 0;
  ::close(fd);
  if (ok) port = ntohs(address.sin_port);
  return ok;
}

/// A port nothing listens on now, for a one-node job without --master-port. Below the kernel's
/// ephemeral range (ip_local_port_range) where it can: a port the kernel hands out may be taken
/// by any outgoing connection (gloo's, NCCL's) in the moment before rank 0 listens on it; one
/// below that range only by another listener.
int free_port() {
  int low = 32768;
  if (std::FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    if (std::fscanf(f, "%d", &low) != 1) low = 32768;
    std::fclose(f);
  }
  if (low - 1024 >= 2000) {
    std::mt19937 pick(std::random_device{}());
    std::uniform_int_distribution<int> below(std::max(1024, low - 12000), low - 1);
    for (int tries = 0; tries < 100; ++tries)
      if (int port = below(pick); bindable(port)) return port;
  }
  int port = 0;
  if (!bindable(port)) throw Error("loom launch: could not choose a free port; give one with --master-port");
  return port;
}

std::string ended(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("was killed by signal ") + std::to_string(WTERMSIG(status)) + " (" +
                                  ::strsignal(WTERMSIG(status)) + ")";
  return "ended";
}

bool failed(int status) { return !(WIFEXITED(status) && WEXITSTATUS(status) == 0); }
/// A rank that ended as `loom train` does on a stop signal sent to it (128 + SIGHUP, SIGINT, SIGPIPE,
/// SIGTERM): the ranks agreed on the stop and wrote their checkpoint; not a failure.
bool stopped_by_signal(int status) {
  if (!WIFEXITED(status)) return false;
  const int code = WEXITSTATUS(status);
  return code == 128 + SIGHUP || code == 128 + SIGINT || code == 128 + SIGPIPE || code == 128 + SIGTERM;
}

Child start(int64_t rank, int64_t local_rank, const std::vector<std::string>& env, const std::vector<std::string>& args) {
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) throw Error(std::string("loom launch: pipe: ") + std::strerror(errno));
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  // Everything the child needs is built before fork: after it, only async-signal-safe calls.
  std::vector<std::string> strings = args;
  strings.insert(strings.begin(), ec ? std::string("loom") : self.string());
  std::vector<char*> argv;
  for (auto& s : strings) argv.push_back(s.data());
  argv.push_back(nullptr);
  std::vector<std::string> environment;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    const std::string name = entry.substr(0, entry.find('='));
    bool replaced = false;
    for (const auto& mine : env) replaced = replaced || mine.rfind(name + "=", 0) == 0;
    // (another launcher's variables, where loom launch runs under torchrun: TORCHELASTIC_USE_AGENT_STORE
    // would make every rank, rank 0 too, a client of a store nobody serves)
    const bool other_launchers = name.rfind("TORCHELASTIC_", 0) == 0 || name == "ROLE_RANK" || name == "ROLE_NAME" ||
                                 name == "ROLE_WORLD_SIZE" || name == "GROUP_WORLD_SIZE";
    if (!replaced && name != "RANK" && name != "LOCAL_RANK" && !other_launchers) environment.push_back(entry);
  }
  for (const auto& e : env) environment.push_back(e);
  environment.push_back("RANK=" + std::to_string(rank));
  environment.push_back("LOCAL_RANK=" + std::to_string(local_rank));
  std::vector<char*> envp;
  for (auto& s : environment) envp.push_back(s.data());
  envp.push_back(nullptr);

  const pid_t launcher = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) throw Error(std::string("loom launch: fork: ") + std::strerror(errno));
  if (pid == 0) {
    ::dup2(pipe_fds[1], STDOUT_FILENO);
    ::dup2(pipe_fds[1], STDERR_FILENO);
    // (a rank in a group of its own that read the terminal would be stopped by SIGTTIN for good)
    if (null_input >= 0) ::dup2(null_input, STDIN_FILENO);
#ifdef SYS_close_range
    ::syscall(SYS_close_range, 3U, ~0U, 4U /* CLOSE_RANGE_CLOEXEC */);  // (what the launcher's libraries opened)
#endif
    ::setpgid(0, 0);  // the terminal's Ctrl-C reaches the launcher, which passes it on
    sigset_t none;  // (a mask the launcher was started with is not the ranks': they must hear their stops)
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    // The launcher's own dispositions are not the ranks': a rank stops on SIGPIPE, and on the
    // SIGHUP below, though the launcher ignores the one and was started under nohup.
    ::signal(SIGHUP, SIG_DFL);
    if (!pipe_ignored_on_entry) ::signal(SIGPIPE, SIG_DFL);
    // A launcher killed outright (kill -9, an out-of-memory killer) takes its ranks with it:
    // they stop as on Ctrl-C, after the step, rank 0 writing a checkpoint. SIGHUP, not SIGTERM:
    // after a Ctrl-C the launcher passed on, a SIGTERM would be the second signal, which stops at
    // once and loses the checkpoint the first promised; a hang-up is the graceful stop still.
    ::prctl(PR_SET_PDEATHSIG, SIGHUP);
    if (::getppid() != launcher) ::_exit(1);  // it died before prctl
    ::execve(argv[0], argv.data(), envp.data());
    // Why, in async-signal-safe calls only: the program and the errno (the launcher names this line).
    const int error = errno;
    char digits[16];
    int n = 0;
    for (int e = error; n == 0 || e > 0; e /= 10) digits[n++] = static_cast<char>('0' + e % 10);
    char message[512];
    size_t length = 0;
    const auto put = [&](const char* text) {  // (strlen is async-signal-safe)
      for (size_t i = 0, size = std::strlen(text); i < size && length < sizeof message; ++i) message[length++] = text[i];
    };
    put("loom launch: could not start the rank's process (errno ");
    while (n > 0) {
      const char digit[2] = {digits[--n], '\0'};
      put(digit);
    }
    put(error == ENOENT ? ": the program is gone; was loom rebuilt or moved?): "
        : error == EACCES ? ": not executable): " : "): ");
    put(argv[0]);  // last: a path too long for the message is cut, the line still ends
    if (length == sizeof message) --length;
    message[length++] = '\n';
    (void)!::write(STDERR_FILENO, message, length);
    ::_exit(127);
  }
  ::close(pipe_fds[1]);
  ::fcntl(pipe_fds[0], F_SETFL, ::fcntl(pipe_fds[0], F_GETFL) | O_NONBLOCK);
  Child c;
  c.rank = rank;
  c.pid = pid;
  c.out = pipe_fds[0];
  return c;
}

// Forwards what a child wrote, line by line (a line of one rank is never cut by another's).
/// A line Loom logged at error level: "[hh:mm:ss E] ..." or "[hh:mm:ss E rank R] ...".
bool is_error_line(const std::string& line) {
  const size_t close = line.find(']');
  if (line.empty() || line[0] != '[' || close == std::string::npos || close > 40) return false;
  const std::string head = line.substr(0, close);
  return head.find(" E rank ") != std::string::npos || (head.size() >= 2 && head.compare(head.size() - 2, 2, " E") == 0);
}

/// A rank's error that only reports another rank's failure (the ddp strategy's collective that
/// found a peer gone): the launcher names the rank that failed of itself, where one did.
bool reports_a_peer(const Child& c) {
  for (const char* echo : {" stopped or did not answer within ", " did not answer within ", " stopped (its connection closed)",
                           " (its log says why)", " (its own error names every key)",
                           "another rank ran out of memory in this step"})
    if (c.error.find(echo) != std::string::npos) return true;
  return false;
}

/// The text of a warning line ("[hh:mm:ss W] ..." or "[hh:mm:ss W rank R] ..."), or empty.
std::string warning_text(const std::string& line) {
  const size_t close = line.find(']');
  if (line.empty() || line[0] != '[' || close == std::string::npos || close > 40) return {};
  const std::string head = line.substr(0, close);
  const bool warning = head.find(" W rank ") != std::string::npos || (head.size() >= 2 && head.compare(head.size() - 2, 2, " W") == 0);
  return warning ? line.substr(close + 1) : std::string();
}

// Every rank gives the same warnings about what they share (the configuration, the data, the
// machine): each is shown once, from the first rank that gave it; the count of the others is said
// at the end. A warning of one rank's own (its device, its memory) differs, and is shown.
std::map<std::string, int64_t> warnings_shown;  // text -> the rank that showed it (its own repeats are shown)
size_t warnings_repeated = 0;

/// A child's pipe closed: its line not yet ended is its last.
void close_pipe(Child& c) {
  if (!c.partial.empty()) {
    std::cerr << c.partial << "\n";
    c.last = c.partial;
    c.partial.clear();
  }
  ::close(c.out);
  c.out = -1;
}

void drain(Child& c, bool all) {
  char buffer[65536];
  // (all: what is there now, up to 1 MiB: a process the rank left behind that writes on for ever
  // would keep the launcher here, away from the other ranks, signals and --grace)
  for (size_t taken = 0;;) {
    const ssize_t n = ::read(c.out, buffer, sizeof buffer);
    if (n <= 0) {
      if (n == 0 || (errno != EINTR && errno != EAGAIN)) close_pipe(c);
      return;
    }
    c.partial.append(buffer, static_cast<size_t>(n));
    size_t start = 0, end;
    while ((end = c.partial.find('\n', start)) != std::string::npos) {
      std::string line = c.partial.substr(start, end - start);
      const std::string warning = warning_text(line);
      // (a long run's warnings name their steps, each one of its own: past 10000 texts, every one is shown)
      const auto shown = warning.empty() || warnings_shown.size() >= 10000 ? warnings_shown.end()
                                                                          : warnings_shown.emplace(warning, c.rank).first;
      if (shown == warnings_shown.end() || shown->second == c.rank) std::cerr << line << "\n";
      else ++warnings_repeated;
      const size_t cr = line.rfind('\r');  // a progress line redrawn in place: its last state
      if (cr != std::string::npos) line = line.substr(cr + 1);
      if (!line.empty()) c.last = line;
      // (and a crash's own line, which names the signal and the library: the stack's lines after it said nothing)
      // (not over the error it logged before: a crash in its exit after that error is not the cause)
      if (is_error_line(line) || ((c.error.empty() || !is_error_line(c.error)) &&
                                  (line.find(": crashed with ") < 200 || line.find(": killed by SIG") < 200)))
        c.error = line;
      start = end + 1;
    }
    c.partial.erase(0, start);
    std::cerr.flush();
    taken += static_cast<size_t>(n);
    if (!all || taken >= (size_t{1} << 20)) return;
  }
}

/// What is left in a child's pipe, then the pipe closed (a process the rank started may hold it
/// open for good: the read end is non-blocking, so the launcher never waits on it).
void drain_and_close(Child& c) {
  if (c.out < 0) return;
  drain(c, true);
  if (c.out >= 0) close_pipe(c);
}

/// `signal` to every rank still running; how many.
int signal_all(std::vector<Child>& children, int signal) {
  int sent = 0;
  for (auto& c : children)
    if (c.running) {
      // (SIGKILL to its group too: what it started, which may hold its pipe, a device or a port)
      if (signal == SIGKILL) ::kill(-c.pid, SIGKILL);
      ::kill(c.pid, signal);
      c.sent |= uint64_t{1} << signal;
      ++sent;
    }
  return sent;
}

}  // namespace

int cmd_launch(const Invocation& invocation) {
  // (started with standard input, output or error closed: /dev/null there first, so that no pipe of
  // the ranks' lands on 0 ... 2, and /dev/null is the ranks' input, not a descriptor of 0 left closed)
  for (int fd = 0; fd <= 2; ++fd)
    if (::fcntl(fd, F_GETFD) < 0 && errno == EBADF)
      if (const int opened = ::open("/dev/null", O_RDWR); opened >= 0 && opened != fd) {
        ::dup2(opened, fd);
        ::close(opened);
      }
  const auto& o = invocation.options;
  const int64_t nproc = o["nproc-per-node"].as<int64_t>();
  const int64_t nnodes = o["nnodes"].as<int64_t>();
  const int64_t node_rank = o["node-rank"].as<int64_t>();
  const std::string master = o["master-addr"].as<std::string>();
  int64_t port = o["master-port"].as<int64_t>();
  const double grace = o["grace"].as<double>();
  if (nproc < 1 || nproc > 1024) throw Error("loom launch: --nproc-per-node " + std::to_string(nproc) + " is not in 1 ... 1024");
  if (nnodes < 1 || nnodes > 65536) throw Error("loom launch: --nnodes " + std::to_string(nnodes) + " is not in 1 ... 65536");
  if (nproc * nnodes > (int64_t{1} << 20))  // (the SDK's bound on WORLD_SIZE: each rank would refuse it)
    throw Error("loom launch: --nproc-per-node " + std::to_string(nproc) + " x --nnodes " + std::to_string(nnodes) + " = " +
                std::to_string(nproc * nnodes) + " ranks; a job has at most " + std::to_string(int64_t{1} << 20));
  if (node_rank < 0 || node_rank >= nnodes)
    throw Error("loom launch: --node-rank " + std::to_string(node_rank) + " is not in 0 ... " + std::to_string(nnodes - 1));
  if (port < 0 || port > 65535) throw Error("loom launch: --master-port " + std::to_string(port) + " is not a port");
  if (!(grace >= 0 && grace <= 86400)) {  // (NaN too)
    char text[32];
    std::snprintf(text, sizeof text, "%g", grace);
    throw Error(std::string("loom launch: --grace ") + text + " is not a number of seconds in 0 ... 86400");
  }
  // An address no rank could reach is said now, not after every rank waited parallel.timeout for it.
  if (master.empty()) throw Error("loom launch: --master-addr is empty; give rank 0's host name or address (127.0.0.1 on one machine)");
  {
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    const int error = ::getaddrinfo(master.c_str(), nullptr, &hints, &found);
    if (error == EAI_AGAIN)  // (a name server that did not answer now: the ranks try again)
      core::log::warn("loom launch: --master-addr ", master, " could not be resolved now (", ::gai_strerror(error),
                      "); the ranks try again");
    else if (error != 0)
      throw Error("loom launch: --master-addr " + master + " does not resolve (" + ::gai_strerror(error) +
                  "); give rank 0's host name or address, one every node resolves (127.0.0.1 on one machine)");
    // Node 0 holds rank 0, whose store every rank, rank 0 too, reaches at that address: one of no
    // interface of this machine (a typo) had them wait parallel.timeout (30 minutes) for it (probe).
    // On one machine that is refused; across nodes it may be this one's by a NAT or a container's
    // port mapping (a public address, a service's), and is said.
    bool here = found == nullptr;
    for (const addrinfo* a = found; a != nullptr && !here; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0) continue;
      here = ::bind(fd, a->ai_addr, a->ai_addrlen) == 0 || errno != EADDRNOTAVAIL;  // (port 0: any free one)
      ::close(fd);
    }
    if (found != nullptr) ::freeaddrinfo(found);
    const std::string not_here = "--master-addr " + master + " is no address of this machine, which is node 0 (--node-rank 0) "
                                 "and holds rank 0, whose store the ranks reach there";
    if (node_rank == 0 && !here && nnodes == 1)
      throw Error("loom launch: " + not_here + ": every rank would wait parallel.timeout for it; give 127.0.0.1, or this "
                  "machine's address or host name (`hostname -I` lists them)");
    if (node_rank == 0 && !here)
      core::log::warn("loom launch: ", not_here, "; unless it reaches this machine (a NAT, a container's port mapping), "
                      "every rank waits parallel.timeout for it: give this machine's address (`hostname -I` lists them)");
  }
  // Ranks on other nodes reach rank 0 at --master-addr: 127.0.0.1 there is each node itself (said,
  // not refused: "nodes" that are one machine, a test of a multi-node job, do reach it).
  if (nnodes > 1 && (master == "localhost" || master.rfind("127.", 0) == 0 || master == "::1"))
    core::log::warn("loom launch: --nnodes ", nnodes, " with --master-addr ", master, ": a node on another machine "
                    "looks for rank 0 on itself and waits parallel.timeout for nothing; give the first node's address "
                    "or host name, the same on every node (nodes that are this one machine: set trainer.threads, "
                    "or each node's ranks take every core, as many times over as there are nodes)");
  // Ranks far past the cores are a typo, not a job: 1000 processes on 2 cores each load LibTorch
  // and plugins, take minutes to start and leave the machine unusable while they do.
  if (const unsigned cores = std::thread::hardware_concurrency(); cores > 0 && nproc > 4 * static_cast<int64_t>(cores))
    throw Error("loom launch: --nproc-per-node " + std::to_string(nproc) + " on a machine with " + std::to_string(cores) +
                " logical cores: at most 4 processes per core (" + std::to_string(4 * cores) +
                " here); one rank per GPU, or a few per machine on CPU");
  if (const unsigned cores = std::thread::hardware_concurrency(); cores > 0 && nproc > static_cast<int64_t>(cores))
    core::log::warn("loom launch: --nproc-per-node ", nproc, " on a machine with ", cores, " logical cores: each rank is a "
                    "process of its own (one per GPU on a GPU machine; on CPU, each gets less than a core)");
  if (invocation.args.empty())
    throw Error("loom launch: no command to launch; e.g. loom launch --nproc-per-node 2 -- train -c my.ini "
                "--set parallel.name=ddp");
  // Each process runs `loom <command>`: only training is a job of several processes.
  std::string command;  // the first word that is no option, past the options of every command (as main finds it)
  size_t command_at = 0;
  for (size_t i = 0; i < invocation.args.size() && command.empty(); ++i) {
    const std::string& a = invocation.args[i];
    if (a == "--log-level" || a == "--plugin-dir") ++i;
    else if (!a.empty() && a[0] != '-') command = a, command_at = i;
  }
  if (command == "launch")
    throw Error("loom launch -- launch ...: a launch inside a launch would start " + std::to_string(nproc) +
                " launchers of their own; give the command each process runs, e.g. -- train -c my.ini");
  if (command.empty())
    throw Error("loom launch: no command after --; e.g. loom launch --nproc-per-node 2 -- train -c my.ini "
                "--set parallel.name=ddp");
  if (std::none_of(commands().begin(), commands().end(), [&](const Command& c) { return c.name == command; }))
    throw Error("loom launch -- " + command + ": no such command (`loom --help` lists them); the command each process "
                "runs is train, e.g. loom launch --nproc-per-node 2 -- train -c my.ini --set parallel.name=ddp");
  if (command != "train")
    throw Error("loom launch -- " + command + ": only train is a job of several processes (each of the " +
                std::to_string(nproc) + " would run `loom " + command + "` by itself); run it without launch: loom " +
                command + " ...");
  // `loom launch --plugin-dir D -- train ...`: the ranks' command takes D too (it was ignored, and
  // the error that followed advised the very flag given).
  std::vector<std::string> args = invocation.args, dirs;
  if (o.count("plugin-dir"))
    for (const auto& dir : o["plugin-dir"].as<std::vector<std::string>>()) dirs.insert(dirs.end(), {"--plugin-dir", dir});
  args.insert(args.begin() + static_cast<std::ptrdiff_t>(command_at) + 1, dirs.begin(), dirs.end());  // (in their order)
  // `-- train --help`: the command's help, once, not once per rank.
  if (std::any_of(args.begin(), args.end(), [](const std::string& a) { return a == "--help" || a == "-h"; })) {
    std::error_code ec;
    std::string self = fs::read_symlink("/proc/self/exe", ec).string();
    if (ec) self = "loom";
    std::vector<std::string> strings = args;
    strings.insert(strings.begin(), self);
    std::vector<char*> argv;
    for (auto& a : strings) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::cout.flush();
    ::execv(self.c_str(), argv.data());
    throw Error("loom launch: cannot run " + self + " for the help of " + command + ": " + std::strerror(errno));
  }
  // The run's configuration is checked once, here: a wrong key or a missing file would be said by
  // every rank, and once more in the launcher's summary.
  {
    std::vector<std::string> child = args;
    child.erase(child.begin() + static_cast<std::ptrdiff_t>(command_at));
    const Command& train = *std::find_if(commands().begin(), commands().end(), [](const Command& c) { return c.name == std::string("train"); });
    po::variables_map options;
    try {
      options = parse_command_line(train, child);
    } catch (const po::error& e) {
      throw Error("loom launch -- train: " + std::string(e.what()) + "; run `loom train --help` for its options");
    }
    core::PluginRegistry registry;
    scan_plugins(registry, options, /*log_refusals=*/false);  // (each rank says its refusals)
    const core::Resolved resolved = core::resolve_run(core::with_run_settings(config_from(options), registry), registry);
    // A global batch the ranks cannot split is each rank's error too: said once, here (the check
    // the trainer makes, for the world this command starts; a batch chosen by memory policies is theirs).
    // Loom's strategies of one process, said once, here (each rank refused itself, every one the same).
    if (const core::ConfigValue& parallel = resolved.at("parallel.name");
        nproc * nnodes > 1 && (parallel.value == "single" || parallel.value == "data_parallel"))
      throw Error("loom launch: parallel.name = " + parallel.value + " (" + parallel.origin.describe() + ") trains in one "
                  "process: each of the " + std::to_string(nproc * nnodes) + " would train the whole model by itself. "
                  "Set parallel.name=ddp to train together" +
                  (parallel.value == "data_parallel" ? " (or run data_parallel without loom launch, one process over "
                                                       "several devices)" : ""));
    const core::ConfigValue& batch = resolved.at("trainer.batch_size");
    const int64_t accumulation = std::stoll(resolved.at("trainer.gradient_accumulation_steps").value);
    const int64_t per_step = accumulation * nproc * nnodes;
    if (resolved.at("parallel.name").value == "ddp" && batch.origin.source != "default" &&
        std::stoll(batch.value) % per_step != 0) {
      // A resume keeps its run's batch: the fix is the number of ranks (a batch of 30 was offered for
      // the run's 32 on 3 ranks, which changes the run).
      const int64_t global = std::stoll(batch.value);
      std::string ranks;
      for (int64_t n = 1, found = 0; n <= 64 && found < 4; ++n)
        if (global % (accumulation * n * nnodes) == 0) ranks += (found++ > 0 ? ", " : "") + std::to_string(n);
      const std::string batch_fix = std::to_string(std::max<int64_t>(per_step, global / per_step * per_step));
      throw Error("loom launch: trainer.batch_size " + batch.value + " (" + batch.origin.describe() + ") is not divisible by " +
                  "trainer.gradient_accumulation_steps " + std::to_string(accumulation) + " x world size " +
                  std::to_string(nproc * nnodes) + "; the global batch must split evenly into micro-batches" +
                  (batch.origin.source == "the run's config.json" && !ranks.empty()
                       ? ": this resume keeps the run's batch, so launch it with --nproc-per-node " + ranks +
                             (nnodes > 1 ? " on each node" : "") + " (or give --set trainer.batch_size=" + batch_fix +
                             " to change the run's batch)"
                       : ", e.g. " + batch_fix));
    }
  }
  // (the port last: the checks before take time in which another program could take it)
  if (port == 0) {
    if (nnodes > 1) throw Error("loom launch: --nnodes " + std::to_string(nnodes) + " needs --master-port, the same on every node");
    port = free_port();
  }
  const std::string world = std::to_string(nproc * nnodes);
  const std::vector<std::string> env{"WORLD_SIZE=" + world, "LOCAL_WORLD_SIZE=" + std::to_string(nproc),
                                     "GROUP_RANK=" + std::to_string(node_rank), "MASTER_ADDR=" + master,
                                     "MASTER_PORT=" + std::to_string(port),
                                     "LOOM_LAUNCH_CHECKED=1"};  // (its warnings said here: cmd_train)
  core::log::info("launch    ", nproc, " process", nproc == 1 ? "" : "es", " on node ", node_rank, " of ", nnodes,
                  " (ranks ", node_rank * nproc, " ... ", node_rank * nproc + nproc - 1, " of ", world, "), rank 0 at ",
                  master, ":", port);

  struct sigaction action {};
  action.sa_handler = on_signal;
  sigfillset(&action.sa_mask);  // (a SIGTERM inside the SIGINT's handler: both counted)
  // (a write to standard error that a signal interrupts is resumed: failed with EINTR, it set
  // std::cerr's badbit and every rank's line after it was dropped; poll still returns at once)
  action.sa_flags = SA_RESTART;
  ::sigaction(SIGINT, &action, nullptr);
  ::sigaction(SIGTERM, &action, nullptr);
  // A closed terminal hangs up the launcher's process group, not the ranks' (each has its own): the
  // launcher passes it on, as Ctrl-C. Ignored on entry (nohup), it stays ignored.
  if (struct sigaction inherited {}; ::sigaction(SIGHUP, nullptr, &inherited) == 0 && inherited.sa_handler != SIG_IGN)
    ::sigaction(SIGHUP, &action, nullptr);
  // A launcher whose standard error closed (`loom launch ... | tee log`, and tee died of the same
  // Ctrl-C) goes on watching its ranks: died of SIGPIPE, it would take them down at once.
  if (struct sigaction inherited {}; ::sigaction(SIGPIPE, nullptr, &inherited) == 0)
    pipe_ignored_on_entry = inherited.sa_handler == SIG_IGN;
  ::signal(SIGPIPE, SIG_IGN);
  // Started with SIGCHLD ignored (a daemon, a job runner), the kernel would reap the ranks and the
  // launcher would never see one end.
  ::signal(SIGCHLD, SIG_DFL);
  {  // (started with them blocked, a parent's mask: Ctrl-C and SIGTERM were held for good, probe M;
     // after the handlers, so that one held until now is passed on, not the default action)
    sigset_t stops;
    sigemptyset(&stops);
    for (const int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE}) sigaddset(&stops, sig);
    ::pthread_sigmask(SIG_UNBLOCK, &stops, nullptr);
  }
  null_input = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  // `loom --log-level warn launch ... -- train ...`: the ranks log at that level too, unless their
  // own command line says another (it quieted the launcher alone).
  std::vector<std::string> rank_args = args;
  if (!o["log-level"].defaulted() &&
      std::none_of(rank_args.begin(), rank_args.end(), [](const std::string& a) { return a.rfind("--log-level", 0) == 0; }))
    rank_args.insert(rank_args.begin() + static_cast<std::ptrdiff_t>(command_at) + 1,
                     {"--log-level", o["log-level"].as<std::string>()});
  std::vector<Child> children;
  // A Ctrl-C while the ranks start stops the starting: the loop below passes it to those started.
  try {
    for (int64_t i = 0; i < nproc && !interrupted; ++i) children.push_back(start(node_rank * nproc + i, i, env, rank_args));
  } catch (const std::exception&) {
    // (a fork or a pipe that failed: the ranks started have done nothing yet but wait to join the others)
    signal_all(children, SIGKILL);
    for (const auto& c : children)
      while (::waitpid(c.pid, nullptr, 0) < 0 && errno == EINTR) {
      }
    throw;
  }

  const Child* first_failure = nullptr;
  const Child* signalled_rank = nullptr;  // one that stopped on a signal sent to it, not through the launcher
  std::sig_atomic_t forwarded = 0;  // signals passed on so far
  bool passed_on = false;           // one reached a rank still running
  std::chrono::steady_clock::time_point stop_by{};
  for (;;) {
    std::vector<pollfd> fds;
    std::vector<Child*> owners;
    for (auto& c : children)
      if (c.out >= 0) {
        fds.push_back({c.out, POLLIN, 0});
        owners.push_back(&c);
      }
    if (!fds.empty()) {
      const int ready = ::poll(fds.data(), fds.size(), 200);
      for (size_t i = 0; ready > 0 && i < fds.size(); ++i)
        if (fds[i].revents != 0) drain(*owners[i], false);
    } else {
      ::usleep(50 * 1000);
    }
    int status = 0;
    pid_t pid;
    while ((pid = ::waitpid(-1, &status, WNOHANG)) > 0)
      for (auto& c : children)
        if (c.pid == pid) {
          c.running = false;
          c.status = status;
          if (c.out >= 0) drain(c, true);
          // (not one the launcher sent it: after a rank failed, the others stop on its SIGTERM, exit 143)
          if (stopped_by_signal(status) && signalled_rank == nullptr && !interrupted && c.sent == 0 &&
              first_failure == nullptr) {
            // The others stop with it (they agreed after a step; before joining they had not: the
            // same signal, passed on, stops them there at once instead of at parallel.timeout).
            signalled_rank = &c;
            signal_all(children, WEXITSTATUS(status) - 128);
          }
          // (a rank ended by the signal the launcher passed on, a second Ctrl-C's, is the stop asked for)
          const bool ended_as_asked = WIFSIGNALED(status) && c.sent_it(WTERMSIG(status));
          if (failed(status) && !stopped_by_signal(status) && !ended_as_asked && first_failure == nullptr) {
            // (during a stop the user asked for too: a rank killed or failing then left no stop
            // checkpoint, and the exit status of a clean stop would say there is one)
            first_failure = &c;
            if (!interrupted) {
              signal_all(children, SIGTERM);
              stop_by = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(grace * 1000));
            } else if (std::any_of(children.begin(), children.end(), [](const Child& o) { return o.running; })) {
              // (no deadline here: rank 0 may be writing the stop's checkpoint, which is its alone;
              // the others may wait for the failed one in a collective, up to parallel.timeout)
              core::log::warn("launch: rank ", c.rank, " ", ended(status), " while the ranks stopped; the others "
                              "finish their stop (", c.rank == 0 ? "no checkpoint: rank 0 writes it" : "rank 0 its checkpoint",
                              "), or wait for it up to parallel.timeout: send the signal again to stop them at once");
            }
          }
        }
    // Each SIGINT or SIGTERM goes on to every rank, and none is killed for it: the first stops them
    // after their step, rank 0 writing the checkpoint (as long as that takes: a scheduler's warning
    // before it kills a job is the time it gives); a second stops them at once.
    // A third: ranks still running after the second handle no signal (stopped, or held by a
    // debugger; the launcher waited for ever): killed.
    for (const std::sig_atomic_t received = signals_received; forwarded < received; ++forwarded) {
      if (forwarded < 2) {
        passed_on = signal_all(children, interrupted) > 0 || passed_on;  // (two in one pass: both go on)
      } else if (std::any_of(children.begin(), children.end(), [](const Child& c) { return c.running; })) {
        core::log::warn("launch: a third ", core::signal_name(interrupted), ": the ranks still running are killed (SIGKILL)");
        for (auto& c : children) c.killed_by_launcher = c.running;
        signal_all(children, SIGKILL);
      }
    }
    bool any = false;
    for (const auto& c : children) any = any || c.running;
    if (!any) break;
    if (stop_by != std::chrono::steady_clock::time_point{} && std::chrono::steady_clock::now() > stop_by) {
      for (auto& c : children) c.killed_by_launcher = c.running;
      signal_all(children, SIGKILL);
      stop_by = {};
    }
  }
  for (auto& c : children) drain_and_close(c);
  if (warnings_repeated > 0)
    core::log::info("launch: ", warnings_repeated, warnings_repeated == 1 ? " warning" : " warnings",
                    " that another rank gave first, word for word, shown once");
  // The first to exit is often a rank whose collective found the failed one gone (it exits the
  // moment the connection closes); the rank that failed of itself is the one to name.
  // (one that exited with its own error, or that a signal not from the launcher ended: kill -9)
  const auto of_itself = [&](const Child& c) {
    if (!failed(c.status) || stopped_by_signal(c.status) || c.killed_by_launcher) return false;
    if (WIFSIGNALED(c.status)) return !c.sent_it(WTERMSIG(c.status));  // (not the launcher's, nor one it passed on)
    return !c.error.empty() && !reports_a_peer(c);
  };
  const Child* blamed = first_failure;
  if (blamed != nullptr && reports_a_peer(*blamed))
    for (const auto& c : children)
      if (of_itself(c)) {
        blamed = &c;
        break;
      }
  // (during a stop the user asked for, a rank that only lost another that stopped first is the stop)
  if (blamed != nullptr && interrupted && reports_a_peer(*blamed)) first_failure = blamed = nullptr;
  if (first_failure != nullptr) {
    const std::string& line = !blamed->error.empty() ? blamed->error : blamed->last;
    core::log::error("launch: rank ", blamed->rank, " ", ended(blamed->status), blamed == first_failure ? "" : " (it failed of itself)",
                     interrupted ? " while the ranks stopped on " + std::string(::strsignal(interrupted)) +
                                       ", so the stop may have written no checkpoint"
                                 : std::string("; the other ranks were stopped"),
                     ". Its ", !blamed->error.empty() ? "error: " : "last line: ", line.empty() ? "(none)" : line);
    return 1;
  }
  const bool all_done = static_cast<int64_t>(children.size()) == nproc &&
                        std::none_of(children.begin(), children.end(), [](const Child& c) { return failed(c.status); });
  if (interrupted && !passed_on && all_done) {  // (a scheduler's SIGTERM at the job's end: it had finished)
    core::log::info("launch: ", ::strsignal(interrupted), " came after every rank had finished; nothing was stopped");
    return 0;
  }
  if (interrupted) {
    core::log::warn("launch: interrupted (", ::strsignal(interrupted), "), passed on to every rank");
    return 128 + interrupted;
  }
  if (signalled_rank != nullptr) {  // (every rank stopped after the same step; rank 0 wrote the checkpoint)
    // (which rank the signal was sent to, the launcher cannot tell: every rank exits with its code,
    // the one reaped first is no more likely the one)
    core::log::warn("launch: the ranks stopped on ", ::strsignal(WEXITSTATUS(signalled_rank->status) - 128),
                    ", sent to a rank, not through the launcher; every rank agreed on the stop");
    return WEXITSTATUS(signalled_rank->status);
  }
  return 0;
}

}  // namespace loom::cli
