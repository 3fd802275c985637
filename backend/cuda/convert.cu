// float32 → bf16 / fp16 copies for the GEMM operands of bf16/fp16 mode (launchers.h:
// convert_to_16bit; linear.cu is the caller). The rounding is convert_math.cuh's, shared with
// the host tests; this file is the kernels and their grid maths.
//
// A grid-stride loop over 64-bit indices. When src is 16-byte aligned and dst 8-byte aligned
// (linear.cu's scratch copies are 256-byte aligned; src may be a slice of a buffer), each
// thread converts four elements through one float4 load and one 8-byte store, and a
// second launch converts the last n % 4; otherwise one element at a time. Each element is
// rounded alone, so the results do not depend on the path.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launchers.h"
#include "backend/math/convert_math.cuh"
#include "common/status.h"

namespace pipeshard::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 8192;  // a few waves on an H200; the grid-stride loop covers the rest

unsigned blocks_for(int64_t work) {
  return static_cast<unsigned>(std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

struct ToBf16 {
  __device__ uint16_t operator()(float f) const { return math::float_to_bf16_rn(f); }
};
struct ToFp16 {
  __device__ uint16_t operator()(float f) const { return math::float_to_fp16_rn(f); }
};

// dst[i] = round(src[i]) for i < n.
template <typename Round>
__global__ void convert_kernel(uint16_t* dst, const float* src, int64_t n, Round round) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    dst[i] = round(src[i]);
  }
}

// Four elements per index: dst[4i .. 4i+3] = round(src[4i .. 4i+3]) for i < groups.
template <typename Round>
__global__ void convert4_kernel(ushort4* dst, const float4* src, int64_t groups, Round round) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < groups; i += int64_t{gridDim.x} * blockDim.x) {
    const float4 v = src[i];
    dst[i] = make_ushort4(round(v.x), round(v.y), round(v.z), round(v.w));
  }
}

template <typename Round>
void launch_convert(uint16_t* dst, const float* src, int64_t n, Round round, cudaStream_t stream) {
  const bool vectors = reinterpret_cast<uintptr_t>(src) % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 8 == 0;
  int64_t done = 0;
  if (vectors && n >= 4) {
    const int64_t groups = n / 4;
    convert4_kernel<<<blocks_for(groups), kThreads, 0, stream>>>(reinterpret_cast<ushort4*>(dst),
                                                                 reinterpret_cast<const float4*>(src), groups, round);
    PIPESHARD_CUDA_LAUNCHED();
    done = groups * 4;
  }
  if (done < n) {
    convert_kernel<<<blocks_for(n - done), kThreads, 0, stream>>>(dst + done, src + done, n - done, round);
    PIPESHARD_CUDA_LAUNCHED();
  }
}

}  // namespace

void convert_to_16bit(uint16_t* dst, const float* src, int64_t n, Precision to, cudaStream_t stream) {
  PIPESHARD_CHECK(n >= 0, "convert_to_16bit of " + std::to_string(n) + " elements");
  if (n == 0) return;
  switch (to) {
    case Precision::kBf16: return launch_convert(dst, src, n, ToBf16{}, stream);
    case Precision::kFp16: return launch_convert(dst, src, n, ToFp16{}, stream);
    case Precision::kFp32:
    case Precision::kTf32: break;
  }
  PIPESHARD_CHECK(false, std::string("convert_to_16bit to ") + precision_name(to) + ": not a 16-bit format");
}

}  // namespace pipeshard::cuda
