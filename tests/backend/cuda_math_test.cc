// The CUDA kernels' per-element formulas (backend/math/elementwise_math.cuh) against the
// CPU backend, on the host: the header compiles without CUDA, so these run on every
// machine, GPU or not, and a formula that differs from the CPU's is caught before a kernel
// ever runs. What they check is that the formulas are the CPU's operation by operation:
// compiled for the host they must give the CPU's results bit for bit (NaN matching any
// NaN) — activations forward and backward, the dropout mask, and SGD/Adam steps. On the
// device the same formulas differ only where CUDA's expf/erff/tanhf differ from glibc's.
// The float → bf16/fp16 rounding of bf16/fp16 mode (convert_math.cuh) is checked against
// known bit patterns and an independent round-to-nearest-even in double.
#include "backend/math/elementwise_math.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/cpu_kernels.h"
#include "backend/math/convert_math.cuh"

namespace pipeshard {
namespace {

namespace math = cuda::math;
using Floats = std::vector<float>;

// Bitwise equal, or both NaN (the CPU's vector code may pick the other operand's payload).
bool same_float(float a, float b) {
  return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b) || (std::isnan(a) && std::isnan(b));
}

// Reports the first few elements where `got` differs from `want` (the CPU's), and the count.
void expect_same_floats(const Floats& want, const Floats& got, const Floats& input, const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  int mismatches = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!same_float(want[i], got[i]) && mismatches++ < 5) {
      ADD_FAILURE() << what << "[" << i << "] (input " << input[i] << "): CPU " << want[i] << " (0x" << std::hex
                    << std::bit_cast<uint32_t>(want[i]) << "), math 0x" << std::bit_cast<uint32_t>(got[i]) << std::dec
                    << " (" << got[i] << ")";
    }
  }
  EXPECT_EQ(mismatches, 0) << what;
}

// Activation inputs: special values, every region boundary of the formulas (saturation,
// overflow of exp and x³), a fine sweep of [-30, 30], uniform values and random bit patterns.
Floats activation_inputs() {
  const float inf = std::numeric_limits<float>::infinity();
  Floats x = {0.0f,
              -0.0f,
              1e-45f,
              -1e-45f,
              FLT_MIN,
              -FLT_MIN,
              1e-7f,
              -1e-7f,
              0.5f,
              -0.5f,
              1.0f,
              -1.0f,
              3.0f,
              -3.0f,
              8.0f,
              -8.0f,
              9.0f,
              -9.0f,
              15.0f,
              -15.0f,
              20.0f,
              -20.0f,
              40.0f,
              -40.0f,
              87.0f,
              -87.0f,
              88.73f,
              -88.73f,
              89.0f,
              -89.0f,
              104.0f,
              -104.0f,
              1e10f,
              -1e10f,
              1e13f,
              -1e13f,
              1e30f,
              -1e30f,
              FLT_MAX,
              -FLT_MAX,
              inf,
              -inf,
              std::numeric_limits<float>::quiet_NaN()};
  for (int i = -30000; i <= 30000; ++i) x.push_back(static_cast<float>(i) * 1e-3f);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uniform(-12.0f, 12.0f);
  for (int i = 0; i < 20000; ++i) x.push_back(uniform(rng));
  std::uniform_int_distribution<uint32_t> any_bits;
  for (int i = 0; i < 20000; ++i) x.push_back(std::bit_cast<float>(any_bits(rng)));
  return x;
}

Floats normal_floats(size_t n, uint32_t seed, float stddev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, stddev);
  Floats v(n);
  for (float& f : v) f = normal(rng);
  return v;
}

struct ActivationCase {
  ActivationKind kind;
  float alpha;
};
const ActivationCase kActivationCases[] = {{ActivationKind::kRelu, 0.01f},     {ActivationKind::kLeakyRelu, 0.01f},
                                           {ActivationKind::kLeakyRelu, 0.2f}, {ActivationKind::kSigmoid, 0.01f},
                                           {ActivationKind::kTanh, 0.01f},     {ActivationKind::kGelu, 0.01f},
                                           {ActivationKind::kGeluTanh, 0.01f}, {ActivationKind::kSilu, 0.01f}};

