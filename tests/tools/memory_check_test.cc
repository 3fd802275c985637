// train refuses, before allocating, a run that cannot fit in the memory the machine has
// left, giving the figures; and the reading of that memory (/proc/meminfo, cgroup v1 and
// v2 limits) from files laid out like a real system's.
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/host_memory.h"
#include "dataset/npy.h"
#include "tests/model_builder.h"
#include "tests/test_util.h"

namespace pipeshard {
namespace {

using testing::quote;
using testing::run_command;
using testing::ScratchDir;
using testing::tool_path;

void write(const std::string& path, const std::string& text) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream(path) << text;
}

TEST(HostMemory, MemAvailableAloneWithoutACgroupLimit) {
  ScratchDir root("host_memory");
  write(root / "proc/meminfo", "MemTotal: 24000000 kB\nMemFree: 1000 kB\nMemAvailable: 2000000 kB\n");
  write(root / "proc/self/cgroup", "0::/\n");
  write(root / "sys/fs/cgroup/memory.max", "max\n");
  const HostMemory m = read_host_memory(root.path());
  EXPECT_EQ(m.mem_available, 2000000LL * 1024);
  EXPECT_EQ(m.cgroup_room, -1);
  EXPECT_EQ(m.available, 2000000LL * 1024);
}

TEST(HostMemory, CgroupV2LimitLessUsageWhenLower) {
  ScratchDir root("host_memory");
  write(root / "proc/meminfo", "MemAvailable: 2000000 kB\n");
  write(root / "proc/self/cgroup", "0::/job/42\n");
  write(root / "sys/fs/cgroup/job/42/memory.max", "1000000000\n");
  write(root / "sys/fs/cgroup/job/42/memory.current", "400000000\n");
  const HostMemory m = read_host_memory(root.path());
  EXPECT_EQ(m.cgroup_room, 600000000);
  EXPECT_EQ(m.available, 600000000);
  EXPECT_EQ(m.cgroup_path, "/job/42");
}

TEST(HostMemory, CgroupV1MemoryControllerAmongOthers) {
  ScratchDir root("host_memory");
  write(root / "proc/meminfo", "MemAvailable: 100 kB\n");
  write(root / "proc/self/cgroup", "5:cpu,cpuacct:/\n4:memory:/slurm/job7\n0::/\n");
  write(root / "sys/fs/cgroup/memory/slurm/job7/memory.limit_in_bytes", "5000000\n");
  write(root / "sys/fs/cgroup/memory/slurm/job7/memory.usage_in_bytes", "1000000\n");
  const HostMemory m = read_host_memory(root.path());
  EXPECT_EQ(m.cgroup_room, 4000000);
  EXPECT_EQ(m.available, 100 * 1024) << "MemAvailable is lower here";
}

TEST(HostMemory, CgroupV1WithoutALimitAndNothingReadable) {
  ScratchDir root("host_memory");
  write(root / "proc/self/cgroup", "4:memory:/\n");
  write(root / "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");  // v1's "none"
  write(root / "sys/fs/cgroup/memory/memory.usage_in_bytes", "420167680\n");
  const HostMemory m = read_host_memory(root.path());
  EXPECT_EQ(m.cgroup_room, -1);
  EXPECT_EQ(m.mem_available, -1);
  EXPECT_EQ(m.available, -1) << "unknown, not zero: nothing is refused on no information";
}

TEST(HostMemory, TheRealSystemHasAFigure) {
  EXPECT_GT(read_host_memory().available, 0) << "/proc/meminfo has MemAvailable on every kernel since 3.14";
}

// 1000 ReLUs on 4096 features keep every other one's output (backward recomputes the rest
// from it), 8 MiB of activations per sample; a batch of 16384 needs about 126 GiB, more
// than any test machine has. The file is 1 MiB and the data 4 MiB.
TEST(MemoryCheck, ARunThatCannotFitIsRefusedBeforeAllocatingWithTheFigures) {
  ScratchDir dir("memory_check");
  testing::ModelBuilder b(64);
  std::string x = b.linear("input", 64, 4096);
  for (int i = 0; i < 1000; ++i) x = b.relu(x);
  b.output(b.linear(x, 4096, 10), 10);
  b.save(dir / "deep_relu.onnx");
  const int64_t samples = 16384;
  const std::vector<float> features(samples * 64, 0.5f);
  std::vector<int64_t> labels(samples, 3);
  ASSERT_TRUE(write_npy(dir / "x.npy", {samples, 64}, features.data()));
  ASSERT_TRUE(write_npy(dir / "y.npy", {samples}, labels.data()));
  const auto r =
      run_command(quote(tool_path("train")) + " " + quote(dir / "deep_relu.onnx") + " --data " + quote(dir / "x.npy") +
                  " --labels " + quote(dir / "y.npy") + " --batch-size 16384 --steps 1");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("train: error: training needs about 12"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(" GiB on this machine (one process; "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("a smaller --batch-size or more --micro-batches"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "one line:\n" << r.err;
  std::printf("%s", r.err.c_str());
}

}  // namespace
}  // namespace pipeshard
