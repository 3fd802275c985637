// Softmax, LayerNorm and BatchNorm on the CPU.
//
// Row kernels (softmax, LayerNorm) give each thread whole rows; per-column sums
// (LayerNorm's dw/db) and per-channel statistics (BatchNorm) give each thread whole
// columns or channels and add rows in order. No sum is split across threads, so results
// do not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "backend/cpu/cpu_kernels.h"
#include "common/status.h"

namespace pipeshard::cpu {
namespace {

float row_max(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

float row_sum(const float* x, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += x[i];
  return s;
}

float row_dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

void check_rows(int64_t rows, int64_t width) {
  PIPESHARD_CHECK(rows >= 0 && width > 0, "rows=" + std::to_string(rows) + " width=" + std::to_string(width));
}

}  // namespace

// ---- softmax ----

void softmax_forward(float* y, const float* x, int64_t rows, int64_t width, bool log) {
  check_rows(rows, width);
  parallel_ranges(rows, rows * width * 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* in = x + r * width;
      float* out = y + r * width;
      const float m = row_max(in, width);
      float sum = 0.0f;
      for (int64_t i = 0; i < width; ++i) {
        out[i] = std::exp(in[i] - m);
        sum += out[i];
      }
      if (log) {
        // (x - max) - log(sum), not x - (max + log(sum)): near x = 1e4 a float has
        // steps of 1e-3, and folding log(sum) into the large max loses it.
        const float log_sum = std::log(sum);
        for (int64_t i = 0; i < width; ++i) out[i] = (in[i] - m) - log_sum;
      } else {
        const float inv = 1.0f / sum;
        for (int64_t i = 0; i < width; ++i) out[i] *= inv;
      }
    }
  });
}

void softmax_backward(float* dx, const float* dy, const float* y, int64_t rows, int64_t width, bool log) {
  check_rows(rows, width);
  parallel_ranges(rows, rows * width * (log ? 16 : 3), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = dy + r * width;
      const float* out = y + r * width;
      float* d = dx + r * width;
      if (log) {  // y = log p: dx = dy − p·Σdy
        const float total = row_sum(g, width);
        for (int64_t i = 0; i < width; ++i) d[i] += g[i] - std::exp(out[i]) * total;
      } else {  // dx = y ⊙ (dy − Σ dy⊙y)
        const float dot = row_dot(g, out, width);
        for (int64_t i = 0; i < width; ++i) d[i] += out[i] * (g[i] - dot);
      }
    }
  });
}

// ---- LayerNorm (backward as llm.c's layernorm_backward) ----

void layernorm_forward(float* y, float* mean, float* rstd, const float* x, const float* w, const float* b, int64_t rows,
                       int64_t width, float eps) {
  check_rows(rows, width);
  parallel_ranges(rows, rows * width * 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* in = x + r * width;
      float* out = y + r * width;
      const float m = row_sum(in, width) / static_cast<float>(width);
      float var = 0.0f;
#pragma omp simd reduction(+ : var)
      for (int64_t i = 0; i < width; ++i) var += (in[i] - m) * (in[i] - m);
      var /= static_cast<float>(width);
      const float s = 1.0f / std::sqrt(var + eps);
      for (int64_t i = 0; i < width; ++i) {
        float v = (in[i] - m) * s;
        if (w != nullptr) v *= w[i];
        if (b != nullptr) v += b[i];
        out[i] = v;
      }
      if (mean != nullptr) mean[r] = m;
      if (rstd != nullptr) rstd[r] = s;
    }
  });
}