std::string case_name(const ActivationCase& c) {
  return std::string(activation_name(c.kind)) + " alpha " + std::to_string(c.alpha);
}

TEST(CudaMath, ActivationForwardIsTheCpus) {
  auto cpu = make_cpu_backend();
  const Floats x = activation_inputs();
  const auto n = static_cast<int64_t>(x.size());
  for (const ActivationCase& c : kActivationCases) {
    Floats want(x.size()), got(x.size());
    cpu->activation_forward(want.data(), x.data(), n, Activation{c.kind, c.alpha});
    for (size_t i = 0; i < x.size(); ++i) got[i] = math::activation_value(c.kind, c.alpha, x[i]);
    expect_same_floats(want, got, x, "forward " + case_name(c));
  }
}

// dx += dy·act'(x) with y given and with y null (recomputed), into a non-zero dx: the CUDA
// kernel passes y only to the kinds whose derivative reads it, so for the others grad must
// ignore it, which garbage y checks.
TEST(CudaMath, ActivationBackwardIsTheCpus) {
  auto cpu = make_cpu_backend();
  const Floats x = activation_inputs();
  const auto n = static_cast<int64_t>(x.size());
  const Floats dy = normal_floats(x.size(), 11, 3.0f), dx0 = normal_floats(x.size(), 12);
  const Floats garbage = normal_floats(x.size(), 13, 100.0f);
  for (const ActivationCase& c : kActivationCases) {
    const Activation act{c.kind, c.alpha};
    Floats y(x.size());
    cpu->activation_forward(y.data(), x.data(), n, act);
    for (const bool with_y : {true, false}) {
      Floats want = dx0, got = dx0;
      cpu->activation_backward(want.data(), dy.data(), x.data(), with_y ? y.data() : nullptr, n, act);
      const bool uses_y = math::activation_grad_uses_output(c.kind);
      for (size_t i = 0; i < x.size(); ++i) {
        float yi = garbage[i];  // what a kernel's register holds when y is not needed
        if (uses_y) yi = with_y ? y[i] : math::activation_value(c.kind, c.alpha, x[i]);
        got[i] = math::add_rn(got[i], math::activation_grad(c.kind, c.alpha, dy[i], x[i], yi));
      }
      expect_same_floats(want, got, x, "backward " + case_name(c) + (with_y ? " with y" : " without y"));
    }
  }
}

// ---- dropout ----

TEST(CudaMath, DropoutMaskIsTheCpusBitForBit) {
  auto cpu = make_cpu_backend();
  constexpr int64_t n = 4099;  // odd: no piece of it is special
  const Floats x = normal_floats(n, 21);
  const uint64_t seeds[] = {0, 1, 42, 0xDEADBEEFCAFEBABEull, ~0ull};
  // The last offset makes offset + i wrap around 2⁶⁴ inside the tensor.
  const uint64_t offsets[] = {0, 1, 12345, uint64_t{1} << 40, ~0ull - 1000};
  const float ratios[] = {0.0f, 1e-7f, 0.1f, 0.25f, 0.5f, 0.9f, 0.9999999f, 1.0f};
  for (uint64_t seed : seeds) {
    for (uint64_t offset : offsets) {
      for (float ratio : ratios) {
        const std::string what =
            "seed " + std::to_string(seed) + " offset " + std::to_string(offset) + " ratio " + std::to_string(ratio);
        Floats y(n), mask(n);
        cpu->dropout_forward(y.data(), mask.data(), x.data(), n, ratio, seed, offset);
        const uint64_t key = math::dropout_key(seed);
        const float keep_scale = math::dropout_keep_scale(ratio);
        Floats got_mask(n), got_y(n);
        int64_t kept = 0;
        for (int64_t i = 0; i < n; ++i) {
          const bool keep = math::dropout_keeps(key, offset + static_cast<uint64_t>(i), ratio);
          kept += keep;
          got_mask[i] = keep ? keep_scale : 0.0f;
          got_y[i] = math::mul_rn(x[i], got_mask[i]);
        }
        expect_same_floats(mask, got_mask, x, "mask " + what);
        expect_same_floats(y, got_y, x, "y " + what);
        // Not vacuous: the draw keeps about 1 − ratio of the elements (±5 σ).
        const double expected = n * (1.0 - ratio), sigma = std::sqrt(n * ratio * (1.0 - ratio));
        EXPECT_NEAR(static_cast<double>(kept), expected, 5 * sigma + 1) << what;
      }
    }
  }
}

