// Elementwise kernels: fill, axpy, scale, add, copy_rows, add_bias, activations, dropout
// (launchers.h; the contract is backend/backend.h's). The per-element formulas live in
// elementwise_math.cuh, shared with the host tests; this file is the kernels and their
// grid maths.
//
// Flat kernels are grid-stride loops over 64-bit indices. Each op is a functor whose
// apply<W>(i) handles elements i .. i+W-1: W = 4 uses float4 loads and stores, taken only
// when every pointer the op touches is 16-byte aligned (callers pass offsets into
// cudaMalloc'd buffers, so alignment is checked, not assumed), W = 1 covers the rest and
// the tail. The arithmetic per element is the same in both, so results never depend on
// alignment. Row kernels (copy_rows, add_bias) use a 2-D grid: columns across x, rows
// across y, so no thread divides an index.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launchers.h"
#include "backend/math/elementwise_math.cuh"
#include "common/status.h"

namespace pipeshard::cuda {
namespace {

using math::add_rn;
using math::mul_rn;

constexpr int kThreads = 256;
// Grid-stride loops need no more than a few waves of blocks (an H200 holds 132 SMs × 8
// blocks of 256 threads at once); more would only add scheduling.
constexpr int64_t kMaxBlocks = 8192;
constexpr int64_t kMaxGridY = 65535;

unsigned blocks_for(int64_t work, int64_t threads = kThreads) {
  return static_cast<unsigned>(std::clamp<int64_t>((work + threads - 1) / threads, 1, kMaxBlocks));
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// ---- W consecutive floats through registers: one float4 access for W = 4 ----

template <int W>
struct Lanes {
  float v[W];
};

template <int W>
__device__ __forceinline__ Lanes<W> load(const float* p) {
  Lanes<W> r;
  if constexpr (W == 4) {
    const float4 q = *reinterpret_cast<const float4*>(p);
    r.v[0] = q.x;
    r.v[1] = q.y;
    r.v[2] = q.z;
    r.v[3] = q.w;
  } else {
#pragma unroll
    for (int k = 0; k < W; ++k) r.v[k] = p[k];
  }
  return r;
}

template <int W>
__device__ __forceinline__ void store(float* p, const Lanes<W>& r) {
  if constexpr (W == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(r.v[0], r.v[1], r.v[2], r.v[3]);
  } else {
#pragma unroll
    for (int k = 0; k < W; ++k) p[k] = r.v[k];
  }
}

// ---- the flat kernel and its launcher ----

// Calls op.apply<4> on the groups of four below n when `vectorised`, op.apply<1> on every
// other element. Each element is visited exactly once.
template <typename Op>
__global__ void elementwise_kernel(Op op, int64_t n, bool vectorised) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  const int64_t t = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  int64_t scalar_begin = 0;
  if (vectorised) {
    const int64_t groups = n / 4;
    for (int64_t g = t; g < groups; g += stride) op.template apply<4>(4 * g);
    scalar_begin = 4 * groups;
  }
  for (int64_t i = scalar_begin + t; i < n; i += stride) op.template apply<1>(i);
}

template <typename Op>
void launch_elementwise(const Op& op, int64_t n, bool vectorised, cudaStream_t stream) {
  if (n <= 0) return;
  const int64_t work = vectorised ? n / 4 + n % 4 : n;
  elementwise_kernel<<<blocks_for(work), kThreads, 0, stream>>>(op, n, vectorised);
  PIPESHARD_CUDA_LAUNCHED();
}

// ---- ops ----

struct FillOp {
  float* dst;  // [n]
  float value;
  template <int W>
  __device__ void apply(int64_t i) const {
    Lanes<W> r;
#pragma unroll
    for (int k = 0; k < W; ++k) r.v[k] = value;
    store<W>(dst + i, r);
  }
};

struct AxpyOp {    // y += a·x
  float* y;        // [n]
  const float* x;  // [n]
  float a;
  template <int W>
  __device__ void apply(int64_t i) const {
    Lanes<W> yv = load<W>(y + i);
    const Lanes<W> xv = load<W>(x + i);
#pragma unroll
    for (int k = 0; k < W; ++k) yv.v[k] = add_rn(yv.v[k], mul_rn(a, xv.v[k]));
    store<W>(y + i, yv);
  }
};

struct ScaleOp {  // x *= a
  float* x;       // [n]
  float a;
  template <int W>
  __device__ void apply(int64_t i) const {
    Lanes<W> xv = load<W>(x + i);
#pragma unroll
    for (int k = 0; k < W; ++k) xv.v[k] = mul_rn(xv.v[k], a);
    store<W>(x + i, xv);
  }
};

struct AddOp {     // y = a + b
  float* y;        // [n]
  const float* a;  // [n]
  const float* b;  // [n]
  template <int W>
  __device__ void apply(int64_t i) const {
    const Lanes<W> av = load<W>(a + i), bv = load<W>(b + i);
    Lanes<W> yv;
#pragma unroll
    for (int k = 0; k < W; ++k) yv.v[k] = add_rn(av.v[k], bv.v[k]);
    store<W>(y + i, yv);
  }
};

template <ActivationKind K>
struct ActivationForwardOp {  // y = act(x)
  float* y;                   // [n]
  const float* x;             // [n]
  float alpha;
  template <int W>
  __device__ void apply(int64_t i) const {
    const Lanes<W> xv = load<W>(x + i);
    Lanes<W> yv;
#pragma unroll
    for (int k = 0; k < W; ++k) yv.v[k] = math::activation_value(K, alpha, xv.v[k]);
    store<W>(y + i, yv);
  }
};

template <ActivationKind K>
struct ActivationBackwardOp {  // dx += dy · act'(x)
  float* dx;                   // [n]
  const float* dy;             // [n]
  const float* x;              // [n]
  const float* y;              // [n] = act(x), or null: recomputed where the derivative needs it
  float alpha;
  template <int W>
  __device__ void apply(int64_t i) const {
    constexpr bool kUsesOutput = math::activation_grad_uses_output(K);
    const Lanes<W> dyv = load<W>(dy + i), xv = load<W>(x + i);
    Lanes<W> yv{};
    if (kUsesOutput) {
      if (y != nullptr) {
        yv = load<W>(y + i);
      } else {
#pragma unroll
        for (int k = 0; k < W; ++k) yv.v[k] = math::activation_value(K, alpha, xv.v[k]);
      }
    }
    Lanes<W> dxv = load<W>(dx + i);
#pragma unroll
    for (int k = 0; k < W; ++k)
      dxv.v[k] = add_rn(dxv.v[k], math::activation_grad(K, alpha, dyv.v[k], xv.v[k], yv.v[k]));
    store<W>(dx + i, dxv);
  }
};

struct DropoutForwardOp {  // mask = keep ? scale : 0; y = x · mask
  float* y;                // [n]
  float* mask;             // [n]
  const float* x;          // [n]
  uint64_t key;            // math::dropout_key(seed)
  uint64_t offset;         // the counter of element 0
  float ratio, keep_scale;
  template <int W>
  __device__ void apply(int64_t i) const {
    const Lanes<W> xv = load<W>(x + i);
    Lanes<W> mv, yv;
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const uint64_t counter = offset + static_cast<uint64_t>(i + k);
      mv.v[k] = math::dropout_keeps(key, counter, ratio) ? keep_scale : 0.0f;
      yv.v[k] = mul_rn(xv.v[k], mv.v[k]);
    }
    store<W>(mask + i, mv);
    store<W>(y + i, yv);
  }
};

struct DropoutBackwardOp {  // dx += dy · mask
  float* dx;                // [n]
  const float* dy;          // [n]
  const float* mask;        // [n]
  template <int W>
  __device__ void apply(int64_t i) const {
    Lanes<W> dxv = load<W>(dx + i);
    const Lanes<W> dyv = load<W>(dy + i), mv = load<W>(mask + i);
#pragma unroll
    for (int k = 0; k < W; ++k) dxv.v[k] = add_rn(dxv.v[k], mul_rn(dyv.v[k], mv.v[k]));
    store<W>(dx + i, dxv);
  }
};

// Calls fn(std::integral_constant<ActivationKind, K>) for a.kind, so that each kind
// compiles to a kernel of its own.
template <typename Fn>
void with_activation_kind(ActivationKind kind, Fn&& fn) {
  using K = ActivationKind;
  switch (kind) {
    case K::kRelu: return fn(std::integral_constant<K, K::kRelu>{});
    case K::kLeakyRelu: return fn(std::integral_constant<K, K::kLeakyRelu>{});
    case K::kSigmoid: return fn(std::integral_constant<K, K::kSigmoid>{});
    case K::kTanh: return fn(std::integral_constant<K, K::kTanh>{});
    case K::kGelu: return fn(std::integral_constant<K, K::kGelu>{});
    case K::kGeluTanh: return fn(std::integral_constant<K, K::kGeluTanh>{});
    case K::kSilu: return fn(std::integral_constant<K, K::kSilu>{});
  }
  PIPESHARD_CHECK(false, "unknown activation kind " + std::to_string(static_cast<int>(kind)));
}

// ---- row kernels: [rows, width] blocks with row strides ----

// Threads per block across a row: the width rounded up to a warp, at most kThreads, so a
// narrow matrix does not leave most of each block idle.
dim3 row_block(int64_t width) {
  return dim3(static_cast<unsigned>(std::clamp<int64_t>((width + 31) / 32 * 32, 32, kThreads)));
}
dim3 row_grid(int64_t rows, int64_t width, const dim3& block) {
  return dim3(blocks_for(width, block.x), static_cast<unsigned>(std::min(rows, kMaxGridY)));
}

// dst[r, j] = src[r, j] (or += when `add`), rows dst_stride / src_stride elements apart.
__global__ void copy_rows_kernel(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
                                 int64_t width, bool add) {
  const int64_t col_stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    float* d = dst + r * dst_stride;
    const float* s = src + r * src_stride;
    for (int64_t j = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; j < width; j += col_stride) {
      d[j] = add ? add_rn(d[j], s[j]) : s[j];
    }
  }
}

