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
//   GELU(_BIAS), or GELU_AUX(_BIAS) writing `pre`, for kGeluTanh in TF32, bf16 and fp16
//   modes, not fp32 (see gelu_epilogue_allowed). Everything else — exact GELU, sigmoid,
//   tanh, SiLU, leaky ReLU, a scaled or misaligned bias — runs in bias_activation_kernel
//   after the GEMM.
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
//
// Precision (create_linear_context). fp32: CUBLAS_COMPUTE_32F. TF32: the same fp32 buffers
// with CUBLAS_COMPUTE_32F_FAST_TF32. bf16 and fp16 ("fp32 master weights, 16-bit compute
// with fp32 accumulation"): every Backend buffer stays fp32; each call first rounds the
// GEMM operands it multiplies (x and W forward; dy, and W for dx, x for dw backward; each
// at most once per call) to nearest even into 16-bit copies (convert.cu), kept in
// grow-only scratch from the backend's caching allocator, 256-byte aligned; cuBLASLt then
// multiplies A/B = CUDA_R_16BF or CUDA_R_16F with CUBLAS_COMPUTE_32F and scale type
// CUDA_R_32F into the same fp32 C/D as before (alpha, beta, epilogues and alignment
// handling unchanged; the bias, its gradient and GELU's aux stay fp32). A result therefore
// differs from fp32 mode's only by the operands' rounding (2^-8 relative for bf16, 2^-11
// for fp16, whose range ends at 65504: larger values become inf, which the trainer's loss
// scaling must avoid) and the order of the fp32 sums. Where the BGRAD epilogue computes db,
// it sums the rounded dy; column_sum_kernel sums the fp32 dy. A plain GEMM for which
// cuBLASLt has no 16-bit kernel runs in fp32 on the unrounded buffers. The copies cost
// one read of each fp32 operand and a write of half its size per call.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <string>

#include "backend/cuda/allocator.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launchers.h"
#include "backend/math/elementwise_math.cuh"
#include "common/status.h"

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

// Shape, transposes, leading dimensions, epilogue, the element type of A and B, and the
// alignment of every pointer: cuBLASLt's heuristic picks kernels for the alignments it is
// told, so a plan is only valid for pointers aligned alike.
using PlanKey = std::array<int64_t, 16>;

PlanKey plan_key(const GemmShape& g, const Epilogue& e, cudaDataType_t input_type, const void* a, const void* b,
                 const void* d) {
  return {g.m,
          g.n,
          g.k,
          g.trans_a,
          g.trans_b,
          g.lda,
          g.ldb,
          g.ldd,
          e.kind,
          e.aux_ld,
          input_type,
          alignment_of(a),
          alignment_of(b),
          alignment_of(d),
          e.bias ? alignment_of(e.bias) : 0,
          e.aux ? alignment_of(e.aux) : 0};
}

// A matmul descriptor, its layouts and the algorithm cuBLASLt's heuristic chose for them.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;  // C is D (in place)
  cublasLtMatmulAlgo_t algo{};
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  cudaDataType_t input_type = CUDA_R_32F;  // of A and B; C and D are always CUDA_R_32F
  bool supported = false;                  // false: cuBLASLt has no algorithm for it (an epilogue declined)

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

// The GEMM operands that bf16/fp16 mode rounds to 16-bit copies, one scratch slot each.
enum class Operand { kX, kW, kDy };
constexpr size_t kOperands = 3;

// A grow-only 16-bit buffer from the backend's allocator: 256-byte aligned (whole
// cudaMalloc blocks), reallocated only when a larger operand comes, so after the first
// step no call allocates.
struct Scratch16 {
  uint16_t* data = nullptr;
  int64_t capacity = 0;  // elements
};

struct LinearContext {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;  // kWorkspaceBytes of device memory, for every GEMM in turn (one stream)
  Precision precision = Precision::kFp32;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;  // for fp32 operands: CUBLAS_COMPUTE_32F or _FAST_TF32
  cudaDataType_t low_type = CUDA_R_32F;              // bf16/fp16 mode: CUDA_R_16BF / CUDA_R_16F
  CachingAllocator* allocator = nullptr;
  std::array<Scratch16, kOperands> copies;  // indexed by Operand
  std::map<PlanKey, Plan> plans;
};