// u == ratio keeps the element (u >= ratio). Random draws almost never land on the
// boundary (2⁻²⁴ a draw), so this searches the counters for draws u = 0.5 and u = 0.25 exactly.
TEST(CudaMath, DropoutKeepsADrawEqualToTheRatio) {
  auto cpu = make_cpu_backend();
  constexpr uint64_t seed = 42;
  const uint64_t key = math::dropout_key(seed);
  for (const uint64_t target : {uint64_t{1} << 23, uint64_t{1} << 22}) {  // u = 0.5, 0.25
    const float ratio = static_cast<float>(target) * 0x1p-24f;
    uint64_t counter = 0;
    while ((math::mix64(key + counter * math::kDropoutGamma) >> 40) != target) {
      ASSERT_LT(++counter, uint64_t{1} << 28) << "no draw of exactly " << ratio << " found";
    }
    const float x = 3.0f;
    const float above = std::nextafter(ratio, 1.0f);
    for (const float r : {ratio, above}) {
      float y = 0.0f, mask = 0.0f;
      cpu->dropout_forward(&y, &mask, &x, 1, r, seed, counter);
      const bool keep = math::dropout_keeps(key, counter, r);
      EXPECT_EQ(keep, r == ratio) << "counter " << counter << " ratio " << r;
      EXPECT_TRUE(same_float(mask, keep ? math::dropout_keep_scale(r) : 0.0f)) << "counter " << counter;
    }
  }
}

// ---- optimizers ----

// Gradients with a non-finite value at `bad_at` (none when negative).
Floats gradients(size_t n, uint32_t seed, int64_t bad_at, float bad) {
  Floats g = normal_floats(n, seed, 0.5f);
  g[1] = 1e38f;  // large but finite: g·0 is still 0
  if (bad_at >= 0) g[bad_at] = bad;
  return g;
}

TEST(CudaMath, SgdUpdateIsTheCpusBitForBit) {
  constexpr size_t n = 1001;
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (const float momentum : {0.0f, 0.9f}) {
    for (const float wd : {0.0f, 1e-2f}) {
      for (const bool nesterov : {false, true}) {
        if (nesterov && momentum == 0.0f) continue;  // torch refuses it, and so does the CPU
        for (const float bad : {0.0f, inf, -inf, nan}) {
          const int64_t bad_at = bad == 0.0f ? -1 : 500;
          const std::string what = "momentum " + std::to_string(momentum) + " wd " + std::to_string(wd) +
                                   (nesterov ? " nesterov" : "") + " bad " + std::to_string(bad);
          Floats want_p = normal_floats(n, 31), want_buf = normal_floats(n, 32);
          Floats got_p = want_p, got_buf = want_buf;
          for (int step = 1; step <= 3; ++step) {
            const SgdStep s{0.1f, momentum, wd, nesterov, step == 1};
            const Floats g = gradients(n, 40 + step, bad_at, bad);
            const bool want_finite = cpu::sgd_step(want_p.data(), g.data(), want_buf.data(), n, s);
            const math::SgdScalars k = math::sgd_scalars(s);
            bool got_bad = false;
            for (size_t i = 0; i < n; ++i) {
              got_p[i] = math::sgd_update(got_p[i], g[i], &got_buf[i], k);
              got_bad |= math::is_non_finite(g[i]);
            }
            const std::string at = what + " step " + std::to_string(step);
            EXPECT_EQ(want_finite, !got_bad) << at;
            EXPECT_EQ(want_finite, bad_at < 0) << at;
            expect_same_floats(want_p, got_p, g, "param " + at);
            expect_same_floats(want_buf, got_buf, g, "momentum " + at);
          }
        }
      }
    }
  }
}

