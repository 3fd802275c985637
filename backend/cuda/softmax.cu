// Softmax and LogSoftmax over the last dim, cross-entropy and mean squared error on the
// GPU (launchers.h); the reference is cpu_normalization.cc and cpu_training.cc, whose
// arithmetic per element and per row norm_math.cuh shares.
//
// Rows: a warp per row up to kWarpRowMaxWidth values (8 rows to a block of 256), a whole
// block above; each makes its passes (max, Σ exp, write) over its row in place of the
// CPU's loops, with the fixed-order reductions of norm_math.cuh.
//
// Losses return a host double, deterministically: a fixed grid of at most kLossBlocks
// blocks, derived from the shape alone, each adding its rows' losses (or its
// grid-stride slice of elements, for MSE) in double in a fixed order into the caller's
// scratch; then one block adds those partial sums in a fixed order. The same inputs give
// the same bits on any GPU and in any run.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launchers.h"
#include "backend/math/norm_math.cuh"
#include "common/status.h"

namespace pipeshard::cuda {
namespace {

// ---- kernels: softmax ----

// y [rows, width] = softmax or log-softmax of x [rows, width] along each row.
template <int kRowThreads>
__global__ void __launch_bounds__(kBlockThreads)
    softmax_forward_kernel(float* y, const float* x, int64_t rows, int64_t width, bool log) {
  __shared__ float shared[kBlockThreads / kWarpThreads];
  const RowThread<kRowThreads> t;
  const int64_t row = t.row();
  if (row >= rows) return;  // the whole warp, or the whole block of a block-wide row
  const float* in = x + row * width;
  float* out = y + row * width;
  float m = -INFINITY;
  for (int64_t i = t.lane; i < width; i += kRowThreads) m = fmaxf(m, in[i]);
  m = row_reduce<kRowThreads>(m, MaxOp{}, shared);
  float sum = 0.0f;
  for (int64_t i = t.lane; i < width; i += kRowThreads) sum += expf(in[i] - m);
  sum = row_reduce<kRowThreads>(sum, SumOp{}, shared);
  if (log) {
    const float log_sum = logf(sum);
    for (int64_t i = t.lane; i < width; i += kRowThreads) out[i] = log_softmax_output(in[i], m, log_sum);
  } else {
    const float inv_sum = 1.0f / sum;
    for (int64_t i = t.lane; i < width; i += kRowThreads) out[i] = softmax_output(in[i], m, inv_sum);
  }
}

// dx [rows, width] += the softmax (or log-softmax) gradient of dy, from the forward output y.
template <int kRowThreads>
__global__ void __launch_bounds__(kBlockThreads)
    softmax_backward_kernel(float* dx, const float* dy, const float* y, int64_t rows, int64_t width, bool log) {
  __shared__ float shared[kBlockThreads / kWarpThreads];
  const RowThread<kRowThreads> t;
  const int64_t row = t.row();
  if (row >= rows) return;
  const float* g = dy + row * width;
  const float* out = y + row * width;
  float* d = dx + row * width;
  float s = 0.0f;  // Σ dy (log) or Σ dy·y
  for (int64_t i = t.lane; i < width; i += kRowThreads) s += log ? g[i] : g[i] * out[i];
  s = row_reduce<kRowThreads>(s, SumOp{}, shared);
  if (log) {
    for (int64_t i = t.lane; i < width; i += kRowThreads) d[i] += log_softmax_input_grad(g[i], out[i], s);
  } else {
    for (int64_t i = t.lane; i < width; i += kRowThreads) d[i] += softmax_input_grad(g[i], out[i], s);
  }
}

// ---- kernels: losses ----

// The losses' partial sums in the caller's scratch: 16,400 bytes, within the 64 KiB that
// reduce_scratch_bytes() promises (checked at each call).
constexpr int kLossBlocks = 1024;
constexpr long long kNoBadRow = LLONG_MAX;
struct LossResult {
  double total;             // Σ loss over all rows or elements
  long long first_bad_row;  // the first row whose label is not a class, or kNoBadRow
};
struct LossScratch {
  LossResult result;
  double block_total[kLossBlocks];       // [blocks]
  long long block_bad_row[kLossBlocks];  // [blocks]
};
static_assert(sizeof(LossScratch) <= 64 * 1024, "the loss partials must fit the reduction scratch");

// Cross-entropy (or NLL when log_probs) of logits [rows, classes] against labels [rows]:
// a warp or block per row, rows in a grid-stride loop, so that each row group adds its
// rows in ascending order; dlogits [rows, classes] (or null) is written, not added.
template <int kRowThreads>
__global__ void __launch_bounds__(kBlockThreads)
    cross_entropy_kernel(float* dlogits, const float* logits, const float* labels, int64_t rows, int64_t classes,
                         float inv_den, bool log_probs, LossScratch* scratch) {
  using Thread = RowThread<kRowThreads>;
  __shared__ float shared_max[kBlockThreads / kWarpThreads];
  __shared__ double shared_sum[kBlockThreads / kWarpThreads];
  __shared__ double group_total[Thread::kRowsPerBlock];
  __shared__ long long group_bad_row[Thread::kRowsPerBlock];
  const Thread t;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * Thread::kRowsPerBlock;
  double total = 0.0;
  long long bad_row = kNoBadRow;
  // Every thread of a row takes the same branches: the row's label decides them.
  for (int64_t row = t.row(); row < rows; row += stride) {
    const float label = labels[row];
    if (!is_class_label(label, classes)) {
      bad_row = std::min<long long>(bad_row, row);
      continue;
    }
    const int64_t k = static_cast<int64_t>(label);
    const float* in = logits + row * classes;
    float* d = dlogits != nullptr ? dlogits + row * classes : nullptr;
    if (log_probs) {
      total += nll_row_loss(in[k]);
      if (d != nullptr) {
        for (int64_t i = t.lane; i < classes; i += kRowThreads) d[i] = nll_grad(i == k, inv_den);
      }
      continue;
    }
    float m = -INFINITY;
    for (int64_t i = t.lane; i < classes; i += kRowThreads) m = fmaxf(m, in[i]);
    m = row_reduce<kRowThreads>(m, MaxOp{}, shared_max);
    double exp_sum = 0.0;  // in double, as the CPU
    for (int64_t i = t.lane; i < classes; i += kRowThreads) exp_sum += expf(in[i] - m);
    exp_sum = row_reduce<kRowThreads>(exp_sum, SumOp{}, shared_sum);
    total += cross_entropy_row_loss(exp_sum, m, in[k]);
    if (d != nullptr) {
      const float inv_sum = static_cast<float>(1.0 / exp_sum);
      for (int64_t i = t.lane; i < classes; i += kRowThreads) {
        d[i] = cross_entropy_grad(in[i], m, inv_sum, inv_den, i == k);
      }
    }
  }
  if (t.lane == 0) {
    group_total[t.row_in_block] = total;
    group_bad_row[t.row_in_block] = bad_row;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double block_total = 0.0;
    long long block_bad_row = kNoBadRow;
    for (int g = 0; g < Thread::kRowsPerBlock; ++g) {
      block_total += group_total[g];
      block_bad_row = std::min(block_bad_row, group_bad_row[g]);
    }
    scratch->block_total[blockIdx.x] = block_total;
    scratch->block_bad_row[blockIdx.x] = block_bad_row;
  }
}

// Σ (pred − target)² over n elements, each thread a grid-stride slice; dpred [n] (or
// null) = 2·(pred − target)/denominator.
__global__ void __launch_bounds__(kBlockThreads)
    squared_error_kernel(float* dpred, const float* pred, const float* target, int64_t n, float grad_scale,
                         LossScratch* scratch) {
  __shared__ double shared[kBlockThreads / kWarpThreads];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kBlockThreads;
  double total = 0.0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kBlockThreads + threadIdx.x; i < n; i += stride) {
    const float p = pred[i], q = target[i];
    total += squared_error(p, q);
    if (dpred != nullptr) dpred[i] = squared_error_grad(p, q, grad_scale);
  }
  total = row_reduce<kBlockThreads>(total, SumOp{}, shared);
  if (threadIdx.x == 0) {
    scratch->block_total[blockIdx.x] = total;
    scratch->block_bad_row[blockIdx.x] = kNoBadRow;
  }
}

// One block: the `blocks` partial sums added in a fixed order into scratch->result.
__global__ void __launch_bounds__(kBlockThreads) finish_loss_kernel(LossScratch* scratch, int blocks) {
  __shared__ double shared_total[kBlockThreads / kWarpThreads];
  __shared__ long long shared_bad_row[kBlockThreads / kWarpThreads];
  double total = 0.0;
  long long bad_row = kNoBadRow;
  for (int j = threadIdx.x; j < blocks; j += kBlockThreads) {
    total += scratch->block_total[j];
    bad_row = std::min(bad_row, scratch->block_bad_row[j]);
  }
  total = row_reduce<kBlockThreads>(total, SumOp{}, shared_total);
  bad_row = row_reduce<kBlockThreads>(bad_row, MinOp{}, shared_bad_row);
  if (threadIdx.x == 0) scratch->result = LossResult{total, bad_row};
}

// ---- launchers ----

void check_rows(int64_t rows, int64_t width) {
  PIPESHARD_CHECK(rows >= 0 && width > 0, "rows=" + std::to_string(rows) + " width=" + std::to_string(width));
}

LossScratch* loss_scratch(void* scratch) {
  PIPESHARD_CHECK(scratch != nullptr && reduce_scratch_bytes() >= sizeof(LossScratch),
                  "the losses need " + std::to_string(sizeof(LossScratch)) + " bytes of reduction scratch, have " +
                      std::to_string(reduce_scratch_bytes()));
  return static_cast<LossScratch*>(scratch);
}

int loss_blocks(int64_t work_items, int64_t items_per_block) {
  return static_cast<int>(std::min<int64_t>((work_items + items_per_block - 1) / items_per_block, kLossBlocks));
}

// Adds the partial sums of `blocks` blocks and brings the result to the host.
LossResult finish_loss(LossScratch* scratch, int blocks, cudaStream_t stream) {
  finish_loss_kernel<<<1, kBlockThreads, 0, stream>>>(scratch, blocks);
  PIPESHARD_CUDA_LAUNCHED();
  LossResult result;
  PIPESHARD_CUDA_CHECK(cudaMemcpyAsync(&result, &scratch->result, sizeof result, cudaMemcpyDeviceToHost, stream));
  PIPESHARD_CUDA_CHECK(cudaStreamSynchronize(stream));
  return result;
}

}  // namespace

