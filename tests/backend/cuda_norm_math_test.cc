// The arithmetic of the CUDA softmax, loss, LayerNorm and BatchNorm kernels
// (backend/math/norm_math.cuh), driven on the host over whole rows and channels the way
// the kernels drive it, against the CPU backend on the same random inputs of awkward
// sizes (width 1, odd widths, widths above the kernels' 1024-wide warp rows, one row).
// Needs no GPU and no CUDA: under a host compiler the header's functions are plain
// inline functions. What this cannot see (launch shapes, the order of the device's
// reductions) is for a test on a GPU.
//
// Tolerance: the drivers add rows in index order where the CPU vectorises some float sums
// (omp simd) and groups BatchNorm's double sums per sample, and they call expf where the
// CPU's cross-entropy calls its exp_nonpositive (both < 2 ulp), so values agree to a few
// float ulps; kRtol (~30 ulps of the values' size) leaves room for that while any formula
// error (a dropped term, a wrong divisor, a variance that is not the unbiased one) is
// orders of magnitude larger.
#include "backend/math/norm_math.cuh"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "tests/backend/backend_check.h"

namespace pipeshard {
namespace {

using namespace pipeshard::testing;  // NOLINT: the checks and fixture of backend_check.h
using namespace pipeshard::cuda;     // NOLINT: the functions under test

constexpr double kRtol = 4e-6;

const int64_t kWidths[] = {1, 2, 5, 33, 1025};
const int64_t kRows[] = {1, 3, 17};

std::string shape_name(int64_t rows, int64_t width) {
  return " rows=" + std::to_string(rows) + " width=" + std::to_string(width);
}

void expect_close(const Floats& got, const Floats& want, const std::string& what) {
  expect_values_near(got, to_double(want), what, kRtol);
}

// ---- host drivers: one row or channel at a time, as a warp, block or column pass does ----

Floats softmax_forward_driver(const Floats& x, int64_t rows, int64_t width, bool log) {
  Floats y(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = x.data() + r * width;
    float m = -std::numeric_limits<float>::infinity(), sum = 0.0f;
    for (int64_t i = 0; i < width; ++i) m = std::max(m, in[i]);
    for (int64_t i = 0; i < width; ++i) sum += std::exp(in[i] - m);
    const float log_sum = std::log(sum), inv_sum = 1.0f / sum;
    for (int64_t i = 0; i < width; ++i) {
      y[r * width + i] = log ? log_softmax_output(in[i], m, log_sum) : softmax_output(in[i], m, inv_sum);
    }
  }
  return y;
}

void softmax_backward_driver(Floats& dx, const Floats& dy, const Floats& y, int64_t rows, int64_t width, bool log) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = dy.data() + r * width;
    const float* out = y.data() + r * width;
    float s = 0.0f;
    for (int64_t i = 0; i < width; ++i) s += log ? g[i] : g[i] * out[i];
    for (int64_t i = 0; i < width; ++i) {
      dx[r * width + i] += log ? log_softmax_input_grad(g[i], out[i], s) : softmax_input_grad(g[i], out[i], s);
    }
  }
}

double cross_entropy_driver(Floats* dlogits, const Floats& logits, const Floats& labels, int64_t rows, int64_t classes,
                            double denominator, bool log_probs) {
  const float inv_den = static_cast<float>(1.0 / denominator);
  double total = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    EXPECT_TRUE(is_class_label(labels[r], classes));
    const int64_t k = static_cast<int64_t>(labels[r]);
    const float* in = logits.data() + r * classes;
    float* d = dlogits != nullptr ? dlogits->data() + r * classes : nullptr;
    if (log_probs) {
      total += nll_row_loss(in[k]);
      for (int64_t i = 0; d != nullptr && i < classes; ++i) d[i] = nll_grad(i == k, inv_den);
      continue;
    }
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < classes; ++i) m = std::max(m, in[i]);
    double exp_sum = 0.0;
    for (int64_t i = 0; i < classes; ++i) exp_sum += std::exp(in[i] - m);
    total += cross_entropy_row_loss(exp_sum, m, in[k]);
    const float inv_sum = static_cast<float>(1.0 / exp_sum);
    for (int64_t i = 0; d != nullptr && i < classes; ++i) d[i] = cross_entropy_grad(in[i], m, inv_sum, inv_den, i == k);
  }
  return total / denominator;
}