// y[r, j] += b[j]
__global__ void add_bias_kernel(float* y, const float* b, int64_t rows, int64_t width) {
  const int64_t col_stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    float* row = y + r * width;
    for (int64_t j = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; j < width; j += col_stride) {
      row[j] = add_rn(row[j], b[j]);
    }
  }
}

}  // namespace

void fill(float* dst, float value, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  if (value == 0.0f && !std::signbit(value)) {  // +0.0f is all zero bits
    PIPESHARD_CUDA_CHECK(cudaMemsetAsync(dst, 0, static_cast<size_t>(n) * sizeof(float), stream));
    return;
  }
  launch_elementwise(FillOp{dst, value}, n, aligned16(dst), stream);
}

void axpy(float* y, float a, const float* x, int64_t n, cudaStream_t stream) {
  launch_elementwise(AxpyOp{y, x, a}, n, aligned16(y) && aligned16(x), stream);
}

void scale(float* x, float a, int64_t n, cudaStream_t stream) {
  launch_elementwise(ScaleOp{x, a}, n, aligned16(x), stream);
}

void add(float* y, const float* a, const float* b, int64_t n, cudaStream_t stream) {
  launch_elementwise(AddOp{y, a, b}, n, aligned16(y) && aligned16(a) && aligned16(b), stream);
}

