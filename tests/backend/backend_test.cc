// Tests of the CPU backend's layers (backend/backend.h): memory, Linear, activations,
// softmax, LayerNorm, BatchNorm, dropout, and agreement with the reference evaluator.
// Written against the Backend interface only (buffers go through upload/download), so
// they describe the contract a second backend must meet too. How gradients are checked,
// and why the tolerances are what they are: tests/backend/backend_check.h.
#include "backend/backend.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "testing/reference_forward.h"
#include "tests/backend/backend_check.h"

namespace pipeshard {
namespace {

using namespace pipeshard::testing;  // NOLINT: the checks and fixture of backend_check.h

// ---- double-precision reference forwards ----

double act_ref(ActivationKind k, double slope, double x) {
  switch (k) {
    case ActivationKind::kRelu: return x > 0 ? x : 0.0;
    case ActivationKind::kLeakyRelu: return x > 0 ? x : slope * x;
    case ActivationKind::kSigmoid: return 1.0 / (1.0 + std::exp(-x));
    case ActivationKind::kTanh: return std::tanh(x);
    case ActivationKind::kGelu: return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)));
    case ActivationKind::kGeluTanh:
      return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
    case ActivationKind::kSilu: return x / (1.0 + std::exp(-x));
  }
  return x;
}

// y[rows, out] = alpha·x·W' + beta·b, then act when given.
Doubles linear_ref(const Doubles& x, const Doubles& w, const Doubles* b, const LinearShape& s,
                   const Activation* act = nullptr) {
  Doubles y(s.rows * s.out);
  for (int64_t r = 0; r < s.rows; ++r) {
    for (int64_t o = 0; o < s.out; ++o) {
      double acc = 0.0;
      for (int64_t i = 0; i < s.in; ++i) {
        acc += x[r * s.in + i] * (s.layout == WeightLayout::kOutIn ? w[o * s.in + i] : w[i * s.out + o]);
      }
      double v = s.alpha * acc + (b ? s.beta * (*b)[o] : 0.0);
      y[r * s.out + o] = act ? act_ref(act->kind, act->alpha, v) : v;
    }
  }
  return y;
}

Doubles softmax_ref(const Doubles& x, int64_t rows, int64_t width, bool log) {
  Doubles y(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double m = x[r * width];
    for (int64_t i = 1; i < width; ++i) m = std::max(m, x[r * width + i]);
    double sum = 0.0;
    for (int64_t i = 0; i < width; ++i) sum += std::exp(x[r * width + i] - m);
    for (int64_t i = 0; i < width; ++i) {
      const double z = x[r * width + i] - m;
      y[r * width + i] = log ? z - std::log(sum) : std::exp(z) / sum;
    }
  }
  return y;
}

Doubles layernorm_ref(const Doubles& x, const Doubles* w, const Doubles* b, int64_t rows, int64_t width, double eps) {
  Doubles y(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double mean = 0.0, var = 0.0;
    for (int64_t i = 0; i < width; ++i) mean += x[r * width + i];
    mean /= width;
    for (int64_t i = 0; i < width; ++i) var += (x[r * width + i] - mean) * (x[r * width + i] - mean);
    var /= width;
    for (int64_t i = 0; i < width; ++i) {
      double v = (x[r * width + i] - mean) / std::sqrt(var + eps);
      y[r * width + i] = v * (w ? (*w)[i] : 1.0) + (b ? (*b)[i] : 0.0);
    }
  }
  return y;
}

struct BnDims {
  int64_t batch, channels, inner;
  int64_t size() const { return batch * channels * inner; }
  int64_t at(int64_t b, int64_t c, int64_t k) const { return (b * channels + c) * inner + k; }
};

// Training: batch statistics (biased variance); inference: the given running statistics.
Doubles batchnorm_ref(const Doubles& x, const Doubles& w, const Doubles& b, const Doubles& running_mean,
                      const Doubles& running_var, const BnDims& d, double eps, bool training) {
  Doubles y(x.size());
  const double n = static_cast<double>(d.batch * d.inner);
  for (int64_t c = 0; c < d.channels; ++c) {
    double mean = running_mean[c], var = running_var[c];
    if (training) {
      mean = var = 0.0;
      for (int64_t bi = 0; bi < d.batch; ++bi)
        for (int64_t k = 0; k < d.inner; ++k) mean += x[d.at(bi, c, k)];
      mean /= n;
      for (int64_t bi = 0; bi < d.batch; ++bi)
        for (int64_t k = 0; k < d.inner; ++k) var += (x[d.at(bi, c, k)] - mean) * (x[d.at(bi, c, k)] - mean);
      var /= n;
    }
    for (int64_t bi = 0; bi < d.batch; ++bi)
      for (int64_t k = 0; k < d.inner; ++k)
        y[d.at(bi, c, k)] = (x[d.at(bi, c, k)] - mean) / std::sqrt(var + eps) * w[c] + b[c];
  }
  return y;
}

// ---- memory and vector helpers ----

TEST_F(BackendTest, AllocateIsZeroFilledAndAligned) {
  for (int64_t n : {1, 3, 1000, 1 << 20}) {
    DeviceBuffer b = zeros(n);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % 64, 0u);
    Floats v = host(b);
    for (float x : v) ASSERT_EQ(x, 0.0f);
  }
}

