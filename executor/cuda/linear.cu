// Linear through cuBLASLt (launchers.h: linear_forward, linear_backward), the CPU
// backend's semantics (cpu_backend.cc) with the bias and the activation fused into the
// GEMM's epilogue where cuBLASLt has one that computes what the CPU computes.
//
// Row-major through a column-major library. A row-major M [r, c] (leading dimension c)
// is, byte for byte, the column-major Mᵀ [c, r] with the same leading dimension. So each
// row-major product P = Q·R is computed as its transpose, Pᵀ = Rᵀ·Qᵀ, which cuBLASLt
// reads and writes in place as D = op(A)·op(B): no matrix is ever copied. With W' = Wᵀ
// for kOutIn ([out, in]) and W for kInOut ([in, out]), so that y = x·W':
//
//   product               column-major D = op(A)·op(B)        m, n, k         A (op, ld)    B (op, ld)
//   y  = x·W'             Yᵀ [out,rows] = W'ᵀ · Xᵀ            out, rows, in   w  kOutIn T,in   x  N, in
//                                                                              w  kInOut N,out
//   dx = dy·W'ᵀ           dXᵀ [in,rows] = W' · dYᵀ            in, rows, out   w  kOutIn N,in   dy N, out
//                                                                              w  kInOut T,out
//   dw = dyᵀ·x  [out,in]  dWᵀ [in,out]  = Xᵀ · dY             in, out, rows   x  N, in         dy T, out
//   dw = xᵀ·dy  [in,out]  dWᵀ [out,in]  = dYᵀ · X             out, in, rows   dy N, out        x  T, in
//
// D's leading dimension is always m. Epilogues (cuBLASLt applies them to D, per row of D,
// which is per output feature here):
// - forward: BIAS when b is given, beta == 1 (cuBLASLt's bias has no scale) and b is
//   16-byte aligned; RELU(_BIAS) when the activation is ReLU and nobody wants `pre`
//   (RELU_AUX saves a bit mask, not the pre-activation values backward reads; and
//   cuBLASLt's max(x, 0) may turn a NaN into 0 where the CPU keeps it, so training, which
//   always keeps `pre`, never meets that difference);
//   GELU(_BIAS), or GELU_AUX(_BIAS) writing `pre`, for kGeluTanh in TF32 mode only (see
//   gelu_epilogue_allowed). Everything else — exact GELU, sigmoid, tanh, SiLU, leaky ReLU,
//   a scaled or misaligned bias — runs in bias_activation_kernel after the GEMM.
// - backward: db = Σ_rows dy through BGRADB (kOutIn: dy is B) or BGRADA (kInOut: dy is A)
//   of the dw GEMM, when the gradients are overwritten (the epilogue writes, it cannot
//   add), alpha == beta == 1 and db is 16-byte aligned; otherwise column_sum_kernel. The
//   activation's own backward is a separate Backend call, so DRELU/DGELU do not apply.
// Any epilogue cuBLASLt declines (no algorithm for the shape and alignments) falls back to
// the plain GEMM and the kernels, so an epilogue is only ever an optimisation.
//
// Alignment. Nothing is assumed beyond float alignment: pointers into the middle of
// buffers (micro-batch slices, tensor-parallel blocks) are common. cuBLASLt is told each
// pointer's actual alignment (its heuristic otherwise assumes 256 bytes), plans are cached
// per alignment class, and a plain TF32 GEMM that has no kernel at the given alignment
// runs in fp32 instead.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <string>

#include "common/status.h"
#include "executor/cuda/cuda_check.h"
#include "executor/cuda/launchers.h"

