// Optimizer steps over the contiguous parameter buffer: SGD (momentum, Nesterov, weight
// decay) and Adam/AdamW (launchers.h; the contract is backend/backend.h's). Model: ggml's
// opt-step-adamw.cu, one fused pass that reads each state element once and writes it once.
//
// The per-element updates are elementwise_math.cuh's, the CPU backend's operation by
// operation with no FMA contraction, and the scalars they use (Adam's bias corrections,
// computed in double) are computed on the host exactly as cpu_training.cc does: the
// device's step equals the CPU's bit for bit. The same pass checks the gradients, as the
// CPU's does (g·0 != 0 for inf and NaN): a thread that saw one sets a flag in `scratch`,
// which the launcher reads back after the kernel.
//
// Grid-stride loops over 64-bit indices; groups of four go through float4 loads and stores
// when every buffer the step touches is 16-byte aligned (a step over one tensor of a
// larger buffer starts at an offset, so alignment is checked, not assumed).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launchers.h"
#include "backend/math/elementwise_math.cuh"
#include "common/status.h"

namespace pipeshard::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 8192;

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

unsigned blocks_for(int64_t n, bool vectorised) {
  const int64_t work = vectorised ? n / 4 + n % 4 : n;
  return static_cast<unsigned>(std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

__device__ __forceinline__ float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void store4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }

// One element of SGD at index i through registers p, g, b; returns whether g was non-finite.
__device__ __forceinline__ bool sgd_element(float& p, float g, float& b, const math::SgdScalars& k) {
  p = math::sgd_update(p, g, &b, k);
  return math::is_non_finite(g);
}

// param, grad, momentum_buffer [n]; momentum_buffer is touched only with momentum, and
// read only after the first step.
__global__ void sgd_kernel(float* param, const float* grad, float* momentum_buffer, int64_t n, math::SgdScalars k,
                           bool vectorised, int* non_finite) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  const int64_t t = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const bool read_buffer = k.with_momentum && !k.first_step;
  bool bad = false;
  int64_t scalar_begin = 0;
  if (vectorised) {
    const int64_t groups = n / 4;
    for (int64_t gi = t; gi < groups; gi += stride) {
      const int64_t i = 4 * gi;
      float4 p = load4(param + i);
      const float4 g = load4(grad + i);
      float4 b = read_buffer ? load4(momentum_buffer + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      bad |= sgd_element(p.x, g.x, b.x, k);
      bad |= sgd_element(p.y, g.y, b.y, k);
      bad |= sgd_element(p.z, g.z, b.z, k);
      bad |= sgd_element(p.w, g.w, b.w, k);
      store4(param + i, p);
      if (k.with_momentum) store4(momentum_buffer + i, b);
    }
    scalar_begin = 4 * groups;
  }
  for (int64_t i = scalar_begin + t; i < n; i += stride) {
    float p = param[i];
    float b = read_buffer ? momentum_buffer[i] : 0.0f;
    bad |= sgd_element(p, grad[i], b, k);
    param[i] = p;
    if (k.with_momentum) momentum_buffer[i] = b;
  }
  if (bad) *non_finite = 1;  // every writer writes 1: the race is benign
}

__device__ __forceinline__ bool adam_element(float& p, float g, float& m, float& v, const math::AdamScalars& k) {
  p = math::adam_update(p, g, m, v, k);
  return math::is_non_finite(g);
}

// param, grad, exp_avg, exp_avg_sq [n].
__global__ void adam_kernel(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                            math::AdamScalars k, bool vectorised, int* non_finite) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  const int64_t t = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  bool bad = false;
  int64_t scalar_begin = 0;
  if (vectorised) {
    const int64_t groups = n / 4;
    for (int64_t gi = t; gi < groups; gi += stride) {
      const int64_t i = 4 * gi;
      float4 p = load4(param + i), m = load4(exp_avg + i), v = load4(exp_avg_sq + i);
      const float4 g = load4(grad + i);
      bad |= adam_element(p.x, g.x, m.x, v.x, k);
      bad |= adam_element(p.y, g.y, m.y, v.y, k);
      bad |= adam_element(p.z, g.z, m.z, v.z, k);
      bad |= adam_element(p.w, g.w, m.w, v.w, k);
      store4(param + i, p);
      store4(exp_avg + i, m);
      store4(exp_avg_sq + i, v);
    }
    scalar_begin = 4 * groups;
  }
  for (int64_t i = scalar_begin + t; i < n; i += stride) {
    float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
    bad |= adam_element(p, grad[i], m, v, k);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
  }
  if (bad) *non_finite = 1;
}

// The flag the kernels set, zeroed before them; `scratch` is the caller's (launchers.h).
int* non_finite_flag(void* scratch, cudaStream_t stream) {
  auto* flag = static_cast<int*>(scratch);
  PIPESHARD_CUDA_CHECK(cudaMemsetAsync(flag, 0, sizeof(int), stream));
  return flag;
}

// Waits for the step and says whether every gradient was finite.
bool all_finite(const int* flag, cudaStream_t stream) {
  int host = 0;
  PIPESHARD_CUDA_CHECK(cudaMemcpyAsync(&host, flag, sizeof(int), cudaMemcpyDeviceToHost, stream));
  PIPESHARD_CUDA_CHECK(cudaStreamSynchronize(stream));
  return host == 0;
}

}  // namespace

bool sgd_step(float* param, const float* grad, float* momentum_buffer, int64_t n, const SgdStep& s, void* scratch,
              cudaStream_t stream) {
  const bool use_momentum = s.momentum != 0.0f;
  PIPESHARD_CHECK(!use_momentum || momentum_buffer != nullptr, "SGD with momentum needs its buffer");
  PIPESHARD_CHECK(!s.nesterov || use_momentum, "Nesterov SGD needs momentum");
  if (n <= 0) return true;
  const math::SgdScalars k = math::sgd_scalars(s);
  const bool vectorised = aligned16(param) && aligned16(grad) && (!use_momentum || aligned16(momentum_buffer));
  int* flag = non_finite_flag(scratch, stream);
  sgd_kernel<<<blocks_for(n, vectorised), kThreads, 0, stream>>>(param, grad, momentum_buffer, n, k, vectorised, flag);
  PIPESHARD_CUDA_LAUNCHED();
  return all_finite(flag, stream);
}

bool adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n, const AdamStep& s,
               void* scratch, cudaStream_t stream) {
  PIPESHARD_CHECK(s.step >= 1, "Adam step " + std::to_string(s.step) + " (steps count from 1)");
  if (n <= 0) return true;
  const math::AdamScalars k = math::adam_scalars(s);
  const bool vectorised = aligned16(param) && aligned16(grad) && aligned16(exp_avg) && aligned16(exp_avg_sq);
  int* flag = non_finite_flag(scratch, stream);
  adam_kernel<<<blocks_for(n, vectorised), kThreads, 0, stream>>>(param, grad, exp_avg, exp_avg_sq, n, k, vectorised,
                                                                  flag);
  PIPESHARD_CUDA_LAUNCHED();
  return all_finite(flag, stream);
}

}  // namespace pipeshard::cuda
