#include "backend/cuda/allocator.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "backend/cuda/cuda_check.h"

namespace pipeshard::cuda {
namespace {

size_t round_up(size_t bytes) {
  constexpr size_t kSmall = 512, kLarge = size_t{2} << 20, kLargeFrom = size_t{1} << 20;
  const size_t unit = bytes >= kLargeFrom ? kLarge : kSmall;
  return std::max(unit, (bytes + unit - 1) / unit * unit);
}

}  // namespace

CachingAllocator::~CachingAllocator() {
  // Live blocks too: their owners (DeviceBuffers) are gone with the backend.
  for (auto& [p, size] : size_of_) cudaFree(p);
}

void* CachingAllocator::allocate(size_t bytes) {
  const size_t size = round_up(bytes);
  // Exact size first; a larger cached block only while it wastes at most a quarter.
  auto it = free_.lower_bound(size);
  if (it != free_.end() && it->first <= size + size / 4) {
    void* p = it->second;
    cached_ -= it->first;
    in_use_ += it->first;
    free_.erase(it);
    peak_ = std::max(peak_, in_use_);
    return p;
  }
  void* p = nullptr;
  cudaError_t rc = cudaMalloc(&p, size);
  if (rc == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // clear it, give the cache back, and try once more
    release_cache();
    rc = cudaMalloc(&p, size);
  }
  if (rc != cudaSuccess) {
    if (rc != cudaErrorMemoryAllocation) {  // not a matter of room: a capture in progress, a lost device
      std::fprintf(stderr, "pipeshard: cudaMalloc of %zu bytes failed: %s\n", size, cudaGetErrorString(rc));
      std::fflush(stderr);
      std::abort();
    }
    size_t free_bytes = 0, total = 0;
    cudaMemGetInfo(&free_bytes, &total);
    std::fprintf(stderr,
                 "pipeshard: out of GPU memory: %zu bytes asked for, %zu in use by pipeshard, %zu free of %zu (%s)\n",
                 size, in_use_, free_bytes, total, cudaGetErrorString(rc));
    std::fflush(stderr);
    std::abort();
  }
  ++driver_allocations_;
  size_of_[p] = size;
  in_use_ += size;
  peak_ = std::max(peak_, in_use_);
  return p;
}

void CachingAllocator::deallocate(void* p) {
  if (p == nullptr) return;
  const size_t size = size_of_.at(p);
  in_use_ -= size;
  cached_ += size;
  free_.emplace(size, p);
}

void CachingAllocator::release_cache() {
  PIPESHARD_CUDA_CHECK(cudaDeviceSynchronize());  // a cached block may still be read by queued work
  for (auto& [size, p] : free_) {
    PIPESHARD_CUDA_CHECK(cudaFree(p));
    size_of_.erase(p);
  }
  free_.clear();
  cached_ = 0;
}

}  // namespace pipeshard::cuda