TEST(CudaMath, AdamUpdateIsTheCpusBitForBit) {
  constexpr size_t n = 1001;
  const float inf = std::numeric_limits<float>::infinity();
  struct Hyper {
    float lr, beta1, beta2, eps;
  };
  // beta1 0.9: the lerp from the start (weight 0.1); 0.3 and 0: from the end (0.7, 1).
  const Hyper hypers[] = {{1e-3f, 0.9f, 0.999f, 1e-8f}, {0.1f, 0.3f, 0.5f, 1e-3f}, {0.01f, 0.0f, 0.99f, 1e-6f}};
  for (const Hyper& h : hypers) {
    for (const float wd : {0.0f, 1e-2f}) {
      for (const bool decoupled : {false, true}) {
        for (const float bad : {0.0f, inf}) {
          const int64_t bad_at = bad == 0.0f ? -1 : 3;
          const std::string what = "lr " + std::to_string(h.lr) + " beta1 " + std::to_string(h.beta1) + " beta2 " +
                                   std::to_string(h.beta2) + " wd " + std::to_string(wd) +
                                   (decoupled ? " AdamW" : " Adam") + " bad " + std::to_string(bad);
          Floats want_p = normal_floats(n, 51), want_m(n, 0.0f), want_v(n, 0.0f);
          Floats got_p = want_p, got_m = want_m, got_v = want_v;
          // Steps 1–4 from zero moments, then a late step (large t: bias corrections near 1).
          for (const int64_t step : {1, 2, 3, 4, 1000}) {
            const AdamStep s{h.lr, h.beta1, h.beta2, h.eps, wd, decoupled, step};
            const Floats g = gradients(n, 60 + static_cast<uint32_t>(step), bad_at, bad);
            const bool want_finite = cpu::adam_step(want_p.data(), g.data(), want_m.data(), want_v.data(), n, s);
            const math::AdamScalars k = math::adam_scalars(s);
            bool got_bad = false;
            for (size_t i = 0; i < n; ++i) {
              got_p[i] = math::adam_update(got_p[i], g[i], got_m[i], got_v[i], k);
              got_bad |= math::is_non_finite(g[i]);
            }
            const std::string at = what + " step " + std::to_string(step);
            EXPECT_EQ(want_finite, !got_bad) << at;
            EXPECT_EQ(want_finite, bad_at < 0) << at;
            expect_same_floats(want_p, got_p, g, "param " + at);
            expect_same_floats(want_m, got_m, g, "exp_avg " + at);
            expect_same_floats(want_v, got_v, g, "exp_avg_sq " + at);
          }
        }
      }
    }
  }
}

// The scalars Adam computes once per step in double (bias corrections, 1 − lr·wd) rounded
// once, over hyper-parameters that are not round numbers: computing any of them in float
// would round twice, and some of these steps would differ in their last bit.
TEST(CudaMath, AdamScalarsAreTheCpusOverRandomHyperParameters) {
  constexpr size_t n = 64;
  std::mt19937 rng(71);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  for (int trial = 0; trial < 200; ++trial) {
    const AdamStep s{1e-4f + 0.3f * unit(rng),
                     0.5f + 0.49f * unit(rng),
                     0.9f + 0.0999f * unit(rng),
                     1e-8f + 1e-3f * unit(rng),
                     0.2f * unit(rng),
                     trial % 2 == 0,
                     1 + static_cast<int64_t>(50 * unit(rng))};
    Floats want_p = normal_floats(n, 80 + trial), want_m = normal_floats(n, 81 + trial, 0.1f);
    Floats want_v = normal_floats(n, 82 + trial, 0.1f);
    for (float& v : want_v) v = v * v;
    want_p[0] = 1.0f;  // with g = m = v = 0 the step leaves p·(1 − lr·wd) for AdamW, p for Adam
    want_m[0] = want_v[0] = 0.0f;
    Floats g = normal_floats(n, 83 + trial);
    g[0] = 0.0f;
    Floats got_p = want_p, got_m = want_m, got_v = want_v;
    cpu::adam_step(want_p.data(), g.data(), want_m.data(), want_v.data(), n, s);
    const math::AdamScalars k = math::adam_scalars(s);
    for (size_t i = 0; i < n; ++i) got_p[i] = math::adam_update(got_p[i], g[i], got_m[i], got_v[i], k);
    const std::string what = "trial " + std::to_string(trial);
    expect_same_floats(want_p, got_p, g, "param " + what);
    expect_same_floats(want_m, got_m, g, "exp_avg " + what);
    expect_same_floats(want_v, got_v, g, "exp_avg_sq " + what);
  }
}

