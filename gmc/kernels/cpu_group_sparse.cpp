// Fused CPU kernel of gmc::group_sparse_linear on the packed BSC format (gmc/kernels/packed.py): the
// torch op around the torch-free compute of group_sparse_core.h (which has the algorithm, its
// products and their thresholds). This file gives the core its host (AtenHost: ATen's OpenMP pool,
// at::mm for the gemm product of prefill), reads the op's tensors into raw pointers, and picks the
// product (path AUTO: the stream for T <= STREAM_MAX_TOKENS, then register tiles, at::mm from
// GEMM_MIN_TOKENS tokens on; int8 and int4 at every T: the integer products).
// x, bias and y are fp32 inside: a bf16 x (and bias) is converted on entry and y back on exit
// (T * (d_in + d_out) numbers, small beside the weights).
//
// This library is the op's CPU implementation: loading it registers `group_sparse_linear` below
// for the CPU dispatch key, so a call of torch.ops.gmc.group_sparse_linear (Python or C++) runs it
// without Python in between. Inputs it does not compile go to the op's torch implementation. It
// also holds the CPU kernels of gmc::decode_attention and gmc::group_sparse_gated_mlp (a gated
// MLP's two products in one call, each run as group_sparse_linear runs it), registered the same way.
//
// Built with -DGMC_RUNTIME_LIBRARY (gmc.kernels.cpu_group_sparse.build_runtime_library), the same
// source is the op's runtime for compiled packages (gmc.formats.compiled): a plain shared library, no
// Python module, that also defines the op's schema (from gmc_schema.h, written from the one Python
// definition), so an AOTInductor package runs in a process that loads it and never imports gmc.
// Inputs the kernel does not compile are then an error: there is no torch implementation to call.
#include <torch/library.h>
#ifdef GMC_RUNTIME_LIBRARY
#include "gmc_schema.h"  // #define GMC_SCHEMAS {"group_sparse_linear(Tensor x, ...) -> Tensor", ...}
#else
#include <torch/python.h>
#endif
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "group_sparse_core.h"