void layernorm_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w,
                        const float* mean, const float* rstd, int64_t rows, int64_t width) {
  check_rows(rows, width);
  PIPESHARD_CHECK(mean != nullptr && rstd != nullptr, "layernorm_backward needs the mean and rstd forward saved");
  if (dx != nullptr) {
    parallel_ranges(rows, rows * width * 8, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const float* g = dy + r * width;
        const float* in = x + r * width;
        const float m = mean[r], s = rstd[r];
        // dnorm = w ⊙ dy; dx = rstd · (dnorm − mean(dnorm) − norm · mean(dnorm ⊙ norm))
        float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
#pragma omp simd reduction(+ : dnorm_mean, dnorm_norm_mean)
        for (int64_t i = 0; i < width; ++i) {
          const float norm = (in[i] - m) * s;
          const float dnorm = (w != nullptr ? w[i] : 1.0f) * g[i];
          dnorm_mean += dnorm;
          dnorm_norm_mean += dnorm * norm;
        }
        dnorm_mean /= static_cast<float>(width);
        dnorm_norm_mean /= static_cast<float>(width);
        float* d = dx + r * width;
        for (int64_t i = 0; i < width; ++i) {
          const float norm = (in[i] - m) * s;
          const float dnorm = (w != nullptr ? w[i] : 1.0f) * g[i];
          d[i] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
        }
      }
    });
  }
  if (dw == nullptr && db == nullptr) return;
  parallel_ranges(width, rows * width * 3, [&](int64_t c0, int64_t c1) {
    for (int64_t r = 0; r < rows; ++r) {
      const float* g = dy + r * width;
      const float* in = x + r * width;
      const float m = mean[r], s = rstd[r];
      if (dw != nullptr) {
        for (int64_t i = c0; i < c1; ++i) dw[i] += (in[i] - m) * s * g[i];
      }
      if (db != nullptr) {
        for (int64_t i = c0; i < c1; ++i) db[i] += g[i];
      }
    }
  });
}

// ---- BatchNorm: x [batch, channels, inner]; statistics per channel over batch × inner ----
//
// Without a reducer each block of channels goes through all its passes (Σx, Σ(x − mean)²,
// normalise; Σdy and Σdy·x̂, dx) at once, while its slice of x is in cache. With one
// (synchronized BatchNorm) a pass needs the global sums of the pass before, so each pass
// runs over all channels and the sums are reduced between passes. Both paths call the
// same per-block functions, so a channel's arithmetic is the same either way. The reducer
// is called from the calling thread only, between parallel regions, never from an OpenMP
// worker: MPI runs at MPI_THREAD_FUNNELED.

namespace {

// Channels are handled in blocks whose per-channel accumulators live on the stack; with
// inner == 1 (BatchNorm1d on [batch, features]) the loops run along contiguous channels.
constexpr int64_t kChannelBlock = 64;

struct BatchNormDims {
  int64_t batch, channels, inner;
  int64_t at(int64_t b, int64_t c) const { return (b * channels + c) * inner; }
  int64_t count() const { return batch * inner; }
};

// acc[c - c0] += Σ_k f(b, c, k) over the batch, in the order b, k.
template <typename F>
void channel_sums(const BatchNormDims& d, int64_t c0, int64_t c1, double* acc, F&& f) {
  for (int64_t b = 0; b < d.batch; ++b) {
    if (d.inner == 1) {
      for (int64_t c = c0; c < c1; ++c) acc[c - c0] += f(d.at(b, c));
    } else {
      for (int64_t c = c0; c < c1; ++c) {
        double s = 0.0;
        const int64_t base = d.at(b, c);
        for (int64_t k = 0; k < d.inner; ++k) s += f(base + k);
        acc[c - c0] += s;
      }
    }
  }
}

// Calls body(c0, c1) for blocks of at most kChannelBlock channels, blocks spread over threads.
template <typename Body>
void channel_blocks(const BatchNormDims& d, int64_t cost, Body&& body) {
  const int64_t blocks = (d.channels + kChannelBlock - 1) / kChannelBlock;
  parallel_ranges(blocks, d.batch * d.channels * d.inner * cost, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) body(k * kChannelBlock, std::min(d.channels, (k + 1) * kChannelBlock));
  });
}

void check_batchnorm(const BatchNormDims& d) {
  PIPESHARD_CHECK(d.batch > 0 && d.channels > 0 && d.inner > 0, "batchnorm shape [" + std::to_string(d.batch) + ", " +
                                                                    std::to_string(d.channels) + ", " +
                                                                    std::to_string(d.inner) + "]");
}

// The count of values per channel over all processes, as the reducer summed it.
double checked_global_count(double global, const BatchNormDims& d) {
  // A reducer that averages or drops a process shows here rather than as wrong statistics.
  PIPESHARD_CHECK(global >= static_cast<double>(d.count()) && global == std::floor(global),
                  "synchronized BatchNorm: the reducer gave " + std::to_string(global) +
                      " values per channel where this process alone has " + std::to_string(d.count()));
  return global;
}