// ---- float → bf16 / fp16 (convert_math.cuh) ----

// An independent reference: x rounded to `precision` significant bits, with exponents
// clamped below at `min_exponent` (so that smaller values are multiples of the subnormal
// spacing 2^(min_exponent − precision + 1)), ties to even. In double every step is exact for
// a float x: the division and multiplication are by powers of two, and nearbyint rounds to
// nearest even in the default rounding mode. Overflow is left to the caller.
double round_to_format(double x, int precision, int min_exponent) {
  if (x == 0.0 || !std::isfinite(x)) return x;
  const int exponent = std::max(std::ilogb(x), min_exponent);
  const double unit = std::ldexp(1.0, exponent - (precision - 1));
  return std::nearbyint(x / unit) * unit;
}

// bf16: 8 significant bits, float32's exponent range (a result past FLT_MAX is inf).
uint16_t reference_bf16(float f) {
  if (std::isnan(f)) return math::kCanonicalNan16;
  const float r = static_cast<float>(round_to_format(f, 8, -126));  // 2^128 → inf
  return static_cast<uint16_t>(std::bit_cast<uint32_t>(r) >> 16);
}

// fp16: 11 significant bits, exponents down to −14; past 65504 only infinity.
float reference_fp16_value(float f) {
  const double r = round_to_format(f, 11, -14);
  if (std::fabs(r) > 65504.0) return std::copysign(std::numeric_limits<float>::infinity(), f);
  return static_cast<float>(r);
}

// Floats that exercise every rounding decision: each value of the 16-bit format, the
// midpoint to its upper neighbour, one float ulp either side of that midpoint (both signs
// of all of them), a strided sweep over all 2^32 bit patterns, and the special values.
Floats rounding_inputs(bool bf16) {
  Floats x;
  for (uint32_t h = 0; h < 0x8000u; ++h) {
    const auto p = static_cast<uint16_t>(h);
    const float v = bf16 ? math::bf16_to_float(p) : math::fp16_to_float(p);
    if (!std::isfinite(v)) continue;
    const float next =
        bf16 ? math::bf16_to_float(static_cast<uint16_t>(h + 1)) : math::fp16_to_float(static_cast<uint16_t>(h + 1));
    // The midpoint is exact in float (one bit more than the format has), also towards inf:
    // for bf16 it is the float 0x7F7F8000, for fp16 65520.
    const float mid = std::isfinite(next) ? static_cast<float>((static_cast<double>(v) + next) / 2)
                                          : (bf16 ? std::bit_cast<float>(0x7F7F8000u) : 65520.0f);
    for (float f : {v, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, std::numeric_limits<float>::infinity())}) {
      x.push_back(f);
      x.push_back(-f);
    }
  }
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; u += 65521) x.push_back(std::bit_cast<float>(static_cast<uint32_t>(u)));
  const float inf = std::numeric_limits<float>::infinity();
  for (float f : {0.0f, -0.0f, inf, -inf, FLT_MAX, -FLT_MAX, FLT_MIN, -FLT_MIN, 1e-45f, -1e-45f, 1e-40f, 65504.0f,
                  65519.996f, 65520.0f, 65520.004f, 1e6f}) {
    x.push_back(f);
  }
  return x;
}

std::string hex(uint32_t v) {
  char buffer[16];
  std::snprintf(buffer, sizeof(buffer), "0x%X", v);
  return buffer;
}