namespace {

// e^x lane by lane (Cephes' expf: x = n ln 2 + r, |r| <= ln 2 / 2, a degree-5 polynomial in r, 2^n
// put into the exponent bits; within 2 ulp of expf on [-87, 88]). x is clamped to +-88.38 (e^x
// then inf or 0); NaN stays NaN. Vectorised where glibc's expf is a scalar call (~4 ns a number).
inline vfloat vexp(vfloat x) {
  x = x > splat(88.3762626647949f) ? splat(88.3762626647949f) : x;
  x = x < splat(-88.3762626647949f) ? splat(-88.3762626647949f) : x;
  const vfloat fx = x * splat(1.44269504088896341f) + splat(0.5f);
  vfloat n = __builtin_convertvector(__builtin_convertvector(fx, vint), vfloat);  // toward zero
  n = n > fx ? n - splat(1.0f) : n;                                                  // floor
  x = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
  vfloat y = splat(1.9875691500e-4f);
  y = y * x + splat(1.3981999507e-3f);
  y = y * x + splat(8.3334519073e-3f);
  y = y * x + splat(4.1665795894e-2f);
  y = y * x + splat(1.6666665459e-1f);
  y = y * x + splat(5.0000001201e-1f);
  y = y * (x * x) + x + splat(1.0f);
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// e^x of n numbers in place through vexp (a short tail padded); returns their sum.
inline float exp_in_place(float* __restrict s, int64_t n, float shift) {
  vfloat total = vfloat{};
  int64_t i = 0;
  for (; i + VEC <= n; i += VEC) {
    const vfloat e = vexp(load(s + i) - splat(shift));
    store(s + i, e);
    total += e;
  }
  float sum = 0.0f;
  for (int j = 0; j < VEC; ++j) sum += total[j];
  if (i < n) {
    float tail[VEC] = {};
    std::memcpy(tail, s + i, (n - i) * sizeof(float));
    const vfloat e = vexp(load(tail) - splat(shift));
    for (int64_t j = 0; j < n - i; ++j) sum += s[i + j] = e[j];
  }
  return sum;
}

// The core's host in the torch build: ATen's thread pool and at::mm for the gemm product.
struct AtenHost {
  static constexpr bool HAS_GEMM = true;
  int64_t threads() const { return at::get_num_threads(); }
  template <class F>
  void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) const {
    at::parallel_for(begin, end, grain, f);
  }
  // out [n, T] = a[w, n].T @ x[T, w].T: MKL reads both operands as transposed views.
  void gemm(const float* a, int64_t lda, const float* x, int64_t ldx, int64_t w, int64_t n, int64_t T,
            float* out) const {
    const at::Tensor panel = at::from_blob(const_cast<float*>(a), {w, n}, {lda, 1}, at::kFloat);
    const at::Tensor xv = at::from_blob(const_cast<float*>(x), {T, w}, {ldx, 1}, at::kFloat);
    at::Tensor part = at::from_blob(out, {n, T}, at::kFloat);
    at::mm_out(part, panel.t(), xv.t());  // [n, w] @ [w, T]
  }
};

// fp32 copy of n bfloat16 numbers.
std::vector<float> widened(const at::Tensor& t) {
  const bf16* p = static_cast<const bf16*>(t.data_ptr());
  std::vector<float> out(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) out[i] = to_float(p[i]);
  return out;
}

// The run_blocks of `values`' dtype: y [T, d_out] (fp32, raw) of x [T, d_in] (fp32, raw); false, y
// incomplete, when row_idx is not one rows_ok accepts. path AUTO: gemm from GEMM_MIN_TOKENS tokens on
// (int4: its integer product at every T).
bool run_layer(const float* xp, int64_t T, int64_t d_in, const at::Tensor& values, const at::Tensor& scales,
               const at::Tensor& row_idx, const at::Tensor& row_ptr, const float* bp, float* yp, int64_t d_out,
               int64_t g_in, int64_t path) {
  const bool integer = values.scalar_type() == at::kByte || values.scalar_type() == at::kChar;
  if (path == AUTO) path = T >= GEMM_MIN_TOKENS && !integer ? GEMM : STREAM;
  const int64_t* rows = row_idx.data_ptr<int64_t>();
  const int32_t* ptr = row_ptr.data_ptr<int32_t>();
  const int64_t n_blocks = row_ptr.numel() - 1, n = values.numel();
  const void* vp = values.data_ptr();
  const AtenHost host;
  switch (values.scalar_type()) {
    case at::kBFloat16:
      return run_blocks(host, xp, T, d_in, static_cast<const bf16*>(vp), n, nullptr, rows, ptr, n_blocks, bp, yp,
                        d_out, g_in, path);
    case at::kChar:
      return run_blocks(host, xp, T, d_in, static_cast<const int8_t*>(vp), n, scales.data_ptr<float>(), rows, ptr,
                        n_blocks, bp, yp, d_out, g_in, path);
    case at::kByte:
      return run_blocks(host, xp, T, d_in, static_cast<const int4x2*>(vp), n, scales.data_ptr(), rows, ptr, n_blocks,
                        bp, yp, d_out, g_in, path);
    default:
      return run_blocks(host, xp, T, d_in, static_cast<const float*>(vp), n, nullptr, rows, ptr, n_blocks, bp, yp,
                        d_out, g_in, path);
  }
}

// A float32 or bfloat16 tensor's numbers as fp32: in place for float32 (`copy` untouched), else
// widened into `copy`; null for an undefined tensor.
const float* as_float(const at::Tensor& t, std::vector<float>& copy) {
  if (!t.defined()) return nullptr;
  if (t.scalar_type() == at::kFloat) return t.data_ptr<float>();
  copy = widened(t);
  return copy.data();
}

// y [..., d_out] in x's dtype, its numbers written by `fill(float* y)` as fp32 (in place for a
// float32 x; for bfloat16 into a copy rounded to nearest even at the end, as at::Tensor::to does).
// An undefined tensor when `fill` returns false.
template <class F>
at::Tensor output(const at::Tensor& x, int64_t T, int64_t d_out, F&& fill) {
  c10::SmallVector<int64_t, 4> sizes(x.sizes().begin(), x.sizes().end());  // [..., d_out]
  sizes.back() = d_out;
  at::Tensor y = at::detail::empty_cpu(sizes, x.scalar_type());
  if (x.scalar_type() == at::kFloat) return fill(y.data_ptr<float>()) ? y : at::Tensor();
  std::vector<float> yw(T * d_out);
  if (!fill(yw.data())) return at::Tensor();
  bf16* out = static_cast<bf16*>(y.data_ptr());
  for (int64_t i = 0; i < T * d_out; ++i) out[i] = c10::BFloat16(yw[i]).x;
  return y;
}

// y [..., d_out] in x's dtype for tensors that passed the checks of the callers below (x, values,
// scales, bias and row_idx (int64) contiguous, `unsupported` null, blocks_ok), or an undefined
// tensor when row_idx is not one rows_ok accepts; scales and bias undefined when absent. A bf16
// x and bias are widened to fp32 first and y narrowed at the end (T * (d_in + d_out) numbers,
// small beside the weights). path: which product (AUTO: by T).
// Raw buffers and at::detail::empty_cpu rather than reshape / to / at::empty: each of those is a
// dispatcher round trip, and at 211 calls per SmolLM2 token they cost a tenth of the step.
at::Tensor run(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales, const at::Tensor& row_idx,
               const at::Tensor& row_ptr, const at::Tensor& bias, int64_t d_out, int64_t g_in, int64_t path) {
  const int64_t d_in = x.size(-1), T = d_in > 0 ? x.numel() / d_in : 0;
  std::vector<float> xw, bw;  // fp32 copies of a bf16 x and bias
  const float* xp = as_float(x, xw);
  const float* bp = as_float(bias, bw);
  return output(x, T, d_out, [&](float* yp) {
    return run_layer(xp, T, d_in, values, scales, row_idx, row_ptr, bp, yp, d_out, g_in, path);
  });
}

int64_t width(const at::Tensor& x) { return x.dim() > 0 ? x.size(-1) : 0; }

// Why the kernel does not compile a layer of width d_in fed with xt numbers, or null.
const char* unsupported(at::ScalarType xt, int64_t d_in, const at::Tensor& values, const at::Tensor& row_idx,
                        const at::Tensor& row_ptr, const std::optional<at::Tensor>& bias, int64_t d_out,
                        int64_t g_in, const std::optional<at::Tensor>& scales) {
  const auto vt = values.scalar_type();
  if (xt != at::kFloat && xt != at::kBFloat16) return "x: float32 or bfloat16";
  if (vt == at::kChar) {
    if (!scales.has_value() || scales->scalar_type() != at::kFloat || scales->dim() != 1 ||
        scales->numel() != row_idx.numel())
      return "int8 values: scales float32 [R], one per row_idx entry";
  } else if (vt == at::kByte) {
    if (!scales.has_value() || scales->scalar_type() != at::kHalf || scales->dim() != 1)
      return "int4 values (uint8, two a byte): scales float16, 1-D";
    if (g_in % 8 != 0) return "int4 values: g_in a multiple of 8";
  } else if (vt != xt || scales.has_value()) {
    return "values: x's dtype without scales, int8 with float32 scales or int4 (uint8) with float16 scales";
  }
  if (values.dim() != 1 || !values.is_contiguous()) return "values: contiguous 1-D";
  if (d_in <= 0 || g_in <= 0 || d_out < 0) return "d_in and g_in positive, d_out not negative";
  if (row_ptr.scalar_type() != at::kInt || !row_ptr.is_contiguous() || row_ptr.numel() != (d_in + g_in - 1) / g_in + 1)
    return "row_ptr: contiguous int32 with G_in + 1 entries";
  if (row_idx.dim() != 1 || (row_idx.scalar_type() != at::kLong && row_idx.scalar_type() != at::kInt))
    return "row_idx: 1-D int64 or int32";
  if (bias.has_value() && (bias->scalar_type() != xt || bias->dim() != 1 || bias->numel() != d_out))
    return "bias: [d_out] in x's dtype";
  return nullptr;
}

// Call gmc::<name>'s torch implementation (the CompositeExplicitAutograd kernel gmc registers in
// Python) with `stack` as its arguments; returns its output. The runtime library has none: there
// the call is an error naming what the kernel runs (`runs`) and what it got (the first two tensors).
at::Tensor call_torch_implementation(const char* name, torch::jit::Stack stack, const char* runs) {
#ifdef GMC_RUNTIME_LIBRARY
  const at::Tensor& first = stack[0].toTensor();
  TORCH_CHECK(false, "gmc runtime: ", name, " runs ", runs, " (got ", first.scalar_type(), " ", first.sizes(), " and ",
              stack[1].toTensor().scalar_type(), "); anything else needs gmc's torch implementation");
#endif
  const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  op.callBoxedForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd, stack);
  return stack[0].toTensor();
}

// The op's torch implementation: the CompositeExplicitAutograd kernel gmc registers in Python
// (group_sparse_linear_torch), which runs other dtypes and raises the contract's GmcErrors.
at::Tensor torch_implementation(const at::Tensor& x, const at::Tensor& values, const at::Tensor& row_idx,
                                const at::Tensor& row_ptr, const std::optional<at::Tensor>& bias,
                                int64_t d_out, int64_t g_in, const std::optional<at::Tensor>& scales) {
  return call_torch_implementation("gmc::group_sparse_linear", {x, values, row_idx, row_ptr, bias, d_out, g_in, scales},
                                   "float32 or bfloat16 x with values of x's dtype, int8 or int4 with scales, on a valid "
                                   "packed layout");
}

