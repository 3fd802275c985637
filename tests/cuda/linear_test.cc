// linear.cu (cuBLASLt, its epilogues and their fallbacks) against the CPU backend, the
// reference, on the same inputs: both weight layouts, every activation fused with and
// without `pre`, scaled and unscaled bias, both GradWrite modes (kOverwrite into NaN, which
// must not leak through), odd and degenerate shapes, and pointers at the alignments the
// epilogue choices hinge on; in each precision. fp32 is held to backend_check.h's forward
// tolerance (1e-5 of the output's scale); TF32 to 1e-2, where any mapping error (a wrong
// transpose, leading dimension or epilogue) is of order one.
//
// bf16 and fp16 are compared twice per case, with per-element bounds (sixteen_bit_bounds):
// - on operands rounded to the format on the host first (x, W, dy; not the bias or the
//   gradients added into, which stay fp32 on the device too). Then both sides multiply the
//   same values — products of two 16-bit values are exact in fp32 — and differ only in
//   how the fp32 sums round: held to 1e-5·(sqrt(k)·M + |want|) + 2^-23·(k/16 + 2)·S, with
//   M the largest |term| and S = Σ|terms|. The first part is rounding to nearest in any
//   order: k additions of random-signed terms move a sum by about sqrt(k) steps of at most
//   2^-23 of partial sums of size ~sqrt(k)·M, ~k·2^-23·M, which 1e-5·sqrt(k)·M covers up
//   to k ≈ 7000. The second is for tensor cores, which are reported to truncate rather
//   than round when they add a block of products (16 for these types) into the fp32
//   accumulator: a bias of up to one ulp of a partial sum (≤ S) per block, which does not
//   average out. Either is hundreds of times below the bound for unrounded operands;
// - on the unrounded operands, against the CPU in fp32: each term x·w of a sum is off by at
//   most (2u + u²)·|x·w| when both factors are rounded (u = 2^-8 for bf16, 2^-11 for
//   fp16), so the bound is (2u + u²)·S with S = Σ|terms| computed on the host, plus the
//   tolerance above.
// An activation after the product multiplies either bound by its largest slope (1.13,
// GELU's); cuBLASLt's GELU-tanh epilogue, which these modes use, computes tanh to about
// 2^-11 relative, so y may be off by a further 0.5·|pre|·2^-11, allowed as 2^-10·|pre|.
// Without a usable GPU every test skips, saying why.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/allocator.h"
#include "backend/cuda/launchers.h"
#include "backend/math/convert_math.cuh"
#include "tests/backend/backend_check.h"
#include "tests/cuda/gpu_test_util.h"

namespace pipeshard::cuda {
namespace {

namespace check = ::pipeshard::testing;
using check::Floats;

void cuda_ok(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) {
    std::fprintf(stderr, "linear_test: %s: %s\n", what, cudaGetErrorString(rc));
    std::abort();
  }
}

// A device copy of a host vector, starting `offset` floats past a 256-byte boundary: offset
// 1 gives cuBLASLt 4-byte aligned pointers, 4 gives 16-byte ones, 0 gives 256.
class DeviceFloats {
 public:
  DeviceFloats(const Floats& host, int64_t offset) : n_(host.size()), offset_(offset) {
    cuda_ok(cudaMalloc(&base_, sizeof(float) * (n_ + offset_ + 1)), "cudaMalloc");
    if (n_ > 0) cuda_ok(cudaMemcpy(data(), host.data(), sizeof(float) * n_, cudaMemcpyHostToDevice), "upload");
  }
  ~DeviceFloats() { cudaFree(base_); }
  DeviceFloats(const DeviceFloats&) = delete;
  DeviceFloats& operator=(const DeviceFloats&) = delete;

  float* data() const { return base_ + offset_; }
  Floats host() const {
    Floats out(n_);
    if (n_ > 0) cuda_ok(cudaMemcpy(out.data(), data(), sizeof(float) * n_, cudaMemcpyDeviceToHost), "download");
    return out;
  }

