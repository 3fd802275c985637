// BatchNorm per channel of x [batch, channels, inner] on the GPU (launchers.h); the
// reference is cpu_normalization.cc, whose arithmetic per value and per channel
// norm_math.cuh shares. Statistics in double, values in float, as there.
//
// A channel's sums are made by the threads of one block, in a fixed order and without
// atomics, so that results repeat bit for bit:
// - inner == 1 (BatchNorm1d on [batch, features]): a block of 32 × 8 threads covers 32
//   neighbouring channels, threadIdx.x the channel (a warp reads 32 consecutive floats of
//   a sample), threadIdx.y one of 8 slices of the batch;
// - inner > 1: a block of 256 threads per channel, consecutive threads on consecutive
//   values of the channel's batch·inner.
// Each thread adds its values in ascending order; the 8 slices are then added in order
// (and, for a block-wide channel, the 32 lanes of the result by a butterfly).
//
// Without a reducer one kernel makes every pass of a channel (forward: Σx, Σ(x − mean)²,
// normalise; backward: Σdy and Σdy·x̂, then dx). With one (synchronized BatchNorm) each
// reduction ends a kernel: its per-channel sums go to device doubles, the stream is
// synchronised, `reduce` sums them over the processes in place, and the next kernel reads
// the totals. Both paths run the same device functions, so a channel's arithmetic is the
// same either way.
#include <cuda_runtime.h>

#include <string>
#include <type_traits>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launchers.h"
#include "backend/math/norm_math.cuh"
#include "common/status.h"

namespace pipeshard::cuda {
namespace {

enum class ChannelMapping { kTile, kBlock };  // inner == 1, inner > 1 (see the file comment)

constexpr int kTileChannels = 32;                         // blockDim.x
constexpr int kSlices = 8;                                // blockDim.y
constexpr int kChannelThreads = kTileChannels * kSlices;  // 256

struct BatchNormShape {
  int64_t batch, channels, inner;
  __host__ __device__ int64_t count() const { return batch * inner; }  // values per channel here
};

// A thread's share of a channel: values j = b·inner + k of it, j = first, first + kStep, ...
template <ChannelMapping M>
struct ChannelThread {
  static constexpr int kStep = M == ChannelMapping::kTile ? kSlices : kChannelThreads;
  int64_t channel;
  int64_t first;
  bool active;  // channel < channels: a tile may run past the last channel
  bool writer;  // the one thread that writes the channel's statistics and parameter gradients

  __device__ explicit ChannelThread(int64_t channels) {
    if constexpr (M == ChannelMapping::kTile) {
      channel = static_cast<int64_t>(blockIdx.x) * kTileChannels + threadIdx.x;
      first = threadIdx.y;
    } else {
      channel = blockIdx.x;
      first = threadIdx.y * kTileChannels + threadIdx.x;
    }
    active = channel < channels;
    writer = active && first == 0;
  }

