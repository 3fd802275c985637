// Tests of the CPU backend's training kernels (backend/backend.h): losses, optimizer
// steps, and results that do not depend on the number of threads. Written against the
// Backend interface (plus the CPU backend's threading threshold, which the thread-count
// test lowers); how gradients are checked: tests/backend/backend_check.h.
#include "backend/backend.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#if __has_include(<omp.h>)
#include <omp.h>
#define PIPESHARD_TEST_HAVE_OMP 1
#endif

#include "backend/cpu/cpu_kernels.h"
#include "tests/backend/backend_check.h"

namespace pipeshard {
namespace {

using namespace pipeshard::testing;  // NOLINT: the checks and fixture of backend_check.h

// ---- double-precision references ----

Doubles log_softmax_ref(const Doubles& x, int64_t rows, int64_t width) {
  Doubles y(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double m = x[r * width], sum = 0.0;
    for (int64_t i = 1; i < width; ++i) m = std::max(m, x[r * width + i]);
    for (int64_t i = 0; i < width; ++i) sum += std::exp(x[r * width + i] - m);
    for (int64_t i = 0; i < width; ++i) y[r * width + i] = x[r * width + i] - m - std::log(sum);
  }
  return y;
}

double cross_entropy_ref(const Doubles& logits, const Floats& labels, int64_t rows, int64_t classes, double den,
                         bool log_probs) {
  double total = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t k = static_cast<int64_t>(labels[r]);
    if (log_probs) {
      total -= logits[r * classes + k];
      continue;
    }
    double m = logits[r * classes];
    for (int64_t i = 1; i < classes; ++i) m = std::max(m, logits[r * classes + i]);
    double sum = 0.0;
    for (int64_t i = 0; i < classes; ++i) sum += std::exp(logits[r * classes + i] - m);
    total += std::log(sum) + m - logits[r * classes + k];
  }
  return total / den;
}

double mse_ref(const Doubles& pred, const Doubles& target, double den) {
  double total = 0.0;
  for (size_t i = 0; i < pred.size(); ++i) total += (pred[i] - target[i]) * (pred[i] - target[i]);
  return total / den;
}

// ---- losses ----

TEST_F(BackendTest, CrossEntropyLossAndGradient) {
  for (bool log_probs : {false, true}) {
    for (int64_t rows : {1, 3, 7}) {
      for (int64_t classes : {1, 5, 33}) {
        const std::string what = std::string(log_probs ? "nll" : "cross-entropy") + " rows=" + std::to_string(rows) +
                                 " classes=" + std::to_string(classes);
        Floats logits = random(rows * classes, -3.0f, 3.0f);
        if (log_probs) {  // real log-probabilities, as a LogSoftmax would give
          const Doubles lp = log_softmax_ref(to_double(logits), rows, classes);
          logits.assign(lp.begin(), lp.end());
        }
        Floats labels(rows);
        std::uniform_int_distribution<int> pick(0, static_cast<int>(classes) - 1);
        for (float& l : labels) l = static_cast<float>(pick(rng_));
        const double den = 2.0 * rows + 1.0;  // the global batch is larger than this piece
        DeviceBuffer bl = buffer(logits), blab = buffer(labels), dl = buffer(random(rows * classes));
        const double loss = be_->cross_entropy(dl.data(), bl.data(), blab.data(), rows, classes, den, log_probs);
        const Doubles ld = to_double(logits);
        EXPECT_NEAR(loss, cross_entropy_ref(ld, labels, rows, classes, den, log_probs), 1e-6) << what;
        expect_gradient_near(
            host(dl),
            numeric_gradient(
                [&](const Doubles& v) { return cross_entropy_ref(v, labels, rows, classes, den, log_probs); }, ld),
            what + " dlogits (written, not added)");
        EXPECT_NEAR(be_->cross_entropy(nullptr, bl.data(), blab.data(), rows, classes, den, log_probs), loss, 1e-12)
            << what << ": without dlogits";
      }
    }
  }
}

TEST_F(BackendTest, CrossEntropyIsStableForLargeLogits) {
  const Floats logits = {1000.0f, -1000.0f, 0.0f, 500.0f, 500.0f, 499.0f};
  const Floats labels = {1.0f, 2.0f};
  DeviceBuffer bl = buffer(logits), blab = buffer(labels), dl = zeros(6);
  const double loss = be_->cross_entropy(dl.data(), bl.data(), blab.data(), 2, 3, 2.0, false);
  EXPECT_NEAR(loss, cross_entropy_ref(to_double(logits), labels, 2, 3, 2.0, false), 1e-6);
  EXPECT_FALSE(be_->any_non_finite(dl.data(), 6));
}

TEST_F(BackendTest, CrossEntropyRefusesALabelOutsideTheClasses) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  DeviceBuffer bl = buffer(random(6)), dl = zeros(6);
  for (float bad : {3.0f, -1.0f, 1.5f}) {
    DeviceBuffer blab = buffer({0.0f, bad});
    EXPECT_DEATH(be_->cross_entropy(dl.data(), bl.data(), blab.data(), 2, 3, 2.0, false), "label") << bad;
  }
}