// ---- forward, per block of channels [c0, c1); block arrays are indexed by c - c0 ----

// sq[c - c0] += Σ (x − mean[c - c0])² over the batch, in the order b, k. Two passes (mean,
// then squared deviations) for an accurate variance.
void add_squared_deviations(const BatchNormDims& d, int64_t c0, int64_t c1, const float* x, const double* mean,
                            double* sq) {
  for (int64_t bi = 0; bi < d.batch; ++bi) {
    for (int64_t c = c0; c < c1; ++c) {
      const double m = mean[c - c0];
      const int64_t base = d.at(bi, c);
      double s = 0.0;
      for (int64_t k = 0; k < d.inner; ++k) s += (x[base + k] - m) * (x[base + k] - m);
      sq[c - c0] += s;
    }
  }
}

// rstd from the biased variance sq / count, and the running statistics (each may be null)
// moved towards mean and the unbiased variance sq / (count − 1).
void finish_training_statistics(int64_t c0, int64_t c1, const double* mean, const double* sq, double count, float eps,
                                float momentum, float* running_mean, float* running_var, double* rstd) {
  for (int64_t c = c0; c < c1; ++c) {
    const double var = sq[c - c0] / count;
    rstd[c - c0] = 1.0 / std::sqrt(var + static_cast<double>(eps));
    if (running_mean != nullptr) {
      running_mean[c] =
          static_cast<float>(momentum * static_cast<double>(running_mean[c]) + (1.0 - momentum) * mean[c - c0]);
    }
    if (running_var != nullptr) {
      const double unbiased = sq[c - c0] / (count - 1.0);
      running_var[c] = static_cast<float>(momentum * static_cast<double>(running_var[c]) + (1.0 - momentum) * unbiased);
    }
  }
}

// y = (x − mean)·rstd·w + b; the statistics in float saved into mean, rstd [channels] when given.
void normalise_channels(const BatchNormDims& d, int64_t c0, int64_t c1, float* y, const float* x, const float* w,
                        const float* b, const double* block_mean, const double* block_rstd, float* mean, float* rstd) {
  float m[kChannelBlock], scale[kChannelBlock], shift[kChannelBlock];
  for (int64_t c = c0; c < c1; ++c) {
    m[c - c0] = static_cast<float>(block_mean[c - c0]);
    scale[c - c0] = static_cast<float>((w != nullptr ? w[c] : 1.0) * block_rstd[c - c0]);
    shift[c - c0] = b != nullptr ? b[c] : 0.0f;
    if (mean != nullptr) mean[c] = m[c - c0];
    if (rstd != nullptr) rstd[c] = static_cast<float>(block_rstd[c - c0]);
  }
  for (int64_t bi = 0; bi < d.batch; ++bi) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t base = d.at(bi, c);
      const float mc = m[c - c0], sc = scale[c - c0], sh = shift[c - c0];
      for (int64_t k = 0; k < d.inner; ++k) y[base + k] = (x[base + k] - mc) * sc + sh;
    }
  }
}

// Training over the batches of every process `reduce` sums over: Σx and the count, then
// Σ(x − global mean)², each pass over all channels followed by one reduction.
void batchnorm_forward_synchronized(const BatchNormDims& d, float* y, float* mean, float* rstd, float* running_mean,
                                    float* running_var, const float* x, const float* w, const float* b, float eps,
                                    float momentum, const ChannelReducer& reduce) {
  const int64_t channels = d.channels;
  std::vector<double> sum(channels + 1, 0.0);  // Σx per channel, then the count
  channel_blocks(d, 1, [&](int64_t c0, int64_t c1) {
    channel_sums(d, c0, c1, sum.data() + c0, [&](int64_t i) { return static_cast<double>(x[i]); });
  });
  sum[channels] = static_cast<double>(d.count());
  reduce(sum.data(), channels + 1);
  const double count = checked_global_count(sum[channels], d);
  PIPESHARD_CHECK(count > 1, "training BatchNorm needs more than one value per channel over all processes");

  std::vector<double> global_mean(channels), sq(channels, 0.0), global_rstd(channels);
  for (int64_t c = 0; c < channels; ++c) global_mean[c] = sum[c] / count;
  channel_blocks(d, 2, [&](int64_t c0, int64_t c1) {
    add_squared_deviations(d, c0, c1, x, global_mean.data() + c0, sq.data() + c0);
  });
  reduce(sq.data(), channels);

  channel_blocks(d, 2, [&](int64_t c0, int64_t c1) {
    finish_training_statistics(c0, c1, global_mean.data() + c0, sq.data() + c0, count, eps, momentum, running_mean,
                               running_var, global_rstd.data() + c0);
    normalise_channels(d, c0, c1, y, x, w, b, global_mean.data() + c0, global_rstd.data() + c0, mean, rstd);
  });
}

