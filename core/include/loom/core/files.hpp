// Writing files so that a crash never leaves a half-written one: write a temporary file beside
// the target, fsync it, rename it over the target, fsync the folder.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>

namespace loom::core {

/// Atomically replaces `path` with `bytes`. Throws loom::Error naming the path on failure.
void write_file_atomic(const std::filesystem::path& path, std::string_view bytes);

/// Reads a whole file; throws loom::Error naming the path.
std::string read_file(const std::filesystem::path& path);

/// fsyncs a folder (after a rename into it).
void fsync_dir(const std::filesystem::path& dir);

/// Atomically renames `from` to `to` (both in one folder) and fsyncs the folder.
void rename_durable(const std::filesystem::path& from, const std::filesystem::path& to);

}  // namespace loom::core