// ---- gmc::decode_attention: one query token over a grouped-query KV cache (decode) ----
//
//   q [B, H, 1, D], k / v [B, H_kv, L, D] (the cache's filled slots: any strides but the last),
//   mask bool [B or 1, 1, 1, L] (true: attend) or none; out [B, H, 1, D] in q's dtype.
//   For each (b, kv head): the G = H / H_kv query heads of that KV head read each key and value
//   row once: s[g, l] = scale * q_g . k_l (masked: -inf), p = softmax_l(s), out_g = sum_l p[g, l] v_l,
//   all in fp32. One call replaces two batched GEMMs and a softmax per layer (MKL's small-matrix
//   path cost ~7 us a call on SmolLM2's shapes; bf16 ones ran ATen's scalar fallback, ~10% of a
//   bf16 decode step: docs/lowering.md).

// Four sums of the lanes of a0..a3 (AVX2: three horizontal adds, where four separate sums are
// four shuffle chains).
inline void sum4(vfloat a0, vfloat a1, vfloat a2, vfloat a3, float* out) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps((__m256)a0, (__m256)a1), _mm256_hadd_ps((__m256)a2, (__m256)a3));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
#else
  const vfloat a[4] = {a0, a1, a2, a3};
  for (int j = 0; j < 4; ++j) {
    float sum = 0.0f;
    for (int i = 0; i < VEC; ++i) sum += a[j][i];
    out[j] = sum;
  }
#endif
}

// s[g, l] = q_g . k_l for g < n query heads (qf [n, D] fp32, s [n, L]) and l < L (k_l = k + l * ks):
// four keys at a time, each group of four read from memory once for all n heads, four
// independent chains and one four-way horizontal sum per head. One key at a time, each dot's two
// chains and its own horizontal sum were one long latency chain (with weighted_rows, a call on
// SmolLM2's heads from Python, 1 thread: 20.9 -> 9.1 us at 56 positions, 392 -> 197 us at 2000).
template <class V>
void dot_rows(const float* __restrict qf, int64_t n, int64_t D, const V* __restrict k, int64_t ks, int64_t L,
              float* __restrict s) {
  const int64_t DV = D / VEC * VEC;
  int64_t l = 0;
  for (; l + 4 <= L; l += 4) {
    const V* k0 = k + l * ks;
    for (int64_t g = 0; g < n; ++g) {
      const float* q = qf + g * D;
      vfloat a0 = vfloat{}, a1 = vfloat{}, a2 = vfloat{}, a3 = vfloat{};
      for (int64_t d = 0; d < DV; d += VEC) {
        const vfloat qd = load(q + d);
        a0 += qd * load(k0 + d);
        a1 += qd * load(k0 + ks + d);
        a2 += qd * load(k0 + 2 * ks + d);
        a3 += qd * load(k0 + 3 * ks + d);
      }
      float* sg = s + g * L + l;
      sum4(a0, a1, a2, a3, sg);
      for (int64_t d = DV; d < D; ++d)
        for (int j = 0; j < 4; ++j) sg[j] += q[d] * to_float(k0[j * ks + d]);
    }
  }
  for (; l < L; ++l) {
    const V* kl = k + l * ks;
    for (int64_t g = 0; g < n; ++g) {
      const float* q = qf + g * D;
      vfloat a = vfloat{};
      for (int64_t d = 0; d < DV; d += VEC) a += load(q + d) * load(kl + d);
      float sum = 0.0f;
      for (int i = 0; i < VEC; ++i) sum += a[i];
      for (int64_t d = DV; d < D; ++d) sum += q[d] * to_float(kl[d]);
      s[g * L + l] = sum;
    }
  }
}

// o[g] = sum_l p[g, l] v_l for g < n (p [n, L], o [n, D], v_l = v + l * vs): LB value rows at a
// time (in L1 for all n heads), each head's output OV vectors at a time in registers across
// those rows (an add into o in memory per row made every row a store and a reload).
constexpr int OV = 8;
constexpr int64_t LB = 32;
template <class V>
void weighted_rows(const float* __restrict p, int64_t n, int64_t L, const V* __restrict v, int64_t vs, int64_t D,
                   float* __restrict o) {
  const int64_t DV = D / VEC * VEC;
  std::fill(o, o + n * D, 0.0f);
  for (int64_t l0 = 0; l0 < L; l0 += LB) {
    const int64_t l1 = std::min(L, l0 + LB);
    for (int64_t g = 0; g < n; ++g) {
      const float* pg = p + g * L;
      float* og = o + g * D;
      for (int64_t d0 = 0; d0 < DV; d0 += OV * VEC) {
        const int nv = int(std::min<int64_t>(OV, (DV - d0) / VEC));
        vfloat acc[OV];
        for (int j = 0; j < nv; ++j) acc[j] = load(og + d0 + j * VEC);
        for (int64_t l = l0; l < l1; ++l) {
          const vfloat pl = vfloat{} + pg[l];
          const V* vl = v + l * vs + d0;
          if (nv == OV) {
#pragma GCC unroll 8
            for (int j = 0; j < OV; ++j) acc[j] += pl * load(vl + j * VEC);
          } else {
            for (int j = 0; j < nv; ++j) acc[j] += pl * load(vl + j * VEC);
          }
        }
        for (int j = 0; j < nv; ++j) store(og + d0 + j * VEC, acc[j]);
      }
      for (int64_t d = DV; d < D; ++d)
        for (int64_t l = l0; l < l1; ++l) og[d] += pg[l] * to_float(v[l * vs + d]);
    }
  }
}

// One token's attention as the kernel reads it: raw pointers and element strides (the last
// dimension of q, k and v contiguous), from decode_attention's tensors or attention_block's scratch.
struct Attention {
  const void* q;        // [B, H, 1, D]: q + b * qb + head * qh
  const void* k;        // [B, H_kv, L, D]: k + b * kb + h * kh + l * ks
  const void* v;        // as k, with vb, vh, vs
  const bool* mask;     // [B or 1, 1, 1, L] (true: attend) or null: mask + b * mb + l * ml
  void* out;            // [B, H, 1, D] contiguous, q's dtype
  int64_t B, H, H_kv, D, L;
  int64_t qb, qh, kb, kh, ks, vb, vh, vs, mb, ml;
};

