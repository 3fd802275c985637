#include "tools/plot/plot.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <vector>

#include "common/atomic_file.h"

extern char** environ;

namespace pipeshard {
namespace {

namespace fs = std::filesystem;

constexpr const char* kScriptName = "pipeshard_plot.py";

// Debian's interpreter by name: the python3 first on PATH may be another without matplotlib.
const char* interpreter_override() {
  const char* env = std::getenv("PIPESHARD_PYTHON");
  return env && *env ? env : nullptr;
}

// Beside the executable first, so that a build folder uses the script it was built
// with even when the source tree has moved on or is gone.
Result<std::string> script_path() {
  std::error_code ec;
  const fs::path beside = fs::read_symlink("/proc/self/exe", ec).parent_path() / kScriptName;
  if (!ec && fs::exists(beside)) return beside.string();
  const std::string source = PIPESHARD_PLOT_SCRIPT_SOURCE;
  if (fs::exists(source)) return source;
  return Status::error("cannot find the plotting script " + std::string(kScriptName) +
                       " beside the executable or at '" + source + "'");
}

// The environment with MPLBACKEND=Agg: files only, never a window.
std::vector<std::string> plot_environment() {
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    if (std::strncmp(*e, "MPLBACKEND=", 11) != 0) env.emplace_back(*e);
  }
  env.emplace_back("MPLBACKEND=Agg");
  return env;
}

std::vector<char*> c_strings(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (std::string& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

// The last non-empty line of `text` (a Python traceback ends with the exception).
std::string last_line(const std::string& text) {
  size_t end = text.find_last_not_of(" \n\r\t");
  if (end == std::string::npos) return "";
  size_t begin = text.rfind('\n', end);
  return text.substr(begin == std::string::npos ? 0 : begin + 1,
                     end + 1 - (begin == std::string::npos ? 0 : begin + 1));
}

// Runs interpreter() with the script and `args`, stdin from /dev/null, stdout and
// stderr collected; OK when it exits with status 0, else its last line of output.
Status run_script(std::vector<std::string> args) {
  Result<std::string> script = script_path();
  if (!script) return script.status();
  const char* override = interpreter_override();
  std::vector<std::string> argv = {override ? override : "/usr/bin/python3", *script};
  argv.insert(argv.end(), args.begin(), args.end());
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) return Status::error(std::string("pipe: ") + std::strerror(errno));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], STDERR_FILENO);
  std::vector<std::string> env = plot_environment();
  std::vector<char*> c_argv = c_strings(argv), c_env = c_strings(env);
  pid_t pid = 0;
  // posix_spawn rather than fork: no copy of a large address space, and MPI libraries
  // that object to fork() in a rank accept it.
  const int spawned = ::posix_spawnp(&pid, argv[0].c_str(), &actions, nullptr, c_argv.data(), c_env.data());
  posix_spawn_file_actions_destroy(&actions);
  ::close(pipe_fds[1]);
  if (spawned != 0) {
    ::close(pipe_fds[0]);
    return Status::error(
        "cannot run the plotting interpreter '" + argv[0] + "'" + (override ? " (from PIPESHARD_PYTHON)" : "") + ": " +
        std::strerror(spawned) +
        (override ? "" : "; install python3-matplotlib, or name a Python with matplotlib in PIPESHARD_PYTHON"));
  }
  std::string output;
  char buffer[4096];
  for (;;) {
    const ssize_t n = ::read(pipe_fds[0], buffer, sizeof buffer);
    if (n > 0) output.append(buffer, static_cast<size_t>(n));
    if (n == 0 || (n < 0 && errno != EINTR)) break;
  }
  ::close(pipe_fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return Status::ok();
  const std::string line = last_line(output);
  if (!line.empty()) return Status::error(line);
  if (WIFEXITED(status)) {
    return Status::error(argv[0] + " " + *script + " exited with status " + std::to_string(WEXITSTATUS(status)));
  }
  return Status::error(argv[0] + " " + *script + " was killed by signal " + std::to_string(WTERMSIG(status)));
}

// A temporary file that is removed when it goes out of scope.
class TemporaryFile {
 public:
  TemporaryFile() {
    path_ = (fs::temp_directory_path() / "pipeshard-plot-XXXXXX.json").string();
    const int fd = ::mkstemps(path_.data(), 5);
    if (fd < 0) {
      path_.clear();
    } else {
      ::close(fd);
    }
  }
  ~TemporaryFile() {
    if (!path_.empty()) std::remove(path_.c_str());
  }
  TemporaryFile(const TemporaryFile&) = delete;
  TemporaryFile& operator=(const TemporaryFile&) = delete;
  const std::string& path() const { return path_; }  // empty when none could be made

 private:
  std::string path_;
};

}  // namespace

Status check_picture_output(const std::string& path) { return run_script({"--check", path}); }

Status draw_picture(const nlohmann::json& data, const std::string& path) {
  TemporaryFile data_file;
  if (data_file.path().empty())
    return Status::error("cannot make a temporary file in " + fs::temp_directory_path().string());
  // dump()'s "replace" keeps going on names that are not valid UTF-8 (corrupt files).
  PIPESHARD_RETURN_IF_ERROR(
      write_file_synced(data_file.path(), data.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)));
  return run_script({data_file.path(), path});
}

}  // namespace pipeshard