namespace {

std::string describe(const GemmShape& g, const Epilogue& e, cudaDataType_t input_type) {
  return "A/B type " + std::to_string(input_type) + " m=" + std::to_string(g.m) + " n=" + std::to_string(g.n) +
         " k=" + std::to_string(g.k) + " transa=" + std::to_string(g.trans_a) + " transb=" + std::to_string(g.trans_b) +
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
//
// A and B are `input_type` (CUDA_R_32F, or CUDA_R_16BF / CUDA_R_16F in bf16/fp16 mode), C
// and D are always CUDA_R_32F, the scale type (alpha, beta) CUDA_R_32F. cuBLASLt lists both
// 16-bit combinations with CUBLAS_COMPUTE_32F (fp32 accumulation) among cublasLtMatmul's
// supported types. The epilogues' vectors stay fp32: the bias and bias-gradient type
// defaults to D's type (cublasLt.h, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE; we set it to
// CUDA_R_32F explicitly for 16-bit inputs so that no default can surprise us), and the GELU
// aux matrix is D's type (CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, left at its default).
bool build_plan(LinearContext& c, Plan& plan, cublasComputeType_t compute, cudaDataType_t input_type,
                const GemmShape& g, const Epilogue& e, const void* a, const void* b, const void* d) {
  plan.compute = compute;
  plan.input_type = input_type;
  PIPESHARD_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan.desc, compute, CUDA_R_32F));
  set_attribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, static_cast<int32_t>(g.trans_a));
  set_attribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, static_cast<int32_t>(g.trans_b));
  set_attribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, static_cast<uint32_t>(e.kind));
  set_epilogue_pointers(plan.desc, e);  // the heuristic reads their alignment
  if (e.aux != nullptr) set_attribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, e.aux_ld);
  if (e.bias != nullptr && input_type != CUDA_R_32F) {
    set_attribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, static_cast<int32_t>(CUDA_R_32F));
  }
  // Stored (before op) dimensions: op(A) is [m, k], op(B) is [k, n].
  const bool ta = g.trans_a != CUBLAS_OP_N, tb = g.trans_b != CUBLAS_OP_N;
  PIPESHARD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.a, input_type, ta ? g.k : g.m, ta ? g.m : g.k, g.lda));
  PIPESHARD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.b, input_type, tb ? g.n : g.k, tb ? g.k : g.n, g.ldb));
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
                                                       cublasLtGetStatusString(status) + " for " +
                                                       describe(g, e, input_type));
  if (found == 0 || result.state != CUBLAS_STATUS_SUCCESS) return false;
  plan.algo = result.algo;
  return true;
}

// A plain fp32-input GEMM that TF32 cannot do (tensor-core kernels want aligned data) runs
// in fp32, which is more precise and has kernels for every alignment.
void make_fp32_plan(LinearContext& c, Plan& plan, const GemmShape& g, const Epilogue& e, const void* a, const void* b,
                    const void* d) {
  plan.clear();
  plan.supported = build_plan(c, plan, CUBLAS_COMPUTE_32F, CUDA_R_32F, g, e, a, b, d);
  PIPESHARD_CHECK(plan.supported, "cuBLASLt has no algorithm for " + describe(g, e, CUDA_R_32F));
}

// A plan for this GEMM: fp32 inputs with the context's compute type, or in fp32 (above);
// 16-bit inputs with fp32 accumulation. An epilogue nobody has a kernel for, or 16-bit
// inputs without one, leave the plan unsupported.
void make_plan(LinearContext& c, Plan& plan, cudaDataType_t input_type, const GemmShape& g, const Epilogue& e,
               const void* a, const void* b, const void* d) {
  const cublasComputeType_t compute = input_type == CUDA_R_32F ? c.compute : CUBLAS_COMPUTE_32F;
  plan.supported = build_plan(c, plan, compute, input_type, g, e, a, b, d);
  if (!plan.supported && e.kind == CUBLASLT_EPILOGUE_DEFAULT && input_type == CUDA_R_32F) {
    make_fp32_plan(c, plan, g, e, a, b, d);
  }
}