namespace pipeshard::cuda {

// ---- cuBLASLt plans ----

namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;
// Epilogue pointers (bias, aux) are fused only at this alignment: the one cuBLASLt's
// epilogue kernels load vectors at. Below it we take the plain GEMM and our kernels.
constexpr uint32_t kEpilogueAlignment = 16;
// CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD for GELU input matrices: a multiple of 8 elements.
constexpr int64_t kGeluAuxLdMultiple = 8;

// The largest power of two up to 256 that divides the address: what cuBLASLt's
// CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES call a buffer's alignment (default 256).
uint32_t alignment_of(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

// D[m, n] = alpha·op(A)[m, k]·op(B)[k, n] + beta·D, column-major (see the table above).
struct GemmShape {
  int64_t m = 0, n = 0, k = 0;
  cublasOperation_t trans_a = CUBLAS_OP_N, trans_b = CUBLAS_OP_N;
  int64_t lda = 0, ldb = 0, ldd = 0;
};

struct Epilogue {
  cublasLtEpilogue_t kind = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;  // BIAS: the bias [m]; BGRADA: db [m]; BGRADB: db [n]
  void* aux = nullptr;         // GELU_AUX: the pre-activation values, [m, n] with ld aux_ld
  int64_t aux_ld = 0;
};

// Shape, transposes, leading dimensions, epilogue and the alignment of every pointer:
// cuBLASLt's heuristic picks kernels for the alignments it is told, so a plan is only
// valid for pointers aligned alike.
using PlanKey = std::array<int64_t, 15>;

PlanKey plan_key(const GemmShape& g, const Epilogue& e, const void* a, const void* b, const void* d) {
  return {g.m, g.n, g.k, g.trans_a, g.trans_b, g.lda, g.ldb, g.ldd, e.kind, e.aux_ld,
          alignment_of(a), alignment_of(b), alignment_of(d),
          e.bias ? alignment_of(e.bias) : 0, e.aux ? alignment_of(e.aux) : 0};
}

// A matmul descriptor, its layouts and the algorithm cuBLASLt's heuristic chose for them.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;  // C is D (in place)
  cublasLtMatmulAlgo_t algo{};
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  bool supported = false;  // false: cuBLASLt has no algorithm for it (an epilogue declined)

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() { clear(); }
  void clear() {
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
    desc = nullptr, a = b = d = nullptr;
    supported = false;
  }
};

}  // namespace

struct LinearContext {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;  // kWorkspaceBytes of device memory, for every GEMM in turn (one stream)
  bool tf32 = false;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  std::map<PlanKey, Plan> plans;
};

namespace {

std::string describe(const GemmShape& g, const Epilogue& e) {
  return "m=" + std::to_string(g.m) + " n=" + std::to_string(g.n) + " k=" + std::to_string(g.k) +
         " transa=" + std::to_string(g.trans_a) + " transb=" + std::to_string(g.trans_b) +
         " lda=" + std::to_string(g.lda) + " ldb=" + std::to_string(g.ldb) + " ldd=" + std::to_string(g.ldd) +
         " epilogue=" + std::to_string(e.kind);
}

template <typename T>
void set_attribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute, const T& value) {
  PIPESHARD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value)));
}

// The pointers change from call to call; their alignment class does not (it is in the key).
void set_epilogue_pointers(cublasLtMatmulDesc_t desc, const Epilogue& e) {
  if (e.bias != nullptr) set_attribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, e.bias);
  if (e.aux != nullptr) set_attribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, e.aux);
}

// Statuses by which cuBLASLt declines an epilogue it has no kernel for.
bool declined(cublasStatus_t status) {
  return status == CUBLAS_STATUS_NOT_SUPPORTED || status == CUBLAS_STATUS_INVALID_VALUE;
}

