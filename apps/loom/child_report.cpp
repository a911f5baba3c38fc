// The report lines of a command's child process (child_report.hpp).
#include "child_report.hpp"

#include <loom/core/stop_signals.hpp>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sys/wait.h>
#include <unistd.h>

namespace loom::cli {

namespace {

std::string unescaped(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\\' || i + 1 == s.size()) {
      out += s[i];
      continue;
    }
    const char c = s[++i];
    out += c == 't' ? '\t' : c == 'n' ? '\n' : c;
  }
  return out;
}

}  // namespace

std::string escaped(const std::string& field) {
  std::string out;
  for (const char c : field) {
    if (c == '\\') out += "\\\\";
    else if (c == '\t') out += "\\t";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

std::vector<std::string> fields(const std::string& line) {
  std::vector<std::string> out;
  for (size_t start = 0;;) {
    const size_t tab = line.find('\t', start);
    out.push_back(unescaped(line.substr(start, tab == std::string::npos ? std::string::npos : tab - start)));
    if (tab == std::string::npos) return out;
    start = tab + 1;
  }
}

void tell_parent(int fd, std::string line) {
  line += '\n';
  for (size_t done = 0; done < line.size();) {
    const ssize_t n = ::write(fd, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) std::_Exit(1);  // the parent is gone: nobody reads the report
    done += static_cast<size_t>(n);
  }
}

std::vector<std::string> own_arguments() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::vector<std::string> out;
  for (std::string arg; std::getline(in, arg, '\0');) out.push_back(arg);
  return out;
}

std::string how_it_ended(int status) {
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const bool reported = core::is_crash_signal(sig);
    return std::string(reported ? "crashed the process running it with " : "ended the process running it by ") +
           core::signal_name(sig) + " (" + ::strsignal(sig) + (reported ? "; its crash report is above, on stderr)" : ")");
  }
  if (WIFEXITED(status))
    return "ended the process running it with exit status " + std::to_string(WEXITSTATUS(status)) +
           " (exit() in the plugin's code?)";
  return "ended the process running it";
}

}  // namespace loom::cli