TEST_F(BackendTest, MemoryUseCountsLiveBuffersAndThePeak) {
  const Backend::MemoryUse before = be_->memory_use();
  EXPECT_GE(before.peak, before.in_use);
  {
    DeviceBuffer a = zeros(1000), b = zeros(1 << 20);
    const Backend::MemoryUse held = be_->memory_use();
    const int64_t asked = 4 * (1000 + (1 << 20));
    EXPECT_GE(held.in_use - before.in_use, asked);
    EXPECT_LE(held.in_use - before.in_use, asked + (int64_t{4} << 20)) << "rounding of at most 2 MiB a buffer";
    EXPECT_GE(held.peak, held.in_use);
  }
  const Backend::MemoryUse after = be_->memory_use();
  EXPECT_EQ(after.in_use, before.in_use) << "freed buffers no longer count";
  EXPECT_GE(after.peak, before.in_use + 4 * (1000 + (1 << 20)));
}

TEST_F(BackendTest, VectorHelpers) {
  const Floats x = random(1000), y = random(1000);
  DeviceBuffer bx = buffer(x), by = buffer(y), bz = zeros(1000);
  be_->axpy(by.data(), 0.5f, bx.data(), 1000);
  Floats got = host(by);
  for (int i = 0; i < 1000; ++i) ASSERT_FLOAT_EQ(got[i], y[i] + 0.5f * x[i]);
  be_->scale(bx.data(), -2.0f, 1000);
  got = host(bx);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(got[i], -2.0f * x[i]);
  be_->copy(bz.data(), bx.data(), 1000);
  EXPECT_EQ(host(bz), got);
  be_->fill(bz.data(), 3.0f, 1000);
  for (float v : host(bz)) ASSERT_EQ(v, 3.0f);
  be_->add_forward(bz.data(), bx.data(), by.data(), 1000);
  const Floats sum = host(bz), a = host(bx), b = host(by);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(sum[i], a[i] + b[i]);
  double want = 0.0;
  for (float v : y) want += static_cast<double>(v) * v;
  DeviceBuffer by2 = buffer(y);
  EXPECT_NEAR(be_->sum_squares(by2.data(), 1000), want, 1e-12 * want);
}

TEST_F(BackendTest, FillWritesTheValueBitForBit) {
  // +0 takes a memset path; -0 and other values must not.
  for (float value : {0.0f, -0.0f, 3.0f}) {
    DeviceBuffer b = buffer(random(1001));
    be_->fill(b.data(), value, 1000);
    const Floats got = host(b);
    for (int i = 0; i < 1000; ++i) {
      ASSERT_EQ(got[i], value);
      ASSERT_EQ(std::signbit(got[i]), std::signbit(value)) << "element " << i;
    }
    EXPECT_NE(got[1000], value) << "fill wrote past its end";
  }
}

TEST_F(BackendTest, AnyNonFinite) {
  Floats x = random(100000);
  DeviceBuffer b = buffer(x);
  EXPECT_FALSE(be_->any_non_finite(b.data(), 100000));
  for (float bad : {INFINITY, -INFINITY, NAN}) {
    x[77777] = bad;
    be_->upload(b.data(), x.data(), 100000);
    EXPECT_TRUE(be_->any_non_finite(b.data(), 100000)) << bad;
  }
  EXPECT_FALSE(be_->any_non_finite(b.data(), 0));
}

// ---- Linear ----

struct LinearCase {
  WeightLayout layout;
  bool bias;
  float alpha, beta;
};

class LinearTest : public BackendTest {
 protected:
  // Forward against linear_ref, then dx, dw, db against central differences of Σ r⊙y.
  void check(const LinearShape& s, bool with_bias, const std::string& what) {
    const Floats x = random(s.rows * s.in), w = random(s.in * s.out), b = random(s.out), r = random(s.rows * s.out);
    DeviceBuffer bx = buffer(x), bw = buffer(w), bb = buffer(b), by = zeros(s.rows * s.out);
    const Doubles dx_ = to_double(x), dw_ = to_double(w), db_ = to_double(b), dr = to_double(r);
    be_->linear_forward(by.data(), bx.data(), bw.data(), with_bias ? bb.data() : nullptr, s);
    expect_values_near(host(by), linear_ref(dx_, dw_, with_bias ? &db_ : nullptr, s), what + " y");

    DeviceBuffer dy = buffer(r), gx = zeros(x.size()), gw = zeros(w.size()), gb = zeros(b.size());
    be_->linear_backward(gx.data(), gw.data(), with_bias ? gb.data() : nullptr, dy.data(), bx.data(), bw.data(), s);
    const Floats gx1 = host(gx), gw1 = host(gw), gb1 = host(gb);
    const Doubles* bias = with_bias ? &db_ : nullptr;
    expect_gradient_near(gx1,
                         numeric_gradient([&](const Doubles& v) { return dot(dr, linear_ref(v, dw_, bias, s)); }, dx_),
                         what + " dx");
    expect_gradient_near(gw1,
                         numeric_gradient([&](const Doubles& v) { return dot(dr, linear_ref(dx_, v, bias, s)); }, dw_),
                         what + " dw");
    if (with_bias) {
      expect_gradient_near(
          gb1, numeric_gradient([&](const Doubles& v) { return dot(dr, linear_ref(dx_, dw_, &v, s)); }, db_),
          what + " db");
    }
    EXPECT_EQ(host(dy), r) << "dy must not be modified";
    be_->linear_backward(gx.data(), gw.data(), with_bias ? gb.data() : nullptr, dy.data(), bx.data(), bw.data(), s);
    expect_doubled(gx1, host(gx), what + " dx");
    expect_doubled(gw1, host(gw), what + " dw");
    expect_doubled(gb1, host(gb), what + " db");
  }
};

