#include "backend/plugin.h"

#include <dlfcn.h>
#include <unistd.h>

#include <climits>
#include <vector>

namespace pipeshard {

std::string executable_folder() {
  char path[PATH_MAX] = {};
  const ssize_t n = ::readlink("/proc/self/exe", path, sizeof path - 1);
  if (n <= 0) return ".";
  std::string p(path, static_cast<size_t>(n));
  return p.substr(0, p.find_last_of('/'));
}

Status open_plugin(const std::string& file, const std::string& absent, std::initializer_list<PluginEntry> entries) {
  const std::string path = executable_folder() + "/" + file;
  void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* e = ::dlerror();
    return Status::error(::access(path.c_str(), F_OK) != 0 ? absent : "cannot load " + path + ": " + (e ? e : "?"));
  }
  // Every address first, so that a plugin missing one entry point sets none: callers test
  // a single pointer, or the Status, and never see half a plugin.
  std::vector<void*> addresses;
  for (const PluginEntry& entry : entries) {
    void* address = ::dlsym(handle, entry.symbol);
    if (address == nullptr) {
      // Not dlclose'd: what the library's initialisers registered (CUDA's fat binaries)
      // may not survive unloading, and the process will not ask again.
      return Status::error(path + " lacks " + entry.symbol + ": a plugin from another build?");
    }
    addresses.push_back(address);
  }
  size_t i = 0;
  for (const PluginEntry& entry : entries) entry.assign(entry.target, addresses[i++]);
  return Status::ok();
}

}  // namespace pipeshard