cublasStatus_t run_plan(LinearContext& c, const Plan& plan, const void* a, const void* b, float* d, float alpha,
                        float beta, cudaStream_t stream) {
  return cublasLtMatmul(c.handle, plan.desc, &alpha, a, plan.a, b, plan.b, &beta, d, plan.d, d, plan.d, &plan.algo,
                        c.workspace, kWorkspaceBytes, stream);
}

// D = alpha·op(A)·op(B) + beta·D with the epilogue, A and B of `input_type`. False when
// cuBLASLt declines the epilogue, or has no kernel for 16-bit inputs (then nothing ran);
// a plain GEMM (DEFAULT) on fp32 inputs never returns false.
bool gemm(LinearContext& c, const GemmShape& g, cudaDataType_t input_type, const void* a, const void* b, float* d,
          float alpha, float beta, const Epilogue& e, cudaStream_t stream) {
  auto [it, created] = c.plans.try_emplace(plan_key(g, e, input_type, a, b, d));
  Plan& plan = it->second;
  if (created) make_plan(c, plan, input_type, g, e, a, b, d);
  if (!plan.supported) return false;
  set_epilogue_pointers(plan.desc, e);
  cublasStatus_t status = run_plan(c, plan, a, b, d, alpha, beta, stream);
  if (declined(status) && (e.kind != CUBLASLT_EPILOGUE_DEFAULT || input_type != CUDA_R_32F)) {
    plan.supported = false;  // and the caller falls back, now and for every later call
    return false;
  }
  if (declined(status) && plan.compute != CUBLAS_COMPUTE_32F) {  // the heuristic promised too much
    make_fp32_plan(c, plan, g, e, a, b, d);
    status = run_plan(c, plan, a, b, d, alpha, beta, stream);
  }
  PIPESHARD_CHECK(status == CUBLAS_STATUS_SUCCESS, std::string("cublasLtMatmul: ") + cublasLtGetStatusString(status) +
                                                       " for " + describe(g, e, input_type));
  return true;
}

// The operands of one product: the fp32 buffers and, in bf16/fp16 mode, their 16-bit copies.
struct Operands {
  const float* a = nullptr;
  const float* b = nullptr;
  const uint16_t* a16 = nullptr;  // null in fp32/TF32 mode
  const uint16_t* b16 = nullptr;
};

// D = alpha·op(A)·op(B) + beta·D with the epilogue, in the context's precision: on the
// 16-bit copies when there are some, else on the fp32 buffers. False when cuBLASLt declines
// the epilogue (then nothing ran). A plain GEMM always runs: should cuBLASLt have no 16-bit
// kernel for it, it runs in fp32 on the unrounded buffers (more precise, never less).
bool product(LinearContext& c, const GemmShape& g, const Operands& o, float* d, float alpha, float beta,
             const Epilogue& e, cudaStream_t stream) {
  if (o.a16 == nullptr) return gemm(c, g, CUDA_R_32F, o.a, o.b, d, alpha, beta, e, stream);
  if (gemm(c, g, c.low_type, o.a16, o.b16, d, alpha, beta, e, stream)) return true;
  if (e.kind != CUBLASLT_EPILOGUE_DEFAULT) return false;
  return gemm(c, g, CUDA_R_32F, o.a, o.b, d, alpha, beta, e, stream);
}

void plain_product(LinearContext& c, const GemmShape& g, const Operands& o, float* d, float alpha, float beta,
                   cudaStream_t stream) {
  product(c, g, o, d, alpha, beta, Epilogue{}, stream);
}

// ---- bf16/fp16 operands ----

bool low_precision(const LinearContext& c) { return c.low_type != CUDA_R_32F; }