// Query heads [g0, g1) of KV head h of batch row b (qf: their rows times scale, s: their scores
// [g1 - g0, L], o: their outputs [g1 - g0, D], all scratch).
template <class V>
void attend_heads(const Attention& a, float scale, int64_t b, int64_t h, int64_t g0, int64_t g1, float* qf, float* s,
                  float* o) {
  const int64_t H = a.H, D = a.D, L = a.L, G = H / a.H_kv, n = g1 - g0;
  const V* qp = static_cast<const V*>(a.q);
  for (int64_t g = 0; g < n; ++g) {
    const V* qg = qp + b * a.qb + (h * G + g0 + g) * a.qh;
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_float(qg[d]) * scale;
  }
  const V* kb = static_cast<const V*>(a.k) + b * a.kb + h * a.kh;
  const V* vb = static_cast<const V*>(a.v) + b * a.vb + h * a.vh;
  dot_rows(qf, n, D, kb, a.ks, L, s);
  for (int64_t g = 0; g < n; ++g) {  // softmax; a row with every slot masked is NaN, as in torch
    float* sg = s + g * L;
    if (a.mask != nullptr)
      for (int64_t l = 0; l < L; ++l)
        if (!a.mask[b * a.mb + l * a.ml]) sg[l] = -std::numeric_limits<float>::infinity();
    const float top = *std::max_element(sg, sg + L);
    const float inv = 1.0f / exp_in_place(sg, L, top);
    for (int64_t l = 0; l < L; ++l) sg[l] *= inv;
  }
  weighted_rows(s, n, L, vb, a.vs, D, o);
  V* op = static_cast<V*>(a.out);
  for (int64_t g = 0; g < n; ++g) {
    V* og = op + ((b * H) + h * G + g0 + g) * D;
    for (int64_t d = 0; d < D; ++d) {
      if constexpr (std::is_same_v<V, float>) og[d] = o[g * D + d];
      else og[d] = c10::BFloat16(o[g * D + d]).x;
    }
  }
}

// Threads share the B * H query heads in contiguous ranges: a range takes the heads of each KV
// head it covers together, so they read that head's keys and values once; a KV head cut by two
// ranges is read by both. By query head rather than by KV head, SmolLM2's 9 heads over 3 KV
// heads split 5 / 4 on two threads where whole KV heads split 2 / 1. Below ATTENTION_GRAIN
// multiply-adds per thread (~2 us) the call stays on one.
constexpr int64_t ATTENTION_GRAIN = 1 << 14;

// Query heads [begin, end) of the B * H (a range of attend's split).
template <class V>
void attend_range(const Attention& a, double scale, int64_t begin, int64_t end) {
  const int64_t H = a.H, D = a.D, L = a.L, G = H / a.H_kv;
  float* qf = thread_scratch(2, G * (2 * D + L));
  for (int64_t i = begin; i < end;) {  // query head i = b * H + h * G + g
    const int64_t b = i / H, h = i % H / G, g0 = i % G, g1 = std::min(G, g0 + end - i);
    attend_heads<V>(a, float(scale), b, h, g0, g1, qf, qf + G * D, qf + G * (D + L));
    i += g1 - g0;
  }
}

template <class V>
void attend(const Attention& a, double scale) {
  const int64_t grain = std::max<int64_t>(1, ATTENTION_GRAIN / std::max<int64_t>(1, a.L * a.D));
  at::parallel_for(0, a.B * a.H, grain, [&](int64_t begin, int64_t end) { attend_range<V>(a, scale, begin, end); });
}

// decode_attention's tensors as the kernel reads them (shapes checked by attention_unsupported).
Attention attention_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                       at::Tensor& out) {
  Attention a{q.data_ptr(), k.data_ptr(), v.data_ptr(), mask.defined() ? mask.data_ptr<bool>() : nullptr,
              out.data_ptr(), q.size(0), q.size(1), k.size(1), q.size(3), k.size(2),
              q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
              mask.defined() && mask.size(0) > 1 ? mask.stride(0) : 0, mask.defined() ? mask.stride(3) : 0};
  return a;
}

// Why decode_attention's kernel cannot run these inputs, or null when it can.
const char* attention_unsupported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const std::optional<at::Tensor>& mask) {
  const auto dt = q.scalar_type();
  if (dt != at::kFloat && dt != at::kBFloat16) return "q: float32 or bfloat16";
  if (k.scalar_type() != dt || v.scalar_type() != dt) return "k and v: q's dtype";
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4 || q.size(2) != 1) return "q [B, H, 1, D], k and v [B, H_kv, L, D]";
  if (k.sizes() != v.sizes() || k.size(0) != q.size(0) || k.size(3) != q.size(3) || k.size(1) == 0 ||
      q.size(1) % k.size(1) != 0 || k.size(2) == 0)
    return "k and v [B, H_kv, L, D] with H_kv dividing H and L > 0";
  if (q.stride(3) != 1 || k.stride(3) != 1 || v.stride(3) != 1) return "q, k and v: contiguous last dimension";
  if (mask.has_value()) {
    const at::Tensor& m = *mask;
    if (m.scalar_type() != at::kBool || m.dim() != 4 || m.size(1) != 1 || m.size(2) != 1 || m.size(3) != k.size(2) ||
        (m.size(0) != 1 && m.size(0) != q.size(0)))
      return "mask: bool [B or 1, 1, 1, L]";
  }
  return nullptr;
}

at::Tensor attention_torch_implementation(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                          const std::optional<at::Tensor>& mask, double scale) {
  return call_torch_implementation("gmc::decode_attention", {q, k, v, mask, scale},
                                   "float32 or bfloat16 q [B, H, 1, D] with k, v of its dtype");
}

// One packed layer as run_layer reads it: row_idx as contiguous int64, scales and bias contiguous
// (undefined for none).
struct Layer {
  at::Tensor values, scales, rows, row_ptr, bias;
};

// `layer` from the op's arguments for inputs of xt numbers and width d_in; false when the kernel
// does not compile them (`unsupported`) or the packed tensors do not describe one layer (blocks_ok).
bool layer_of(at::ScalarType xt, int64_t d_in, const at::Tensor& values, const at::Tensor& row_idx,
              const at::Tensor& row_ptr, const std::optional<at::Tensor>& bias, int64_t d_out, int64_t g_in,
              const std::optional<at::Tensor>& scales, Layer& layer) {
  if (unsupported(xt, d_in, values, row_idx, row_ptr, bias, d_out, g_in, scales)) return false;
  const bool direct = row_idx.scalar_type() == at::kLong && row_idx.is_contiguous();  // pack()'s rows
  layer.rows = direct ? row_idx : row_idx.to(at::kLong).contiguous();
  if (!blocks_ok(values.numel(), layer.rows.numel(), row_ptr.data_ptr<int32_t>(), row_ptr.numel() - 1, d_in, g_in,
                 values.scalar_type() == at::kByte, scales.has_value() ? scales->numel() : 0))
    return false;
  layer.values = values;
  layer.row_ptr = row_ptr;
  layer.scales = scales.has_value() ? scales->contiguous() : at::Tensor();
  layer.bias = bias.has_value() ? bias->contiguous() : at::Tensor();
  return true;
}