TEST_F(LinearTest, ForwardAndGradientsAllLayoutsAndScales) {
  const LinearCase cases[] = {{WeightLayout::kOutIn, true, 1.0f, 1.0f},  {WeightLayout::kInOut, true, 1.0f, 1.0f},
                              {WeightLayout::kOutIn, false, 1.0f, 1.0f}, {WeightLayout::kInOut, false, 1.0f, 1.0f},
                              {WeightLayout::kOutIn, true, 0.7f, -1.3f}, {WeightLayout::kInOut, true, 2.5f, 0.25f}};
  for (const LinearCase& c : cases) {
    for (int64_t rows : {1, 3, 7}) {
      for (int64_t in : {1, 5, 33}) {
        for (int64_t out : {1, 5, 33}) {
          const LinearShape s{rows, in, out, c.layout, c.alpha, c.beta};
          const std::string what = std::string(c.layout == WeightLayout::kOutIn ? "[out,in]" : "[in,out]") +
                                   (c.bias ? " bias" : " no-bias") + " alpha=" + std::to_string(c.alpha) +
                                   " beta=" + std::to_string(c.beta) + " rows=" + std::to_string(rows) +
                                   " in=" + std::to_string(in) + " out=" + std::to_string(out);
          check(s, c.bias, what);
          if (HasFailure()) return;
        }
      }
    }
  }
}

TEST_F(LinearTest, NullGradientsAreSkipped) {
  const LinearShape s{3, 5, 4, WeightLayout::kOutIn, 1.0f, 1.0f};
  DeviceBuffer x = buffer(random(15)), w = buffer(random(20)), dy = buffer(random(12)), dw = zeros(20);
  be_->linear_backward(nullptr, dw.data(), nullptr, dy.data(), x.data(), w.data(), s);
  double norm = be_->sum_squares(dw.data(), 20);
  EXPECT_GT(norm, 0.0);
}

// No rows is a no-op; no input features leave y = beta·b (then the activation).
TEST_F(LinearTest, EmptyShapes) {
  DeviceBuffer x = zeros(1), w = zeros(1), b = buffer({1.0f, -2.0f}), y = buffer({7.0f, 7.0f});
  be_->linear_forward(y.data(), x.data(), w.data(), b.data(), LinearShape{0, 3, 2});
  EXPECT_EQ(host(y), (Floats{7.0f, 7.0f}));
  const Activation relu{ActivationKind::kRelu};
  be_->linear_forward(y.data(), x.data(), w.data(), b.data(), LinearShape{1, 0, 2, WeightLayout::kOutIn, 1.0f, 0.5f},
                      &relu);
  EXPECT_EQ(host(y), (Floats{0.5f, 0.0f}));
  DeviceBuffer dy = buffer({1.0f, 1.0f}), db = zeros(2);
  be_->linear_backward(nullptr, nullptr, db.data(), dy.data(), x.data(), w.data(),
                       LinearShape{1, 0, 2, WeightLayout::kOutIn, 1.0f, 0.5f});
  EXPECT_EQ(host(db), (Floats{0.5f, 0.5f}));
}

// The fused epilogue: y = act(linear), pre = linear; the chain rule through
// activation_backward(pre) then linear_backward matches differences of act(linear(x)).
TEST_F(LinearTest, FusedEpilogueForwardAndChainedGradient) {
  for (ActivationKind kind : kAllActivations) {
    for (WeightLayout layout : {WeightLayout::kOutIn, WeightLayout::kInOut}) {
      const LinearShape s{7, 5, 33, layout, 0.9f, 1.1f};
      const Activation act{kind, 0.05f};
      const std::string what = "fused " + kind_name(kind);
      Floats x = random(s.rows * s.in), w = random(s.in * s.out), b = random(s.out), r = random(s.rows * s.out);
      const Doubles xd = to_double(x), wd = to_double(w), bd = to_double(b), rd = to_double(r);
      if (kind == ActivationKind::kRelu || kind == ActivationKind::kLeakyRelu) {
        // Keep pre-activations away from the kink, where differences straddle two slopes.
        const Doubles pre = linear_ref(xd, wd, &bd, s);
        for (int64_t i = 0; i < s.out; ++i) {
          double closest = 1.0;
          for (int64_t row = 0; row < s.rows; ++row) closest = std::min(closest, std::fabs(pre[row * s.out + i]));
          if (closest < 1e-3) b[i] += 0.01f;
        }
      }
      const Doubles bd2 = to_double(b);
      DeviceBuffer bx = buffer(x), bw = buffer(w), bb = buffer(b), by = zeros(s.rows * s.out),
                   bpre = zeros(s.rows * s.out);
      be_->linear_forward(by.data(), bx.data(), bw.data(), bb.data(), s, &act, bpre.data());
      expect_values_near(host(bpre), linear_ref(xd, wd, &bd2, s), what + " pre");
      expect_values_near(host(by), linear_ref(xd, wd, &bd2, s, &act), what + " y");

      DeviceBuffer dy = buffer(r), dpre = zeros(s.rows * s.out), gx = zeros(x.size()), gw = zeros(w.size()),
                   gb = zeros(b.size());
      be_->activation_backward(dpre.data(), dy.data(), bpre.data(), by.data(), s.rows * s.out, act);
      be_->linear_backward(gx.data(), gw.data(), gb.data(), dpre.data(), bx.data(), bw.data(), s);
      expect_gradient_near(
          host(gx), numeric_gradient([&](const Doubles& v) { return dot(rd, linear_ref(v, wd, &bd2, s, &act)); }, xd),
          what + " dx");
      expect_gradient_near(
          host(gw), numeric_gradient([&](const Doubles& v) { return dot(rd, linear_ref(xd, v, &bd2, s, &act)); }, wd),
          what + " dw");
      expect_gradient_near(
          host(gb), numeric_gradient([&](const Doubles& v) { return dot(rd, linear_ref(xd, wd, &v, s, &act)); }, bd2),
          what + " db");
    }
  }
}