// Creates the plan's descriptors and asks cuBLASLt's heuristic for an algorithm; false
// when it has none for this epilogue, these alignments, this compute type.
bool build_plan(LinearContext& c, Plan& plan, cublasComputeType_t compute, const GemmShape& g, const Epilogue& e,
                const void* a, const void* b, const void* d) {
  plan.compute = compute;
  PIPESHARD_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan.desc, compute, CUDA_R_32F));
  set_attribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, static_cast<int32_t>(g.trans_a));
  set_attribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, static_cast<int32_t>(g.trans_b));
  set_attribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, static_cast<uint32_t>(e.kind));
  set_epilogue_pointers(plan.desc, e);  // the heuristic reads their alignment
  if (e.aux != nullptr) set_attribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, e.aux_ld);
  // Stored (before op) dimensions: op(A) is [m, k], op(B) is [k, n].
  const bool ta = g.trans_a != CUBLAS_OP_N, tb = g.trans_b != CUBLAS_OP_N;
  PIPESHARD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.a, CUDA_R_32F, ta ? g.k : g.m, ta ? g.m : g.k, g.lda));
  PIPESHARD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.b, CUDA_R_32F, tb ? g.n : g.k, tb ? g.k : g.n, g.ldb));
  PIPESHARD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.d, CUDA_R_32F, g.m, g.n, g.ldd));

  cublasLtMatmulPreference_t preference = nullptr;
  PIPESHARD_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference));
  const uint64_t workspace = kWorkspaceBytes;
  PIPESHARD_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                              &workspace, sizeof(workspace)));
  const uint32_t alignments[] = {alignment_of(a), alignment_of(b), alignment_of(d), alignment_of(d)};
  const cublasLtMatmulPreferenceAttributes_t attributes[] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i) {
    PIPESHARD_CUBLAS_CHECK(
        cublasLtMatmulPreferenceSetAttribute(preference, attributes[i], &alignments[i], sizeof(alignments[i])));
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(c.handle, plan.desc, plan.a, plan.b, plan.d, plan.d,
                                                               preference, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(preference);
  if (declined(status)) return false;
  PIPESHARD_CHECK(status == CUBLAS_STATUS_SUCCESS, std::string("cublasLtMatmulAlgoGetHeuristic: ") +
                                                       cublasLtGetStatusString(status) + " for " + describe(g, e));
  if (found == 0 || result.state != CUBLAS_STATUS_SUCCESS) return false;
  plan.algo = result.algo;
  return true;
}

// A plain GEMM that TF32 cannot do (tensor-core kernels want aligned data) runs in fp32,
// which is more precise and has kernels for every alignment.
void make_fp32_plan(LinearContext& c, Plan& plan, const GemmShape& g, const Epilogue& e, const void* a,
                    const void* b, const void* d) {
  plan.clear();
  plan.supported = build_plan(c, plan, CUBLAS_COMPUTE_32F, g, e, a, b, d);
  PIPESHARD_CHECK(plan.supported, "cuBLASLt has no algorithm for " + describe(g, e));
}

// A plan for this GEMM with the context's compute type, or in fp32 (above). An epilogue
// nobody has a kernel for leaves the plan unsupported.
void make_plan(LinearContext& c, Plan& plan, const GemmShape& g, const Epilogue& e, const void* a, const void* b,
               const void* d) {
  plan.supported = build_plan(c, plan, c.compute, g, e, a, b, d);
  if (!plan.supported && e.kind == CUBLASLT_EPILOGUE_DEFAULT) make_fp32_plan(c, plan, g, e, a, b, d);
}

cublasStatus_t run_plan(LinearContext& c, const Plan& plan, const float* a, const float* b, float* d, float alpha,
                        float beta, cudaStream_t stream) {
  return cublasLtMatmul(c.handle, plan.desc, &alpha, a, plan.a, b, plan.b, &beta, d, plan.d, d, plan.d, &plan.algo,
                        c.workspace, kWorkspaceBytes, stream);
}

// D = alpha·op(A)·op(B) + beta·D with the epilogue. False when cuBLASLt declines the
// epilogue (then nothing ran); a plain GEMM (DEFAULT) never returns false.
bool gemm(LinearContext& c, const GemmShape& g, const float* a, const float* b, float* d, float alpha, float beta,
          const Epilogue& e, cudaStream_t stream) {
  auto [it, created] = c.plans.try_emplace(plan_key(g, e, a, b, d));
  Plan& plan = it->second;
  if (created) make_plan(c, plan, g, e, a, b, d);
  if (!plan.supported) return false;
  set_epilogue_pointers(plan.desc, e);
  cublasStatus_t status = run_plan(c, plan, a, b, d, alpha, beta, stream);
  if (declined(status) && e.kind != CUBLASLT_EPILOGUE_DEFAULT) {
    plan.supported = false;  // and the caller falls back, now and for every later call
    return false;
  }
  if (declined(status) && plan.compute != CUBLAS_COMPUTE_32F) {  // the heuristic promised too much
    make_fp32_plan(c, plan, g, e, a, b, d);
    status = run_plan(c, plan, a, b, d, alpha, beta, stream);
  }
  PIPESHARD_CHECK(status == CUBLAS_STATUS_SUCCESS,
                  std::string("cublasLtMatmul: ") + cublasLtGetStatusString(status) + " for " + describe(g, e));
  return true;
}

void plain_gemm(LinearContext& c, const GemmShape& g, const float* a, const float* b, float* d, float alpha,
                float beta, cudaStream_t stream) {
  gemm(c, g, a, b, d, alpha, beta, Epilogue{}, stream);
}

// ---- the products of the table at the top ----

GemmShape forward_shape(const LinearShape& s) {
  const bool out_in = s.layout == WeightLayout::kOutIn;
  GemmShape g;
  g.m = s.out, g.n = s.rows, g.k = s.in;
  g.trans_a = out_in ? CUBLAS_OP_T : CUBLAS_OP_N, g.lda = out_in ? s.in : s.out;
  g.trans_b = CUBLAS_OP_N, g.ldb = s.in;
  g.ldd = s.out;
  return g;
}

GemmShape input_grad_shape(const LinearShape& s) {
  const bool out_in = s.layout == WeightLayout::kOutIn;
  GemmShape g;
  g.m = s.in, g.n = s.rows, g.k = s.out;
  g.trans_a = out_in ? CUBLAS_OP_N : CUBLAS_OP_T, g.lda = out_in ? s.in : s.out;
  g.trans_b = CUBLAS_OP_N, g.ldb = s.out;
  g.ldd = s.in;
  return g;
}

// kOutIn: A = x, B = dy. kInOut: A = dy, B = x.
GemmShape weight_grad_shape(const LinearShape& s) {
  const bool out_in = s.layout == WeightLayout::kOutIn;
  GemmShape g;
  g.m = out_in ? s.in : s.out, g.n = out_in ? s.out : s.in, g.k = s.rows;
  g.trans_a = CUBLAS_OP_N, g.lda = g.m;
  g.trans_b = CUBLAS_OP_T, g.ldb = g.n;
  g.ldd = g.m;
  return g;
}

// ---- kernels: what no epilogue does ----

// The CPU backend's formulas (cpu_backend.cc), term by term.
struct Identity {
  __device__ float operator()(float x) const { return x; }
};
struct Relu {
  __device__ float operator()(float x) const { return x < 0.0f ? 0.0f : x; }  // NaN propagates
};
struct LeakyRelu {
  float slope;
  __device__ float operator()(float x) const { return x > 0.0f ? x : x * slope; }
};
struct Sigmoid {
  __device__ float operator()(float x) const { return 1.0f / (1.0f + expf(-x)); }
};
struct Tanh {
  __device__ float operator()(float x) const { return tanhf(x); }
};
struct Gelu {  // exact: x·Φ(x)
  __device__ float operator()(float x) const { return x * 0.5f * (1.0f + erff(x * 0.70710678118654752440f)); }
};
struct GeluTanh {  // 0.5x(1 + tanh(√(2/π)(x + 0.044715x³)))
  __device__ float operator()(float x) const {
    const float inner = 0.79788456080286535588f * (x + 0.044715f * (x * x * x));
    return 0.5f * x * (1.0f + tanhf(inner));
  }
};
struct Silu {
  __device__ float operator()(float x) const { return x / (1.0f + expf(-x)); }
};

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;  // grid-stride loops cover the rest

int blocks_for(int64_t n) { return static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks)); }