TEST_F(BackendTest, MeanSquaredErrorLossAndGradient) {
  for (int64_t n : {1, 5, 33, 231}) {
    const Floats pred = random(n), target = random(n);
    const double den = n + 3.0;
    DeviceBuffer bp = buffer(pred), bt = buffer(target), dp = buffer(random(n));
    const double loss = be_->mean_squared_error(dp.data(), bp.data(), bt.data(), n, den);
    const Doubles pd = to_double(pred), td = to_double(target);
    EXPECT_NEAR(loss, mse_ref(pd, td, den), 1e-7);
    expect_gradient_near(host(dp), numeric_gradient([&](const Doubles& v) { return mse_ref(v, td, den); }, pd),
                         "mse dpred n=" + std::to_string(n));
  }
}

// ---- optimizers: three steps against torch.optim's arithmetic, written out in double ----

struct SgdCase {
  float lr, momentum, weight_decay;
  bool nesterov;
};

TEST_F(BackendTest, SgdMatchesTorchOptimForThreeSteps) {
  const SgdCase cases[] = {{0.1f, 0.0f, 0.0f, false},
                           {0.1f, 0.9f, 0.0f, false},
                           {0.05f, 0.9f, 0.0f, true},
                           {0.1f, 0.0f, 0.01f, false},
                           {0.1f, 0.8f, 0.05f, true}};
  const int64_t n = 37;
  for (const SgdCase& c : cases) {
    const std::string what = "lr=" + std::to_string(c.lr) + " momentum=" + std::to_string(c.momentum) +
                             " wd=" + std::to_string(c.weight_decay) + (c.nesterov ? " nesterov" : "");
    Floats p = random(n);
    Doubles pd = to_double(p), buf(n);
    DeviceBuffer bp = buffer(p), bbuf = zeros(n);
    for (int step = 1; step <= 3; ++step) {
      const Floats g = random(n);
      DeviceBuffer bg = buffer(g);
      be_->sgd_step(bp.data(), bg.data(), c.momentum != 0.0f ? bbuf.data() : nullptr, n,
                    SgdStep{c.lr, c.momentum, c.weight_decay, c.nesterov, step == 1});
      for (int64_t i = 0; i < n; ++i) {
        double gi = g[i] + c.weight_decay * pd[i];
        if (c.momentum != 0.0f) {
          buf[i] = step == 1 ? gi : c.momentum * buf[i] + gi;
          gi = c.nesterov ? gi + c.momentum * buf[i] : buf[i];
        }
        pd[i] -= c.lr * gi;
      }
      expect_values_near(host(bp), pd, what + " step " + std::to_string(step), 1e-6);
    }
  }
}

TEST_F(BackendTest, SgdMomentumHandComputed) {
  // p = 1, g = 0.5 each step, lr 0.1, momentum 0.9:
  //   buf 0.5, 0.95, 1.355;  p 0.95, 0.855, 0.7195
  DeviceBuffer p = buffer({1.0f}), g = buffer({0.5f}), buf = zeros(1);
  const float want[] = {0.95f, 0.855f, 0.7195f};
  for (int step = 1; step <= 3; ++step) {
    be_->sgd_step(p.data(), g.data(), buf.data(), 1, SgdStep{0.1f, 0.9f, 0.0f, false, step == 1});
    EXPECT_NEAR(host(p)[0], want[step - 1], 1e-6) << "step " << step;
  }
}