 private:
  size_t n_;
  int64_t offset_;
  float* base_ = nullptr;
};

// |got − want| ≤ tol[i] for every element (NaN fails); the first few failures reported.
void expect_within(const Floats& got, const Floats& want, const check::Doubles& tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  ASSERT_EQ(tol.size(), want.size()) << what;
  int failures = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(err <= tol[i]) && failures++ < 5) {
      ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << want[i] << " (error " << err
                    << ", tolerance " << tol[i] << ")";
    }
  }
}

Floats absolute(const Floats& v) {
  Floats a(v.size());
  for (size_t i = 0; i < v.size(); ++i) a[i] = std::fabs(v[i]);
  return a;
}

float max_abs(const Floats& v) {
  float m = 0.0f;
  for (float f : v) m = std::max(m, std::fabs(f));
  return m;
}

// The largest slope of any activation the tests use (GELU's, 1.1289; SiLU 1.0998; leaky
// ReLU here 1): how far an error in the pre-activation can move y.
constexpr double kActivationSlope = 1.13;

std::string shape_name(const LinearShape& s) {
  return std::string(s.layout == WeightLayout::kOutIn ? "[out,in]" : "[in,out]") + " rows=" + std::to_string(s.rows) +
         " in=" + std::to_string(s.in) + " out=" + std::to_string(s.out) + " alpha=" + std::to_string(s.alpha) +
         " beta=" + std::to_string(s.beta);
}