void softmax_forward(float* y, const float* x, int64_t rows, int64_t width, bool log, cudaStream_t stream) {
  check_rows(rows, width);
  if (rows == 0) return;
  with_row_threads(width, [&](auto row_threads) {
    constexpr int kRowThreads = decltype(row_threads)::value;
    softmax_forward_kernel<kRowThreads>
        <<<row_blocks<kRowThreads>(rows), kBlockThreads, 0, stream>>>(y, x, rows, width, log);
    PIPESHARD_CUDA_LAUNCHED();
  });
}

void softmax_backward(float* dx, const float* dy, const float* y, int64_t rows, int64_t width, bool log,
                      cudaStream_t stream) {
  check_rows(rows, width);
  if (rows == 0) return;
  with_row_threads(width, [&](auto row_threads) {
    constexpr int kRowThreads = decltype(row_threads)::value;
    softmax_backward_kernel<kRowThreads>
        <<<row_blocks<kRowThreads>(rows), kBlockThreads, 0, stream>>>(dx, dy, y, rows, width, log);
    PIPESHARD_CUDA_LAUNCHED();
  });
}

double cross_entropy(float* dlogits, const float* logits, const float* labels, int64_t rows, int64_t classes,
                     double denominator, bool log_probs, void* scratch, cudaStream_t stream) {
  PIPESHARD_CHECK(rows >= 0 && classes > 0, "cross_entropy over " + std::to_string(classes) + " classes");
  PIPESHARD_CHECK(denominator > 0.0, "cross_entropy denominator " + std::to_string(denominator));
  if (rows == 0) {
    PIPESHARD_CUDA_CHECK(cudaStreamSynchronize(stream));  // a host result, like any other
    return 0.0;
  }
  LossScratch* s = loss_scratch(scratch);
  const float inv_den = static_cast<float>(1.0 / denominator);
  int blocks = 0;
  with_row_threads(classes, [&](auto row_threads) {
    constexpr int kRowThreads = decltype(row_threads)::value;
    blocks = loss_blocks(rows, kBlockThreads / kRowThreads);
    cross_entropy_kernel<kRowThreads>
        <<<blocks, kBlockThreads, 0, stream>>>(dlogits, logits, labels, rows, classes, inv_den, log_probs, s);
    PIPESHARD_CUDA_LAUNCHED();
  });
  const LossResult result = finish_loss(s, blocks, stream);
  if (result.first_bad_row != kNoBadRow) {
    // The data loader validates labels; one out of range here is a bug upstream.
    float label = 0.0f;
    PIPESHARD_CUDA_CHECK(cudaMemcpy(&label, labels + result.first_bad_row, sizeof label, cudaMemcpyDeviceToHost));
    const bool label_is_a_class = false;
    PIPESHARD_CHECK(label_is_a_class, "row " + std::to_string(result.first_bad_row) + ": label " +
                                          std::to_string(label) + " is not a class in [0, " + std::to_string(classes) +
                                          ")");
  }
  return result.total / denominator;
}

double mean_squared_error(float* dpred, const float* pred, const float* target, int64_t n, double denominator,
                          void* scratch, cudaStream_t stream) {
  PIPESHARD_CHECK(n >= 0 && denominator > 0.0, "mean_squared_error denominator " + std::to_string(denominator));
  if (n == 0) {
    PIPESHARD_CUDA_CHECK(cudaStreamSynchronize(stream));
    return 0.0;
  }
  LossScratch* s = loss_scratch(scratch);
  const float grad_scale = static_cast<float>(2.0 / denominator);
  const int blocks = loss_blocks(n, kBlockThreads);
  squared_error_kernel<<<blocks, kBlockThreads, 0, stream>>>(dpred, pred, target, n, grad_scale, s);
  PIPESHARD_CUDA_LAUNCHED();
  return finish_loss(s, blocks, stream).total / denominator;
}

}  // namespace pipeshard::cuda