TEST_F(BackendTest, AdamAndAdamWMatchTorchOptimForThreeSteps) {
  const int64_t n = 37;
  for (bool decoupled : {false, true}) {
    for (float wd : {0.0f, 0.1f}) {
      const std::string what = std::string(decoupled ? "AdamW" : "Adam") + " wd=" + std::to_string(wd);
      const float lr = 0.01f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
      Floats p = random(n);
      Doubles pd = to_double(p), m(n), v(n);
      DeviceBuffer bp = buffer(p), bm = zeros(n), bv = zeros(n);
      for (int step = 1; step <= 3; ++step) {
        const Floats g = random(n);
        DeviceBuffer bg = buffer(g);
        be_->adam_step(bp.data(), bg.data(), bm.data(), bv.data(), n,
                       AdamStep{lr, beta1, beta2, eps, wd, decoupled, step});
        const double c1 = 1.0 - std::pow(double{beta1}, step), c2 = 1.0 - std::pow(double{beta2}, step);
        for (int64_t i = 0; i < n; ++i) {
          double gi = g[i];
          if (decoupled) {
            pd[i] *= 1.0 - double{lr} * wd;
          } else {
            gi += wd * pd[i];
          }
          m[i] = beta1 * m[i] + (1.0 - beta1) * gi;
          v[i] = beta2 * v[i] + (1.0 - beta2) * gi * gi;
          pd[i] -= lr * (m[i] / c1) / (std::sqrt(v[i] / c2) + eps);
        }
        expect_values_near(host(bp), pd, what + " param step " + std::to_string(step), 1e-6);
        expect_values_near(host(bm), m, what + " exp_avg step " + std::to_string(step), 1e-6);
        expect_values_near(host(bv), v, what + " exp_avg_sq step " + std::to_string(step), 1e-5);
      }
    }
  }
}

// The optimizers say whether every gradient was finite (--on-nonfinite stop rides on it),
// wherever the bad one sits, threaded pieces included.
TEST_F(BackendTest, OptimizersReportAnInfOrNanGradient) {
  const int64_t n = 100000;
  cpu::ScopedParallelMinWork threaded(1);
  for (int64_t at : {int64_t{0}, n / 2, n - 1}) {
    for (float bad : {INFINITY, -INFINITY, NAN, 1.0f}) {
      Floats g = random(n);
      g[at] = bad;
      DeviceBuffer p = buffer(random(n)), bg = buffer(g), m = zeros(n), v = zeros(n);
      const bool finite = bad == 1.0f;
      EXPECT_EQ(be_->sgd_step(p.data(), bg.data(), m.data(), n, SgdStep{0.1f, 0.9f, 0.0f, false, true}), finite)
          << "sgd, " << bad << " at " << at;
      EXPECT_EQ(be_->adam_step(p.data(), bg.data(), m.data(), v.data(), n,
                               AdamStep{0.01f, 0.9f, 0.999f, 1e-8f, 0.0f, false, 1}),
                finite)
          << "adam, " << bad << " at " << at;
    }
  }
}

TEST_F(BackendTest, AdamFirstStepMovesEachWeightByLr) {
  // Bias correction makes step 1 move every weight by lr·sign(g) (up to eps).
  DeviceBuffer p = buffer({1.0f, -2.0f}), g = buffer({0.3f, -7.0f}), m = zeros(2), v = zeros(2);
  be_->adam_step(p.data(), g.data(), m.data(), v.data(), 2, AdamStep{0.01f, 0.9f, 0.999f, 1e-8f, 0.0f, false, 1});
  const Floats got = host(p);
  EXPECT_NEAR(got[0], 0.99f, 1e-6);
  EXPECT_NEAR(got[1], -1.99f, 1e-6);
}

// ---- results do not depend on the number of threads ----