void layernorm_forward_driver(Floats& y, Floats& mean, Floats& rstd, const Floats& x, const float* w, const float* b,
                              int64_t rows, int64_t width, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = x.data() + r * width;
    float sum = 0.0f, squared_deviations = 0.0f;
    for (int64_t i = 0; i < width; ++i) sum += in[i];
    const float m = layernorm_mean(sum, width);
    for (int64_t i = 0; i < width; ++i) squared_deviations += (in[i] - m) * (in[i] - m);
    const float s = layernorm_rstd(squared_deviations, width, eps);
    for (int64_t i = 0; i < width; ++i) y[r * width + i] = layernorm_output(in[i], m, s, w, b, i);
    mean[r] = m;
    rstd[r] = s;
  }
}

void layernorm_backward_driver(Floats* dx, Floats* dw, Floats* db, const Floats& dy, const Floats& x, const float* w,
                               const Floats& mean, const Floats& rstd, int64_t rows, int64_t width) {
  for (int64_t r = 0; dx != nullptr && r < rows; ++r) {
    const float* g = dy.data() + r * width;
    const float* in = x.data() + r * width;
    float dnorm_sum = 0.0f, dnorm_norm_sum = 0.0f;
    for (int64_t i = 0; i < width; ++i) {
      const float dnorm = layernorm_dnorm(g[i], w, i);
      dnorm_sum += dnorm;
      dnorm_norm_sum += dnorm * layernorm_norm(in[i], mean[r], rstd[r]);
    }
    const float dnorm_mean = dnorm_sum / static_cast<float>(width);
    const float dnorm_norm_mean = dnorm_norm_sum / static_cast<float>(width);
    for (int64_t i = 0; i < width; ++i) {
      (*dx)[r * width + i] += layernorm_input_grad(in[i], g[i], w, i, mean[r], rstd[r], dnorm_mean, dnorm_norm_mean);
    }
  }
  for (int64_t i = 0; i < width; ++i) {  // the column pass: Σ over rows in double, one addition
    double sum_dw = 0.0, sum_db = 0.0;
    for (int64_t r = 0; r < rows; ++r) {
      sum_dw += layernorm_weight_grad(x[r * width + i], dy[r * width + i], mean[r], rstd[r]);
      sum_db += dy[r * width + i];
    }
    if (dw != nullptr) (*dw)[i] += static_cast<float>(sum_dw);
    if (db != nullptr) (*db)[i] += static_cast<float>(sum_db);
  }
}

// ---- BatchNorm; `replicas` > 1 simulates synchronized BatchNorm over that many processes
// holding the same batch: the reducer multiplies every partial sum (and the count) by it ----

struct BnDims {  // x [batch, channels, inner]
  int64_t batch, channels, inner;
  int64_t size() const { return batch * channels * inner; }
  int64_t at(int64_t b, int64_t c, int64_t k) const { return (b * channels + c) * inner + k; }
};

struct BnState {
  Floats y, mean, rstd, running_mean, running_var;
};

// f(index) for the values of channel c in ascending order.
void for_each_in_channel(const BnDims& d, int64_t c, const std::function<void(int64_t)>& f) {
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t k = 0; k < d.inner; ++k) f(d.at(b, c, k));
  }
}

double channel_sum(const BnDims& d, int64_t c, const std::function<double(int64_t)>& f) {
  double s = 0.0;
  for_each_in_channel(d, c, [&](int64_t i) { s += f(i); });
  return s;
}

void batchnorm_forward_driver(BnState& st, const Floats& x, const float* w, const float* b, const BnDims& d, float eps,
                              float momentum, bool training, double replicas) {
  for (int64_t c = 0; c < d.channels; ++c) {
    double m, r;
    if (training) {
      const double count = static_cast<double>(d.batch * d.inner) * replicas;
      m = channel_sum(d, c, [&](int64_t i) { return static_cast<double>(x[i]); }) * replicas / count;
      const double sq = channel_sum(d, c, [&](int64_t i) { return batchnorm_squared_deviation(x[i], m); }) * replicas;
      r = batchnorm_training_rstd(sq, count, eps);
      st.running_mean[c] = batchnorm_running_update(st.running_mean[c], m, momentum);
      st.running_var[c] = batchnorm_running_update(st.running_var[c], batchnorm_unbiased_variance(sq, count), momentum);
    } else {
      m = st.running_mean[c];
      r = batchnorm_inference_rstd(st.running_var[c], eps);
    }
    const BatchNormAffine a = batchnorm_affine(m, r, w, b, c);
    st.mean[c] = a.mean;
    st.rstd[c] = static_cast<float>(r);
    for_each_in_channel(d, c, [&](int64_t i) { st.y[i] = batchnorm_output(x[i], a); });
  }
}

