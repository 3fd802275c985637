// LayerNorm over the last dim on the GPU (launchers.h); the reference is
// cpu_normalization.cc (backward as llm.c's layernorm_backward), whose arithmetic per
// element norm_math.cuh shares.
//
// Forward and dx: a warp per row up to kWarpRowMaxWidth values, a block above, with the
// row sums in float like the CPU's and reduced in a fixed order.
// dw, db [width] += Σ over rows: a column pass with no atomics, so the sums repeat bit for
// bit. A block owns 32 neighbouring columns (coalesced reads of each row); its 16 row
// slices each add every 16th row in ascending order, in double, and the 16 partial sums
// are then added in slice order before the one addition into dw and db.
#include <cuda_runtime.h>

#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launchers.h"
#include "backend/math/norm_math.cuh"
#include "common/status.h"

namespace pipeshard::cuda {
namespace {

constexpr int kColumnTile = 32;  // columns per block of the dw/db pass, one per threadIdx.x
constexpr int kRowSlices = 16;   // threadIdx.y: row r goes to slice r % kRowSlices

// y [rows, width] = (x − mean)·rstd (·w + b); mean, rstd [rows] (either may be null) saved.
template <int kRowThreads>
__global__ void __launch_bounds__(kBlockThreads)
    layernorm_forward_kernel(float* y, float* mean, float* rstd, const float* x, const float* w, const float* b,
                             int64_t rows, int64_t width, float eps) {
  __shared__ float shared[kBlockThreads / kWarpThreads];
  const RowThread<kRowThreads> t;
  const int64_t row = t.row();
  if (row >= rows) return;  // the whole warp, or the whole block of a block-wide row
  const float* in = x + row * width;
  float* out = y + row * width;
  float sum = 0.0f;
  for (int64_t i = t.lane; i < width; i += kRowThreads) sum += in[i];
  const float m = layernorm_mean(row_reduce<kRowThreads>(sum, SumOp{}, shared), width);
  float squared_deviations = 0.0f;  // two passes, for an accurate variance
  for (int64_t i = t.lane; i < width; i += kRowThreads) squared_deviations += (in[i] - m) * (in[i] - m);
  const float s = layernorm_rstd(row_reduce<kRowThreads>(squared_deviations, SumOp{}, shared), width, eps);
  for (int64_t i = t.lane; i < width; i += kRowThreads) out[i] = layernorm_output(in[i], m, s, w, b, i);
  if (t.lane == 0) {
    if (mean != nullptr) mean[row] = m;
    if (rstd != nullptr) rstd[row] = s;
  }
}

// dx [rows, width] += rstd·(dnorm − mean(dnorm) − norm·mean(dnorm ⊙ norm)), dnorm = w ⊙ dy.
template <int kRowThreads>
__global__ void __launch_bounds__(kBlockThreads)
    layernorm_input_grad_kernel(float* dx, const float* dy, const float* x, const float* w, const float* mean,
                                const float* rstd, int64_t rows, int64_t width) {
  __shared__ float shared[kBlockThreads / kWarpThreads];
  const RowThread<kRowThreads> t;
  const int64_t row = t.row();
  if (row >= rows) return;
  const float* g = dy + row * width;
  const float* in = x + row * width;
  float* d = dx + row * width;
  const float m = mean[row], s = rstd[row];
  float dnorm_sum = 0.0f, dnorm_norm_sum = 0.0f;
  for (int64_t i = t.lane; i < width; i += kRowThreads) {
    const float dnorm = layernorm_dnorm(g[i], w, i);
    dnorm_sum += dnorm;
    dnorm_norm_sum += dnorm * layernorm_norm(in[i], m, s);
  }
  const float dnorm_mean = row_reduce<kRowThreads>(dnorm_sum, SumOp{}, shared) / static_cast<float>(width);
  const float dnorm_norm_mean = row_reduce<kRowThreads>(dnorm_norm_sum, SumOp{}, shared) / static_cast<float>(width);
  for (int64_t i = t.lane; i < width; i += kRowThreads) {
    d[i] += layernorm_input_grad(in[i], g[i], w, i, m, s, dnorm_mean, dnorm_norm_mean);
  }
}

// dw [width] += Σ_rows (x − mean)·rstd·dy and db [width] += Σ_rows dy (either may be null);
// block (kColumnTile, kRowSlices), one block per kColumnTile columns.
__global__ void __launch_bounds__(kColumnTile* kRowSlices)
    layernorm_param_grad_kernel(float* dw, float* db, const float* dy, const float* x, const float* mean,
                                const float* rstd, int64_t rows, int64_t width) {
  __shared__ double slice_dw[kRowSlices][kColumnTile];
  __shared__ double slice_db[kRowSlices][kColumnTile];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kColumnTile + threadIdx.x;
  double sum_dw = 0.0, sum_db = 0.0;
  if (col < width) {
    for (int64_t r = threadIdx.y; r < rows; r += kRowSlices) {
      const float g = dy[r * width + col];
      sum_dw += layernorm_weight_grad(x[r * width + col], g, mean[r], rstd[r]);
      sum_db += g;
    }
  }
  slice_dw[threadIdx.y][threadIdx.x] = sum_dw;
  slice_db[threadIdx.y][threadIdx.x] = sum_db;
  __syncthreads();
  if (threadIdx.y == 0 && col < width) {
    double total_dw = slice_dw[0][threadIdx.x], total_db = slice_db[0][threadIdx.x];
    for (int slice = 1; slice < kRowSlices; ++slice) {
      total_dw += slice_dw[slice][threadIdx.x];
      total_db += slice_db[slice][threadIdx.x];
    }
    if (dw != nullptr) dw[col] += static_cast<float>(total_dw);
    if (db != nullptr) db[col] += static_cast<float>(total_db);
  }
}

void check_rows(int64_t rows, int64_t width) {
  PIPESHARD_CHECK(rows >= 0 && width > 0, "rows=" + std::to_string(rows) + " width=" + std::to_string(width));
}

}  // namespace

void layernorm_forward(float* y, float* mean, float* rstd, const float* x, const float* w, const float* b, int64_t rows,
                       int64_t width, float eps, cudaStream_t stream) {
  check_rows(rows, width);
  if (rows == 0) return;
  with_row_threads(width, [&](auto row_threads) {
    constexpr int kRowThreads = decltype(row_threads)::value;
    layernorm_forward_kernel<kRowThreads>
        <<<row_blocks<kRowThreads>(rows), kBlockThreads, 0, stream>>>(y, mean, rstd, x, w, b, rows, width, eps);
    PIPESHARD_CUDA_LAUNCHED();
  });
}

void layernorm_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w,
                        const float* mean, const float* rstd, int64_t rows, int64_t width, cudaStream_t stream) {
  check_rows(rows, width);
  PIPESHARD_CHECK(mean != nullptr && rstd != nullptr, "layernorm_backward needs the mean and rstd forward saved");
  if (rows == 0) return;
  if (dx != nullptr) {
    with_row_threads(width, [&](auto row_threads) {
      constexpr int kRowThreads = decltype(row_threads)::value;
      layernorm_input_grad_kernel<kRowThreads>
          <<<row_blocks<kRowThreads>(rows), kBlockThreads, 0, stream>>>(dx, dy, x, w, mean, rstd, rows, width);
      PIPESHARD_CUDA_LAUNCHED();
    });
  }
  if (dw == nullptr && db == nullptr) return;
  const int64_t blocks = (width + kColumnTile - 1) / kColumnTile;
  PIPESHARD_CHECK(blocks <= 0x7fffffff, "layernorm width " + std::to_string(width));
  layernorm_param_grad_kernel<<<static_cast<unsigned>(blocks), dim3(kColumnTile, kRowSlices), 0, stream>>>(
      dw, db, dy, x, mean, rstd, rows, width);
  PIPESHARD_CUDA_LAUNCHED();
}

}  // namespace pipeshard::cuda