// y[rows, width] = act(src + beta·b) elementwise; pre (or null) receives src + beta·b.
// src may be y or pre (each element is read before it is written, by the same thread).
// The bias is added unfused (round, then add), as the CPU does.
template <typename Act>
__global__ void bias_activation_kernel(float* y, float* pre, const float* src, const float* b, float beta,
                                       int64_t rows, int64_t width, Act act) {
  const int64_t n = rows * width;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    float v = src[i];
    if (b != nullptr) v = __fadd_rn(v, __fmul_rn(beta, b[i % width]));
    if (pre != nullptr) pre[i] = v;
    y[i] = act(v);
  }
}

template <typename Act>
void launch_bias_activation(float* y, float* pre, const float* src, const float* b, float beta, int64_t rows,
                            int64_t width, Act act, cudaStream_t stream) {
  bias_activation_kernel<<<blocks_for(rows * width), kThreads, 0, stream>>>(y, pre, src, b, beta, rows, width, act);
  PIPESHARD_CUDA_LAUNCHED();
}

void bias_activation(float* y, float* pre, const float* src, const float* b, float beta, int64_t rows, int64_t width,
                     const Activation* act, cudaStream_t stream) {
  if (rows * width == 0) return;
  if (act == nullptr) return launch_bias_activation(y, nullptr, src, b, beta, rows, width, Identity{}, stream);
  switch (act->kind) {
    case ActivationKind::kRelu: return launch_bias_activation(y, pre, src, b, beta, rows, width, Relu{}, stream);
    case ActivationKind::kLeakyRelu:
      return launch_bias_activation(y, pre, src, b, beta, rows, width, LeakyRelu{act->alpha}, stream);
    case ActivationKind::kSigmoid: return launch_bias_activation(y, pre, src, b, beta, rows, width, Sigmoid{}, stream);
    case ActivationKind::kTanh: return launch_bias_activation(y, pre, src, b, beta, rows, width, Tanh{}, stream);
    case ActivationKind::kGelu: return launch_bias_activation(y, pre, src, b, beta, rows, width, Gelu{}, stream);
    case ActivationKind::kGeluTanh:
      return launch_bias_activation(y, pre, src, b, beta, rows, width, GeluTanh{}, stream);
    case ActivationKind::kSilu: return launch_bias_activation(y, pre, src, b, beta, rows, width, Silu{}, stream);
  }
  PIPESHARD_CHECK(false, "unknown activation kind " + std::to_string(static_cast<int>(act->kind)));
}

