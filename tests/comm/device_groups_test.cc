// The registry of device groups (comm/device_groups.h) in one process: which kind a run
// uses, what the kinds carry, the groups they make, and what they know about the machine.
// The NCCL kind's plugin is nccl_plugin_test's; its groups need GPUs (the device check).
#include <cstdlib>
#include <string>

#include <gtest/gtest.h>

#include "backend/registry.h"
#include "comm/device_groups.h"

namespace pipeshard {
namespace {

const BackendKind& cpu() { return *find_backend("cpu"); }
const BackendKind& cuda() { return *find_backend("cuda"); }

// Sets an environment variable for one test and puts back what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    if (old != nullptr) old_ = old;
    had_ = old != nullptr;
    if (value != nullptr) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (had_) {
      ::setenv(name_, old_.c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

TEST(DeviceGroups, TheKindsAndWhatTheyCarry) {
  ASSERT_EQ(device_group_kinds().size(), 3u);
  const DeviceGroupKind& host = *find_device_groups("host");
  const DeviceGroupKind& staged = *find_device_groups("staged");
  const DeviceGroupKind& nccl = *find_device_groups("nccl");
  EXPECT_TRUE(host.carries_memory(BackendMemory::kHost));
  EXPECT_FALSE(host.carries_memory(BackendMemory::kDevice));
  EXPECT_TRUE(staged.carries_memory(BackendMemory::kHost));
  EXPECT_TRUE(staged.carries_memory(BackendMemory::kDevice));
  EXPECT_FALSE(nccl.carries_memory(BackendMemory::kHost));
  EXPECT_TRUE(nccl.one_process_per_device);
  EXPECT_FALSE(staged.one_process_per_device);
  EXPECT_TRUE(host.available().is_ok());
  EXPECT_TRUE(staged.available().is_ok());
  EXPECT_EQ(find_device_groups("gloo"), nullptr);
}

TEST(DeviceGroups, OneProcessUsesTheHostGroups) {
  EXPECT_STREQ(choose_device_groups(cuda(), 1, "nccl").name, "host");
  EXPECT_STREQ(choose_device_groups(cpu(), 1, "staged").name, "host");
}

TEST(DeviceGroups, ABackendInHostMemoryIsStagedOnlyWhenTheTestsAsk) {
  {
    ScopedEnv unset("PIPESHARD_STAGE_COMM", nullptr);
    EXPECT_STREQ(choose_device_groups(cpu(), 4, "staged").name, "host");
  }
  ScopedEnv staged("PIPESHARD_STAGE_COMM", "1");
  EXPECT_STREQ(choose_device_groups(cpu(), 4, "staged").name, "staged");
}

TEST(DeviceGroups, ABackendInDeviceMemoryGetsWhatWasAskedFor) {
  EXPECT_STREQ(choose_device_groups(cuda(), 2, "staged").name, "staged");
  EXPECT_STREQ(choose_device_groups(cuda(), 2, "nccl").name, "nccl");
}

TEST(DeviceGroups, HostGroupsLeaveTheTrainerOnTheHostGroups) {
  DeviceGroups none;
  EXPECT_STREQ(none.kind().name, "host");
  EXPECT_EQ(none.for_trainer(), nullptr);
  none.abandon();  // nothing to let go of
}

TEST(DeviceGroups, StagedGroupsStageEveryGroup) {
  std::unique_ptr<Communicator> world = make_single_process_communicator();
  ProcessGroups host = make_process_groups(*world, ProcessLayout{});
  std::unique_ptr<Backend> backend = make_cpu_backend();
  DeviceGroups staged = make_device_groups(*find_device_groups("staged"), host, *backend, 0);
  ProcessGroups* groups = staged.for_trainer();
  ASSERT_NE(groups, nullptr);
  ASSERT_NE(groups->data, nullptr);
  ASSERT_NE(groups->tensor, nullptr);
  ASSERT_NE(groups->pipeline, nullptr);
  EXPECT_NE(groups->data.get(), host.data.get());
  float x[3] = {1, 2, 3};  // a group of one sums to itself, through the staging copies
  groups->data->all_reduce(x, 3, ReduceOp::kSum);
  EXPECT_EQ(x[2], 3.0f);
}

TEST(DeviceGroups, TheDeviceIsTheLocalRankModuloTheDevices) {
  ScopedEnv rank("OMPI_COMM_WORLD_LOCAL_RANK", "3");
  EXPECT_EQ(local_rank(), 3);
  EXPECT_EQ(device_of_this_process(cpu()), 0);  // one CPU
}

TEST(DeviceGroups, AMachineWithoutDevicesIsCrowded) {
  std::unique_ptr<Communicator> world = make_single_process_communicator();
  EXPECT_EQ(split_by_machine(*world)->size(), 1);
  const Crowding fits = crowded_machines(*world, cpu());
  EXPECT_EQ(fits.machines, 0);
  if (cuda().usable_devices(nullptr) > 0) GTEST_SKIP() << "this machine has a usable GPU";
  const Crowding none = crowded_machines(*world, cuda());
  EXPECT_EQ(none.machines, 1);
  EXPECT_EQ(none.processes, 1);
  EXPECT_EQ(none.devices, 0);
}

}  // namespace
}  // namespace pipeshard