// src [n] rounded (to nearest even) into the scratch slot of `which`, grown first if it is
// too small. The old block goes back to the allocator: work already queued on this stream
// that reads it runs before anything queued later can reuse it.
const uint16_t* rounded_copy(LinearContext& c, Operand which, const float* src, int64_t n, cudaStream_t stream) {
  Scratch16& slot = c.copies[static_cast<size_t>(which)];
  if (n > slot.capacity) {
    // A recorded step may not allocate (cudaMalloc fails while the stream is captured, and
    // the allocator would call that "out of GPU memory"): say what happened instead.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    PIPESHARD_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    PIPESHARD_CHECK(capture == cudaStreamCaptureStatusNone,
                    "Linear's 16-bit operand scratch had to grow while a CUDA graph was recording (" +
                        std::to_string(n) + " elements, " + std::to_string(slot.capacity) +
                        " held): the first, eager step should have sized it");
    c.allocator->deallocate(slot.data);
    slot.data = static_cast<uint16_t*>(c.allocator->allocate(static_cast<size_t>(n) * sizeof(uint16_t)));
    slot.capacity = n;
    PIPESHARD_CHECK(alignment_of(slot.data) == 256, "16-bit scratch at a " + std::to_string(alignment_of(slot.data)) +
                                                        "-byte boundary, 256 expected from cudaMalloc");
  }
  convert_to_16bit(slot.data, src, n, c.precision, stream);
  return slot.data;
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

struct Identity {
  __device__ float operator()(float x) const { return x; }
};
// The activations of activation_forward (elementwise_math.cuh, the CPU's formulas operation
// by operation, never contracted), so that a y recomputed from `pre` in backward is the y
// written here, bit for bit.
template <ActivationKind K>
struct Act {
  float alpha;
  __device__ float operator()(float x) const { return math::activation_value(K, alpha, x); }
};

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;  // grid-stride loops cover the rest

int blocks_for(int64_t n) { return static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks)); }

// y[rows, width] = act(src + beta·b) elementwise; pre (or null) receives src + beta·b.
// src may be y or pre (each element is read before it is written, by the same thread).
// The bias is added unfused (round, then add), as the CPU does.
template <typename Act>
__global__ void bias_activation_kernel(float* y, float* pre, const float* src, const float* b, float beta, int64_t rows,
                                       int64_t width, Act act) {
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
  const float a = act->alpha;
  auto run = [&](auto f) { launch_bias_activation(y, pre, src, b, beta, rows, width, f, stream); };
  switch (act->kind) {
    case ActivationKind::kRelu: return run(Act<ActivationKind::kRelu>{a});
    case ActivationKind::kLeakyRelu: return run(Act<ActivationKind::kLeakyRelu>{a});
    case ActivationKind::kSigmoid: return run(Act<ActivationKind::kSigmoid>{a});
    case ActivationKind::kTanh: return run(Act<ActivationKind::kTanh>{a});
    case ActivationKind::kGelu: return run(Act<ActivationKind::kGelu>{a});
    case ActivationKind::kGeluTanh: return run(Act<ActivationKind::kGeluTanh>{a});
    case ActivationKind::kSilu: return run(Act<ActivationKind::kSilu>{a});
  }
  PIPESHARD_CHECK(false, "unknown activation kind " + std::to_string(static_cast<int>(act->kind)));
}

// db[width] = (or +=) beta · Σ_rows dy[rows, width]. A block owns kColumns columns;
// kRowLanes threads per column each sum every kRowLanes-th row, then one adds the lanes
// in order: the result does not depend on timing (no atomics).
constexpr int kColumns = 32, kRowLanes = 8;