  // f(index into x) for this thread's values of the channel, in ascending order.
  template <typename F>
  __device__ void for_each_value(const BatchNormShape& s, F&& f) const {
    if (!active) return;
    int64_t b = first / s.inner, k = first % s.inner;
    const int64_t step_b = kStep / s.inner, step_k = kStep % s.inner;
    while (b < s.batch) {
      f((b * s.channels + channel) * s.inner + k);
      b += step_b;
      k += step_k;
      if (k >= s.inner) {
        k -= s.inner;
        ++b;
      }
    }
  }
};

struct ChannelShared {
  double partial[kSlices][kTileChannels];  // [threadIdx.y][threadIdx.x]
  double total[kTileChannels];
};

// The channel's total of v over its threads, returned to each of them; every thread of
// the block must call it.
template <ChannelMapping M>
__device__ double channel_reduce(double v, ChannelShared& shared) {
  shared.partial[threadIdx.y][threadIdx.x] = v;
  __syncthreads();
  if (threadIdx.y == 0) {  // warp 0
    double s = shared.partial[0][threadIdx.x];
    for (int slice = 1; slice < kSlices; ++slice) s += shared.partial[slice][threadIdx.x];
    if constexpr (M == ChannelMapping::kBlock) s = warp_reduce(s, SumOp{});
    shared.total[threadIdx.x] = s;
  }
  __syncthreads();
  // The next call writes `partial` only after this barrier, `total` only after its own first.
  return shared.total[M == ChannelMapping::kTile ? threadIdx.x : 0];
}

// ---- device functions: one pass each ----

template <ChannelMapping M>
__device__ double channel_sum(const ChannelThread<M>& t, const BatchNormShape& s, const float* x,
                              ChannelShared& shared) {
  double sum = 0.0;
  t.for_each_value(s, [&](int64_t i) { sum += x[i]; });
  return channel_reduce<M>(sum, shared);
}

// Σ (x − mean)² about `mean` (this process's or the global one): two passes for an accurate variance.
template <ChannelMapping M>
__device__ double channel_squared_deviations(const ChannelThread<M>& t, const BatchNormShape& s, const float* x,
                                             double mean, ChannelShared& shared) {
  double sum = 0.0;
  t.for_each_value(s, [&](int64_t i) { sum += batchnorm_squared_deviation(x[i], mean); });
  return channel_reduce<M>(sum, shared);
}

// rstd from the biased variance; the running statistics (each may be null) move towards
// the mean and the unbiased variance.
template <ChannelMapping M>
__device__ double finish_training_statistics(const ChannelThread<M>& t, float* running_mean, float* running_var,
                                             double mean, double squared_deviations, double count, float eps,
                                             float momentum) {
  if (t.writer) {
    const int64_t c = t.channel;
    if (running_mean != nullptr) running_mean[c] = batchnorm_running_update(running_mean[c], mean, momentum);
    if (running_var != nullptr) {
      running_var[c] =
          batchnorm_running_update(running_var[c], batchnorm_unbiased_variance(squared_deviations, count), momentum);
    }
  }
  return batchnorm_training_rstd(squared_deviations, count, eps);
}

// y = (x − mean)·rstd·w + b; mean and rstd in float saved into saved_mean, saved_rstd
// [channels] when given.
template <ChannelMapping M>
__device__ void normalise_channel(const ChannelThread<M>& t, const BatchNormShape& s, float* y, const float* x,
                                  const float* w, const float* b, double mean, double rstd, float* saved_mean,
                                  float* saved_rstd) {
  if (!t.active) return;
  const BatchNormAffine a = batchnorm_affine(mean, rstd, w, b, t.channel);
  if (t.writer) {
    if (saved_mean != nullptr) saved_mean[t.channel] = a.mean;
    if (saved_rstd != nullptr) saved_rstd[t.channel] = static_cast<float>(rstd);
  }
  t.for_each_value(s, [&](int64_t i) { y[i] = batchnorm_output(x[i], a); });
}

// S1 = Σ dy and S2 = Σ dy·x̂ of this process's values.
template <ChannelMapping M>
__device__ void gradient_sums(const ChannelThread<M>& t, const BatchNormShape& s, const float* dy, const float* x,
                              const float* mean, const float* rstd, ChannelShared& shared, double* s1, double* s2) {
  double sum_dy = 0.0, sum_dy_xhat = 0.0;
  if (t.active) {
    const double mc = mean[t.channel], sc = rstd[t.channel];
    t.for_each_value(s, [&](int64_t i) {
      sum_dy += dy[i];
      sum_dy_xhat += batchnorm_dy_xhat(x[i], dy[i], mc, sc);
    });
  }
  *s1 = channel_reduce<M>(sum_dy, shared);
  *s2 = channel_reduce<M>(sum_dy_xhat, shared);
}

template <ChannelMapping M>
__device__ void add_parameter_gradients(const ChannelThread<M>& t, float* dw, float* db, double s1, double s2) {
  if (!t.writer) return;
  if (dw != nullptr) dw[t.channel] += static_cast<float>(s2);
  if (db != nullptr) db[t.channel] += static_cast<float>(s1);
}

// dx += w·rstd·(dy − S1/count − x̂·S2/count) when training, w·rstd·dy otherwise.
template <ChannelMapping M>
__device__ void add_input_gradient(const ChannelThread<M>& t, const BatchNormShape& s, float* dx, const float* dy,
                                   const float* x, const float* w, const float* mean, const float* rstd, double s1,
                                   double s2, double count, bool training) {
  if (!t.active) return;
  const BatchNormInputGrad g = batchnorm_input_grad_coefficients(w, mean, rstd, t.channel, s1, s2, count, training);
  t.for_each_value(s, [&](int64_t i) { dx[i] += batchnorm_input_grad(x[i], dy[i], g); });
}

// ---- kernels: block (kTileChannels, kSlices); grid as with_mapping gives ----

// Training on this process's batch: every pass of a channel in one kernel.
template <ChannelMapping M>
__global__ void __launch_bounds__(kChannelThreads)
    batchnorm_forward_kernel(float* y, float* mean, float* rstd, float* running_mean, float* running_var,
                             const float* x, const float* w, const float* b, BatchNormShape s, float eps,
                             float momentum) {
  __shared__ ChannelShared shared;
  const ChannelThread<M> t(s.channels);
  const double count = static_cast<double>(s.count());
  const double m = channel_sum(t, s, x, shared) / count;
  const double squared_deviations = channel_squared_deviations(t, s, x, m, shared);
  const double r =
      finish_training_statistics(t, running_mean, running_var, m, squared_deviations, count, eps, momentum);
  normalise_channel(t, s, y, x, w, b, m, r, mean, rstd);
}

// Inference: the running statistics, saved into mean and 1/√(running_var + eps) into rstd.
template <ChannelMapping M>
__global__ void __launch_bounds__(kChannelThreads)
    batchnorm_inference_kernel(float* y, float* mean, float* rstd, const float* running_mean, const float* running_var,
                               const float* x, const float* w, const float* b, BatchNormShape s, float eps) {
  const ChannelThread<M> t(s.channels);
  if (!t.active) return;
  const double m = running_mean[t.channel];
  const double r = batchnorm_inference_rstd(running_var[t.channel], eps);
  normalise_channel(t, s, y, x, w, b, m, r, mean, rstd);
}

// Synchronized pass 1: sums [channels + 1] = Σx per channel, then this process's count.
template <ChannelMapping M>
__global__ void __launch_bounds__(kChannelThreads)
    batchnorm_sum_kernel(double* sums, const float* x, BatchNormShape s) {
  __shared__ ChannelShared shared;
  const ChannelThread<M> t(s.channels);
  const double sum = channel_sum(t, s, x, shared);
  if (t.writer) sums[t.channel] = sum;
  if (blockIdx.x == 0 && threadIdx.x == 0 && threadIdx.y == 0) sums[s.channels] = static_cast<double>(s.count());
}

// Synchronized pass 2: squared_deviations [channels] = Σ(x − mean)² about the global mean sums/count.
template <ChannelMapping M>
__global__ void __launch_bounds__(kChannelThreads)
    batchnorm_squared_deviations_kernel(double* squared_deviations, const double* sums, double count, const float* x,
                                        BatchNormShape s) {
  __shared__ ChannelShared shared;
  const ChannelThread<M> t(s.channels);
  const double m = t.active ? sums[t.channel] / count : 0.0;
  const double sum = channel_squared_deviations(t, s, x, m, shared);
  if (t.writer) squared_deviations[t.channel] = sum;
}

// Synchronized pass 3: the statistics from the global sums, and y.
template <ChannelMapping M>
__global__ void __launch_bounds__(kChannelThreads)
    batchnorm_normalise_kernel(float* y, float* mean, float* rstd, float* running_mean, float* running_var,
                               const float* x, const float* w, const float* b, BatchNormShape s, const double* sums,
                               const double* squared_deviations, double count, float eps, float momentum) {
  const ChannelThread<M> t(s.channels);
  if (!t.active) return;
  const double m = sums[t.channel] / count;
  const double r =
      finish_training_statistics(t, running_mean, running_var, m, squared_deviations[t.channel], count, eps, momentum);
  normalise_channel(t, s, y, x, w, b, m, r, mean, rstd);
}

// Backward on this process's batch: S1, S2 into db, dw, and dx (when given) from them.
template <ChannelMapping M>
__global__ void __launch_bounds__(kChannelThreads)
    batchnorm_backward_kernel(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w,
                              const float* mean, const float* rstd, BatchNormShape s, bool training) {
  __shared__ ChannelShared shared;
  const ChannelThread<M> t(s.channels);
  double s1, s2;
  gradient_sums(t, s, dy, x, mean, rstd, shared, &s1, &s2);
  add_parameter_gradients(t, dw, db, s1, s2);
  if (dx != nullptr) {
    add_input_gradient(t, s, dx, dy, x, w, mean, rstd, s1, s2, static_cast<double>(s.count()), training);
  }
}

// Synchronized backward pass 1: this process's S1, S2 into db, dw, and into sums
// [2·channels + 1] = S1 per channel, S2 per channel, this process's count.
template <ChannelMapping M>
__global__ void __launch_bounds__(kChannelThreads)
    batchnorm_gradient_sums_kernel(double* sums, float* dw, float* db, const float* dy, const float* x,
                                   const float* mean, const float* rstd, BatchNormShape s) {
  __shared__ ChannelShared shared;
  const ChannelThread<M> t(s.channels);
  double s1, s2;
  gradient_sums(t, s, dy, x, mean, rstd, shared, &s1, &s2);
  add_parameter_gradients(t, dw, db, s1, s2);
  if (t.writer) {
    sums[t.channel] = s1;
    sums[s.channels + t.channel] = s2;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0 && threadIdx.y == 0) sums[2 * s.channels] = static_cast<double>(s.count());
}

// Synchronized backward pass 2: dx from the global sums and count (training only).
template <ChannelMapping M>
__global__ void __launch_bounds__(kChannelThreads)
    batchnorm_input_grad_kernel(float* dx, const float* dy, const float* x, const float* w, const float* mean,
                                const float* rstd, BatchNormShape s, const double* sums, double count) {
  const ChannelThread<M> t(s.channels);
  if (!t.active) return;
  add_input_gradient(t, s, dx, dy, x, w, mean, rstd, sums[t.channel], sums[s.channels + t.channel], count, true);
}

// ---- host ----

// Calls launch(std::integral_constant<ChannelMapping, M>{}, grid) for the mapping that suits `inner`.
template <typename Launch>
void with_mapping(const BatchNormShape& s, Launch&& launch) {
  const int64_t blocks = s.inner == 1 ? (s.channels + kTileChannels - 1) / kTileChannels : s.channels;
  PIPESHARD_CHECK(blocks <= 0x7fffffff, "batchnorm over " + std::to_string(s.channels) + " channels");
  const dim3 grid(static_cast<unsigned>(blocks));
  if (s.inner == 1) {
    launch(std::integral_constant<ChannelMapping, ChannelMapping::kTile>{}, grid);
  } else {
    launch(std::integral_constant<ChannelMapping, ChannelMapping::kBlock>{}, grid);
  }
}

const dim3 kChannelBlock(kTileChannels, kSlices);

void check_batchnorm(const BatchNormShape& s) {
  PIPESHARD_CHECK(s.batch > 0 && s.channels > 0 && s.inner > 0, "batchnorm shape [" + std::to_string(s.batch) + ", " +
                                                                    std::to_string(s.channels) + ", " +
                                                                    std::to_string(s.inner) + "]");
}

// reduce(data, n) once the kernels that wrote data have finished. The reducer must be
// done with data when it returns (Communicator::all_reduce_sum blocks).
void reduce_when_written(const ChannelReducer& reduce, double* data, int64_t n, cudaStream_t stream) {
  PIPESHARD_CUDA_CHECK(cudaStreamSynchronize(stream));
  reduce(data, n);
}

// The count of values per channel over all processes, as the reducer summed it.
double checked_global_count(const double* device_count, const BatchNormShape& s, cudaStream_t stream) {
  double global = 0.0;
  PIPESHARD_CUDA_CHECK(cudaMemcpyAsync(&global, device_count, sizeof global, cudaMemcpyDeviceToHost, stream));
  PIPESHARD_CUDA_CHECK(cudaStreamSynchronize(stream));
  // A reducer that averages or drops a process shows here rather than as wrong statistics.
  PIPESHARD_CHECK(global >= static_cast<double>(s.count()) && global == floor(global),
                  "synchronized BatchNorm: the reducer gave " + std::to_string(global) +
                      " values per channel where this process alone has " + std::to_string(s.count()));
  return global;
}

void batchnorm_forward_synchronized(const BatchNormShape& s, float* y, float* mean, float* rstd, float* running_mean,
                                    float* running_var, const float* x, const float* w, const float* b, float eps,
                                    float momentum, const ChannelReducer& reduce, ReducerScratch& scratch,
                                    cudaStream_t stream) {
  const int64_t channels = s.channels;
  double* sums = scratch.get(2 * channels + 1, stream);  // [channels + 1]: Σx, then the count
  double* squared_deviations = sums + channels + 1;      // [channels]
  with_mapping(s, [&](auto mapping, dim3 grid) {
    batchnorm_sum_kernel<decltype(mapping)::value><<<grid, kChannelBlock, 0, stream>>>(sums, x, s);
    PIPESHARD_CUDA_LAUNCHED();
  });
  reduce_when_written(reduce, sums, channels + 1, stream);
  const double count = checked_global_count(sums + channels, s, stream);
  PIPESHARD_CHECK(count > 1, "training BatchNorm needs more than one value per channel over all processes");
  with_mapping(s, [&](auto mapping, dim3 grid) {
    batchnorm_squared_deviations_kernel<decltype(mapping)::value>
        <<<grid, kChannelBlock, 0, stream>>>(squared_deviations, sums, count, x, s);
    PIPESHARD_CUDA_LAUNCHED();
  });
  reduce_when_written(reduce, squared_deviations, channels, stream);
  with_mapping(s, [&](auto mapping, dim3 grid) {
    batchnorm_normalise_kernel<decltype(mapping)::value><<<grid, kChannelBlock, 0, stream>>>(
        y, mean, rstd, running_mean, running_var, x, w, b, s, sums, squared_deviations, count, eps, momentum);
    PIPESHARD_CUDA_LAUNCHED();
  });
}

void batchnorm_backward_synchronized(const BatchNormShape& s, float* dx, float* dw, float* db, const float* dy,
                                     const float* x, const float* w, const float* mean, const float* rstd,
                                     const ChannelReducer& reduce, ReducerScratch& scratch, cudaStream_t stream) {
  const int64_t channels = s.channels;
  double* sums = scratch.get(2 * channels + 1, stream);  // S1 per channel, S2 per channel, the count
  with_mapping(s, [&](auto mapping, dim3 grid) {
    batchnorm_gradient_sums_kernel<decltype(mapping)::value>
        <<<grid, kChannelBlock, 0, stream>>>(sums, dw, db, dy, x, mean, rstd, s);
    PIPESHARD_CUDA_LAUNCHED();
  });
  reduce_when_written(reduce, sums, 2 * channels + 1, stream);
  const double count = checked_global_count(sums + 2 * channels, s, stream);
  with_mapping(s, [&](auto mapping, dim3 grid) {
    batchnorm_input_grad_kernel<decltype(mapping)::value>
        <<<grid, kChannelBlock, 0, stream>>>(dx, dy, x, w, mean, rstd, s, sums, count);
    PIPESHARD_CUDA_LAUNCHED();
  });
}

}  // namespace

ReducerScratch::~ReducerScratch() {
  if (data_ != nullptr) cudaFree(data_);  // its backend has synchronised its stream
}

double* ReducerScratch::get(int64_t n, cudaStream_t stream) {
  if (n <= size_) return data_;
  if (data_ != nullptr) {
    PIPESHARD_CUDA_CHECK(cudaStreamSynchronize(stream));  // kernels may still read the old sums
    PIPESHARD_CUDA_CHECK(cudaFree(data_));
    data_ = nullptr;
    size_ = 0;
  }
  PIPESHARD_CUDA_CHECK(cudaMalloc(&data_, static_cast<size_t>(n) * sizeof(double)));
  size_ = n;
  return data_;
}

void batchnorm_forward(float* y, float* mean, float* rstd, float* running_mean, float* running_var, const float* x,
                       const float* w, const float* b, int64_t batch, int64_t channels, int64_t inner, float eps,
                       float momentum, bool training, const ChannelReducer* reduce, ReducerScratch* scratch,
                       cudaStream_t stream) {
  const BatchNormShape s{batch, channels, inner};
  check_batchnorm(s);
  if (!training) {
    PIPESHARD_CHECK(running_mean != nullptr && running_var != nullptr, "inference BatchNorm needs running stats");
    with_mapping(s, [&](auto mapping, dim3 grid) {
      batchnorm_inference_kernel<decltype(mapping)::value>
          <<<grid, kChannelBlock, 0, stream>>>(y, mean, rstd, running_mean, running_var, x, w, b, s, eps);
      PIPESHARD_CUDA_LAUNCHED();
    });
    return;
  }
  PIPESHARD_CHECK(mean != nullptr && rstd != nullptr, "training BatchNorm saves mean and rstd");
  if (reduce != nullptr) {
    PIPESHARD_CHECK(scratch != nullptr, "synchronized BatchNorm needs the backend's reducer scratch");
    batchnorm_forward_synchronized(s, y, mean, rstd, running_mean, running_var, x, w, b, eps, momentum, *reduce,
                                   *scratch, stream);
    return;
  }
  // PyTorch refuses this too: the unbiased variance of one value is undefined.
  PIPESHARD_CHECK(s.count() > 1, "training BatchNorm needs more than one value per channel");
  with_mapping(s, [&](auto mapping, dim3 grid) {
    batchnorm_forward_kernel<decltype(mapping)::value>
        <<<grid, kChannelBlock, 0, stream>>>(y, mean, rstd, running_mean, running_var, x, w, b, s, eps, momentum);
    PIPESHARD_CUDA_LAUNCHED();
  });
}

void batchnorm_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w,
                        const float* mean, const float* rstd, int64_t batch, int64_t channels, int64_t inner,
                        bool training, const ChannelReducer* reduce, ReducerScratch* scratch, cudaStream_t stream) {
  const BatchNormShape s{batch, channels, inner};
  check_batchnorm(s);
  PIPESHARD_CHECK(mean != nullptr && rstd != nullptr, "batchnorm_backward needs the mean and rstd forward saved");
  // Without dx nothing needs the global sums: dw and db take the local ones anyway.
  if (reduce != nullptr && training && dx != nullptr) {
    PIPESHARD_CHECK(scratch != nullptr, "synchronized BatchNorm needs the backend's reducer scratch");
    batchnorm_backward_synchronized(s, dx, dw, db, dy, x, w, mean, rstd, *reduce, *scratch, stream);
    return;
  }
  if (dx == nullptr && dw == nullptr && db == nullptr) return;
  with_mapping(s, [&](auto mapping, dim3 grid) {
    batchnorm_backward_kernel<decltype(mapping)::value>
        <<<grid, kChannelBlock, 0, stream>>>(dx, dw, db, dy, x, w, mean, rstd, s, training);
    PIPESHARD_CUDA_LAUNCHED();
  });
}

}  // namespace pipeshard::cuda