TEST(CudaMath, Bf16RoundingKnownPatterns) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  auto bits = [](uint32_t u) { return std::bit_cast<float>(u); };
  const std::pair<float, uint16_t> cases[] = {
      {1.0f, 0x3F80},
      {-2.0f, 0xC000},
      {0.0f, 0x0000},
      {-0.0f, 0x8000},
      {inf, 0x7F80},
      {-inf, 0xFF80},
      {bits(0x3F808000u), 0x3F80},  // 1 + 2^-8: a tie, stays at the even 0x3F80
      {bits(0x3F818000u), 0x3F82},  // 1 + 3·2^-8: a tie, up to the even 0x3F82
      {bits(0x3F808001u), 0x3F81},  // just above a tie: up
      {bits(0x3F807FFFu), 0x3F80},  // just below: down
      {bits(0xBF818000u), 0xBF82},  // negative ties mirror the positive ones
      {bits(0x7F7F7FFFu), 0x7F7F},  // just below the midpoint past the largest bf16: stays finite
      {bits(0x7F7F8000u), 0x7F80},  // that midpoint: ties to the even side, infinity
      {FLT_MAX, 0x7F80},
      {-FLT_MAX, 0xFF80},
      {FLT_MIN, 0x0080},            // bf16 keeps float32's exponent range ...
      {bits(0x00010000u), 0x0001},  // ... and its subnormals: the smallest bf16 subnormal, 2^-133
      {bits(0x00008000u), 0x0000},  // half of it: a tie, to the even 0
      {bits(0x00018000u), 0x0002},  // 1.5 units: a tie, to the even 2
      {bits(0x00008001u), 0x0001},  // just above half a unit: up
      {1e-45f, 0x0000},
      {-1e-45f, 0x8000},
      {bits(0x007FFFFFu), 0x0080},  // the largest float subnormal rounds up into the normal range
  };
  for (const auto& [f, want] : cases) {
    EXPECT_EQ(math::float_to_bf16_rn(f), want) << f << " (" << hex(std::bit_cast<uint32_t>(f)) << ")";
    // The well-known formulation: the upper 16 bits after adding 0x7FFF + the lowest kept bit.
    const uint32_t u = std::bit_cast<uint32_t>(f);
    EXPECT_EQ(want, static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)) << hex(u);
  }
  for (float f : {nan, -nan, bits(0x7F800001u), bits(0xFFFFFFFFu), bits(0x7FC00000u)}) {
    const uint16_t h = math::float_to_bf16_rn(f);
    EXPECT_TRUE(std::isnan(math::bf16_to_float(h))) << hex(std::bit_cast<uint32_t>(f)) << " -> " << hex(h);
  }
}

TEST(CudaMath, Fp16RoundingKnownPatterns) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const std::pair<float, uint16_t> cases[] = {
      {1.0f, 0x3C00},
      {-2.0f, 0xC000},
      {0.5f, 0x3800},
      {0.1f, 0x2E66},
      {1.0f / 3.0f, 0x3555},
      {0.0f, 0x0000},
      {-0.0f, 0x8000},
      {inf, 0x7C00},
      {-inf, 0xFC00},
      {1.0f + 0x1p-11f, 0x3C00},      // a tie: stays at the even 0x3C00
      {1.0f + 3 * 0x1p-11f, 0x3C02},  // a tie: up to the even 0x3C02
      {1.0f + 0x1p-11f + 0x1p-23f, 0x3C01},
      {65504.0f, 0x7BFF},
      {-65504.0f, 0xFBFF},   // the largest fp16
      {65519.996f, 0x7BFF},  // the float just below 65520 (65504 + half a unit)
      {65520.0f, 0x7C00},
      {-65520.0f, 0xFC00},  // the tie goes to the even side: infinity
      {1e6f, 0x7C00},
      {FLT_MAX, 0x7C00},
      {-FLT_MAX, 0xFC00},
      {0x1p-14f, 0x0400},             // the smallest normal
      {0x1p-14f - 0x1p-25f, 0x0400},  // 1023.5·2^-24: a tie between 0x03FF and the even 0x0400
      {0x1p-14f - 0x1p-24f, 0x03FF},  // the largest subnormal
      {0x1p-24f, 0x0001},
      {-0x1p-24f, 0x8001},  // the smallest subnormal
      {5.96e-8f, 0x0001},   // just below 2^-24 = 5.9604645e-8, above its half
      {0x1p-25f, 0x0000},
      {-0x1p-25f, 0x8000},  // half the smallest subnormal: a tie, to ±0
      {std::nextafter(0x1p-25f, 1.0f), 0x0001},
      {3 * 0x1p-25f, 0x0002},  // 1.5 units: a tie, to the even 2
      {5 * 0x1p-25f, 0x0002},  // 2.5 units: a tie, to the even 2
      {0x1p-26f, 0x0000},
      {1e-45f, 0x0000},
      {-1e-45f, 0x8000},
      {FLT_MIN, 0x0000},
  };
  for (const auto& [f, want] : cases) {
    EXPECT_EQ(math::float_to_fp16_rn(f), want) << f << " (" << hex(std::bit_cast<uint32_t>(f)) << ")";
  }
  for (float f : {nan, -nan, std::bit_cast<float>(0x7F800001u), std::bit_cast<float>(0xFFFFFFFFu)}) {
    const uint16_t h = math::float_to_fp16_rn(f);
    EXPECT_TRUE(std::isnan(math::fp16_to_float(h))) << hex(std::bit_cast<uint32_t>(f)) << " -> " << hex(h);
  }
}

