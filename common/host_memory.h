// How much memory this process may still take before the kernel (or its container)
// refuses or kills it: what `train` compares its estimate with before allocating.
#ifndef PIPESHARD_COMMON_HOST_MEMORY_H_
#define PIPESHARD_COMMON_HOST_MEMORY_H_

#include <cstdint>
#include <string>

namespace pipeshard {

struct HostMemory {
  int64_t available = -1;      // bytes: the smaller of what follows that is known; -1: unknown
  int64_t mem_available = -1;  // /proc/meminfo's MemAvailable
  int64_t cgroup_room = -1;    // the cgroup's limit less its usage (v2 memory.max, v1 limit_in_bytes); -1: no limit
  std::string cgroup_path;     // the cgroup the limit belongs to, for messages
};

// Reads the figures under `root` ("/" on a real system; tests pass a folder laid out like
// one): proc/meminfo, proc/self/cgroup, and the cgroup's files under sys/fs/cgroup (v2,
// unified or hybrid) or sys/fs/cgroup/memory (v1). Anything missing or unreadable counts
// as unknown, never as an error.
HostMemory read_host_memory(const std::string& root = "/");

// "1.5 GiB", "300.0 MiB", "12.0 KiB", "7 B".
std::string bytes_text(int64_t bytes);

// A size as a user writes it: "1073741824", "1.5GiB", "512 MiB", "8G" (K, M, G, T and
// KiB … TiB: powers of 1024), "80GB" (KB … TB: powers of 1000). False on anything else,
// on 0 or less, or past 2^62 bytes.
bool parse_bytes(const std::string& text, int64_t* bytes);

}  // namespace pipeshard

#endif  // PIPESHARD_COMMON_HOST_MEMORY_H_