// a [T, d_ff] = silu(h[:, :d_ff]) * h[:, d_ff:] for h [T, 2 d_ff], silu(g) = g / (1 + e^-g).
void silu_mul(const float* __restrict h, int64_t T, int64_t d_ff, float* __restrict a) {
  for (int64_t t = 0; t < T; ++t) {
    const float* g = h + t * 2 * d_ff;
    const float* u = g + d_ff;
    float* o = a + t * d_ff;
    int64_t i = 0;
    for (; i + VEC <= d_ff; i += VEC) {
      const vfloat gi = load(g + i);
      store(o + i, gi / (splat(1.0f) + vexp(-gi)) * load(u + i));
    }
    if (i < d_ff) {  // the tail through the same vexp
      float gt[VEC] = {}, ut[VEC] = {}, ot[VEC];
      std::memcpy(gt, g + i, (d_ff - i) * sizeof(float));
      std::memcpy(ut, u + i, (d_ff - i) * sizeof(float));
      const vfloat gi = load(gt);
      store(ot, gi / (splat(1.0f) + vexp(-gi)) * load(ut));
      std::memcpy(o + i, ot, (d_ff - i) * sizeof(float));
    }
  }
}

at::Tensor gated_mlp_torch_implementation(const at::Tensor& x, const at::Tensor& values, const at::Tensor& row_idx,
                                          const at::Tensor& row_ptr, const std::optional<at::Tensor>& bias,
                                          const at::Tensor& down_values, const at::Tensor& down_row_idx,
                                          const at::Tensor& down_row_ptr, const std::optional<at::Tensor>& down_bias,
                                          int64_t d_ff, int64_t d_out, int64_t g_in,
                                          const std::optional<at::Tensor>& scales,
                                          const std::optional<at::Tensor>& down_scales) {
  return call_torch_implementation("gmc::group_sparse_gated_mlp",
                                   {x, values, row_idx, row_ptr, bias, down_values, down_row_idx, down_row_ptr,
                                    down_bias, d_ff, d_out, g_in, scales, down_scales},
                                   "float32 or bfloat16 x with values of x's dtype, int8 or int4 with scales, on valid "
                                   "packed layouts");
}

}  // namespace

// gmc::group_sparse_linear on CPU (registered below, so a Python call of the op comes straight
// here): x [..., d_in] -> [..., d_out]. Inputs `unsupported` accepts whose packed tensors pass
// blocks_ok and rows_ok run the compiled products; everything else (other dtypes, int64 row_ptr,
// unsorted or inconsistent indices, wrong shapes) goes to the op's torch implementation (row_idx may be
// found wanting part way through the decode stream: the partial y is dropped).
at::Tensor group_sparse_linear(const at::Tensor& x, const at::Tensor& values, const at::Tensor& row_idx,
                               const at::Tensor& row_ptr, const std::optional<at::Tensor>& bias,
                               int64_t d_out, int64_t g_in, const std::optional<at::Tensor>& scales) {
  Layer layer;
  if (!layer_of(x.scalar_type(), width(x), values, row_idx, row_ptr, bias, d_out, g_in, scales, layer))
    return torch_implementation(x, values, row_idx, row_ptr, bias, d_out, g_in, scales);
  at::Tensor y = run(x.contiguous(), layer.values, layer.scales, layer.rows, layer.row_ptr, layer.bias, d_out, g_in,
                     AUTO);
  return y.defined() ? y : torch_implementation(x, values, row_idx, row_ptr, bias, d_out, g_in, scales);
}

// The op's C shim for AOTInductor (gmc.formats.compiled): a compiled CPU package calls this function
// directly, not through the proxy executor (whose boxing into IValues and dispatcher round trip
// cost about 5 us per call, 121 calls per SmolLM2 token). The arguments follow the schema; an
// optional tensor is a pointer to its handle or null; the new output handle goes to *out.
// Packages link against this library by its soname, libgmc_ops.so (both builds carry it).
extern "C" AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_group_sparse_linear(
    AtenTensorHandle x, AtenTensorHandle values, AtenTensorHandle row_idx, AtenTensorHandle row_ptr,
    AtenTensorHandle* bias, int64_t d_out, int64_t g_in, AtenTensorHandle* scales, AtenTensorHandle* out) {
  using torch::aot_inductor::new_tensor_handle;
  using torch::aot_inductor::pointer_to_optional;
  using torch::aot_inductor::tensor_handle_to_tensor_pointer;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *out = new_tensor_handle(group_sparse_linear(
        *tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(values),
        *tensor_handle_to_tensor_pointer(row_idx), *tensor_handle_to_tensor_pointer(row_ptr),
        pointer_to_optional<at::Tensor>(bias), d_out, g_in, pointer_to_optional<at::Tensor>(scales)));
  });
}

// gmc::decode_attention on CPU (schema in gmc/kernels/decode_attention.py): inputs
// attention_unsupported rejects go to the op's torch implementation.
// gmc::group_sparse_gated_mlp on CPU: a gated MLP's two group-sparse products in one call,
//   h [T, 2 d_ff] = x @ W_gu_hat.T + bias        (gate | up: the layout fuse_siblings gives them)
//   y [T, d_out]  = (silu(h[:, :d_ff]) * h[:, d_ff:]) @ W_down_hat.T + down_bias
// with h and its activation fp32 in per-thread scratch (never rounded to x's dtype, never a tensor).
// Each product is run_layer's, as group_sparse_linear runs it; what the call saves is a second op
// call and the activation's own kernel between them (docs/lowering.md). Inputs
// either layer does not compile go to the op's torch implementation, as group_sparse_linear's do.
at::Tensor group_sparse_gated_mlp(const at::Tensor& x, const at::Tensor& values, const at::Tensor& row_idx,
                                  const at::Tensor& row_ptr, const std::optional<at::Tensor>& bias,
                                  const at::Tensor& down_values, const at::Tensor& down_row_idx,
                                  const at::Tensor& down_row_ptr, const std::optional<at::Tensor>& down_bias,
                                  int64_t d_ff, int64_t d_out, int64_t g_in, const std::optional<at::Tensor>& scales,
                                  const std::optional<at::Tensor>& down_scales) {
  const auto fallback = [&] {
    return gated_mlp_torch_implementation(x, values, row_idx, row_ptr, bias, down_values, down_row_idx, down_row_ptr,
                                          down_bias, d_ff, d_out, g_in, scales, down_scales);
  };
  Layer up, down;
  if (d_ff <= 0 ||
      !layer_of(x.scalar_type(), width(x), values, row_idx, row_ptr, bias, 2 * d_ff, g_in, scales, up) ||
      !layer_of(x.scalar_type(), d_ff, down_values, down_row_idx, down_row_ptr, down_bias, d_out, g_in, down_scales,
                down))
    return fallback();
  const at::Tensor xc = x.contiguous();
  const int64_t d_in = width(xc), T = xc.numel() / d_in;
  std::vector<float> xw, bw, dw;  // fp32 copies of a bf16 x and biases
  const float* xp = as_float(xc, xw);
  const float* bp = as_float(up.bias, bw);
  const float* dp = as_float(down.bias, dw);
  float* h = thread_scratch(3, T * 2 * d_ff);
  float* a = thread_scratch(4, T * d_ff);
  at::Tensor y = output(xc, T, d_out, [&](float* yp) {
    if (!run_layer(xp, T, d_in, up.values, up.scales, up.rows, up.row_ptr, bp, h, 2 * d_ff, g_in, AUTO))
      return false;
    silu_mul(h, T, d_ff, a);
    return run_layer(a, T, d_ff, down.values, down.scales, down.rows, down.row_ptr, dp, yp, d_out, g_in, AUTO);
  });
  return y.defined() ? y : fallback();
}