// db[width] = (or +=) beta · Σ_rows dy[rows, width]. A block owns kColumns columns;
// kRowLanes threads per column each sum every kRowLanes-th row, then one adds the lanes
// in order: the result does not depend on timing (no atomics).
constexpr int kColumns = 32, kRowLanes = 8;

__global__ void column_sum_kernel(float* db, const float* dy, int64_t rows, int64_t width, float beta,
                                  bool overwrite) {
  __shared__ float partial[kRowLanes][kColumns];
  const int64_t column = blockIdx.x * int64_t{kColumns} + threadIdx.x;
  float sum = 0.0f;
  if (column < width) {
    for (int64_t r = threadIdx.y; r < rows; r += kRowLanes) sum += dy[r * width + column];
  }
  partial[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y != 0 || column >= width) return;
  float total = 0.0f;
  for (int lane = 0; lane < kRowLanes; ++lane) total += partial[lane][threadIdx.x];
  const float scaled = beta * total;
  db[column] = overwrite ? scaled : db[column] + scaled;
}

void column_sum(float* db, const float* dy, int64_t rows, int64_t width, float beta, bool overwrite,
                cudaStream_t stream) {
  if (width == 0) return;
  const int64_t blocks = (width + kColumns - 1) / kColumns;
  PIPESHARD_CHECK(blocks <= INT32_MAX, "bias gradient of " + std::to_string(width) + " features");
  column_sum_kernel<<<static_cast<unsigned>(blocks), dim3(kColumns, kRowLanes), 0, stream>>>(db, dy, rows, width, beta,
                                                                                           overwrite);
  PIPESHARD_CUDA_LAUNCHED();
}

