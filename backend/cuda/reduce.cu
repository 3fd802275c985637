// Reductions: bias_backward (a column sum into a device buffer) and the two that return
// host values, sum_squares and any_non_finite (launchers.h; the contract is
// backend/backend.h's).
//
// Every result is deterministic: the grid depends on the shape only (never on the device
// or its occupancy), each thread adds its elements in a fixed order, block sums go
// through a fixed shuffle tree, and the block partials are added by one block in a fixed
// order. No atomics take part in a sum, so the same input gives the same bits on every run.
//
// Scratch layout (the caller's `scratch`, reduce_scratch_bytes() long, from cudaMalloc
// and so aligned for doubles): the first kMaxPartials doubles hold the block partials of
// sum_squares, the next double its total, the int after that any_non_finite's flag. A call
// owns all of it until it returns (each synchronises the stream before returning).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launchers.h"

namespace pipeshard::cuda {
namespace {

constexpr int kThreads = 256;  // a multiple of 32, at most 32 warps (block_sum's tree)
constexpr int kWarps = kThreads / 32;
// Blocks of sum_squares's first pass: enough to fill an H200 (132 SMs × 8 blocks), few
// enough for one block to add up.
constexpr int64_t kMaxPartials = 1024;
// Elements per thread before sum_squares asks for another block.
constexpr int64_t kItemsPerThread = 4;

constexpr size_t kPartialsOffset = 0;
constexpr size_t kTotalOffset = kPartialsOffset + kMaxPartials * sizeof(double);
constexpr size_t kFlagOffset = kTotalOffset + sizeof(double);
// Generous on purpose: the losses in softmax.cu take the same buffer ("scratch as for
// reduce.cu"), and 64 KiB of device memory costs nothing next to the model.
constexpr size_t kScratchBytes = size_t{64} << 10;
static_assert(kFlagOffset + sizeof(int) <= kScratchBytes);

template <typename T>
T* scratch_at(void* scratch, size_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(scratch) + offset);
}

// The block's sum of v, valid in thread 0: each warp's shuffle tree, then warp 0's over
// the warp sums. The order of the additions is fixed by the block size alone.
__device__ double block_sum(double v) {
  __shared__ double warp_sums[kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  v = 0.0;
  if (warp == 0) {
    v = lane < kWarps ? warp_sums[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  }
  return v;
}

// partials[blockIdx.x] = Σ x[i]² (in double) over the block's grid-stride share of x.
__global__ void sum_squares_partials_kernel(const float* x, int64_t n, double* partials) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  double s = 0.0;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) {
    const double v = x[i];
    s += v * v;
  }
  s = block_sum(s);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

// *total = Σ partials[0, count), by one block.
__global__ void sum_partials_kernel(const double* partials, int count, double* total) {
  double s = 0.0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) s += partials[i];
  s = block_sum(s);
  if (threadIdx.x == 0) *total = s;
}

// *flag = 1 when some x[i] is ±inf or NaN (x·0 != 0, the CPU's probe); every writer
// writes the same value, so the races are benign.
__global__ void any_non_finite_kernel(const float* x, int64_t n, int* flag) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  bool bad = false;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) {
    bad |= __fmul_rn(x[i], 0.0f) != 0.0f;
  }
  if (bad) *flag = 1;
}

// db[j] += Σ_r dy[r, j]. A block owns kColumns columns at a time: thread (tx, ty) adds
// rows ty, ty + kRowLanes, … of column tx in order, then thread (tx, 0) adds the
// kRowLanes partial sums in order and once into db. Warps read 32 consecutive floats of
// a row; no atomics, so the sum's order is fixed.
constexpr int kColumns = 32;
constexpr int kRowLanes = 16;

__global__ void bias_backward_kernel(float* db, const float* dy, int64_t rows, int64_t width) {
  __shared__ float partial[kRowLanes][kColumns + 1];  // +1: no bank conflicts reading a column
  const int tx = threadIdx.x, ty = threadIdx.y;
  for (int64_t tile = blockIdx.x; tile * kColumns < width; tile += gridDim.x) {  // uniform per block
    const int64_t j = tile * kColumns + tx;
    float s = 0.0f;
    if (j < width) {
      for (int64_t r = ty; r < rows; r += kRowLanes) s = __fadd_rn(s, dy[r * width + j]);
    }
    partial[ty][tx] = s;
    __syncthreads();
    if (ty == 0 && j < width) {
      float total = partial[0][tx];
      for (int k = 1; k < kRowLanes; ++k) total = __fadd_rn(total, partial[k][tx]);
      db[j] = __fadd_rn(db[j], total);
    }
    __syncthreads();  // partial is rewritten by the next tile
  }
}

unsigned blocks_for(int64_t work, int64_t limit) {
  return static_cast<unsigned>(std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, limit));
}

template <typename T>
T read_back(const T* device_value, cudaStream_t stream) {
  T host{};
  PIPESHARD_CUDA_CHECK(cudaMemcpyAsync(&host, device_value, sizeof(T), cudaMemcpyDeviceToHost, stream));
  PIPESHARD_CUDA_CHECK(cudaStreamSynchronize(stream));
  return host;
}

}  // namespace

void bias_backward(float* db, const float* dy, int64_t rows, int64_t width, cudaStream_t stream) {
  if (rows <= 0 || width <= 0) return;
  constexpr int64_t kMaxTiles = 65535;
  const auto tiles = static_cast<unsigned>(std::min<int64_t>((width + kColumns - 1) / kColumns, kMaxTiles));
  bias_backward_kernel<<<tiles, dim3(kColumns, kRowLanes), 0, stream>>>(db, dy, rows, width);
  PIPESHARD_CUDA_LAUNCHED();
}

size_t reduce_scratch_bytes() { return kScratchBytes; }

double sum_squares(const float* x, int64_t n, void* scratch, cudaStream_t stream) {
  if (n <= 0) return 0.0;
  auto* partials = scratch_at<double>(scratch, kPartialsOffset);
  auto* total = scratch_at<double>(scratch, kTotalOffset);
  // The grid is a function of n alone: the same n always sums in the same order.
  const unsigned blocks = blocks_for((n + kItemsPerThread - 1) / kItemsPerThread, kMaxPartials);
  sum_squares_partials_kernel<<<blocks, kThreads, 0, stream>>>(x, n, partials);
  PIPESHARD_CUDA_LAUNCHED();
  sum_partials_kernel<<<1, kThreads, 0, stream>>>(partials, static_cast<int>(blocks), total);
  PIPESHARD_CUDA_LAUNCHED();
  return read_back(total, stream);
}

bool any_non_finite(const float* x, int64_t n, void* scratch, cudaStream_t stream) {
  if (n <= 0) return false;
  auto* flag = scratch_at<int>(scratch, kFlagOffset);
  PIPESHARD_CUDA_CHECK(cudaMemsetAsync(flag, 0, sizeof(int), stream));
  constexpr int64_t kMaxBlocks = 1024;
  any_non_finite_kernel<<<blocks_for((n + kItemsPerThread - 1) / kItemsPerThread, kMaxBlocks), kThreads, 0, stream>>>(
      x, n, flag);
  PIPESHARD_CUDA_LAUNCHED();
  return read_back(flag, stream) != 0;
}

}  // namespace pipeshard::cuda