// The parameter: what the GEMMs compute in.
class CudaLinearTest : public ::testing::TestWithParam<Precision> {
 protected:
  void SetUp() override {
    if (const std::string why = testing::no_usable_gpu(); !why.empty()) {
      GTEST_SKIP() << why << "; the cuBLASLt check runs on a machine with one";
    }
    // Blocking: uploads are cudaMemcpy on the legacy stream, which a pageable upload may
    // leave unfinished when it returns; a blocking stream waits for them.
    cuda_ok(cudaStreamCreate(&stream_), "cudaStreamCreate");
    context_ = create_linear_context(GetParam(), &allocator_);
  }
  void TearDown() override {
    if (context_ == nullptr) return;
    cuda_ok(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    destroy_linear_context(context_);
    cudaStreamDestroy(stream_);
  }

  double rtol() const { return GetParam() == Precision::kTf32 ? 1e-2 : check::kForwardRtol; }
  bool sixteen_bit() const { return GetParam() == Precision::kBf16 || GetParam() == Precision::kFp16; }
  // The 16-bit format's unit roundoff: a rounded operand is within u of itself, relatively.
  double unit_roundoff() const { return GetParam() == Precision::kBf16 ? 0x1p-8 : 0x1p-11; }
  // v rounded to the 16-bit format (to nearest even, as the device rounds), as floats.
  Floats rounded(const Floats& v) const {
    Floats r(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      r[i] = GetParam() == Precision::kBf16 ? math::bf16_to_float(math::float_to_bf16_rn(v[i]))
                                            : math::fp16_to_float(math::float_to_fp16_rn(v[i]));
    }
    return r;
  }
  // Per-element bounds for 16-bit results (the header comment): want [n] the CPU's values,
  // sums [n] = Σ|terms| of each, M the largest |term|, k the terms per sum; `exact_operands`
  // when the operands were rounded on the host.
  check::Doubles sixteen_bit_bounds(const Floats& want, const Floats& sums, double m, int64_t k,
                                    bool exact_operands) const {
    const double u = unit_roundoff();
    check::Doubles tol(want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      tol[i] = 1e-5 * (std::sqrt(static_cast<double>(k)) * m + std::fabs(want[i])) +
               0x1p-23 * (static_cast<double>(k) / 16 + 2) * sums[i] + 1e-30;
      if (!exact_operands) tol[i] += (2 * u + u * u) * sums[i];
    }
    return tol;
  }
  Floats random(int64_t n) {
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    Floats v(static_cast<size_t>(n));
    for (float& x : v) x = dist(rng_);
    return v;
  }
  void expect_near(const Floats& got, const Floats& want, const std::string& what) {
    check::expect_values_near(got, check::to_double(want), what, rtol());
  }
  void sync() { cuda_ok(cudaStreamSynchronize(stream_), "linear on the GPU"); }

  // y (and pre) from the GPU against the CPU backend; in bf16/fp16 twice (the header).
  void check_forward(const LinearShape& s, bool with_bias, const Activation* act, bool want_pre, int64_t offset,
                     const std::string& what) {
    const Floats x = random(s.rows * s.in), w = random(s.in * s.out), b = random(s.out);
    if (!sixteen_bit()) return compare_forward(s, x, w, b, with_bias, act, want_pre, offset, false, what);
    compare_forward(s, rounded(x), rounded(w), b, with_bias, act, want_pre, offset, true,
                    what + " (operands rounded on the host)");
    compare_forward(s, x, w, b, with_bias, act, want_pre, offset, false, what + " (unrounded operands)");
  }

  void compare_forward(const LinearShape& s, const Floats& x, const Floats& w, const Floats& b, bool with_bias,
                       const Activation* act, bool want_pre, int64_t offset, bool exact_operands,
                       const std::string& what) {
    const Floats before(static_cast<size_t>(s.rows * s.out), 7.0f);  // rows = 0 must leave it
    Floats y = before, pre = before;
    cpu_->linear_forward(y.data(), x.data(), w.data(), with_bias ? b.data() : nullptr, s, act,
                         want_pre ? pre.data() : nullptr);
    DeviceFloats gx(x, offset), gw(w, offset), gb(b, offset), gy(before, offset), gpre(before, offset);
    linear_forward(context_, gy.data(), gx.data(), gw.data(), with_bias ? gb.data() : nullptr, s, act,
                   want_pre ? gpre.data() : nullptr, stream_);
    sync();
    if (!sixteen_bit()) {
      expect_near(gy.host(), y, what + " y");
      expect_near(gpre.host(), pre, what + " pre");
      return;
    }
    // Bounds from the pre-activation: v = alpha·x·W' + beta·b, its Σ|terms| and largest term.
    Floats v = before, sums = before;
    const LinearShape abs_shape{s.rows, s.in, s.out, s.layout, std::fabs(s.alpha), std::fabs(s.beta)};
    cpu_->linear_forward(v.data(), x.data(), w.data(), with_bias ? b.data() : nullptr, s);
    cpu_->linear_forward(sums.data(), absolute(x).data(), absolute(w).data(), with_bias ? absolute(b).data() : nullptr,
                         abs_shape);
    const double m = std::max(double{abs_shape.alpha} * max_abs(x) * max_abs(w),
                              with_bias ? double{abs_shape.beta} * max_abs(b) : 0.0);
    const check::Doubles pre_tol = sixteen_bit_bounds(v, sums, m, s.in + 1, exact_operands);
    check::Doubles y_tol = pre_tol;
    if (act != nullptr && s.rows > 0) {
      const bool gelu_epilogue = act->kind == ActivationKind::kGeluTanh;
      for (size_t i = 0; i < y_tol.size(); ++i) {
        y_tol[i] =
            kActivationSlope * pre_tol[i] + 1e-5 * std::fabs(y[i]) + (gelu_epilogue ? 0x1p-10 * std::fabs(v[i]) : 0.0);
      }
    }
    expect_within(gy.host(), y, y_tol, what + " y");
    if (want_pre && act != nullptr) {
      expect_within(gpre.host(), pre, pre_tol, what + " pre");
    } else {
      expect_within(gpre.host(), pre, check::Doubles(pre.size(), 0.0), what + " pre (untouched)");
    }
  }

  // dx, dw, db from the GPU against the CPU backend; kAdd adds into random gradients,
  // kOverwrite overwrites NaN. In bf16/fp16 twice (the header).
  void check_backward(const LinearShape& s, bool want_dx, bool want_dw, bool want_db, GradWrite params, GradWrite input,
                      int64_t offset, const std::string& what) {
    const Floats x = random(s.rows * s.in), w = random(s.in * s.out), dy = random(s.rows * s.out);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    auto start = [&](int64_t n, GradWrite mode) {
      return mode == GradWrite::kAdd ? random(n) : Floats(static_cast<size_t>(n), nan);
    };
    const Grads initial{start(s.rows * s.in, input), start(s.in * s.out, params), start(s.out, params)};
    const Wanted wanted{want_dx, want_dw, want_db, params, input};
    if (!sixteen_bit()) return compare_backward(s, x, w, dy, initial, wanted, offset, false, what);
    compare_backward(s, rounded(x), rounded(w), rounded(dy), initial, wanted, offset, true,
                     what + " (operands rounded on the host)");
    compare_backward(s, x, w, dy, initial, wanted, offset, false, what + " (unrounded operands)");
  }

  struct Grads {
    Floats dx, dw, db;
  };
  struct Wanted {
    bool dx, dw, db;
    GradWrite params, input;
  };

  void compare_backward(const LinearShape& s, const Floats& x, const Floats& w, const Floats& dy, const Grads& initial,
                        const Wanted& want, int64_t offset, bool exact_operands, const std::string& what) {
    Grads cpu = initial;
    DeviceFloats gx(x, offset), gw(w, offset), gdy(dy, offset), gdx(initial.dx, offset), gdw(initial.dw, offset),
        gdb(initial.db, offset);
    cpu_->linear_backward(want.dx ? cpu.dx.data() : nullptr, want.dw ? cpu.dw.data() : nullptr,
                          want.db ? cpu.db.data() : nullptr, dy.data(), x.data(), w.data(), s, want.params, want.input);
    linear_backward(context_, want.dx ? gdx.data() : nullptr, want.dw ? gdw.data() : nullptr,
                    want.db ? gdb.data() : nullptr, gdy.data(), gx.data(), gw.data(), s, want.params, want.input,
                    stream_);
    sync();
    if (!sixteen_bit()) {
      if (want.dx) expect_near(gdx.host(), cpu.dx, what + " dx");
      if (want.dw) expect_near(gdw.host(), cpu.dw, what + " dw");
      if (want.db) expect_near(gdb.host(), cpu.db, what + " db");
      expect_near(gdy.host(), dy, what + " dy is not modified");
      return;
    }
    // Σ|terms| of each gradient: the same products on absolute values, overwritten.
    Grads sums{Floats(cpu.dx.size()), Floats(cpu.dw.size()), Floats(cpu.db.size())};
    const LinearShape abs_shape{s.rows, s.in, s.out, s.layout, std::fabs(s.alpha), std::fabs(s.beta)};
    cpu_->linear_backward(sums.dx.data(), sums.dw.data(), sums.db.data(), absolute(dy).data(), absolute(x).data(),
                          absolute(w).data(), abs_shape, GradWrite::kOverwrite, GradWrite::kOverwrite);
    const double a = abs_shape.alpha, dy_max = max_abs(dy);
    if (want.dx) {
      expect_within(gdx.host(), cpu.dx,
                    sixteen_bit_bounds(cpu.dx, sums.dx, a * dy_max * max_abs(w), s.out, exact_operands), what + " dx");
    }
    if (want.dw) {
      expect_within(gdw.host(), cpu.dw,
                    sixteen_bit_bounds(cpu.dw, sums.dw, a * dy_max * max_abs(x), s.rows, exact_operands), what + " dw");
    }
    if (want.db) {  // from the rounded dy where the BGRAD epilogue sums it: one rounded factor, within the bound
      expect_within(gdb.host(), cpu.db,
                    sixteen_bit_bounds(cpu.db, sums.db, abs_shape.beta * dy_max, s.rows, exact_operands), what + " db");
    }
    expect_within(gdy.host(), dy, check::Doubles(dy.size(), 0.0), what + " dy is not modified");
  }

  std::unique_ptr<Backend> cpu_ = make_cpu_backend();
  std::mt19937 rng_{20240611};
  cudaStream_t stream_ = nullptr;
  CachingAllocator allocator_;  // the 16-bit scratch's; outlives context_ (TearDown)
  LinearContext* context_ = nullptr;
};

TEST_P(CudaLinearTest, ForwardAndBackwardInBothLayouts) {
  for (WeightLayout layout : {WeightLayout::kOutIn, WeightLayout::kInOut}) {
    for (const auto& [alpha, beta] : {std::pair{1.0f, 1.0f}, std::pair{0.7f, -1.3f}}) {
      for (int64_t rows : {1, 3, 64}) {
        for (int64_t in : {1, 5, 128}) {
          for (int64_t out : {1, 8, 33, 128}) {
            const LinearShape s{rows, in, out, layout, alpha, beta};
            const std::string what = shape_name(s);
            check_forward(s, true, nullptr, false, 0, what + " bias");
            check_forward(s, false, nullptr, false, 0, what + " no bias");
            check_backward(s, true, true, true, GradWrite::kAdd, GradWrite::kAdd, 0, what + " add");
            check_backward(s, true, true, true, GradWrite::kOverwrite, GradWrite::kOverwrite, 0, what + " overwrite");
            if (HasFailure()) return;
          }
        }
      }
    }
  }
}

// Every activation, fused with and without `pre`, at shapes where cuBLASLt's GELU aux
// applies (out a multiple of 8, aligned pre) and where it does not.
TEST_P(CudaLinearTest, FusedActivations) {
  for (ActivationKind kind : check::kAllActivations) {
    const Activation act{kind, 0.05f};
    for (WeightLayout layout : {WeightLayout::kOutIn, WeightLayout::kInOut}) {
      for (const LinearShape& s : {LinearShape{7, 5, 33, layout, 0.9f, 1.0f}, LinearShape{16, 32, 64, layout},
                                   LinearShape{5, 3, 8, layout, 1.0f, 1.1f}}) {
        for (int64_t offset : {0, 1}) {
          const std::string what = check::kind_name(kind) + " " + shape_name(s) + " offset " + std::to_string(offset);
          for (bool bias : {true, false}) {
            check_forward(s, bias, &act, true, offset, what + (bias ? " bias" : "") + " with pre");
            check_forward(s, bias, &act, false, offset, what + (bias ? " bias" : "") + " without pre");
          }
          if (HasFailure()) return;
        }
      }
    }
  }
}

// 4-, 8- and 16-byte aligned buffers: the epilogues' alignment fallbacks, and cuBLASLt
// plans chosen for each alignment class (a plan for 256-byte pointers must not serve these).
TEST_P(CudaLinearTest, MisalignedBuffers) {
  const Activation gelu_tanh{ActivationKind::kGeluTanh}, relu{ActivationKind::kRelu};
  for (int64_t offset : {0, 1, 2, 4, 1, 0}) {  // back and forth through the plan cache
    for (WeightLayout layout : {WeightLayout::kOutIn, WeightLayout::kInOut}) {
      const LinearShape s{24, 40, 64, layout};
      const std::string what = shape_name(s) + " offset " + std::to_string(offset);
      check_forward(s, true, nullptr, false, offset, what);
      check_forward(s, true, &relu, false, offset, what + " relu");
      check_forward(s, true, &gelu_tanh, true, offset, what + " gelu-tanh with pre");
      check_backward(s, true, true, true, GradWrite::kOverwrite, GradWrite::kOverwrite, offset, what + " overwrite");
      check_backward(s, true, true, true, GradWrite::kAdd, GradWrite::kAdd, offset, what + " add");
      if (HasFailure()) return;
    }
  }
}

TEST_P(CudaLinearTest, SomeGradientsOnly) {
  for (WeightLayout layout : {WeightLayout::kOutIn, WeightLayout::kInOut}) {
    const LinearShape s{9, 17, 24, layout};
    for (GradWrite mode : {GradWrite::kAdd, GradWrite::kOverwrite}) {
      const std::string what = shape_name(s) + (mode == GradWrite::kAdd ? " add" : " overwrite");
      check_backward(s, false, true, false, mode, mode, 0, what + " dw");
      check_backward(s, false, false, true, mode, mode, 0, what + " db");
      check_backward(s, true, false, false, mode, mode, 0, what + " dx");
      check_backward(s, false, true, true, mode, GradWrite::kAdd, 0, what + " dw db");
    }
  }
}

// No rows leaves y alone; no input features give y = act(beta·b); no outputs is a no-op;
// overwritten gradients of an empty product are zero.
TEST_P(CudaLinearTest, EmptyShapes) {
  const Activation sigmoid{ActivationKind::kSigmoid};
  for (WeightLayout layout : {WeightLayout::kOutIn, WeightLayout::kInOut}) {
    for (const LinearShape& s :
         {LinearShape{0, 3, 2, layout}, LinearShape{4, 0, 3, layout, 1.0f, 0.5f}, LinearShape{4, 3, 0, layout}}) {
      const std::string what = shape_name(s);
      check_forward(s, true, nullptr, false, 0, what);
      check_forward(s, true, &sigmoid, true, 0, what + " sigmoid");
      check_backward(s, true, true, true, GradWrite::kAdd, GradWrite::kAdd, 0, what + " add");
      check_backward(s, true, true, true, GradWrite::kOverwrite, GradWrite::kOverwrite, 0, what + " overwrite");
    }
  }
}

// Sizes where cuBLASLt picks tensor-core kernels, split-K and its workspace.
TEST_P(CudaLinearTest, LargerLayers) {
  const Activation gelu_tanh{ActivationKind::kGeluTanh};
  for (WeightLayout layout : {WeightLayout::kOutIn, WeightLayout::kInOut}) {
    const LinearShape s{512, 1024, 256, layout};
    check_forward(s, true, &gelu_tanh, true, 0, shape_name(s) + " gelu-tanh");
    check_backward(s, true, true, true, GradWrite::kOverwrite, GradWrite::kOverwrite, 0, shape_name(s));
    const LinearShape k_heavy{8, 4096, 16, layout};
    check_forward(k_heavy, true, nullptr, false, 0, shape_name(k_heavy));
    check_backward(k_heavy, true, true, true, GradWrite::kAdd, GradWrite::kAdd, 0, shape_name(k_heavy));
  }
}

// Sizes that are not multiples of 8 (16-bit tensor-core kernels want them), a single row,
// a single feature, and k up to 1001, through the 16-bit copies' grow-only scratch: each
// shape smaller or larger than the one before. Offset 1 gives 4-byte aligned fp32 operands
// (the conversion's one-element path), offset 4 16-byte aligned ones with a tail.
TEST_P(CudaLinearTest, AwkwardSizes) {
  const Activation gelu_tanh{ActivationKind::kGeluTanh}, relu{ActivationKind::kRelu};
  const LinearShape shapes[] = {{1, 1, 1},      {1, 13, 7},    {3, 257, 9}, {17, 31, 1},
                                {29, 1001, 35}, {63, 67, 129}, {5, 3, 11}};
  for (WeightLayout layout : {WeightLayout::kOutIn, WeightLayout::kInOut}) {
    for (LinearShape s : shapes) {
      s.layout = layout;
      for (int64_t offset : {0, 1, 4}) {
        const std::string what = shape_name(s) + " offset " + std::to_string(offset);
        check_forward(s, true, nullptr, false, offset, what + " bias");
        check_forward(s, true, &gelu_tanh, true, offset, what + " gelu-tanh with pre");
        check_forward(s, false, &relu, false, offset, what + " relu");
        check_backward(s, true, true, true, GradWrite::kOverwrite, GradWrite::kOverwrite, offset, what + " overwrite");
        check_backward(s, true, true, true, GradWrite::kAdd, GradWrite::kAdd, offset, what + " add");
        if (HasFailure()) return;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaLinearTest,
                         ::testing::Values(Precision::kFp32, Precision::kTf32, Precision::kBf16, Precision::kFp16),
                         [](const ::testing::TestParamInfo<Precision>& info) {
                           std::string name = precision_name(info.param);
                           name[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(name[0])));
                           return name;
                         });

}  // namespace
}  // namespace pipeshard::cuda