void batchnorm_backward_driver(Floats* dx, Floats& dw, Floats& db, const Floats& dy, const Floats& x, const float* w,
                               const Floats& mean, const Floats& rstd, const BnDims& d, bool training,
                               double replicas) {
  for (int64_t c = 0; c < d.channels; ++c) {
    double s1 = channel_sum(d, c, [&](int64_t i) { return static_cast<double>(dy[i]); });
    double s2 = channel_sum(d, c, [&](int64_t i) { return batchnorm_dy_xhat(x[i], dy[i], mean[c], rstd[c]); });
    dw[c] += static_cast<float>(s2);  // this process's sums
    db[c] += static_cast<float>(s1);
    if (dx == nullptr) continue;
    double count = static_cast<double>(d.batch * d.inner);
    if (training && replicas > 1.0) {  // the global sums, as the reducer gives them
      s1 *= replicas;
      s2 *= replicas;
      count *= replicas;
    }
    const BatchNormInputGrad g =
        batchnorm_input_grad_coefficients(w, mean.data(), rstd.data(), c, s1, s2, count, training);
    for_each_in_channel(d, c, [&](int64_t i) { (*dx)[i] += batchnorm_input_grad(x[i], dy[i], g); });
  }
}

class NormMathTest : public BackendTest {};

// ---- softmax ----

TEST_F(NormMathTest, SoftmaxForwardAndBackwardMatchTheCpuBackend) {
  for (bool log : {false, true}) {
    for (int64_t rows : kRows) {
      for (int64_t width : kWidths) {
        const std::string what = std::string(log ? "log-softmax" : "softmax") + shape_name(rows, width);
        const int64_t n = rows * width;
        const Floats x = random(n, -8.0f, 8.0f), dy = random(n), dx0 = random(n);
        DeviceBuffer bx = buffer(x), by = zeros(n), bdy = buffer(dy), bdx = buffer(dx0);
        be_->softmax_forward(by.data(), bx.data(), rows, width, log);
        const Floats y = host(by);
        expect_close(softmax_forward_driver(x, rows, width, log), y, what + " y");
        be_->softmax_backward(bdx.data(), bdy.data(), by.data(), rows, width, log);
        Floats dx = dx0;
        softmax_backward_driver(dx, dy, y, rows, width, log);
        expect_close(dx, host(bdx), what + " dx (added)");
      }
    }
  }
}

// ---- losses ----

TEST_F(NormMathTest, LabelsAreClassIndicesAsTheCpuChecksThem) {
  EXPECT_TRUE(is_class_label(0.0f, 1));
  EXPECT_TRUE(is_class_label(-0.0f, 3));
  EXPECT_TRUE(is_class_label(2.0f, 3));
  EXPECT_FALSE(is_class_label(3.0f, 3));
  EXPECT_FALSE(is_class_label(-1.0f, 3));
  EXPECT_FALSE(is_class_label(1.5f, 3));
  EXPECT_FALSE(is_class_label(std::nanf(""), 3));
  EXPECT_FALSE(is_class_label(std::numeric_limits<float>::infinity(), 3));
  EXPECT_FALSE(is_class_label(1e30f, 3)) << "out of range before any conversion to an integer";
}

TEST_F(NormMathTest, CrossEntropyAndNllMatchTheCpuBackend) {
  for (bool log_probs : {false, true}) {
    for (int64_t rows : kRows) {
      for (int64_t classes : kWidths) {
        const std::string what = std::string(log_probs ? "nll" : "cross-entropy") + shape_name(rows, classes);
        const int64_t n = rows * classes;
        Floats logits = random(n, -20.0f, 20.0f);
        if (log_probs) {  // log-probabilities, as a LogSoftmax would give
          DeviceBuffer bx = buffer(logits), by = zeros(n);
          be_->softmax_forward(by.data(), bx.data(), rows, classes, true);
          logits = host(by);
        }
        Floats labels(rows);
        std::uniform_int_distribution<int64_t> pick(0, classes - 1);
        for (float& l : labels) l = static_cast<float>(pick(rng_));
        const double den = 2.0 * rows + 1.0;
        DeviceBuffer bl = buffer(logits), blab = buffer(labels), bd = buffer(random(n));
        const double want = be_->cross_entropy(bd.data(), bl.data(), blab.data(), rows, classes, den, log_probs);
        Floats d(n, 7.0f);
        const double got = cross_entropy_driver(&d, logits, labels, rows, classes, den, log_probs);
        EXPECT_NEAR(got, want, 1e-6 * (1.0 + std::fabs(want))) << what;
        expect_close(d, host(bd), what + " dlogits (written)");
        EXPECT_EQ(cross_entropy_driver(nullptr, logits, labels, rows, classes, den, log_probs), got) << what;
      }
    }
  }
}