void copy_rows(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows, int64_t width,
               bool add, cudaStream_t stream) {
  if (rows <= 0 || width <= 0) return;
  const dim3 block = row_block(width);
  copy_rows_kernel<<<row_grid(rows, width, block), block, 0, stream>>>(dst, dst_stride, src, src_stride, rows, width,
                                                                       add);
  PIPESHARD_CUDA_LAUNCHED();
}

void add_bias(float* y, const float* b, int64_t rows, int64_t width, cudaStream_t stream) {
  if (rows <= 0 || width <= 0) return;
  const dim3 block = row_block(width);
  add_bias_kernel<<<row_grid(rows, width, block), block, 0, stream>>>(y, b, rows, width);
  PIPESHARD_CUDA_LAUNCHED();
}

void activation_forward(float* y, const float* x, int64_t n, const Activation& a, cudaStream_t stream) {
  with_activation_kind(a.kind, [&](auto kind) {
    constexpr ActivationKind K = decltype(kind)::value;
    launch_elementwise(ActivationForwardOp<K>{y, x, a.alpha}, n, aligned16(y) && aligned16(x), stream);
  });
}

void activation_backward(float* dx, const float* dy, const float* x, const float* y, int64_t n, const Activation& a,
                         cudaStream_t stream) {
  with_activation_kind(a.kind, [&](auto kind) {
    constexpr ActivationKind K = decltype(kind)::value;
    // y is read only by the kinds whose derivative uses it.
    const bool y_read = math::activation_grad_uses_output(K) && y != nullptr;
    const bool vectorised = aligned16(dx) && aligned16(dy) && aligned16(x) && (!y_read || aligned16(y));
    launch_elementwise(ActivationBackwardOp<K>{dx, dy, x, y, a.alpha}, n, vectorised, stream);
  });
}

void dropout_forward(float* y, float* mask, const float* x, int64_t n, float ratio, uint64_t seed, uint64_t offset,
                     cudaStream_t stream) {
  PIPESHARD_CHECK(ratio >= 0.0f && ratio <= 1.0f, "dropout ratio " + std::to_string(ratio));
  const DropoutForwardOp op{y, mask, x, math::dropout_key(seed), offset, ratio, math::dropout_keep_scale(ratio)};
  launch_elementwise(op, n, aligned16(y) && aligned16(mask) && aligned16(x), stream);
}

void dropout_backward(float* dx, const float* dy, const float* mask, int64_t n, cudaStream_t stream) {
  launch_elementwise(DropoutBackwardOp{dx, dy, mask}, n, aligned16(dx) && aligned16(dy) && aligned16(mask), stream);
}

}  // namespace pipeshard::cuda