void zero(float* p, int64_t n, cudaStream_t stream) {
  if (p == nullptr || n <= 0) return;
  PIPESHARD_CUDA_CHECK(cudaMemsetAsync(p, 0, sizeof(float) * static_cast<size_t>(n), stream));
}

bool aligned_for_epilogue(const void* p) { return alignment_of(p) >= kEpilogueAlignment; }

void check_shape(const LinearShape& s) {
  PIPESHARD_CHECK(s.rows >= 0 && s.in >= 0 && s.out >= 0, "linear shape rows=" + std::to_string(s.rows) +
                                                              " in=" + std::to_string(s.in) +
                                                              " out=" + std::to_string(s.out));
}

// ---- forward ----

// How one forward runs: the GEMM into `gemm_out` with `epilogue`, then, when `kernel`,
// bias_activation_kernel from gemm_out with what the epilogue did not do.
struct ForwardPlan {
  float* gemm_out = nullptr;
  Epilogue epilogue;
  bool kernel = false;
  const float* kernel_bias = nullptr;
  float* kernel_pre = nullptr;
};

// cuBLASLt's GELU epilogue is the tanh form (so never kGelu), evaluated, as far as we can
// tell, with the hardware's approximate tanh (relative error ~2^-11). That is below a TF32
// GEMM's own rounding but fifty times the 1e-5 that fp32 results are held to against the
// CPU (tests/backend_check.h), so fp32 mode computes GELU-tanh in our kernel (tanhf).
bool gelu_epilogue_allowed(const LinearContext& c) { return c.tf32; }

// Everything after a plain GEMM (or one with the bias epilogue when `bias_fused`).
ForwardPlan unfused_forward(float* y, const float* b, const Activation* act, float* pre, bool bias_fused) {
  ForwardPlan p;
  const bool keep_pre = act != nullptr && pre != nullptr;
  p.gemm_out = keep_pre ? pre : y;
  if (bias_fused && b != nullptr) p.epilogue = Epilogue{CUBLASLT_EPILOGUE_BIAS, b};
  p.kernel_bias = bias_fused ? nullptr : b;
  p.kernel_pre = keep_pre ? pre : nullptr;
  p.kernel = act != nullptr || p.kernel_bias != nullptr;
  return p;
}

ForwardPlan plan_forward(const LinearContext& c, const LinearShape& s, float* y, const float* b,
                         const Activation* act, float* pre) {
  const bool bias_fusable = b == nullptr || (s.beta == 1.0f && aligned_for_epilogue(b));
  if (!bias_fusable) return unfused_forward(y, b, act, pre, false);
  ForwardPlan p;
  p.gemm_out = y;
  p.epilogue.bias = b;
  if (act == nullptr) {
    p.epilogue.kind = b ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    return p;
  }
  if (act->kind == ActivationKind::kRelu && pre == nullptr) {
    p.epilogue.kind = b ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_RELU;
    return p;
  }
  if (act->kind == ActivationKind::kGeluTanh && gelu_epilogue_allowed(c)) {
    if (pre == nullptr) {
      p.epilogue.kind = b ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
      return p;
    }
    // pre [rows, out] is the column-major aux [out, rows] with ld = out.
    if (s.out % kGeluAuxLdMultiple == 0 && aligned_for_epilogue(pre)) {
      p.epilogue.kind = b ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
      p.epilogue.aux = pre;
      p.epilogue.aux_ld = s.out;
      return p;
    }
  }
  return unfused_forward(y, b, act, pre, true);
}

}  // namespace

