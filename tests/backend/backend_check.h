// Shared by the backend test suites (backend_test.cc, backend_training_test.cc): a
// fixture that moves data through a Backend's upload/download, and the checks.
//
// Gradient checks: each backward is compared with central differences of a scalar
// L = Σ r ⊙ y (r random; for losses L is the loss) computed by a small double-precision
// reference forward in the suite, at the float inputs the backend saw. In double, with
// h = 1e-6·max(1, |x|), the difference quotient is exact to ~1e-9 relative (truncation
// h²·|f‴| ≈ 1e-12, rounding 1e-16·|L|/h ≈ 1e-10), so the comparison measures the
// backend's float arithmetic alone: a few ulps on sums of at most a few hundred terms,
// < 1e-5 of the typical gradient size. We allow |analytic − numeric| ≤ 1e-3·(|numeric| +
// mean |numeric|): two orders of magnitude of headroom, while any formula error (a
// missing factor, a wrong transpose, a dropped term) is of order one. Forward values are
// held to 1e-5 of the output's scale.
#ifndef PIPESHARD_TESTS_BACKEND_BACKEND_CHECK_H_
#define PIPESHARD_TESTS_BACKEND_BACKEND_CHECK_H_

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/registry.h"

namespace pipeshard::testing {

using Floats = std::vector<float>;
using Doubles = std::vector<double>;

constexpr double kGradRtol = 1e-3;
constexpr double kForwardRtol = 1e-5;

inline const ActivationKind kAllActivations[] = {
    ActivationKind::kRelu, ActivationKind::kLeakyRelu, ActivationKind::kSigmoid, ActivationKind::kTanh,
    ActivationKind::kGelu, ActivationKind::kGeluTanh,  ActivationKind::kSilu};

inline std::string kind_name(ActivationKind k) { return activation_name(k); }

inline Doubles to_double(const Floats& v) { return Doubles(v.begin(), v.end()); }

inline double dot(const Doubles& a, const Doubles& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// ---- checks ----

// ∂L/∂x by central differences in double.
inline Doubles numeric_gradient(const std::function<double(const Doubles&)>& loss, Doubles x) {
  Doubles g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i], h = 1e-6 * std::max(1.0, std::fabs(x0));
    x[i] = x0 + h;
    const double up = loss(x);
    x[i] = x0 - h;
    const double down = loss(x);
    x[i] = x0;
    g[i] = (up - down) / (2 * h);
  }
  return g;
}

inline void expect_gradient_near(const Floats& analytic, const Doubles& numeric, const std::string& what) {
  ASSERT_EQ(analytic.size(), numeric.size()) << what;
  double scale = 0.0;
  for (double v : numeric) scale += std::fabs(v) / numeric.size();
  int failures = 0;
  for (size_t i = 0; i < numeric.size(); ++i) {
    const double tol = kGradRtol * (std::fabs(numeric[i]) + scale) + 1e-7;
    if (!(std::fabs(analytic[i] - numeric[i]) <= tol) && failures++ < 5) {
      ADD_FAILURE() << what << "[" << i << "]: analytic " << analytic[i] << ", numeric " << numeric[i];
    }
  }
}

// Forward values: |got − want| ≤ rtol·(|want| + mean |want|).
inline void expect_values_near(const Floats& got, const Doubles& want, const std::string& what,
                               double rtol = kForwardRtol) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0.0;
  for (double v : want) scale += std::fabs(v) / want.size();
  int failures = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double tol = rtol * (std::fabs(want[i]) + scale) + 1e-30;
    if (!(std::fabs(got[i] - want[i]) <= tol) && failures++ < 5) {
      ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << want[i];
    }
  }
}

// The += convention: a second backward call adds the same amount again.
inline void expect_doubled(const Floats& once, const Floats& twice, const std::string& what) {
  ASSERT_EQ(once.size(), twice.size());
  for (size_t i = 0; i < once.size(); ++i) {
    EXPECT_NEAR(twice[i], 2.0 * once[i], 1e-6 * (1.0 + std::fabs(once[i]))) << what << "[" << i << "]";
  }
}

// The backend the suites test: the CPU one, or with PIPESHARD_TEST_BACKEND=cuda (the
// "gpu"-labelled copies of the suites in tests/CMakeLists.txt) the CUDA one on GPU 0,
// held to the same double-precision references. Null, with the reason in `why`, when
// that backend cannot be had here.
inline std::unique_ptr<Backend> backend_under_test(std::string* why) {
  const char* wanted = std::getenv("PIPESHARD_TEST_BACKEND");
  if (wanted == nullptr || std::string(wanted) == "cpu") return make_cpu_backend();
  if (std::string(wanted) == "cuda") {
    Result<std::unique_ptr<Backend>> gpu = make_backend("cuda", {.device = 0, .precision = Precision::kFp32});
    if (gpu) return std::move(*gpu);
    *why = gpu.status().message() + "; the GPU check runs these on a machine with one";
    return nullptr;
  }
  *why = std::string("PIPESHARD_TEST_BACKEND=") + wanted + ": no such backend in this build";
  return nullptr;
}

// Tests see the backend only through be_ and host vectors.
class BackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!be_) GTEST_SKIP() << skip_;
  }

  Floats random(int64_t n, float lo = -1.0f, float hi = 1.0f) {
    std::uniform_real_distribution<float> dist(lo, hi);
    Floats v(n);
    for (float& x : v) x = dist(rng_);
    return v;
  }
  // Random values with |x| ≥ gap, away from a kink at 0.
  Floats random_away_from_zero(int64_t n, float gap, float hi) {
    Floats v = random(n, gap, hi);
    std::bernoulli_distribution sign(0.5);
    for (float& x : v) x = sign(rng_) ? -x : x;
    return v;
  }
  DeviceBuffer buffer(const Floats& host) {
    DeviceBuffer b(*be_, static_cast<int64_t>(host.size()));
    be_->upload(b.data(), host.data(), static_cast<int64_t>(host.size()));
    return b;
  }
  DeviceBuffer zeros(int64_t n) { return DeviceBuffer(*be_, n); }
  Floats host(const DeviceBuffer& b) {
    Floats v(b.size());
    be_->download(v.data(), b.data(), b.size());
    return v;
  }

  std::string skip_;
  std::unique_ptr<Backend> be_ = backend_under_test(&skip_);
  std::mt19937 rng_{20240611};
};

}  // namespace pipeshard::testing

#endif  // PIPESHARD_TESTS_BACKEND_BACKEND_CHECK_H_