// Its C shim, as group_sparse_linear's.
extern "C" AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_group_sparse_gated_mlp(
    AtenTensorHandle x, AtenTensorHandle values, AtenTensorHandle row_idx, AtenTensorHandle row_ptr,
    AtenTensorHandle* bias, AtenTensorHandle down_values, AtenTensorHandle down_row_idx,
    AtenTensorHandle down_row_ptr, AtenTensorHandle* down_bias, int64_t d_ff, int64_t d_out, int64_t g_in,
    AtenTensorHandle* scales, AtenTensorHandle* down_scales, AtenTensorHandle* out) {
  using torch::aot_inductor::new_tensor_handle;
  using torch::aot_inductor::pointer_to_optional;
  using torch::aot_inductor::tensor_handle_to_tensor_pointer;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *out = new_tensor_handle(group_sparse_gated_mlp(
        *tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(values),
        *tensor_handle_to_tensor_pointer(row_idx), *tensor_handle_to_tensor_pointer(row_ptr),
        pointer_to_optional<at::Tensor>(bias), *tensor_handle_to_tensor_pointer(down_values),
        *tensor_handle_to_tensor_pointer(down_row_idx), *tensor_handle_to_tensor_pointer(down_row_ptr),
        pointer_to_optional<at::Tensor>(down_bias), d_ff, d_out, g_in, pointer_to_optional<at::Tensor>(scales),
        pointer_to_optional<at::Tensor>(down_scales)));
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& mask, double scale) {
  if (attention_unsupported(q, k, v, mask)) return attention_torch_implementation(q, k, v, mask, scale);
  at::Tensor out = at::detail::empty_cpu({q.size(0), q.size(1), 1, q.size(3)}, q.scalar_type());
  const Attention a = attention_of(q, k, v, mask.has_value() ? *mask : at::Tensor(), out);
  if (q.scalar_type() == at::kFloat) attend<float>(a, scale);
  else attend<bf16>(a, scale);
  return out;
}

// decode_attention's C shim for AOTInductor, as aoti_torch_cpu_group_sparse_linear's.
extern "C" AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_decode_attention(
    AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, AtenTensorHandle* mask, double scale,
    AtenTensorHandle* out) {
  using torch::aot_inductor::new_tensor_handle;
  using torch::aot_inductor::pointer_to_optional;
  using torch::aot_inductor::tensor_handle_to_tensor_pointer;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *out = new_tensor_handle(decode_attention(
        *tensor_handle_to_tensor_pointer(q), *tensor_handle_to_tensor_pointer(k), *tensor_handle_to_tensor_pointer(v),
        pointer_to_optional<at::Tensor>(mask), scale));
  });
}

// ---- gmc::attention_block: a decoder layer's attention for one token, q/k/v product to o product ----
//
//   qkv [n] = x @ W_qkv_hat.T + qkv_bias            n = (H + 2 H_kv) D: q | k | v, fp32 scratch
//   q, k   = each head h: h * cos + rot(h) * sin,   rot(h) = (-h[D/2:], h[:D/2])   (HF's rotate_half)
//   keys[0, :, index] = k, values[0, :, index] = v   (in place: the cache the program owns)
//   a [H D] = attention of q over keys / values [0, length) (mask optional), fp32 scratch
//   y [..., d_out] = a @ W_o_hat.T + o_bias
// What fuse_attention puts in place of that subgraph of an exported decode step: the products and
// the attention are group_sparse_linear's and decode_attention's own (their shares, attend_heads),
// so the numbers are the unfused graph's; the call saves two op calls, the rope's generated kernel
// and the views, buffers and handles around them, and where both products split over threads it
// runs them and the attention in one parallel region (one_region: one fork and three barriers
// where the ops forked and joined three times; docs/lowering.md). float32 x on a batch-1 cache
// only; anything else goes to the op's torch implementation.

namespace {

// Why attention_block's kernel cannot run these inputs, or null when it can (the layers are
// checked by layer_of).
const char* block_unsupported(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                              const at::Tensor& index, const at::Tensor& keys, const at::Tensor& values, int64_t length,
                              const std::optional<at::Tensor>& mask, int64_t heads) {
  if (x.scalar_type() != at::kFloat || x.numel() != width(x)) return "x: float32, one token";
  if (keys.scalar_type() != at::kFloat || values.scalar_type() != at::kFloat || keys.dim() != 4 ||
      keys.sizes() != values.sizes() || keys.size(0) != 1 || keys.stride(3) != 1 || values.stride(3) != 1)
    return "keys and values: float32 [1, H_kv, M, D], contiguous last dimension";
  const int64_t H_kv = keys.size(1), D = keys.size(3), M = keys.size(2);
  if (H_kv == 0 || heads <= 0 || heads % H_kv != 0 || D == 0 || D % 2 != 0) return "heads a multiple of H_kv, D even";
  for (const at::Tensor* t : {&cos, &sin})
    if (t->scalar_type() != at::kFloat || t->numel() != D || !t->is_contiguous()) return "cos and sin: float32, D each";
  if (index.scalar_type() != at::kLong || index.numel() != 1) return "index: one int64";
  const int64_t slot = *index.data_ptr<int64_t>();
  if (slot < 0 || slot >= M || length < slot + 1 || length > M) return "index in [0, M), length in [index + 1, M]";
  if (mask.has_value()) {
    const at::Tensor& m = *mask;
    if (m.scalar_type() != at::kBool || m.dim() != 4 || m.size(0) != 1 || m.size(1) != 1 || m.size(2) != 1 ||
        m.size(3) != length)
      return "mask: bool [1, 1, 1, length]";
  }
  return nullptr;
}

// q and k heads [0, n) of `h` [n, D] rotated in place by cos, sin [D]. fp-contract off: the two
// products and their sum rounded one by one, as the unfused graph's generated kernel computes them.
__attribute__((optimize("fp-contract=off"))) void rope(float* __restrict h, int64_t n, int64_t D,
                                                         const float* __restrict cos, const float* __restrict sin) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < n; ++i) {
    float* r = h + i * D;
    for (int64_t d = 0; d < half; ++d) {
      const float a = r[d], b = r[d + half];
      const float lo = a * cos[d] + -b * sin[d];
      const float hi = b * cos[d + half] + a * sin[d + half];
      r[d] = lo;
      r[d + half] = hi;
    }
  }
}