LinearContext* create_linear_context(bool tf32) {
  auto* c = new LinearContext;
  c->tf32 = tf32;
  c->compute = tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  PIPESHARD_CUBLAS_CHECK(cublasLtCreate(&c->handle));
  PIPESHARD_CUDA_CHECK(cudaMalloc(&c->workspace, kWorkspaceBytes));
  return c;
}

void destroy_linear_context(LinearContext* context) {
  if (context == nullptr) return;
  context->plans.clear();
  cudaFree(context->workspace);  // waits for the GEMMs that still use it
  cublasLtDestroy(context->handle);
  delete context;
}

void linear_forward(LinearContext* context, float* y, const float* x, const float* w, const float* b,
                    const LinearShape& s, const Activation* epilogue, float* pre, cudaStream_t stream) {
  check_shape(s);
  if (s.rows == 0 || s.out == 0) return;
  if (s.in == 0) {  // y = beta·b, then the activation: nothing to multiply
    zero(y, s.rows * s.out, stream);
    if (b != nullptr || epilogue != nullptr) bias_activation(y, pre, y, b, s.beta, s.rows, s.out, epilogue, stream);
    return;
  }
  const GemmShape g = forward_shape(s);
  ForwardPlan p = plan_forward(*context, s, y, b, epilogue, pre);
  if (!gemm(*context, g, w, x, p.gemm_out, s.alpha, 0.0f, p.epilogue, stream)) {
    p = unfused_forward(y, b, epilogue, pre, false);
    plain_gemm(*context, g, w, x, p.gemm_out, s.alpha, 0.0f, stream);
  }
  if (p.kernel) {
    bias_activation(y, p.kernel_pre, p.gemm_out, p.kernel_bias, s.beta, s.rows, s.out, epilogue, stream);
  }
}

void linear_backward(LinearContext* context, float* dx, float* dw, float* db, const float* dy, const float* x,
                     const float* w, const LinearShape& s, GradWrite param_grads, GradWrite input_grad,
                     cudaStream_t stream) {
  check_shape(s);
  const bool overwrite_params = param_grads == GradWrite::kOverwrite;
  const bool overwrite_input = input_grad == GradWrite::kOverwrite;
  if (s.rows == 0 || s.out == 0) {  // no products: overwritten gradients are zero
    if (overwrite_params) {
      zero(db, s.out, stream);
      zero(dw, s.in * s.out, stream);
    }
    if (overwrite_input) zero(dx, s.rows * s.in, stream);
    return;
  }
  if (dx != nullptr && s.in > 0) {
    plain_gemm(*context, input_grad_shape(s), w, dy, dx, s.alpha, overwrite_input ? 0.0f : 1.0f, stream);
  }
  bool db_done = false;
  if (dw != nullptr && s.in > 0) {
    const bool out_in = s.layout == WeightLayout::kOutIn;
    const GemmShape g = weight_grad_shape(s);
    const float* a = out_in ? x : dy;
    const float* b = out_in ? dy : x;
    const float param_beta = overwrite_params ? 0.0f : 1.0f;
    // The bias-gradient epilogue writes Σ dy: it cannot add or scale by beta, and whether
    // alpha scales it is not documented, so it runs only where neither matters.
    if (db != nullptr && overwrite_params && s.alpha == 1.0f && s.beta == 1.0f && aligned_for_epilogue(db)) {
      const Epilogue e{out_in ? CUBLASLT_EPILOGUE_BGRADB : CUBLASLT_EPILOGUE_BGRADA, db};
      db_done = gemm(*context, g, a, b, dw, s.alpha, param_beta, e, stream);
    }
    if (!db_done) plain_gemm(*context, g, a, b, dw, s.alpha, param_beta, stream);
  }
  if (db != nullptr && !db_done) column_sum(db, dy, s.rows, s.out, s.beta, overwrite_params, stream);
}

}  // namespace pipeshard::cuda