TEST_F(NormMathTest, CrossEntropyOfExtremeLogitsStaysFinite) {
  const Floats logits = {1000.0f, -1000.0f, 0.0f, 500.0f, 500.0f, 499.0f};
  const Floats labels = {1.0f, 2.0f};
  DeviceBuffer bl = buffer(logits), blab = buffer(labels), bd = zeros(6);
  const double want = be_->cross_entropy(bd.data(), bl.data(), blab.data(), 2, 3, 2.0, false);
  Floats d(6);
  EXPECT_NEAR(cross_entropy_driver(&d, logits, labels, 2, 3, 2.0, false), want, 1e-9 * want);
  for (float v : d) EXPECT_TRUE(std::isfinite(v));
  expect_close(d, host(bd), "dlogits");
}

TEST_F(NormMathTest, MeanSquaredErrorMatchesTheCpuBackend) {
  for (int64_t n : {1, 5, 33, 1025}) {
    const Floats pred = random(n, -3.0f, 3.0f), target = random(n, -3.0f, 3.0f);
    const double den = n + 3.0;
    DeviceBuffer bp = buffer(pred), bt = buffer(target), bd = zeros(n);
    const double want = be_->mean_squared_error(bd.data(), bp.data(), bt.data(), n, den);
    const float grad_scale = static_cast<float>(2.0 / den);
    double total = 0.0;
    Floats d(n);
    for (int64_t i = 0; i < n; ++i) {
      total += squared_error(pred[i], target[i]);
      d[i] = squared_error_grad(pred[i], target[i], grad_scale);
    }
    EXPECT_NEAR(total / den, want, 1e-12 * want) << n;
    EXPECT_EQ(d, host(bd)) << "the gradient is one float product, as on the CPU; n=" << n;
  }
}

// ---- LayerNorm ----

TEST_F(NormMathTest, LayerNormForwardAndBackwardMatchTheCpuBackend) {
  const float eps = 1e-5f;
  for (int affine = 0; affine < 4; ++affine) {  // bit 0: w, bit 1: b
    for (int64_t rows : kRows) {
      for (int64_t width : kWidths) {
        const std::string what =
            "layernorm w=" + std::to_string(affine & 1) + " b=" + std::to_string(affine >> 1) + shape_name(rows, width);
        const int64_t n = rows * width;
        const Floats x = random(n, -2.0f, 3.0f), w = random(width, 0.5f, 1.5f), b = random(width), dy = random(n);
        const float* pw = (affine & 1) ? w.data() : nullptr;
        const float* pb = (affine & 2) ? b.data() : nullptr;
        DeviceBuffer bx = buffer(x), bw = buffer(w), bb = buffer(b), by = zeros(n), bmean = zeros(rows),
                     brstd = zeros(rows);
        float* w_ptr = (affine & 1) ? bw.data() : nullptr;
        be_->layernorm_forward(by.data(), bmean.data(), brstd.data(), bx.data(), w_ptr,
                               (affine & 2) ? bb.data() : nullptr, rows, width, eps);
        Floats y(n), mean(rows), rstd(rows);
        layernorm_forward_driver(y, mean, rstd, x, pw, pb, rows, width, eps);
        expect_close(y, host(by), what + " y");
        expect_close(mean, host(bmean), what + " mean");
        expect_close(rstd, host(brstd), what + " rstd");

        // Backward from the CPU's saved statistics, into buffers that already hold values.
        const Floats cpu_mean = host(bmean), cpu_rstd = host(brstd);
        const Floats dx0 = random(n), dw0 = random(width), db0 = random(width);
        DeviceBuffer bdy = buffer(dy), bdx = buffer(dx0), bdw = buffer(dw0), bdb = buffer(db0);
        be_->layernorm_backward(bdx.data(), bdw.data(), bdb.data(), bdy.data(), bx.data(), w_ptr, bmean.data(),
                                brstd.data(), rows, width);
        Floats dx = dx0, dw = dw0, db = db0;
        layernorm_backward_driver(&dx, &dw, &db, dy, x, pw, cpu_mean, cpu_rstd, rows, width);
        expect_close(dx, host(bdx), what + " dx");
        expect_close(dw, host(bdw), what + " dw");
        expect_close(db, host(bdb), what + " db");
      }
    }
  }
}

