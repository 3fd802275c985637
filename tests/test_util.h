// Helpers shared by the test suites: where the sources and tools are, scratch
// folders, running a tool and capturing its exit status and stderr.
#ifndef PIPESHARD_TESTS_TEST_UTIL_H_
#define PIPESHARD_TESTS_TEST_UTIL_H_

#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace pipeshard::testing {

inline std::string source_path(const std::string& rel) { return std::string(PIPESHARD_SOURCE_DIR) + "/" + rel; }
inline std::string tool_path(const std::string& tool) { return std::string(PIPESHARD_BIN_DIR) + "/" + tool; }

// The names (without .onnx) of every model in models/, sorted.
inline std::vector<std::string> model_names() {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(source_path("models"))) {
    if (e.path().extension() == ".onnx") names.push_back(e.path().stem().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

// A fresh, empty folder under the system temp dir, removed by the destructor.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& tag) {
    std::string pattern = (std::filesystem::temp_directory_path() / ("pipeshard-" + tag + "-XXXXXX")).string();
    path_ = ::mkdtemp(pattern.data()) ? pattern : std::string();
  }
  ~ScratchDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& rel) const { return path_ + "/" + rel; }

 private:
  std::string path_;
};

struct CommandResult {
  int exit_code = -1;  // the process's exit status, or -1 if it did not exit normally
  std::string out;     // stdout
  std::string err;     // stderr
};

inline std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs `command` through the shell, capturing stdout and stderr to files.
inline CommandResult run_command(const std::string& command) {
  ScratchDir io("cmd");
  const std::string full = command + " >" + (io / "out") + " 2>" + (io / "err");
  const int status = std::system(full.c_str());
  CommandResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = read_text(io / "out");
  r.err = read_text(io / "err");
  return r;
}

// Single quotes for the shell.
inline std::string quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

}  // namespace pipeshard::testing

#endif  // PIPESHARD_TESTS_TEST_UTIL_H_
