// The NCCL plugin (libpipeshard_nccl_plugin.so, comm/device_groups.h) without a GPU: it loads,
// and it shares this process's watchdog. The watchdog is process-wide state that train
// arms; had the plugin a copy of its own, the NCCL communicator's waits would register
// where nothing is armed and a hung NCCL operation would never be caught. A build without
// NCCL has no plugin, and the test says so and skips.
#include <dlfcn.h>
#include <link.h>

#include <string>

#include <gtest/gtest.h>

#include "comm/device_groups.h"
#include "comm/watchdog.h"

namespace pipeshard {
namespace {

// Loaded objects whose path ends in `name`.
int loaded_copies(const std::string& name) {
  struct Search {
    std::string name;
    int found = 0;
  } search{"/" + name};
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        auto* s = static_cast<Search*>(data);
        const std::string path = info->dlpi_name != nullptr ? info->dlpi_name : "";
        if (path.size() >= s->name.size() && path.compare(path.size() - s->name.size(), s->name.size(), s->name) == 0) {
          ++s->found;
        }
        return 0;
      },
      &search);
  return search.found;
}

TEST(NcclPlugin, LoadsAndSharesTheProcesssWatchdog) {
  watchdog_disarm();  // this process uses the watchdog, as train does: it is loaded before the plugin
  const Status available = find_device_groups("nccl")->available();
  if (!available) {
    const std::string& why = available.message();
    ASSERT_EQ(why.rfind("this build has no NCCL communicator", 0), 0u) << why;
    GTEST_SKIP() << why;
  }
  EXPECT_EQ(loaded_copies("libpipeshard_nccl_plugin.so"), 1);
  EXPECT_EQ(loaded_copies("libpipeshard_watchdog.so"), 1);
  // The watchdog this test links, and the one the plugin's references resolve to (dlsym on
  // the plugin's handle searches it and its dependencies): one and the same.
  void* mine =
      dlsym(RTLD_DEFAULT, "_ZN9pipeshard12WatchdogWaitC1EPKcPKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE");
  ASSERT_NE(mine, nullptr) << "this test's WatchdogWait";
  Dl_info where{};
  ASSERT_NE(dladdr(mine, &where), 0);
  EXPECT_NE(std::string(where.dli_fname).find("libpipeshard_watchdog.so"), std::string::npos) << where.dli_fname;
  const std::string plugin = std::string(PIPESHARD_BIN_DIR) + "/libpipeshard_nccl_plugin.so";
  void* handle = dlopen(plugin.c_str(), RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(handle, nullptr) << "the plugin is loaded";
  EXPECT_EQ(dlsym(handle, "_ZN9pipeshard12WatchdogWaitC1EPKcPKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE"),
            mine);
  dlclose(handle);  // the reference RTLD_NOLOAD took; the plugin stays
}

}  // namespace
}  // namespace pipeshard