// Where the backend says so, activation_forward(pre) rewrites the fused forward's y bit
// for bit: Program recomputes such outputs in backward instead of keeping them. The
// 64-wide shape is one cuBLASLt's epilogues take on a GPU.
TEST_F(LinearTest, RecomputedActivationIsTheFusedOutput) {
  for (ActivationKind kind : kAllActivations) {
    const Activation act{kind, 0.05f};
    if (!be_->epilogue_recomputes_exactly(act)) {
      std::printf("%s: %s is not recomputed exactly (Program keeps its output)\n", be_->name(),
                  kind_name(kind).c_str());
      continue;
    }
    for (const LinearShape& s : {LinearShape{7, 5, 33, WeightLayout::kOutIn, 0.9f, 1.1f},
                                 LinearShape{64, 64, 64, WeightLayout::kOutIn, 1.0f, 1.0f}}) {
      const int64_t n = s.rows * s.out;
      DeviceBuffer x = buffer(random(s.rows * s.in)), w = buffer(random(s.in * s.out)), b = buffer(random(s.out));
      DeviceBuffer y = zeros(n), pre = zeros(n), again = zeros(n);
      be_->linear_forward(y.data(), x.data(), w.data(), b.data(), s, &act, pre.data());
      be_->activation_forward(again.data(), pre.data(), n, act);
      const Floats fused = host(y), recomputed = host(again);
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(std::memcmp(&fused[i], &recomputed[i], sizeof(float)), 0)
            << kind_name(kind) << " out=" << s.out << " element " << i << ": fused " << fused[i] << ", recomputed "
            << recomputed[i];
      }
    }
  }
}

// ---- activations ----

TEST_F(BackendTest, ActivationsForwardAndGradient) {
  for (ActivationKind kind : kAllActivations) {
    const Activation act{kind, 0.1f};
    for (int64_t n : {1, 5, 33, 3 * 33, 7 * 33}) {
      const std::string what = kind_name(kind) + " n=" + std::to_string(n);
      const Floats x = random_away_from_zero(n, 1e-2f, 4.0f), r = random(n);
      const Doubles xd = to_double(x), rd = to_double(r);
      DeviceBuffer bx = buffer(x), by = zeros(n), dy = buffer(r), dx = zeros(n), dx_no_y = zeros(n);
      be_->activation_forward(by.data(), bx.data(), n, act);
      Doubles want(n);
      for (int64_t i = 0; i < n; ++i) want[i] = act_ref(kind, act.alpha, xd[i]);
      expect_values_near(host(by), want, what + " y");

      be_->activation_backward(dx.data(), dy.data(), bx.data(), by.data(), n, act);
      const Floats once = host(dx);
      const Doubles numeric = numeric_gradient(
          [&](const Doubles& v) {
            double s = 0.0;
            for (int64_t i = 0; i < n; ++i) s += rd[i] * act_ref(kind, act.alpha, v[i]);
            return s;
          },
          xd);
      expect_gradient_near(once, numeric, what + " dx");
      be_->activation_backward(dx_no_y.data(), dy.data(), bx.data(), nullptr, n, act);
      expect_gradient_near(host(dx_no_y), numeric, what + " dx (y not passed)");
      be_->activation_backward(dx.data(), dy.data(), bx.data(), by.data(), n, act);
      expect_doubled(once, host(dx), what + " dx");
    }
  }
}

// PyTorch's conventions at the kink: Relu'(0) = 0, LeakyRelu'(0) = slope.
TEST_F(BackendTest, ActivationDerivativeAtZeroFollowsPyTorch) {
  DeviceBuffer x = buffer({0.0f}), y = zeros(1), dy = buffer({1.0f}), dx = zeros(1);
  be_->activation_backward(dx.data(), dy.data(), x.data(), y.data(), 1, Activation{ActivationKind::kRelu});
  EXPECT_EQ(host(dx)[0], 0.0f);
  be_->fill(dx.data(), 0.0f, 1);
  be_->activation_backward(dx.data(), dy.data(), x.data(), y.data(), 1, Activation{ActivationKind::kLeakyRelu, 0.2f});
  EXPECT_EQ(host(dx)[0], 0.2f);
}