// ---- backward, per block of channels [c0, c1) ----

// s1[c - c0] += Σ dy and s2[c - c0] += Σ dy·x̂, x̂ = (x − mean)·rstd.
void add_gradient_sums(const BatchNormDims& d, int64_t c0, int64_t c1, const float* dy, const float* x,
                       const float* mean, const float* rstd, double* s1, double* s2) {
  channel_sums(d, c0, c1, s1, [&](int64_t i) { return static_cast<double>(dy[i]); });
  for (int64_t bi = 0; bi < d.batch; ++bi) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t base = d.at(bi, c);
      const double mc = mean[c], sc = rstd[c];
      double s = 0.0;
      for (int64_t k = 0; k < d.inner; ++k) s += dy[base + k] * ((x[base + k] - mc) * sc);
      s2[c - c0] += s;
    }
  }
}

void add_parameter_gradients(int64_t c0, int64_t c1, float* dw, float* db, const double* s1, const double* s2) {
  for (int64_t c = c0; c < c1; ++c) {
    if (dw != nullptr) dw[c] += static_cast<float>(s2[c - c0]);
    if (db != nullptr) db[c] += static_cast<float>(s1[c - c0]);
  }
}

// training: dx += w·rstd·(dy − S1/count − x̂·S2/count), the gradient through the batch
// statistics; inference: the statistics are constants and dx += w·rstd·dy.
void add_input_gradient(const BatchNormDims& d, int64_t c0, int64_t c1, float* dx, const float* dy, const float* x,
                        const float* w, const float* mean, const float* rstd, const double* s1, const double* s2,
                        double count, bool training) {
  float m[kChannelBlock], k_dy[kChannelBlock], k_mean[kChannelBlock], k_xhat[kChannelBlock], s[kChannelBlock];
  for (int64_t c = c0; c < c1; ++c) {
    const double gain = (w != nullptr ? w[c] : 1.0) * rstd[c];
    m[c - c0] = mean[c];
    s[c - c0] = rstd[c];
    k_dy[c - c0] = static_cast<float>(gain);
    k_mean[c - c0] = training ? static_cast<float>(gain * s1[c - c0] / count) : 0.0f;
    k_xhat[c - c0] = training ? static_cast<float>(gain * s2[c - c0] / count) : 0.0f;
  }
  for (int64_t bi = 0; bi < d.batch; ++bi) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t base = d.at(bi, c);
      const int64_t j = c - c0;
      for (int64_t k = 0; k < d.inner; ++k) {
        const float xhat = (x[base + k] - m[j]) * s[j];
        dx[base + k] += k_dy[j] * dy[base + k] - k_mean[j] - k_xhat[j] * xhat;
      }
    }
  }
}

// Training backward with dx over the batches of every process `reduce` sums over: local
// S1, S2 into dw, db; then S1, S2 and the count reduced (one call), and dx from the totals.
void batchnorm_backward_synchronized(const BatchNormDims& d, float* dx, float* dw, float* db, const float* dy,
                                     const float* x, const float* w, const float* mean, const float* rstd,
                                     const ChannelReducer& reduce) {
  const int64_t channels = d.channels;
  std::vector<double> sums(2 * channels + 1, 0.0);  // S1 per channel, S2 per channel, the count
  double* s1 = sums.data();
  double* s2 = sums.data() + channels;
  channel_blocks(d, 4, [&](int64_t c0, int64_t c1) {
    add_gradient_sums(d, c0, c1, dy, x, mean, rstd, s1 + c0, s2 + c0);
    add_parameter_gradients(c0, c1, dw, db, s1 + c0, s2 + c0);
  });
  sums[2 * channels] = static_cast<double>(d.count());
  reduce(sums.data(), 2 * channels + 1);
  const double count = checked_global_count(sums[2 * channels], d);
  channel_blocks(d, 4, [&](int64_t c0, int64_t c1) {
    add_input_gradient(d, c0, c1, dx, dy, x, w, mean, rstd, s1 + c0, s2 + c0, count, true);
  });
}

}  // namespace