// The non-empty blocks of a packed layer of width d_in (layer_of's tensors) as V's products read them.
template <class V>
void layer_blocks(const Layer& layer, int64_t d_in, int64_t g_in, std::vector<Block<V>>& blocks) {
  blocks_for(static_cast<const V*>(layer.values.data_ptr()),
             layer.scales.defined() ? layer.scales.data_ptr() : nullptr, layer.rows.data_ptr<int64_t>(),
             layer.row_ptr.data_ptr<int32_t>(), layer.row_ptr.numel() - 1, d_in, g_in, blocks);
}

// The attention block's two products (`x` [d_in] -> `h` [n], `att` [d_att] -> `y` [d_out]), with
// `between` (the rope and cache writes, on thread 0) and `attend_share(p, P)` (thread p's query
// heads) between them, in one OpenMP region of P threads with three barriers, where the three ops'
// own calls forked and joined three times. Each product is split as stream_split splits it (thread
// p's share into y or its partial, the partials added in thread order), so the numbers are the
// same. false when a share finds row_idx wanting: then the first product's false leaves the cache
// unwritten.
template <class V, class Between, class AttendShare>
bool one_region(const float* xp, int64_t d_in, const Layer& qkv, float* h, int64_t n, const float* att,
                int64_t d_att, const Layer& o, float* yp, int64_t d_out, int64_t g_in, int64_t threads,
                const Between& between, const AttendShare& attend_share) {
  static thread_local std::vector<Block<V>> kept_qkv, kept_o;
  // the region's threads must see this thread's vectors: references, not the thread_local names
  std::vector<Block<V>>& qb = kept_qkv;
  std::vector<Block<V>>& ob = kept_o;
  layer_blocks<V>(qkv, d_in, g_in, qb);
  layer_blocks<V>(o, d_att, g_in, ob);
  int64_t total_q = 0, total_o = 0;
  for (const Block<V>& b : qb) total_q += share_weight(b);
  for (const Block<V>& b : ob) total_o += share_weight(b);
  const int64_t cap_q = stream_capacity(qb, 1), cap_o = stream_capacity(ob, 1);
  const V* end_q = static_cast<const V*>(qkv.values.data_ptr()) + qkv.values.numel();
  const V* end_o = static_cast<const V*>(o.values.data_ptr()) + o.values.numel();
  const float* bias_q = qkv.bias.defined() ? qkv.bias.data_ptr<float>() : nullptr;
  const float* bias_o = o.bias.defined() ? o.bias.data_ptr<float>() : nullptr;
  float* partial = thread_scratch(1, (threads - 1) * std::max(n, d_out));
  std::atomic<bool> bad{false};
  int64_t team = 1;
#pragma omp parallel num_threads(threads)
  {
    const int64_t p = omp_get_thread_num(), P = omp_get_num_threads();
    if (p == 0) team = P;
    if (!stream_share(qb, total_q, p, P, xp, 1, d_in, split_output(h, partial, p, 1, n, bias_q), n, end_q, cap_q,
                      false))
      bad.store(true, std::memory_order_relaxed);
#pragma omp barrier
    if (p == 0 && !bad.load()) {
      add_partials(h, partial, P, n);
      between();
    }
#pragma omp barrier
    if (!bad.load()) attend_share(p, P);
#pragma omp barrier
    if (!bad.load() && !stream_share(ob, total_o, p, P, att, 1, d_att, split_output(yp, partial, p, 1, d_out, bias_o),
                                     d_out, end_o, cap_o, false))
      bad.store(true, std::memory_order_relaxed);
  }
  if (bad.load()) return false;
  add_partials(yp, partial, team, d_out);
  return true;
}

at::Tensor attention_block_torch_implementation(torch::jit::Stack stack) {
  return call_torch_implementation("gmc::attention_block", std::move(stack),
                                   "float32 x of one token over a float32 batch-1 cache, on valid packed layouts");
}

}  // namespace

at::Tensor attention_block(const at::Tensor& x, const at::Tensor& qkv_values, const at::Tensor& qkv_row_idx,
                           const at::Tensor& qkv_row_ptr, const std::optional<at::Tensor>& qkv_bias,
                           const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& index, at::Tensor& keys,
                           at::Tensor& values, int64_t length, const std::optional<at::Tensor>& mask, double scale,
                           const at::Tensor& o_values, const at::Tensor& o_row_idx, const at::Tensor& o_row_ptr,
                           const std::optional<at::Tensor>& o_bias, int64_t heads, int64_t d_out, int64_t g_in,
                           const std::optional<at::Tensor>& qkv_scales, const std::optional<at::Tensor>& o_scales) {
  const auto fallback = [&] {
    return attention_block_torch_implementation({x, qkv_values, qkv_row_idx, qkv_row_ptr, qkv_bias, cos, sin, index,
                                                 keys, values, length, mask, scale, o_values, o_row_idx, o_row_ptr,
                                                 o_bias, heads, d_out, g_in, qkv_scales, o_scales});
  };
  if (block_unsupported(x, cos, sin, index, keys, values, length, mask, heads)) return fallback();
  const int64_t H_kv = keys.size(1), D = keys.size(3), n = (heads + 2 * H_kv) * D;
  Layer qkv, o;
  if (!layer_of(at::kFloat, width(x), qkv_values, qkv_row_idx, qkv_row_ptr, qkv_bias, n, g_in, qkv_scales, qkv) ||
      !layer_of(at::kFloat, heads * D, o_values, o_row_idx, o_row_ptr, o_bias, d_out, g_in, o_scales, o))
    return fallback();
  const at::Tensor xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  float* h = thread_scratch(3, n);
  float* att = thread_scratch(4, heads * D);
  const int64_t slot = *index.data_ptr<int64_t>();
  float* kp = keys.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  const auto between = [&] {  // q and k rotated, k and v into the cache
    rope(h, heads + H_kv, D, cos.data_ptr<float>(), sin.data_ptr<float>());
    for (int64_t j = 0; j < H_kv; ++j) {
      std::memcpy(kp + j * keys.stride(1) + slot * keys.stride(2), h + (heads + j) * D, D * sizeof(float));
      std::memcpy(vp + j * values.stride(1) + slot * values.stride(2), h + (heads + H_kv + j) * D, D * sizeof(float));
    }
  };
  const at::Tensor m = mask.has_value() ? *mask : at::Tensor();
  const Attention a{h, kp, vp, m.defined() ? m.data_ptr<bool>() : nullptr, att, 1, heads, H_kv, D, length,
                    heads * D, D, keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1),
                    values.stride(2), 0, m.defined() ? m.stride(3) : 0};
  // one region when both products split (as run_layer would split them) over values of one dtype;
  // else the three ops' own calls, one after the other
  const int64_t threads = at::get_num_threads();
  const auto vt = qkv.values.scalar_type();
  const auto split = [](const Layer& l) { return splits(l.values.numel(), l.values.scalar_type() == at::kByte); };
  if (threads > 1 && !at::in_parallel_region() && vt == o.values.scalar_type() && split(qkv) && split(o)) {
    const auto attend_share = [&](int64_t p, int64_t P) {
      attend_range<float>(a, scale, heads * p / P, heads * (p + 1) / P);
    };
    at::Tensor y = output(xc, 1, d_out, [&](float* yp) {
      const auto run = [&](auto tag) {
        using V = decltype(tag);
        return one_region<V>(xp, width(xc), qkv, h, n, att, heads * D, o, yp, d_out, g_in, threads, between,
                             attend_share);
      };
      switch (vt) {
        case at::kBFloat16: return run(bf16{});
        case at::kChar: return run(int8_t{});
        case at::kByte: return run(int4x2{});
        default: return run(float{});
      }
    });
    return y.defined() ? y : fallback();  // (the cache slot is rewritten with the same numbers)
  }
  if (!run_layer(xp, 1, width(xc), qkv.values, qkv.scales, qkv.rows, qkv.row_ptr,
                 qkv.bias.defined() ? qkv.bias.data_ptr<float>() : nullptr, h, n, g_in, AUTO))
    return fallback();
  between();
  attend<float>(a, scale);
  at::Tensor y = output(xc, 1, d_out, [&](float* yp) {
    return run_layer(att, 1, heads * D, o.values, o.scales, o.rows, o.row_ptr,
                     o.bias.defined() ? o.bias.data_ptr<float>() : nullptr, yp, d_out, g_in, AUTO);
  });
  return y.defined() ? y : fallback();  // (the cache slot is rewritten with the same numbers)
}