#ifdef PIPESHARD_TEST_HAVE_OMP
TEST_F(BackendTest, ResultsDoNotDependOnTheThreadCount) {
  // The backend threads only loops far larger than these (cpu::kParallelMinWork); lower its
  // threshold so that every kernel takes its threaded path here.
  const cpu::ScopedParallelMinWork every_loop_threaded(1);
  const int64_t rows = 513, width = 1031;
  const int64_t n = rows * width;
  const Floats x = random(n), r = random(n), w = random(width), w2 = random(width * 64);
  Floats labels(rows);
  for (int64_t i = 0; i < rows; ++i) labels[i] = static_cast<float>(i % width);
  auto run = [&] {
    DeviceBuffer bx = buffer(x), dy = buffer(r), bw = buffer(w), lw = buffer(w2), blab = buffer(labels);
    DeviceBuffer y = zeros(n), mean = zeros(width), rstd = zeros(width), dx = zeros(n), dw = zeros(width),
                 db = zeros(width), lmean = zeros(rows), lrstd = zeros(rows), ldw = zeros(width * 64), ldb = zeros(64),
                 dl = zeros(n), ly = zeros(rows * 64);
    be_->batchnorm_forward(y.data(), mean.data(), rstd.data(), nullptr, nullptr, bx.data(), bw.data(), bw.data(), rows,
                           width, 1, 1e-5f, 0.9f, true);
    be_->batchnorm_backward(dx.data(), dw.data(), db.data(), dy.data(), bx.data(), bw.data(), mean.data(), rstd.data(),
                            rows, width, 1, true);
    be_->layernorm_forward(y.data(), lmean.data(), lrstd.data(), bx.data(), bw.data(), bw.data(), rows, width, 1e-5f);
    be_->layernorm_backward(dx.data(), dw.data(), db.data(), dy.data(), bx.data(), bw.data(), lmean.data(),
                            lrstd.data(), rows, width);
    be_->linear_forward(ly.data(), bx.data(), lw.data(), ldb.data(), LinearShape{rows, width, 64});
    be_->linear_backward(nullptr, ldw.data(), ldb.data(), dy.data(), bx.data(), lw.data(),
                         LinearShape{rows, width, 64});
    const double ce = be_->cross_entropy(dl.data(), bx.data(), blab.data(), rows, width, rows, false);
    const double ss = be_->sum_squares(bx.data(), n);
    Floats all = host(y);
    for (const DeviceBuffer* b : {&dx, &dw, &db, &ldb, &dl}) {
      const Floats h = host(*b);
      all.insert(all.end(), h.begin(), h.end());
    }
    all.push_back(static_cast<float>(ce));
    all.push_back(static_cast<float>(ce - static_cast<float>(ce)));
    all.push_back(static_cast<float>(ss));
    all.push_back(static_cast<float>(ss - static_cast<float>(ss)));
    return all;
  };
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const Floats serial = run();
  omp_set_num_threads(std::max(threads, 3));
  const Floats parallel = run();
  omp_set_num_threads(threads);
  ASSERT_EQ(serial.size(), parallel.size());
  for (size_t i = 0; i < serial.size(); ++i) ASSERT_EQ(serial[i], parallel[i]) << "element " << i;
}
#endif

}  // namespace
}  // namespace pipeshard

namespace pipeshard {
namespace {

// GradWrite::kOverwrite: the same gradients as adding into zeroed buffers, whatever
// the buffers held before.
TEST(LinearBackwardOverwrite, EqualsAddingIntoZeroedBuffers) {
  std::unique_ptr<Backend> be = make_cpu_backend();
  for (WeightLayout layout : {WeightLayout::kOutIn, WeightLayout::kInOut}) {
    const LinearShape s{7, 5, 33, layout, 0.5f, 2.0f};
    std::vector<float> x(7 * 5), w(5 * 33), dy(7 * 33);
    for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.7f * i);
    for (size_t i = 0; i < w.size(); ++i) w[i] = std::cos(0.3f * i);
    for (size_t i = 0; i < dy.size(); ++i) dy[i] = std::sin(1.1f * i + 0.2f);
    std::vector<float> dx0(x.size(), 0.0f), dw0(w.size(), 0.0f), db0(33, 0.0f);
    be->linear_backward(dx0.data(), dw0.data(), db0.data(), dy.data(), x.data(), w.data(), s);
    std::vector<float> dx1(x.size(), 123.0f), dw1(w.size(), -7.0f), db1(33, 9.0f);
    be->linear_backward(dx1.data(), dw1.data(), db1.data(), dy.data(), x.data(), w.data(), s, GradWrite::kOverwrite,
                        GradWrite::kOverwrite);
    EXPECT_EQ(dx1, dx0);
    EXPECT_EQ(dw1, dw0);
    EXPECT_EQ(db1, db0);
  }
}

}  // namespace
}  // namespace pipeshard

namespace pipeshard {
namespace {

// The vectorisable exp that cross-entropy uses: within 2 ulp of std::exp on [-87, 0].
TEST(ExpNonpositive, WithinTwoUlpOfStdExp) {
  int worst_ulp = 0;
  for (int i = 0; i <= 2000000; ++i) {
    const float x = -87.0f * static_cast<float>(i) / 2000000.0f;
    const float want = std::exp(x), got = cpu::exp_nonpositive(x);
    int32_t a, b;
    std::memcpy(&a, &want, 4);
    std::memcpy(&b, &got, 4);
    worst_ulp = std::max(worst_ulp, std::abs(a - b));
  }
  EXPECT_LE(worst_ulp, 2);
  EXPECT_EQ(cpu::exp_nonpositive(0.0f), 1.0f);
  EXPECT_GT(cpu::exp_nonpositive(-1000.0f), 0.0f);
}

// The logits of NaN weights (fuzz/regressions/checkpoint/, "Findings" in fuzz/README.md):
// NaN in, NaN out, with no conversion of NaN to int on the way (UBSan checks that part).
TEST(ExpNonpositive, NanGivesNan) {
  EXPECT_TRUE(std::isnan(cpu::exp_nonpositive(std::numeric_limits<float>::quiet_NaN())));
}

}  // namespace
}  // namespace pipeshard