// In inference mode mean and rstd, when given, receive running_mean and
// 1/√(running_var + eps): backward has no eps, so in both modes it reads the statistics
// that forward normalised with from these two buffers.
void batchnorm_forward(float* y, float* mean, float* rstd, float* running_mean, float* running_var, const float* x,
                       const float* w, const float* b, int64_t batch, int64_t channels, int64_t inner, float eps,
                       float momentum, bool training, const ChannelReducer* reduce) {
  const BatchNormDims d{batch, channels, inner};
  check_batchnorm(d);
  if (!training) {
    PIPESHARD_CHECK(running_mean != nullptr && running_var != nullptr, "inference BatchNorm needs running stats");
    channel_blocks(d, 4, [&](int64_t c0, int64_t c1) {
      double block_mean[kChannelBlock], block_rstd[kChannelBlock];
      for (int64_t c = c0; c < c1; ++c) {
        block_mean[c - c0] = running_mean[c];
        block_rstd[c - c0] = 1.0 / std::sqrt(static_cast<double>(running_var[c]) + static_cast<double>(eps));
      }
      normalise_channels(d, c0, c1, y, x, w, b, block_mean, block_rstd, mean, rstd);
    });
    return;
  }
  PIPESHARD_CHECK(mean != nullptr && rstd != nullptr, "training BatchNorm saves mean and rstd");
  if (reduce != nullptr) {
    batchnorm_forward_synchronized(d, y, mean, rstd, running_mean, running_var, x, w, b, eps, momentum, *reduce);
    return;
  }
  const int64_t n = d.count();
  // PyTorch refuses this too: the unbiased variance of one value is undefined.
  PIPESHARD_CHECK(n > 1, "training BatchNorm needs more than one value per channel");
  channel_blocks(d, 4, [&](int64_t c0, int64_t c1) {
    double sum[kChannelBlock] = {}, sq[kChannelBlock] = {}, block_mean[kChannelBlock], block_rstd[kChannelBlock];
    channel_sums(d, c0, c1, sum, [&](int64_t i) { return static_cast<double>(x[i]); });
    for (int64_t c = c0; c < c1; ++c) block_mean[c - c0] = sum[c - c0] / static_cast<double>(n);
    add_squared_deviations(d, c0, c1, x, block_mean, sq);
    finish_training_statistics(c0, c1, block_mean, sq, static_cast<double>(n), eps, momentum, running_mean, running_var,
                               block_rstd);
    normalise_channels(d, c0, c1, y, x, w, b, block_mean, block_rstd, mean, rstd);
  });
}

void batchnorm_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w,
                        const float* mean, const float* rstd, int64_t batch, int64_t channels, int64_t inner,
                        bool training, const ChannelReducer* reduce) {
  const BatchNormDims d{batch, channels, inner};
  check_batchnorm(d);
  PIPESHARD_CHECK(mean != nullptr && rstd != nullptr, "batchnorm_backward needs the mean and rstd forward saved");
  // Without dx nothing needs the global sums: dw and db take the local ones anyway.
  if (reduce != nullptr && training && dx != nullptr) {
    batchnorm_backward_synchronized(d, dx, dw, db, dy, x, w, mean, rstd, *reduce);
    return;
  }
  const double n = static_cast<double>(d.count());
  channel_blocks(d, 8, [&](int64_t c0, int64_t c1) {
    double s1[kChannelBlock] = {}, s2[kChannelBlock] = {};
    add_gradient_sums(d, c0, c1, dy, x, mean, rstd, s1, s2);
    add_parameter_gradients(c0, c1, dw, db, s1, s2);
    if (dx != nullptr) add_input_gradient(d, c0, c1, dx, dy, x, w, mean, rstd, s1, s2, n, training);
  });
}

}  // namespace pipeshard::cpu
