// The report lines of a command's child process (core::run_child_process): `loom plugins check`
// and `loom bench` run plugin code in one, so that a crash or a hang ends that child alone. A line
// is fields separated by tabs; tabs, line breaks and backslashes in a field are escaped.
#pragma once

#include <string>
#include <vector>

namespace loom::cli {

/// `field` with its tabs, line breaks and backslashes escaped, to stand between tabs.
std::string escaped(const std::string& field);
/// A report line's fields, unescaped.
std::vector<std::string> fields(const std::string& line);
/// Writes `line` and a line break to descriptor `fd`, the child's end of its pipe; a parent gone
/// (nobody reads) ends this process, with status 1.
void tell_parent(int fd, std::string line);
/// This process's arguments as it was started (/proc/self/cmdline): a child's command line.
std::vector<std::string> own_arguments();
/// How a child that did not finish ended, from its wait status: "crashed the process running it
/// with SIGSEGV (Segmentation fault; its crash report is above, on stderr)", "... exit status 3".
std::string how_it_ended(int status);

}  // namespace loom::cli