// Every 16-bit pattern converts to the float it stands for and back to itself.
TEST(CudaMath, SixteenBitPatternsRoundTrip) {
  for (uint32_t h = 0; h <= 0xFFFFu; ++h) {
    const auto p = static_cast<uint16_t>(h);
    const float b = math::bf16_to_float(p), f = math::fp16_to_float(p);
    EXPECT_EQ(std::bit_cast<uint32_t>(b), h << 16);
    if (!std::isnan(b)) {
      EXPECT_EQ(math::float_to_bf16_rn(b), p) << hex(h);
    }
    const bool fp16_nan = (h & 0x7C00u) == 0x7C00u && (h & 0x3FFu) != 0u;
    EXPECT_EQ(std::isnan(f), fp16_nan) << hex(h);
    if (!fp16_nan) {
      EXPECT_EQ(math::float_to_fp16_rn(f), p) << hex(h);
    }
    // The value: (−1)^s · 2^(e−15) · 1.m, or 2^-14 · 0.m for e = 0.
    const int e = static_cast<int>((h >> 10) & 0x1Fu), m = static_cast<int>(h & 0x3FFu);
    if (e != 0x1F) {
      const double magnitude = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
      EXPECT_EQ(static_cast<double>(f), (h & 0x8000u) ? -magnitude : magnitude) << hex(h);
      EXPECT_EQ(std::signbit(f), (h & 0x8000u) != 0) << hex(h);
    }
  }
}

// Against the reference in double (and, where the compiler has _Float16, its conversion,
// which is IEEE round-to-nearest-even in software), on every rounding decision.
TEST(CudaMath, SixteenBitRoundingIsRoundToNearestEven) {
  int failures = 0;
  for (float f : rounding_inputs(true)) {
    const uint16_t got = math::float_to_bf16_rn(f), want = reference_bf16(f);
    if (got != want && failures++ < 5) {
      ADD_FAILURE() << "bf16 of " << hex(std::bit_cast<uint32_t>(f)) << ": " << hex(got) << ", want " << hex(want);
    }
  }
  for (float f : rounding_inputs(false)) {
    const uint16_t got = math::float_to_fp16_rn(f);
    const float value = math::fp16_to_float(got);
    if (std::isnan(f)) {
      if (!std::isnan(value) && failures++ < 5) ADD_FAILURE() << "fp16 of NaN: " << hex(got);
      continue;
    }
    const float want = reference_fp16_value(f);
    const bool same = value == want && std::signbit(value) == std::signbit(want);
    if (!same && failures++ < 5) {
      ADD_FAILURE() << "fp16 of " << f << " (" << hex(std::bit_cast<uint32_t>(f)) << "): " << hex(got) << " = " << value
                    << ", want " << want;
    }
#ifdef __FLT16_MAX__
    const auto compiler = static_cast<_Float16>(f);
    uint16_t compiler_bits;
    std::memcpy(&compiler_bits, &compiler, sizeof(compiler_bits));
    if (compiler_bits != got && failures++ < 5) {
      ADD_FAILURE() << "fp16 of " << f << ": " << hex(got) << ", the compiler's _Float16 " << hex(compiler_bits);
    }
#endif
  }
  EXPECT_EQ(failures, 0);
}

}  // namespace
}  // namespace pipeshard