// ---- softmax ----

TEST_F(BackendTest, SoftmaxAndLogSoftmaxForwardAndGradient) {
  for (bool log : {false, true}) {
    for (int64_t rows : {1, 3, 7}) {
      for (int64_t width : {1, 5, 33}) {
        const std::string what = std::string(log ? "log_softmax" : "softmax") + " rows=" + std::to_string(rows) +
                                 " width=" + std::to_string(width);
        const int64_t n = rows * width;
        const Floats x = random(n, -4.0f, 4.0f), r = random(n);
        const Doubles xd = to_double(x), rd = to_double(r);
        DeviceBuffer bx = buffer(x), by = zeros(n), dy = buffer(r), dx = zeros(n);
        be_->softmax_forward(by.data(), bx.data(), rows, width, log);
        expect_values_near(host(by), softmax_ref(xd, rows, width, log), what + " y");
        be_->softmax_backward(dx.data(), dy.data(), by.data(), rows, width, log);
        const Floats once = host(dx);
        expect_gradient_near(
            once, numeric_gradient([&](const Doubles& v) { return dot(rd, softmax_ref(v, rows, width, log)); }, xd),
            what + " dx");
        be_->softmax_backward(dx.data(), dy.data(), by.data(), rows, width, log);
        expect_doubled(once, host(dx), what + " dx");
      }
    }
  }
}

TEST_F(BackendTest, SoftmaxIsStableForLargeInputs) {
  const Floats x = {1000.0f, 999.0f, -1000.0f, 88.0f, 89.0f, 90.0f};
  DeviceBuffer bx = buffer(x), by = zeros(6);
  for (bool log : {false, true}) {
    be_->softmax_forward(by.data(), bx.data(), 2, 3, log);
    expect_values_near(host(by), softmax_ref(to_double(x), 2, 3, log), log ? "log_softmax" : "softmax");
  }
}

// ---- LayerNorm ----

TEST_F(BackendTest, LayerNormForwardAndGradient) {
  const float eps = 1e-5f;
  for (bool affine : {true, false}) {
    for (int64_t rows : {1, 3, 7}) {
      for (int64_t width : {1, 5, 33}) {
        const std::string what = std::string(affine ? "affine" : "plain") + " rows=" + std::to_string(rows) +
                                 " width=" + std::to_string(width);
        const int64_t n = rows * width;
        const Floats x = random(n, -2.0f, 3.0f), w = random(width, 0.5f, 1.5f), b = random(width), r = random(n);
        const Doubles xd = to_double(x), wd = to_double(w), bd = to_double(b), rd = to_double(r);
        const Doubles* pw = affine ? &wd : nullptr;
        const Doubles* pb = affine ? &bd : nullptr;
        DeviceBuffer bx = buffer(x), bw = buffer(w), bb = buffer(b), by = zeros(n), mean = zeros(rows),
                     rstd = zeros(rows);
        be_->layernorm_forward(by.data(), mean.data(), rstd.data(), bx.data(), affine ? bw.data() : nullptr,
                               affine ? bb.data() : nullptr, rows, width, eps);
        expect_values_near(host(by), layernorm_ref(xd, pw, pb, rows, width, eps), what + " y");
        Doubles want_mean(rows);
        for (int64_t i = 0; i < n; ++i) want_mean[i / width] += xd[i] / width;
        expect_values_near(host(mean), want_mean, what + " mean");

        DeviceBuffer dy = buffer(r), dx = zeros(n), dw = zeros(width), db = zeros(width);
        auto backward = [&] {
          be_->layernorm_backward(dx.data(), affine ? dw.data() : nullptr, affine ? db.data() : nullptr, dy.data(),
                                  bx.data(), affine ? bw.data() : nullptr, mean.data(), rstd.data(), rows, width);
        };
        backward();
        const Floats dx1 = host(dx), dw1 = host(dw), db1 = host(db);
        expect_gradient_near(
            dx1,
            numeric_gradient([&](const Doubles& v) { return dot(rd, layernorm_ref(v, pw, pb, rows, width, eps)); }, xd),
            what + " dx");
        if (affine) {
          expect_gradient_near(
              dw1,
              numeric_gradient([&](const Doubles& v) { return dot(rd, layernorm_ref(xd, &v, pb, rows, width, eps)); },
                               wd),
              what + " dw");
          expect_gradient_near(
              db1,
              numeric_gradient([&](const Doubles& v) { return dot(rd, layernorm_ref(xd, pw, &v, rows, width, eps)); },
                               bd),
              what + " db");
        }
        backward();
        expect_doubled(dx1, host(dx), what + " dx");
        expect_doubled(dw1, host(dw), what + " dw");
        expect_doubled(db1, host(db), what + " db");
      }
    }
  }
}

// ---- BatchNorm ----

