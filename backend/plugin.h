// Plugins: shared libraries beside the executable that the process opens only when it
// needs what they hold. The CUDA backend (libpipeshard_cuda_plugin.so: cuBLASLt alone is
// 540 MB, and linking it would cost every process 0.17 s and 200 MB at start-up) and the
// NCCL communicator (libpipeshard_nccl_plugin.so: libnccl is 200 MB more) are two; a build
// without their toolkit has no such file, and the reason says so.
//
// A plugin exports C entry points. Objects cross the boundary as C++ objects (a Backend, a
// Communicator), so a plugin and the executable that opens it must come from one build.
#ifndef PIPESHARD_BACKEND_PLUGIN_H_
#define PIPESHARD_BACKEND_PLUGIN_H_

#include <initializer_list>
#include <string>

#include "common/status.h"

namespace pipeshard {

// One entry point to resolve: the symbol's name and the function pointer that receives its
// address.
struct PluginEntry {
  template <typename F>
  PluginEntry(const char* symbol, F** function)
      : symbol(symbol), target(function),
        assign([](void* target, void* address) { *static_cast<F**>(target) = reinterpret_cast<F*>(address); }) {}
  const char* symbol;
  void* target;
  void (*assign)(void* target, void* address);
};

// The folder of the running executable (/proc/self/exe), where the build puts the plugins;
// "." when it cannot be read.
std::string executable_folder();

// Opens `file` (a bare name such as "libpipeshard_cuda_plugin.so") in executable_folder()
// with RTLD_NOW | RTLD_LOCAL, so that what the plugin defines stays its own (libraries it
// shares with the process, libcudart or libpipeshard_watchdog, are found already loaded by
// their soname and not loaded twice), and sets every entry's function pointer. The library
// stays loaded for the life of the process; callers open each plugin once and keep the
// result. On failure no pointer is set and the reason is one line: `absent` when there is
// no such file (the build made none), "cannot load PATH: <dlerror>" when it does not load,
// "PATH lacks SYMBOL: a plugin from another build?" when an entry point is missing.
Status open_plugin(const std::string& file, const std::string& absent, std::initializer_list<PluginEntry> entries);

}  // namespace pipeshard

#endif  // PIPESHARD_BACKEND_PLUGIN_H_