__global__ void column_sum_kernel(float* db, const float* dy, int64_t rows, int64_t width, float beta, bool overwrite) {
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
  PIPESHARD_CHECK(s.rows >= 0 && s.in >= 0 && s.out >= 0, "linear shape rows=" + std::to_string(s.rows) + " in=" +
                                                              std::to_string(s.in) + " out=" + std::to_string(s.out));
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
// tell, with the hardware's approximate tanh (relative error ~2^-11). That is at or below
// the rounding of a TF32, fp16 (both 2^-11 per operand) or bf16 (2^-8) GEMM's inputs, but
// fifty times the 1e-5 that fp32 results are held to against the CPU
// (tests/backend/backend_check.h), so fp32 mode computes GELU-tanh in our kernel (tanhf).
bool gelu_epilogue_allowed(const LinearContext& c) { return c.precision != Precision::kFp32; }

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

ForwardPlan plan_forward(const LinearContext& c, const LinearShape& s, float* y, const float* b, const Activation* act,
                         float* pre) {
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

LinearContext* create_linear_context(Precision precision, CachingAllocator* allocator) {
  PIPESHARD_CHECK(allocator != nullptr, "create_linear_context without an allocator");
  auto* c = new LinearContext;
  c->precision = precision;
  c->allocator = allocator;
  c->compute = precision == Precision::kTf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  if (precision == Precision::kBf16) c->low_type = CUDA_R_16BF;
  if (precision == Precision::kFp16) c->low_type = CUDA_R_16F;
  PIPESHARD_CUBLAS_CHECK(cublasLtCreate(&c->handle));
  PIPESHARD_CUDA_CHECK(cudaMalloc(&c->workspace, kWorkspaceBytes));
  return c;
}

void destroy_linear_context(LinearContext* context) {
  if (context == nullptr) return;
  context->plans.clear();
  for (Scratch16& slot : context->copies) context->allocator->deallocate(slot.data);
  cudaFree(context->workspace);  // waits for the GEMMs that still use it
  cublasLtDestroy(context->handle);
  delete context;
}

// Every activation but cuBLASLt's GELU epilogue goes through bias_activation_kernel's Act,
// which is activation_forward's formula.
bool epilogue_recomputes_exactly(const LinearContext* context, const Activation& a) {
  return !(a.kind == ActivationKind::kGeluTanh && gelu_epilogue_allowed(*context));
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
  Operands o{w, x};  // A = W', B = x (the table at the top)
  if (low_precision(*context)) {
    o.a16 = rounded_copy(*context, Operand::kW, w, s.in * s.out, stream);
    o.b16 = rounded_copy(*context, Operand::kX, x, s.rows * s.in, stream);
  }
  ForwardPlan p = plan_forward(*context, s, y, b, epilogue, pre);
  if (!product(*context, g, o, p.gemm_out, s.alpha, 0.0f, p.epilogue, stream)) {
    p = unfused_forward(y, b, epilogue, pre, false);
    plain_product(*context, g, o, p.gemm_out, s.alpha, 0.0f, stream);
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
  const bool want_dx = dx != nullptr && s.in > 0, want_dw = dw != nullptr && s.in > 0;
  // bf16/fp16: each operand rounded once, dy shared by both products.
  const uint16_t *dy16 = nullptr, *w16 = nullptr, *x16 = nullptr;
  if (low_precision(*context) && (want_dx || want_dw)) {
    dy16 = rounded_copy(*context, Operand::kDy, dy, s.rows * s.out, stream);
    if (want_dx) w16 = rounded_copy(*context, Operand::kW, w, s.in * s.out, stream);
    if (want_dw) x16 = rounded_copy(*context, Operand::kX, x, s.rows * s.in, stream);
  }
  if (want_dx) {
    const Operands o{w, dy, w16, dy16};
    plain_product(*context, input_grad_shape(s), o, dx, s.alpha, overwrite_input ? 0.0f : 1.0f, stream);
  }
  bool db_done = false;
  if (want_dw) {
    const bool out_in = s.layout == WeightLayout::kOutIn;
    const GemmShape g = weight_grad_shape(s);
    const Operands o = out_in ? Operands{x, dy, x16, dy16} : Operands{dy, x, dy16, x16};
    const float param_beta = overwrite_params ? 0.0f : 1.0f;
    // The bias-gradient epilogue writes Σ dy: it cannot add or scale by beta, and whether
    // alpha scales it is not documented, so it runs only where neither matters. In
    // bf16/fp16 mode it sums the rounded dy that the product reads (in fp32).
    if (db != nullptr && overwrite_params && s.alpha == 1.0f && s.beta == 1.0f && aligned_for_epilogue(db)) {
      const Epilogue e{out_in ? CUBLASLT_EPILOGUE_BGRADB : CUBLASLT_EPILOGUE_BGRADA, db};
      db_done = product(*context, g, o, dw, s.alpha, param_beta, e, stream);
    }
    if (!db_done) plain_product(*context, g, o, dw, s.alpha, param_beta, stream);
  }
  if (db != nullptr && !db_done) column_sum(db, dy, s.rows, s.out, s.beta, overwrite_params, stream);
}

}  // namespace pipeshard::cuda
