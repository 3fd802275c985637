#include "common/host_memory.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace pipeshard {
namespace {

// The first token of a file as a non-negative integer; -1 when missing, "max" or not a number.
int64_t read_number(const std::string& path) {
  std::ifstream in(path);
  std::string token;
  if (!(in >> token) || token.empty() || token.size() > 19 ||
      token.find_first_not_of("0123456789") != std::string::npos) {
    return -1;
  }
  return std::stoll(token);
}

// MemAvailable from a meminfo file, in bytes.
int64_t mem_available(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    long long kib = 0;
    if (std::sscanf(line.c_str(), "MemAvailable: %lld kB", &kib) == 1 && kib >= 0) return kib * 1024;
  }
  return -1;
}

// Limit less usage of the memory cgroup `dir` (files `limit` and `usage`); -1 without a limit.
int64_t room(const std::string& dir, const char* limit, const char* usage) {
  const int64_t l = read_number(dir + "/" + limit), u = read_number(dir + "/" + usage);
  // cgroup v1 writes "no limit" as a huge number (PAGE_COUNTER_MAX pages); treat ≥ 2^60 as none.
  if (l < 0 || l >= (int64_t{1} << 60)) return -1;
  return std::max<int64_t>(0, l - std::max<int64_t>(u, 0));
}

}  // namespace

HostMemory read_host_memory(const std::string& root) {
  const std::string base = root.empty() || root.back() != '/' ? root + "/" : root;
  HostMemory m;
  m.mem_available = mem_available(base + "proc/meminfo");
  // /proc/self/cgroup: "0::/path" (v2), "N:memory:/path" or "N:...,memory,...:/path" (v1).
  std::ifstream in(base + "proc/self/cgroup");
  std::string line;
  while (std::getline(in, line)) {
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    std::string controllers(1, ',');  // ",memory," or ",," (v2): each name between commas
    controllers.append(line, a + 1, b - a - 1).push_back(',');
    const std::string path = line.substr(b + 1);
    int64_t r = -1;
    std::string where;
    if (controllers == ",,") {  // v2
      for (const char* mount : {"sys/fs/cgroup", "sys/fs/cgroup/unified"}) {
        where = base + mount + path;
        if ((r = room(where, "memory.max", "memory.current")) >= 0) break;
      }
    } else if (controllers.find(",memory,") != std::string::npos) {  // v1
      where = base + "sys/fs/cgroup/memory" + path;
      r = room(where, "memory.limit_in_bytes", "memory.usage_in_bytes");
    }
    if (r >= 0 && (m.cgroup_room < 0 || r < m.cgroup_room)) {
      m.cgroup_room = r;
      m.cgroup_path = path;
    }
  }
  for (int64_t known : {m.mem_available, m.cgroup_room}) {
    if (known >= 0 && (m.available < 0 || known < m.available)) m.available = known;
  }
  return m;
}

std::string bytes_text(int64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char text[32];
  if (u == 0) {
    std::snprintf(text, sizeof text, "%lld B", static_cast<long long>(bytes));
  } else {
    std::snprintf(text, sizeof text, "%.1f %s", v, kUnits[u]);
  }
  return text;
}

bool parse_bytes(const std::string& text, int64_t* bytes) {
  static const std::pair<const char*, double> kUnits[] = {
      {"", 1},     {"B", 1},      {"K", 0x1p10},   {"KiB", 0x1p10}, {"KB", 1e3},   {"M", 0x1p20},   {"MiB", 0x1p20},
      {"MB", 1e6}, {"G", 0x1p30}, {"GiB", 0x1p30}, {"GB", 1e9},     {"T", 0x1p40}, {"TiB", 0x1p40}, {"TB", 1e12}};
  if (text.empty() || ((text[0] < '0' || text[0] > '9') && text[0] != '.')) return false;  // no sign, no space
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    return false;
  }
  std::string unit = text.substr(used);
  if (!unit.empty() && unit[0] == ' ') unit.erase(0, 1);
  for (const auto& [name, scale] : kUnits) {
    if (unit != name) continue;
    const double b = value * scale;
    if (!(b >= 1) || b > 0x1p62) return false;
    *bytes = static_cast<int64_t>(b);
    return true;
  }
  return false;
}

}  // namespace pipeshard