class BatchNormTest : public BackendTest {
 protected:
  // channels = 70 crosses the kernel's 64-channel blocks.
  void check(const BnDims& d, bool training) {
    const std::string what = std::string(training ? "training" : "inference") + " [" + std::to_string(d.batch) + ", " +
                             std::to_string(d.channels) + ", " + std::to_string(d.inner) + "]";
    const float eps = 1e-5f, momentum = 0.9f;
    const int64_t n = d.size(), c = d.channels;
    const Floats x = random(n, -2.0f, 3.0f), w = random(c, 0.5f, 1.5f), b = random(c), r = random(n);
    const Floats rm = random(c), rv = random(c, 0.5f, 2.0f);
    const Doubles xd = to_double(x), wd = to_double(w), bd = to_double(b), rd = to_double(r), rmd = to_double(rm),
                  rvd = to_double(rv);
    DeviceBuffer bx = buffer(x), bw = buffer(w), bb = buffer(b), by = zeros(n), mean = zeros(c), rstd = zeros(c),
                 brm = buffer(rm), brv = buffer(rv);
    be_->batchnorm_forward(by.data(), mean.data(), rstd.data(), brm.data(), brv.data(), bx.data(), bw.data(), bb.data(),
                           d.batch, d.channels, d.inner, eps, momentum, training);
    auto forward = [&](const Doubles& xv, const Doubles& wv, const Doubles& bv) {
      return batchnorm_ref(xv, wv, bv, rmd, rvd, d, eps, training);
    };
    expect_values_near(host(by), forward(xd, wd, bd), what + " y");
    if (!training) {
      EXPECT_EQ(host(brm), rm) << "inference leaves the running mean alone";
      EXPECT_EQ(host(brv), rv) << "inference leaves the running variance alone";
    }

    DeviceBuffer dy = buffer(r), dx = zeros(n), dw = zeros(c), db = zeros(c);
    auto backward = [&] {
      be_->batchnorm_backward(dx.data(), dw.data(), db.data(), dy.data(), bx.data(), bw.data(), mean.data(),
                              rstd.data(), d.batch, d.channels, d.inner, training);
    };
    backward();
    const Floats dx1 = host(dx), dw1 = host(dw), db1 = host(db);
    expect_gradient_near(dx1, numeric_gradient([&](const Doubles& v) { return dot(rd, forward(v, wd, bd)); }, xd),
                         what + " dx");
    expect_gradient_near(dw1, numeric_gradient([&](const Doubles& v) { return dot(rd, forward(xd, v, bd)); }, wd),
                         what + " dw");
    expect_gradient_near(db1, numeric_gradient([&](const Doubles& v) { return dot(rd, forward(xd, wd, v)); }, bd),
                         what + " db");
    backward();
    expect_doubled(dx1, host(dx), what + " dx");
    expect_doubled(dw1, host(dw), what + " dw");
    expect_doubled(db1, host(db), what + " db");
  }
};

TEST_F(BatchNormTest, TrainingForwardAndFullGradient) {
  for (const BnDims& d :
       {BnDims{3, 1, 1}, BnDims{7, 5, 1}, BnDims{3, 70, 1}, BnDims{1, 5, 4}, BnDims{3, 33, 5}, BnDims{7, 3, 3}}) {
    check(d, true);
  }
}

TEST_F(BatchNormTest, InferenceForwardAndGradient) {
  for (const BnDims& d : {BnDims{1, 1, 1}, BnDims{7, 5, 1}, BnDims{3, 70, 1}, BnDims{3, 33, 5}}) check(d, false);
}

// ONNX momentum m: running = m·running + (1 − m)·batch, with the unbiased variance.
TEST_F(BatchNormTest, RunningStatisticsUseUnbiasedVarianceAndOnnxMomentum) {
  // One channel, values 1, 2, 3, 4 (two samples × inner 2): mean 2.5, biased variance
  // 1.25, unbiased 5/3.
  DeviceBuffer x = buffer({1, 2, 3, 4}), y = zeros(4), mean = zeros(1), rstd = zeros(1), w = buffer({1}),
               b = buffer({0});
  DeviceBuffer rm = buffer({1.0f}), rv = buffer({2.0f});
  be_->batchnorm_forward(y.data(), mean.data(), rstd.data(), rm.data(), rv.data(), x.data(), w.data(), b.data(), 2, 1,
                         2, 1e-5f, 0.9f, true);
  EXPECT_NEAR(host(rm)[0], 0.9 * 1.0 + 0.1 * 2.5, 1e-6);
  EXPECT_NEAR(host(rv)[0], 0.9 * 2.0 + 0.1 * (5.0 / 3.0), 1e-6);
  EXPECT_NEAR(host(mean)[0], 2.5, 1e-7);
  EXPECT_NEAR(host(rstd)[0], 1.0 / std::sqrt(1.25 + 1e-5), 1e-6) << "normalisation uses the biased variance";
  // A second step with the same batch moves the statistics again.
  be_->batchnorm_forward(y.data(), mean.data(), rstd.data(), rm.data(), rv.data(), x.data(), w.data(), b.data(), 2, 1,
                         2, 1e-5f, 0.9f, true);
  EXPECT_NEAR(host(rm)[0], 0.9 * (0.9 + 0.25) + 0.1 * 2.5, 1e-6);
  EXPECT_NEAR(host(rv)[0], 0.9 * (1.8 + 1.0 / 6.0) + 0.1 * (5.0 / 3.0), 1e-6);
}

