// A crash says so: on SIGSEGV, SIGBUS, SIGFPE, SIGILL or SIGABRT the process writes one report to
// stderr (the signal, the faulting address, what it was doing in a plugin where a CrashContext
// said so, the stack as module+offset, which `addr2line -f -C -e
// MODULE OFFSET` turns into functions and lines) and then dies of the same signal, so the exit
// status and core dumps stay what they would have been. Only async-signal-safe calls run in the
// handler (write, backtrace_symbols_fd, dladdr reads no allocation); `backtrace` is called once
// at installation so that libgcc's unwinder is loaded before any crash.
#include <loom/core/crash_report.hpp>

#include <atomic>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <dlfcn.h>
#include <execinfo.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <initializer_list>
#include <ucontext.h>
#include <unistd.h>

namespace loom::core {

namespace {

void put(const char* text) {
  const ssize_t written = ::write(STDERR_FILENO, text, std::strlen(text));
  (void)written;
}

void put_hex(uintptr_t value) {
  char buffer[2 + 16 + 1];
  char* p = buffer + sizeof buffer - 1;
  *p = '\0';
  do {
    *--p = "0123456789abcdef"[value & 0xf];
    value >>= 4;
  } while (value != 0);
  *--p = 'x';
  *--p = '0';
  put(p);
}

// module+offset of an address, as backtrace_symbols_fd writes the frames of the stack.
void put_location(uintptr_t address) {
  Dl_info info{};
  put_hex(address);
  if (address != 0 && ::dladdr(reinterpret_cast<void*>(address), &info) != 0 && info.dli_fname != nullptr) {
    put(" in ");
    put(info.dli_fname);
    put(" (+");
    put_hex(address - reinterpret_cast<uintptr_t>(info.dli_fbase));
    put(")");
    if (info.dli_sname != nullptr) {
      put(" ");
      put(info.dli_sname);
    }
  }
}

const char* name_of(int sig) {
  switch (sig) {
    case SIGSEGV: return "SIGSEGV (invalid memory access)";
    case SIGBUS: return "SIGBUS (bus error: a file mapped into memory shrank, or an unaligned access)";
    case SIGFPE: return "SIGFPE (arithmetic error)";
    case SIGILL: return "SIGILL (illegal instruction: code built for another processor?)";
    case SIGABRT: return "SIGABRT (abort(): a failed assertion, or an exception nothing caught)";
    default: return "a fatal signal";
  }
}

const char* program_name = "loom";
char context[256] = "";  // CrashContext's text: read by the handlers, written only outside them
std::atomic<bool> returning{false};
pid_t guarded = 0;  // the process report_exit_calls guards (a plugin's forked child is not it)

void put_context() {
  if (context[0] == '\0') return;
  put("  while ");
  put(context);
  put("\n");
}

// exit() before the command returned: a plugin's (Loom calls none; main ends with _Exit).
void on_exit_call() {
  if (returning.load() || ::getpid() != guarded) return;
  put("\n");
  put(program_name);
  put(": a plugin (or a library) ended the process with exit() before the command finished");
  if (context[0] != '\0') {
    put(", while ");
    put(context);
  }
  put(". What the command was doing did not complete (files it wrote before stand); the exit status is 1, "
      "whatever the plugin gave. A plugin reports a failure by throwing loom::sdk::Error; `loom plugins check FILE` "
      "runs its components one by one.\n");
  std::_Exit(1);
}

/// A hexadecimal number at `text` (as /proc/self/maps writes them), and where it ends. (strtoull
/// is not on POSIX's list of async-signal-safe functions.)
uintptr_t hex_at(const char*& text) {
  uintptr_t value = 0;
  for (;; ++text) {
    const char c = *text;
    const int digit = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (digit < 0) return value;
    value = value * 16 + static_cast<uintptr_t>(digit);
  }
}

/// The file mapped at `address` (from /proc/self/maps, read with read(2) into a fixed buffer) into
/// `path`, and the offset in it that `address` maps; false where no file is mapped there.
bool mapped_file_at(uintptr_t address, char* path, size_t size, uintptr_t& offset) {
  const int fd = ::open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  static char buffer[16384];
  size_t have = 0;
  bool found = false;
  for (;;) {
    const ssize_t n = ::read(fd, buffer + have, sizeof buffer - 1 - have);
    if (n <= 0) break;
    have += static_cast<size_t>(n);
    buffer[have] = '\0';
    char* line = buffer;
    for (char* end; !found && (end = std::strchr(line, '\n')) != nullptr; line = end + 1) {
      *end = '\0';
      // "start-end perms offset dev inode   path"
      const char* p = line;
      const uintptr_t start = hex_at(p);
      const uintptr_t stop = *p == '-' ? hex_at(++p) : 0;
      const char* fields = std::strchr(p, ' ');                                  // " perms offset ..."
      const char* at_offset = fields ? std::strchr(fields + 1, ' ') : nullptr;  // " offset ..."
      const char* file = std::strchr(line, '/');
      if (address >= start && address < stop && file != nullptr && at_offset != nullptr) {
        const char* q = at_offset + 1;
        offset = hex_at(q) + (address - start);
        std::strncpy(path, file, size - 1);
        path[size - 1] = '\0';
        found = true;
      }
    }
    if (found) break;
    have = static_cast<size_t>(buffer + have - line);  // (a line cut by the read: kept for the next)
    std::memmove(buffer, line, have);
    if (have == sizeof buffer - 1) have = 0;  // (no line this long: dropped)
  }
  ::close(fd);
  return found;
}

void put_decimal(uint64_t value) {
  char buffer[21];
  char* p = buffer + sizeof buffer - 1;
  *p = '\0';
  do {
    *--p = static_cast<char>('0' + value % 10);
    value /= 10;
  } while (value != 0);
  put(p);
}

void on_crash(int sig, siginfo_t* info, void* raw_context) {
  put("\n");
  // Sent by another process (kill -SEGV): no fault here, and no address (si_addr holds the
  // sender's pid: "crashed with SIGSEGV (invalid memory access) at address 0x2cc8", a bug report
  // asked for). (abort() and raise() are this process's own: si_pid is its own.)
  if (info->si_code <= 0 && info->si_pid != ::getpid()) {
    put(program_name);
    put(": killed by ");
    put(sig == SIGSEGV ? "SIGSEGV" : sig == SIGBUS ? "SIGBUS" : sig == SIGFPE ? "SIGFPE" : sig == SIGILL ? "SIGILL" : "SIGABRT");
    put(", which process ");
    put_decimal(static_cast<uint64_t>(info->si_pid));
    put(" sent (kill): no fault of its own, and nothing of the run's step was saved\n");
    ::raise(sig);  // (SA_RESETHAND: the default action now)
    return;
  }
  put(program_name);
  put(": crashed with ");
  put(name_of(sig));
  if (sig != SIGABRT) {  // (raised, not a fault: no address)
    put(" at address ");
    put_hex(reinterpret_cast<uintptr_t>(info->si_addr));
  }
  static char file[512];
  uintptr_t offset = 0;
  struct stat now {};
  if (sig == SIGBUS && info->si_code == BUS_ADRERR &&
      mapped_file_at(reinterpret_cast<uintptr_t>(info->si_addr), file, sizeof file, offset)) {
    put(", in ");
    put(file);
    // (past its end now: cut short while mapped, by another process writing over it in place;
    // else the file's pages could not be read, an I/O error)
    if (::stat(file, &now) == 0 && static_cast<uintptr_t>(now.st_size) <= offset)
      put(", which became shorter while it was read: another process wrote it in place (cp over it, rsync "
          "--inplace, a sync tool). Read a copy that nothing writes to; Loom writes its own files whole, by renaming.\n");
    else
      put(", whose data could not be read (an I/O error: a disk, or a network file system that went away).\n");
  } else {
    put(". This is a bug in Loom or in a plugin; please report it with the lines below.\n");
  }
  put_context();
#if defined(__x86_64__)
  const auto* context = static_cast<const ucontext_t*>(raw_context);
  const auto pc = static_cast<uintptr_t>(context->uc_mcontext.gregs[REG_RIP]);
  put("  pc ");
  put_location(pc);
  put("\n");
  if (pc == 0) {
    // A call through a null function pointer: the unwinder cannot start from address 0, but the
    // call left its return address on top of the stack.
    const auto sp = static_cast<uintptr_t>(context->uc_mcontext.gregs[REG_RSP]);
    put("  called from ");
    put_location(*reinterpret_cast<const uintptr_t*>(sp));
    put("\n");
  }
#else
  (void)raw_context;
#endif
  void* frames[64];
  const int n = ::backtrace(frames, 64);
  put("  stack (addr2line -f -C -e MODULE OFFSET names each frame):\n");
  ::backtrace_symbols_fd(frames, n, STDERR_FILENO);
  // SA_RESETHAND restored the default action: returning re-runs the faulting instruction, which
  // now ends the process with the signal. A signal raised by kill() is raised again.
  if (info->si_code <= 0) ::raise(sig);
}

}  // namespace

void install_crash_report(const char* program) {
  if (program != nullptr) program_name = program;
  void* warm[1];
  (void)::backtrace(warm, 1);
  static char alternate_stack[64 * 1024];  // a stack overflow still gets its report
  stack_t stack{};
  stack.ss_sp = alternate_stack;
  stack.ss_size = sizeof alternate_stack;
  ::sigaltstack(&stack, nullptr);
  struct sigaction action {};
  action.sa_sigaction = &on_crash;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_SIGINFO | SA_RESETHAND | SA_ONSTACK;
  for (const int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) ::sigaction(sig, &action, nullptr);
}

void report_exit_calls() {
  static bool registered = false;
  guarded = ::getpid();
  if (!registered) registered = std::atexit(&on_exit_call) == 0;
}

void command_returning() { returning.store(true); }

CrashContext::CrashContext(const char* what) {
  std::memcpy(previous_, context, sizeof previous_);
  std::strncpy(context, what, sizeof context - 1);
  context[sizeof context - 1] = '\0';
}

CrashContext::~CrashContext() { std::memcpy(context, previous_, sizeof previous_); }

}  // namespace loom::core
