// Device memory without cudaMalloc in the step loop: freed blocks are kept by size and
// handed out again, as PyTorch's caching allocator does in its simplest form. Training
// allocates the same sizes every step (activations, staging), so after the first step
// every request is served from the cache. Sizes are rounded up (512 B, or 2 MiB above
// 1 MiB) so that near sizes share blocks.
#ifndef PIPESHARD_BACKEND_CUDA_ALLOCATOR_H_
#define PIPESHARD_BACKEND_CUDA_ALLOCATOR_H_

#include <cstddef>
#include <map>
#include <unordered_map>

namespace pipeshard::cuda {

class CachingAllocator {
 public:
  CachingAllocator() = default;
  ~CachingAllocator();  // returns every block to the driver
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // A block of at least `bytes` on the current device; fatal (with the figures) when the
  // device has no room even after the cache is returned to the driver.
  void* allocate(size_t bytes);
  void deallocate(void* p);  // p from allocate(), or null

  size_t bytes_in_use() const { return in_use_; }
  size_t bytes_cached() const { return cached_; }
  size_t peak_bytes_in_use() const { return peak_; }
  size_t driver_allocations() const { return driver_allocations_; }

 private:
  void release_cache();

  std::multimap<size_t, void*> free_;          // rounded size -> block
  std::unordered_map<void*, size_t> size_of_;  // every live or cached block
  size_t in_use_ = 0, cached_ = 0, peak_ = 0, driver_allocations_ = 0;
};

}  // namespace pipeshard::cuda

#endif  // PIPESHARD_BACKEND_CUDA_ALLOCATOR_H_