// ---- dropout ----

TEST_F(BackendTest, DropoutMaskIsReproducibleScaledAndIndependentOfPieces) {
  const int64_t n = 200000;
  const float ratio = 0.3f;
  const Floats x = random(n);
  DeviceBuffer bx = buffer(x), y = zeros(n), mask = zeros(n), y2 = zeros(n), mask2 = zeros(n);
  be_->dropout_forward(y.data(), mask.data(), bx.data(), n, ratio, 42, 1000);
  const Floats m = host(mask), yv = host(y);
  const float keep = 1.0f / (1.0f - ratio);
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_TRUE(m[i] == 0.0f || std::fabs(m[i] - keep) <= 1e-6f * keep) << m[i];
    ASSERT_EQ(yv[i], x[i] * m[i]);
    kept += m[i] != 0.0f;
  }
  // Binomial(n, 0.7): standard deviation ≈ 205; allow 5 of them.
  EXPECT_NEAR(static_cast<double>(kept), 0.7 * n, 1025.0);

  // Same (seed, offset): same mask; drawn in two pieces with offsets: same mask.
  be_->dropout_forward(y2.data(), mask2.data(), bx.data(), n, ratio, 42, 1000);
  EXPECT_EQ(host(mask2), m);
  be_->fill(mask2.data(), -1.0f, n);
  be_->dropout_forward(y2.data(), mask2.data(), bx.data(), 12345, ratio, 42, 1000);
  be_->dropout_forward(y2.data() + 12345, mask2.data() + 12345, bx.data() + 12345, n - 12345, ratio, 42, 1000 + 12345);
  EXPECT_EQ(host(mask2), m);
  // Another seed or offset: another mask.
  be_->dropout_forward(y2.data(), mask2.data(), bx.data(), n, ratio, 43, 1000);
  EXPECT_NE(host(mask2), m);
  be_->dropout_forward(y2.data(), mask2.data(), bx.data(), n, ratio, 42, 1001);
  EXPECT_NE(host(mask2), m);
}

TEST_F(BackendTest, DropoutRatioZeroIsIdentityAndRatioOneDropsAll) {
  const Floats x = random(1000);
  DeviceBuffer bx = buffer(x), y = zeros(1000), mask = zeros(1000);
  be_->dropout_forward(y.data(), mask.data(), bx.data(), 1000, 0.0f, 7, 0);
  EXPECT_EQ(host(y), x);
  for (float v : host(mask)) ASSERT_EQ(v, 1.0f);
  be_->dropout_forward(y.data(), mask.data(), bx.data(), 1000, 1.0f, 7, 0);
  for (float v : host(y)) ASSERT_EQ(v, 0.0f);
}

TEST_F(BackendTest, DropoutGradientReusesTheMask) {
  for (int64_t n : {1, 5, 33, 231}) {
    const Floats x = random(n), r = random(n);
    DeviceBuffer bx = buffer(x), y = zeros(n), mask = zeros(n), dy = buffer(r), dx = zeros(n);
    be_->dropout_forward(y.data(), mask.data(), bx.data(), n, 0.5f, 9, 0);
    const Doubles md = to_double(host(mask)), rd = to_double(r);
    be_->dropout_backward(dx.data(), dy.data(), mask.data(), n);
    const Floats once = host(dx);
    // With the mask fixed, y = x ⊙ mask.
    expect_gradient_near(once,
                         numeric_gradient(
                             [&](const Doubles& v) {
                               double s = 0.0;
                               for (int64_t i = 0; i < n; ++i) s += rd[i] * v[i] * md[i];
                               return s;
                             },
                             to_double(x)),
                         "dropout dx n=" + std::to_string(n));
    be_->dropout_backward(dx.data(), dy.data(), mask.data(), n);
    expect_doubled(once, host(dx), "dropout dx");
  }
}

// ---- the backend against the reference evaluator (testing/reference_forward.h) ----

class AgainstReferenceForward : public BackendTest {
 protected:
  int add_param(Graph& g, const Floats& data) {
    std::string name = std::to_string(g.params.size());  // (not "p" + …: GCC 12's -Wrestrict bug 105329)
    g.params.push_back(Parameter{name, {static_cast<int64_t>(data.size())}, data, true});
    return static_cast<int>(g.params.size()) - 1;
  }
  HostTensor reference(const Graph& g, const Node& node, const HostTensor& x) { return forward_node(g, node, {&x}); }
  void expect_close(const Floats& ours, const HostTensor& ref, const std::string& what) {
    expect_values_near(ours, to_double(ref.data), what);
  }
};