// ---- BatchNorm ----

class BatchNormMathTest : public NormMathTest {
 protected:
  void check(const BnDims& d, bool training, double replicas, bool affine) {
    const std::string what = std::string(training ? "training" : "inference") + " [" + std::to_string(d.batch) + ", " +
                             std::to_string(d.channels) + ", " + std::to_string(d.inner) + "] replicas " +
                             std::to_string(static_cast<int>(replicas)) + (affine ? " affine" : " plain");
    const float eps = 1e-5f, momentum = 0.9f;
    const int64_t n = d.size(), c = d.channels;
    const Floats x = random(n, -2.0f, 3.0f), w = random(c, 0.5f, 1.5f), b = random(c), dy = random(n);
    const Floats rm = random(c), rv = random(c, 0.5f, 2.0f);
    const ChannelReducer reducer = [replicas](double* data, int64_t count) {
      for (int64_t i = 0; i < count; ++i) data[i] *= replicas;
    };
    const ChannelReducer* reduce = replicas > 1.0 ? &reducer : nullptr;
    const float* pw = affine ? w.data() : nullptr;
    const float* pb = affine ? b.data() : nullptr;

    DeviceBuffer bx = buffer(x), bw = buffer(w), bb = buffer(b), by = zeros(n), bmean = zeros(c), brstd = zeros(c),
                 brm = buffer(rm), brv = buffer(rv);
    be_->batchnorm_forward(by.data(), bmean.data(), brstd.data(), brm.data(), brv.data(), bx.data(),
                           affine ? bw.data() : nullptr, affine ? bb.data() : nullptr, d.batch, d.channels, d.inner,
                           eps, momentum, training, reduce);
    BnState st{Floats(n), Floats(c), Floats(c), rm, rv};
    batchnorm_forward_driver(st, x, pw, pb, d, eps, momentum, training, replicas);
    expect_close(st.y, host(by), what + " y");
    expect_close(st.mean, host(bmean), what + " mean");
    expect_close(st.rstd, host(brstd), what + " rstd");
    expect_close(st.running_mean, host(brm), what + " running mean");
    expect_close(st.running_var, host(brv), what + " running var (unbiased, ONNX momentum)");

    for (bool want_dx : {true, false}) {
      const Floats mean = host(bmean), rstd = host(brstd), dx0 = random(n), dw0 = random(c), db0 = random(c);
      DeviceBuffer bdy = buffer(dy), bdx = buffer(dx0), bdw = buffer(dw0), bdb = buffer(db0);
      be_->batchnorm_backward(want_dx ? bdx.data() : nullptr, bdw.data(), bdb.data(), bdy.data(), bx.data(),
                              affine ? bw.data() : nullptr, bmean.data(), brstd.data(), d.batch, d.channels, d.inner,
                              training, reduce);
      Floats dx = dx0, dw = dw0, db = db0;
      batchnorm_backward_driver(want_dx ? &dx : nullptr, dw, db, dy, x, pw, mean, rstd, d, training, replicas);
      const std::string which = what + (want_dx ? "" : " without dx");
      expect_close(dx, host(bdx), which + " dx");
      expect_close(dw, host(bdw), which + " dw (this process's)");
      expect_close(db, host(bdb), which + " db (this process's)");
    }
  }
};

TEST_F(BatchNormMathTest, TrainingMatchesTheCpuBackend) {
  for (const BnDims& d :
       {BnDims{2, 1, 1}, BnDims{3, 5, 1}, BnDims{7, 70, 1}, BnDims{1, 5, 4}, BnDims{3, 33, 5}, BnDims{2, 3, 7}}) {
    for (bool affine : {true, false}) check(d, true, 1.0, affine);
  }
}

TEST_F(BatchNormMathTest, SynchronizedTrainingMatchesTheCpuBackend) {
  // One value per process is enough when the reducer makes the count 2.
  for (const BnDims& d : {BnDims{1, 3, 1}, BnDims{3, 5, 1}, BnDims{7, 70, 1}, BnDims{3, 33, 5}}) {
    check(d, true, 2.0, true);
  }
}

TEST_F(BatchNormMathTest, InferenceMatchesTheCpuBackend) {
  for (const BnDims& d : {BnDims{1, 1, 1}, BnDims{3, 5, 1}, BnDims{7, 70, 1}, BnDims{3, 33, 5}}) {
    for (bool affine : {true, false}) check(d, false, 1.0, affine);
    check(d, false, 2.0, true);  // inference ignores the reducer
  }
}

}  // namespace
}  // namespace pipeshard