// Its C shim, as group_sparse_linear's; keys and values are written in place.
extern "C" AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_attention_block(
    AtenTensorHandle x, AtenTensorHandle qkv_values, AtenTensorHandle qkv_row_idx, AtenTensorHandle qkv_row_ptr,
    AtenTensorHandle* qkv_bias, AtenTensorHandle cos, AtenTensorHandle sin, AtenTensorHandle index,
    AtenTensorHandle keys, AtenTensorHandle values, int64_t length, AtenTensorHandle* mask, double scale,
    AtenTensorHandle o_values, AtenTensorHandle o_row_idx, AtenTensorHandle o_row_ptr, AtenTensorHandle* o_bias,
    int64_t heads, int64_t d_out, int64_t g_in, AtenTensorHandle* qkv_scales, AtenTensorHandle* o_scales,
    AtenTensorHandle* out) {
  using torch::aot_inductor::new_tensor_handle;
  using torch::aot_inductor::pointer_to_optional;
  using torch::aot_inductor::tensor_handle_to_tensor_pointer;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *out = new_tensor_handle(attention_block(
        *tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(qkv_values),
        *tensor_handle_to_tensor_pointer(qkv_row_idx), *tensor_handle_to_tensor_pointer(qkv_row_ptr),
        pointer_to_optional<at::Tensor>(qkv_bias), *tensor_handle_to_tensor_pointer(cos),
        *tensor_handle_to_tensor_pointer(sin), *tensor_handle_to_tensor_pointer(index),
        *tensor_handle_to_tensor_pointer(keys), *tensor_handle_to_tensor_pointer(values), length,
        pointer_to_optional<at::Tensor>(mask), scale, *tensor_handle_to_tensor_pointer(o_values),
        *tensor_handle_to_tensor_pointer(o_row_idx), *tensor_handle_to_tensor_pointer(o_row_ptr),
        pointer_to_optional<at::Tensor>(o_bias), heads, d_out, g_in, pointer_to_optional<at::Tensor>(qkv_scales),
        pointer_to_optional<at::Tensor>(o_scales)));
  });
}

// Strict entry for tests and benchmarks: x [T, d_in] contiguous, row_idx int64, inputs the op
// compiles and a layout that passes blocks_ok and rows_ok (else an error); path forces a product
// (1 stream, 2 tiles, 3 gemm).
at::Tensor forward(const at::Tensor& x, const at::Tensor& values, const at::Tensor& row_idx,
                   const at::Tensor& row_ptr, const std::optional<at::Tensor>& bias, int64_t d_out,
                   int64_t g_in, int64_t path, const std::optional<at::Tensor>& scales) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: contiguous [T, d_in]");
  TORCH_CHECK(row_idx.is_contiguous() && row_idx.scalar_type() == at::kLong, "row_idx: contiguous int64");
  const char* reason = unsupported(x.scalar_type(), width(x), values, row_idx, row_ptr, bias, d_out, g_in, scales);
  TORCH_CHECK(reason == nullptr, reason);
  const char* layout = "values / row_idx / row_ptr do not describe one packed layer "
                       "(row_idx ascending inside each block, within [0, d_out))";
  TORCH_CHECK(blocks_ok(values.numel(), row_idx.numel(), row_ptr.data_ptr<int32_t>(), row_ptr.numel() - 1,
                        x.size(1), g_in, values.scalar_type() == at::kByte, scales.has_value() ? scales->numel() : 0),
              layout);
  at::Tensor y = run(x, values, scales.has_value() ? scales->contiguous() : at::Tensor(), row_idx, row_ptr,
                     bias.has_value() ? bias->contiguous() : at::Tensor(), d_out, g_in, path);
  TORCH_CHECK(y.defined(), layout);  // run checks row_idx (rows_ok) before or while it adds
  return y;
}

// Each op's schema is defined once, in Python (gmc/kernels/group_sparse_linear.py,
// gmc/kernels/decode_attention.py, gmc/kernels/gated_mlp.py), which loads this library at an op's
// first float32 or bfloat16 CPU call; the runtime library defines them from the same strings
// (gmc.formats.compiled.SCHEMAS).
#ifdef GMC_RUNTIME_LIBRARY
TORCH_LIBRARY(gmc, m) {
  for (const char* schema : GMC_SCHEMAS) m.def(schema);
}
#endif

TORCH_LIBRARY_IMPL(gmc, CPU, m) {
  m.impl("group_sparse_linear", &group_sparse_linear);
  m.impl("decode_attention", &decode_attention);
  m.impl("group_sparse_gated_mlp", &group_sparse_gated_mlp);
  m.impl("attention_block", &attention_block);
}

#ifndef GMC_RUNTIME_LIBRARY
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("forward", &forward,
        "group-sparse linear: x fp32/bf16, values of x's dtype or int8 with scales (path: 0 auto, 1 stream, "
        "2 tiles, 3 gemm)",
        py::arg("x"), py::arg("values"), py::arg("row_idx"), py::arg("row_ptr"), py::arg("bias"), py::arg("d_out"),
        py::arg("g_in"), py::arg("path"), py::arg("scales") = py::none());
}
#endif