TEST_F(AgainstReferenceForward, LinearActivationsSoftmaxLayerNormBatchNorm) {
  const int64_t rows = 7, in = 33, out = 5;
  const HostTensor x{{rows, in}, random(rows * in, -2.0f, 2.0f)};
  DeviceBuffer bx = buffer(x.data);
  for (WeightLayout layout : {WeightLayout::kOutIn, WeightLayout::kInOut}) {
    Graph g;
    Node n;
    n.kind = OpKind::kLinear;
    n.layout = layout;
    n.in_features = in;
    n.out_features = out;
    n.alpha = 0.5f;
    n.beta = 2.0f;
    n.weight = add_param(g, random(in * out));
    n.bias = add_param(g, random(out));
    DeviceBuffer w = buffer(g.params[n.weight].data), b = buffer(g.params[n.bias].data), y = zeros(rows * out);
    be_->linear_forward(y.data(), bx.data(), w.data(), b.data(), LinearShape{rows, in, out, layout, n.alpha, n.beta});
    expect_close(host(y), reference(g, n, x), "linear");
  }
  for (ActivationKind kind : kAllActivations) {
    Graph g;
    Node n;
    n.kind = OpKind::kActivation;
    n.activation = kind;
    n.alpha = 0.2f;
    DeviceBuffer y = zeros(rows * in);
    be_->activation_forward(y.data(), bx.data(), rows * in, Activation{kind, n.alpha});
    expect_close(host(y), reference(g, n, x), kind_name(kind));
  }
  for (bool log : {false, true}) {
    Graph g;
    Node n;
    n.kind = log ? OpKind::kLogSoftmax : OpKind::kSoftmax;
    n.axis = 1;
    DeviceBuffer y = zeros(rows * in);
    be_->softmax_forward(y.data(), bx.data(), rows, in, log);
    expect_close(host(y), reference(g, n, x), log ? "log_softmax" : "softmax");
  }
  {
    Graph g;
    Node n;
    n.kind = OpKind::kLayerNorm;
    n.epsilon = 1e-5f;
    n.weight = add_param(g, random(in, 0.5f, 1.5f));
    n.bias = add_param(g, random(in));
    DeviceBuffer w = buffer(g.params[n.weight].data), b = buffer(g.params[n.bias].data), y = zeros(rows * in),
                 mean = zeros(rows), rstd = zeros(rows);
    be_->layernorm_forward(y.data(), mean.data(), rstd.data(), bx.data(), w.data(), b.data(), rows, in, n.epsilon);
    expect_close(host(y), reference(g, n, x), "layernorm");
  }
  for (bool training : {false, true}) {
    Graph g;
    Node n;
    n.kind = OpKind::kBatchNorm;
    n.epsilon = 1e-5f;
    n.momentum = 0.9f;
    n.training = training;
    n.weight = add_param(g, random(in, 0.5f, 1.5f));
    n.bias = add_param(g, random(in));
    n.running_mean = add_param(g, random(in));
    n.running_var = add_param(g, random(in, 0.5f, 2.0f));
    DeviceBuffer w = buffer(g.params[n.weight].data), b = buffer(g.params[n.bias].data), y = zeros(rows * in),
                 mean = zeros(in), rstd = zeros(in), rm = buffer(g.params[n.running_mean].data),
                 rv = buffer(g.params[n.running_var].data);
    be_->batchnorm_forward(y.data(), mean.data(), rstd.data(), rm.data(), rv.data(), bx.data(), w.data(), b.data(),
                           rows, in, 1, n.epsilon, n.momentum, training);
    expect_close(host(y), reference(g, n, x), training ? "batchnorm (training)" : "batchnorm (inference)");
  }
}

// ---- a figure: achieved GEMM rate of linear_forward ----

TEST_F(BackendTest, LinearForwardThroughput) {
  const int64_t rows = 256, in = 1024, out = 1024;
  const LinearShape s{rows, in, out, WeightLayout::kOutIn};
  DeviceBuffer x = buffer(random(rows * in)), w = buffer(random(in * out)), b = buffer(random(out)),
               y = zeros(rows * out), pre = zeros(rows * out);
  const Activation relu{ActivationKind::kRelu};
  for (const Activation* epilogue : {static_cast<const Activation*>(nullptr), &relu}) {
    be_->linear_forward(y.data(), x.data(), w.data(), b.data(), s, epilogue, pre.data());  // warm-up
    const int reps = 20;
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) be_->linear_forward(y.data(), x.data(), w.data(), b.data(), s, epilogue, pre.data());
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double gflops = 2.0 * rows * in * out * reps / seconds / 1e9;
    // Correctness column: one output element against a double dot product.
    Floats xh(rows * in), wh(in * out), bh(out), yh(rows * out);
    be_->download(xh.data(), x.data(), rows * in);
    be_->download(wh.data(), w.data(), in * out);
    be_->download(bh.data(), b.data(), out);
    be_->download(yh.data(), y.data(), rows * out);
    double want = bh[17];
    for (int64_t i = 0; i < in; ++i) want += static_cast<double>(xh[100 * in + i]) * wh[17 * in + i];
    if (epilogue) want = std::max(want, 0.0);
    std::printf(
        "[ figure   ] linear_forward rows=%lld in=%lld out=%lld%s: %.3f ms, %.1f GFLOP/s "
        "(2*rows*in*out / time), y[100,17] error %.1e\n",
        static_cast<long long>(rows), static_cast<long long>(in), static_cast<long long>(out),
        epilogue ? " +bias+relu" : " +bias", seconds / reps * 1e3, gflops, std::fabs(yh[100 * out + 17] - want));
    EXPECT_NEAR(yh[100 * out + 17], want, 1e-4 * (1.0 + std::fabs(want)));
  }
}

}  // namespace
}  // namespace pipeshard
