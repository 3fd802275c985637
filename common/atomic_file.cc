#include "common/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string_view>

namespace pipeshard {
namespace {

// "cannot write 'path' (reason)", the reason from errno as the failed call left it.
Status cannot_write(const std::string& path, int error) {
  return Status::error("cannot write '" + path + "' (" + std::strerror(error) + ")");
}

void crash_if(const CrashPoint& crash, CrashPoint::Where where) {
  if (crash.where == where) std::raise(SIGKILL);
}

// Writes bytes[0, n) to fd; false on an error (EINTR is retried: train handles SIGINT).
bool write_all(int fd, const char* bytes, size_t n) {
  size_t done = 0;
  while (done < n) {
    const ssize_t w = ::write(fd, bytes + done, n - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    done += static_cast<size_t>(w);
  }
  return true;
}

// Writes `path`; errors name `shown` (the file the caller asked for).
Status write_synced(const std::string& path, const std::vector<std::string_view>& pieces, const CrashPoint& crash,
                    const std::string& shown) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return cannot_write(shown, errno);
  size_t total = 0;
  for (std::string_view p : pieces) total += p.size();
  size_t first = total;  // bytes before the crash point
  if (crash.where == CrashPoint::Where::kAfterBytes)
    first = std::min(first, static_cast<size_t>(std::max<int64_t>(crash.bytes, 0)));
  bool written = true;
  size_t done = 0;
  for (std::string_view p : pieces) {
    const size_t before = first > done ? std::min(p.size(), first - done) : 0;  // this piece's part before it
    written = written && write_all(fd, p.data(), before);
    if (done + before == first) crash_if(crash, CrashPoint::Where::kAfterBytes);
    written = written && write_all(fd, p.data() + before, p.size() - before);
    done += p.size();
  }
  crash_if(crash, CrashPoint::Where::kAfterBytes);  // no pieces, or a point past the end
  const int write_error = written ? 0 : errno;
  const bool synced = written && ::fsync(fd) == 0;
  const int error = written ? errno : write_error;
  ::close(fd);
  if (!synced) {
    std::remove(path.c_str());
    return cannot_write(shown, error);
  }
  return Status::ok();
}

std::vector<std::string_view> views(const std::vector<std::string>& pieces) {
  return std::vector<std::string_view>(pieces.begin(), pieces.end());
}

Status write_atomically(const std::string& path, const std::vector<std::string_view>& pieces, const CrashPoint& crash) {
  const std::string tmp = path + ".tmp" + std::to_string(::getpid());
  PIPESHARD_RETURN_IF_ERROR(write_synced(tmp, pieces, crash, path));
  crash_if(crash, CrashPoint::Where::kBeforeRename);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int error = errno;
    std::remove(tmp.c_str());
    return cannot_write(path, error);
  }
  crash_if(crash, CrashPoint::Where::kAfterRename);
  // Make the rename itself durable: until the folder is synced, a power cut may bring
  // back the old name.
  const std::string dir = std::filesystem::path(path).parent_path().string();
  const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  const bool synced = dfd >= 0 && ::fsync(dfd) == 0;
  if (dfd >= 0) ::close(dfd);
  if (!synced)
    return Status::error("wrote '" + path + "' but cannot sync its folder: the new file may not survive a power cut");
  return Status::ok();
}

}  // namespace

Status write_file_synced(const std::string& path, const std::string& bytes) {
  return write_synced(path, {bytes}, {}, path);
}

Status write_file_synced(const std::string& path, const std::vector<std::string>& pieces) {
  return write_synced(path, views(pieces), {}, path);
}

Status write_file_atomically(const std::string& path, const std::string& bytes, const CrashPoint& crash) {
  return write_atomically(path, {bytes}, crash);
}

Status write_file_atomically(const std::string& path, const std::vector<std::string>& pieces, const CrashPoint& crash) {
  return write_atomically(path, views(pieces), crash);
}

Status check_writable_folder(const std::string& folder) {
  const std::string dir = folder.empty() ? "." : folder;
  std::string probe = (std::filesystem::path(dir) / ".pipeshard-probe-XXXXXX").string();
  const int fd = ::mkstemp(probe.data());
  if (fd < 0) return Status::error("cannot create files in '" + dir + "' (" + std::strerror(errno) + ")");
  ::close(fd);
  std::remove(probe.c_str());
  return Status::ok();
}

Status check_creatable_folder(const std::string& folder) {
  namespace fs = std::filesystem;
  std::error_code ec;
  // Appended piece by piece: "'" + a temporary string trips GCC 12's -Wrestrict (a false alarm).
  auto not_a_folder = [](const std::string& path) {
    std::string message = "'";
    message += path;
    message += "' is a file, not a folder";
    return Status::error(message);
  };
  fs::path p = folder.empty() ? fs::path(".") : fs::path(folder);
  if (fs::exists(p, ec) && !fs::is_directory(p, ec)) return not_a_folder(folder);
  while (!fs::exists(p, ec) && p.has_parent_path() && p.parent_path() != p) p = p.parent_path();
  if (!fs::exists(p, ec)) p = ".";
  if (!fs::is_directory(p, ec)) return not_a_folder(p.string());
  return check_writable_folder(p.string());
}

}  // namespace pipeshard
