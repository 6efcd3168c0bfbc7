// Fused CPU kernel for gmc::group_sparse_linear on the packed BSC format (gmc/kernels/packed.py).
//
//   y = bias (or 0)                                      // [T, d_out]
//   one parallel region; thread p owns output rows [a_p, b_p) (no two threads write one row)
//   for tiles and gemm; the stream (decode) splits the layer's k rows instead (stream_split_k):
//     for each input block v:                            // values_v [w_v, R_v] row-major
//       [i0, i1) = kept rows of block v inside [a_p, b_p)   // row_idx ascending: binary search
//       y[:, row_idx[i0:i1]] += x[:, cols_v] @ values_v[:, i0:i1]   // one of these products:
//
//   stream  (T <= STREAM_MAX_TOKENS): decode. Walk k down the block, reading up to ACC / T
//           contiguous values per k row into an accumulator acc[T, <= ACC / T]; each pass takes one k row from each
//           eighth of the block, so eight streams far apart are in flight at once (one or four
//           nearby streams left DRAM half idle: docs/lowering.md, "Decode kernel").
//   tiles   (T <= GEMM_MIN_TOKENS): a TT x RR register tile (6 x 64 fp32 on AVX-512) over the
//           [w_v, RR] panel, software-prefetched (the panel rows are R_v apart).
//   gemm    (larger T): at::mm of values_v[:, i0:i1].T @ x_v.T (MKL/oneDNN, single-threaded inside
//           the region) into per-thread scratch, stored (a row's first block) or added row by row
//           into the thread's y rows kept transposed ([rows, T]: contiguous), which are written
//           into y, with the bias, at the end (y is not cleared first). bf16/int8 values are
//           first converted to fp32, GEMM_CHUNK columns at a time, into a per-thread panel.
//   integer (int4 at every T, int8 above STREAM_MAX_TOKENS; what path AUTO picks for them): x
//           quantized to int8 per 32 numbers, integer dot products over tiles of INT4_TILE
//           columns, INT4_TOKENS tokens at a time (stream_int4, int4_rows, int8_rows).
//
// Dtypes: values are fp32, bf16, int8 (weight-only, with one fp32 scale per packed column) or
// int4 (two codes a byte, an fp16 scale and offset per column and 32 k rows: see "int4 values");
// every product but the integer one converts them to fp32 as it loads them (bf16 by a 16-bit
// shift) and accumulates in fp32; int8 accumulators are multiplied by their column's scale when
// they are added into y. int4 tiles and gemm dequantize into fp32 panels.
// x, bias and y are fp32 inside: a bf16 x (and bias) is converted on entry and y back on exit
// (T * (d_in + d_out) numbers, small beside the weights).
//
// Every kept weight is read once per token tile (once in total for decode) and no pruned weight
// is read; partial products go straight into y with plain adds (rows are unique within a block
// and owned by one thread), so there are no index_add_ temporaries, no atomics, and one
// fork/join per call. Precondition (what gmc.kernels.packed.pack produces; checked on every call, by the
// decode stream chunk by chunk as it reaches the rows, by the other products before they start:
// blocks_ok, rows_ok): row_idx is strictly ascending inside each block. Thresholds: measured on a 2-vCPU
// AVX-512 Xeon, see docs/lowering.md.
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

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int VEC = 16;  // floats per vector register (zmm)
constexpr int NV = 4;    // vectors per tile row: RR = 64 rows
#else
constexpr int VEC = 8;   // ymm (AVX2) or two xmm: GCC splits the vector type as needed
constexpr int NV = 2;    // RR = 16 rows: 6 x 2 accumulators fit 16 registers
#endif
constexpr int RR = VEC * NV;  // kept rows per register tile
constexpr int TT_MAX = 6;     // tokens per register tile: TT_MAX * NV accumulators
constexpr int PF = 8;         // software prefetch distance in panel rows
// stream: most accumulator floats (256 KB, in L2); T tokens take up to ACC / T rows of a block per
// sweep, the accumulator sized for the layer's largest block, so one token sweeps every block
// once up to 65536 kept rows. Sweeps cut k rows into runs: at 4096 rows per sweep (16 KB) the
// 49152-row output head read 4 KB runs 48 KB apart (each a fresh page for the prefetcher) and
// streamed int8 at 12-14 GB/s, at 65536 rows 15-16 (docs/lowering.md); at 1024 rows
// dense gate/up streamed bf16 at 11 GB/s against 18-21 for down.
constexpr int64_t ACC = 65536;
constexpr int64_t STREAM_MAX_TOKENS = 4;
constexpr int64_t GEMM_MIN_TOKENS = 33;
constexpr int64_t GEMM_CHUNK = 256;  // gemm: columns of a bf16/int8 panel converted to fp32 at once
// Output-row ranges handed to threads start on multiples of this many rows (cache lines of y).
constexpr int64_t ROW_ALIGN = 16;
// Below this many kept weights a layer runs on one thread (fork/join costs more than it saves).
constexpr int64_t MIN_PARALLEL_NNZ = 1 << 15;

typedef float vfloat __attribute__((vector_size(VEC * sizeof(float))));
typedef uint16_t vbf16 __attribute__((vector_size(VEC * sizeof(uint16_t))));
typedef uint32_t vuint __attribute__((vector_size(VEC * sizeof(uint32_t))));
typedef int8_t vint8 __attribute__((vector_size(VEC)));
typedef int32_t vint __attribute__((vector_size(VEC * sizeof(int32_t))));

using bf16 = uint16_t;  // bfloat16 bits: the high half of an fp32

// int8 values carry a per-column scale, applied when a column's accumulator is added into y.
template <class V>
constexpr bool SCALED = std::is_same_v<V, int8_t>;

// int4 values (gmc.kernels.packed.quantize_int4). Block v's columns go in tiles of INT4_TILE (the
// last one narrower when R_v is not a multiple), one after another; tile j of width tw holds
// codes [ceil(w_v / 8)][tw][4] bytes: for each octet of k rows, column c's 8 codes (0..15) in one
// 32-bit word, byte i holding k rows 8o + 2i (low nibble) and 8o + 2i + 1 (high nibble), 0 past
// w_v; and scales [ceil(w_v / INT4_GROUP)][2][tw] fp16: over the INT4_GROUP k rows of subgroup s,
// column c's weights are q * d[s, c] + m[s, c]. Tile j starts at byte 16 j ceil(w_v / 8) 4 of the
// block and at scale 16 j ceil(w_v / INT4_GROUP) 2. Block v starts at byte
// row_ptr[v] * g_in / 2 and at scale row_ptr[v] * 2 * ceil(g_in / INT4_GROUP) (every block but the
// last is g_in wide; g_in a multiple of 8).
// A column's octet word is what an integer dot product takes: decode (stream_int4) quantizes each
// subgroup of x to int8 (one fp32 scale per 32 numbers, as llama.cpp's Q8 activations) and
// multiplies 4 codes by 4 int8 numbers per 32-bit lane (vpdpbusd with AVX512-VNNI, vpmaddubsw +
// vpmaddwd without), one int32 sum per column and subgroup, scaled once; a tile is read front to
// back in one pass, its sums kept in registers (with the columns' octet rows 4 R_v bytes apart, a
// pass over one subgroup read runs too short for the prefetcher: 8-11 GB/s). Prefill runs the same
// tile product, INT4_TOKENS tokens at a time, each thread over the tiles of its output rows
// (int4_rows): a dense 1536 x 576 layer, 256 tokens, one thread, 6.5 ms through fp32 panels and
// MKL, 2.0 ms so. The fp32 product of the same layout (path STREAM_FLOAT, any T) is the accuracy
// reference; paths TILES_ONLY and GEMM dequantize GEMM_CHUNK columns at a time into an fp32 panel
// and run the fp32 products on it.
constexpr int64_t INT4_GROUP = 32;
constexpr int64_t INT4_TILE = 16;  // columns a tile: the layout's, whatever this CPU's vector width
struct int4x2 {  // the value type of int4 blocks: two codes
  uint8_t bits;
};
template <class V>
constexpr bool INT4 = std::is_same_v<V, int4x2>;

// One stored weight as fp32.
inline float to_float(float v) { return v; }
inline float to_float(bf16 v) {
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(int8_t v) { return float(v); }

// VEC consecutive stored weights as fp32 (unaligned loads). bf16/int8 are widened by intrinsics
// where there are some: GCC's __builtin_convertvector of int8 lanes to float goes one lane at a
// time (vcvtsi2ss per weight), bf16 went through two xmm halves, and the loop vectorizer widened
// int8 through int16 with register spills: the int8 stream ran at 7-8 GB/s, a third of fp32's
// (docs/lowering.md, "Widening int8 and bf16").
inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vfloat load(const bf16* p) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#elif defined(__AVX2__)
  return (vfloat)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
#else
  vbf16 h;
  std::memcpy(&h, p, sizeof(h));
  const vuint bits = __builtin_convertvector(h, vuint) << 16;
  vfloat v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
#endif
}
inline vfloat load(const int8_t* p) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return (vfloat)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  vint8 q;
  std::memcpy(&q, p, sizeof(q));
  return __builtin_convertvector(__builtin_convertvector(q, vint), vfloat);
#endif
}
inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }

// VEC consecutive fp16 numbers as fp32.
inline vfloat load(const at::Half* p) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  return (vfloat)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vfloat v;
  for (int j = 0; j < VEC; ++j) v[j] = float(p[j]);
  return v;
#endif
}

inline vfloat splat(float c) { return vfloat{} + c; }

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

// y[rows[r]] += acc[r] (times scale[r] for int8 values), r < n.
template <class V>
inline void scatter_add(float* __restrict y, const int64_t* __restrict rows, const float* __restrict acc,
                        const float* __restrict scale, int64_t n) {
  if constexpr (SCALED<V>) {
    for (int64_t r = 0; r < n; ++r) y[rows[r]] += acc[r] * scale[r];
  } else {
    for (int64_t r = 0; r < n; ++r) y[rows[r]] += acc[r];
  }
}

// acc[TT, RR] = x[TT tokens, 0:w] @ v[0:w, 0:RR]; then y[t, rows[r]] += acc[t, r] for r < nr.
// v: panel of values_v (row stride ldv = R_v); x: row stride ldx; y: row stride ldy; scale: the
// panel's column scales (int8 values). nr < RR only for the last tile of a range: rows past nr
// are multiplied (the values after them, still inside the buffer: the caller checks and uses
// tile_tail at its very end) but never stored.
template <class V, int TT>
inline void tile_full(const V* __restrict v, int64_t ldv, int64_t w, const float* __restrict x,
                      int64_t ldx, const int64_t* __restrict rows, const float* __restrict scale, int nr,
                      float* __restrict y, int64_t ldy) {
  vfloat acc[TT][NV];
#pragma GCC unroll 8
  for (int t = 0; t < TT; ++t)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) acc[t][j] = vfloat{};
  for (int64_t k = 0; k < w; ++k) {
    const V* vk = v + k * ldv;
    // the panel is strided (ldv apart): prefetch PF rows ahead, the streamer does not
#pragma GCC unroll 8
    for (int j = 0; j < NV * VEC; j += 16) __builtin_prefetch(vk + PF * ldv + j, 0, 3);
    vfloat b[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) b[j] = load(vk + j * VEC);
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) {
      const vfloat a = vfloat{} + x[t * ldx + k];  // broadcast
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) acc[t][j] += a * b[j];
    }
  }
  alignas(64) float out[TT][RR];
  std::memcpy(out, acc, sizeof(out));
  for (int t = 0; t < TT; ++t) scatter_add<V>(y + t * ldy, rows, out[t], scale, nr);
}

// Same product for a tile of nr < RR rows at the end of values (no full-width read possible).
template <class V>
inline void tile_tail(const V* __restrict v, int64_t ldv, int64_t w, const float* __restrict x,
                      int64_t ldx, int tt, const int64_t* __restrict rows, const float* __restrict scale,
                      int nr, float* __restrict y, int64_t ldy) {
  float acc[TT_MAX][RR] = {};
  for (int64_t k = 0; k < w; ++k) {
    const V* vk = v + k * ldv;
    for (int t = 0; t < tt; ++t) {
      const float a = x[t * ldx + k];
#pragma omp simd
      for (int r = 0; r < nr; ++r) acc[t][r] += a * to_float(vk[r]);
    }
  }
  for (int t = 0; t < tt; ++t) scatter_add<V>(y + t * ldy, rows, acc[t], scale, nr);
}

template <class V>
using TileFn = void (*)(const V*, int64_t, int64_t, const float*, int64_t, const int64_t*, const float*, int,
                        float*, int64_t);
template <class V>
constexpr TileFn<V> TILES[TT_MAX + 1] = {nullptr,         tile_full<V, 1>, tile_full<V, 2>, tile_full<V, 3>,
                                         tile_full<V, 4>, tile_full<V, 5>, tile_full<V, 6>};

template <class V>
struct Block {
  const V* values;       // [w, R] row-major
  const int64_t* rows;   // [R] ascending output rows
  const float* scales;   // [R] column scales (int8 values), else null
  int64_t R, w, col;     // kept rows, width, first input column
  const at::Half* halves = nullptr;  // int4 values: [ceil(w / INT4_GROUP), 2, R] scales and offsets
};

// The non-empty blocks of a layer into `blocks` (cleared first).
template <class V>
void blocks_of(const V* values, const float* scales, const int64_t* row_idx, const int32_t* row_ptr,
               int64_t n_blocks, int64_t d_in, int64_t g_in, std::vector<Block<V>>& blocks) {
  blocks.clear();
  for (int64_t v = 0; v < n_blocks; ++v) {
    const int64_t start = row_ptr[v], R = row_ptr[v + 1] - row_ptr[v];
    const int64_t col = v * g_in, w = std::min(g_in, d_in - col);
    if (R > 0) blocks.push_back({values + start * g_in, row_idx + start, scales ? scales + start : nullptr, R, w, col});
  }
}

// The non-empty int4 blocks of a layer (see INT4_GROUP for their layout) into `blocks`.
void blocks_of4(const int4x2* values, const at::Half* scales, const int64_t* row_idx, const int32_t* row_ptr,
                int64_t n_blocks, int64_t d_in, int64_t g_in, std::vector<Block<int4x2>>& blocks) {
  const int64_t subgroups = (g_in + INT4_GROUP - 1) / INT4_GROUP;
  blocks.clear();
  for (int64_t v = 0; v < n_blocks; ++v) {
    const int64_t start = row_ptr[v], R = row_ptr[v + 1] - row_ptr[v];
    const int64_t col = v * g_in, w = std::min(g_in, d_in - col);
    if (R > 0)
      blocks.push_back({values + start * (g_in / 2), row_idx + start, nullptr, R, w, col,
                        scales + start * 2 * subgroups});
  }
}

// Kept rows of `b` whose output row lies in [a, e): [i0, i1) by binary search.
template <class V>
inline std::pair<int64_t, int64_t> rows_in(const Block<V>& b, int64_t a, int64_t e) {
  const int64_t* lo = std::lower_bound(b.rows, b.rows + b.R, a);
  const int64_t* hi = std::lower_bound(lo, b.rows + b.R, e);
  return {lo - b.rows, hi - b.rows};
}

// The scales of the columns from i of `b` (int8 values), else null.
template <class V>
inline const float* column_scales(const Block<V>& b, int64_t i) {
  return SCALED<V> ? b.scales + i : nullptr;
}

// a[r] += sum_i xs[i] * v[i * step + r] for r < n: K k rows (step apart) into one accumulator row,
// VEC rows at a time in two FMA chains, so the K x broadcasts, two sums and a load stay in
// registers (the loop vectorizer spilled them for int8, widened through int16).
template <int K, class V>
inline void add_rows(float* __restrict a, const V* __restrict v, int64_t step, const float* xs, int64_t n) {
  vfloat xv[K];
#pragma GCC unroll 8
  for (int i = 0; i < K; ++i) xv[i] = vfloat{} + xs[i];
  int64_t r = 0;
  for (; r + VEC <= n; r += VEC) {
    vfloat s0 = load(a + r), s1 = vfloat{};
#pragma GCC unroll 8
    for (int i = 0; i < K; i += 2) {
      s0 += xv[i] * load(v + i * step + r);
      if (i + 1 < K) s1 += xv[i + 1] * load(v + (i + 1) * step + r);
    }
    store(a + r, s0 + s1);
  }
  for (; r < n; ++r) {
    float sum = a[r];
    for (int i = 0; i < K; ++i) sum += xs[i] * to_float(v[i * step + r]);
    a[r] = sum;
  }
}

// True when rows[0..n) rise strictly from above `prev` and the last is below d_out: then every
// one lies in [0, d_out) (with prev = -1) and none repeats. Branch-free, so it vectorizes.
inline bool rows_rise(const int64_t* __restrict rows, int64_t n, int64_t prev, int64_t d_out) {
  if (n == 0) return true;
  bool bad = rows[0] <= prev || rows[n - 1] >= d_out;
  for (int64_t i = 1; i < n; ++i) bad |= rows[i] <= rows[i - 1];
  return !bad;
}

// stream: y[:, rows[i0:i1]] += x @ values[:, i0:i1] in chunks of cw rows (acc: [T, cw] scratch of
// `capacity` floats, stream_capacity). Each chunk's rows are checked first (rows_rise, from the
// block's first row): false, and nothing of that chunk added, when they do not rise inside
// [0, d_out). Rows stay in L1 for the scatter, so the check costs no memory traffic.
template <class V>
bool stream_rows(const Block<V>& b, int64_t i0, int64_t i1, const float* __restrict x, int64_t ldx,
                 int64_t T, float* __restrict y, int64_t ldy, float* __restrict acc, int64_t capacity,
                 const V* values_end, int64_t d_out) {
  const int64_t R = b.R, w = b.w;
  const int64_t cw = capacity / T / VEC * VEC;
  for (int64_t c0 = i0; c0 < i1; c0 += cw) {
    const int64_t n = std::min(cw, i1 - c0);
    if (!rows_rise(b.rows + c0, n, c0 > 0 ? b.rows[c0 - 1] : -1, d_out)) return false;
    // whole vectors: the columns past n read the next values of the buffer into accumulator slots
    // never added into y, unless the last k row would then read past the buffer
    const int64_t np = (n + VEC - 1) / VEC * VEC;
    const int64_t m = b.values + (w - 1) * R + c0 + np <= values_end ? np : n;
    for (int64_t t = 0; t < T; ++t) std::memset(acc + t * cw, 0, m * sizeof(float));
    const V* v = b.values + c0;
    // One k row from each eighth of the block per pass: concurrent misses in eight regions keep
    // DRAM busy where eight adjacent rows (one region) reached 8-10 GB/s on SmolLM2's shapes.
    const int64_t seg = w / 8;  // rows per eighth
    for (int64_t k = 0; k < seg; ++k)
      for (int64_t t = 0; t < T; ++t) {
        const float* xt = x + t * ldx + k;
        const float xs[8] = {xt[0], xt[seg], xt[2 * seg], xt[3 * seg], xt[4 * seg], xt[5 * seg], xt[6 * seg], xt[7 * seg]};
        add_rows<8>(acc + t * cw, v + k * R, seg * R, xs, m);
      }
    int64_t k = 8 * seg;
    for (; k + 4 <= w; k += 4)
      for (int64_t t = 0; t < T; ++t) add_rows<4>(acc + t * cw, v + k * R, R, x + t * ldx + k, m);
    for (; k < w; ++k)
      for (int64_t t = 0; t < T; ++t) add_rows<1>(acc + t * cw, v + k * R, R, x + t * ldx + k, m);
    for (int64_t t = 0; t < T; ++t) scatter_add<V>(y + t * ldy, b.rows + c0, acc + t * cw, column_scales(b, c0), n);
  }
  return true;
}

// Accumulator floats the stream needs for T tokens over `blocks`: T rows of the largest block in
// whole vectors, at most ACC.
template <class V>
int64_t stream_capacity(const std::vector<Block<V>>& blocks, int64_t T) {
  int64_t rows = VEC;
  for (const Block<V>& b : blocks) rows = std::max(rows, (b.R + VEC - 1) / VEC * VEC);
  return std::min(ACC / T / VEC * VEC, rows) * T;
}

// This thread's scratch of at least n floats (slot: which of its buffers: 0 the stream's
// accumulator, 1 split-k partials, 2 decode attention's rows, 3 and 4 the gated MLP's rows, 5 an
// int4 tile panel), kept across calls and
// grown as needed, uninitialised: decode makes ~120 calls per token, and a fresh accumulator per
// call was a malloc and free each (an mmap and page faults past glibc's 128 KB threshold).
float* thread_scratch(int slot, int64_t n) {
  thread_local std::vector<float> buffers[6];
  std::vector<float>& buffer = buffers[slot];
  if (int64_t(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

void init_rows(float* y, int64_t T, int64_t d_out, const float* bias, int64_t a, int64_t e) {
  for (int64_t t = 0; t < T; ++t) {
    float* yt = y + t * d_out;
    if (bias) std::memcpy(yt + a, bias + a, (e - a) * sizeof(float));
    else std::memset(yt + a, 0, (e - a) * sizeof(float));
  }
}

// tiles: y[:, rows[i0:i1]] += x @ values[:, i0:i1], RR rows x TT_MAX tokens at a time.
template <class V>
void tile_rows(const Block<V>& b, int64_t i0, int64_t i1, const float* x, int64_t ldx, int64_t T,
               float* y, int64_t ldy, const V* values_end) {
  for (int64_t i = i0; i < i1; i += RR) {
    const int nr = static_cast<int>(std::min<int64_t>(RR, i1 - i));
    const V* panel = b.values + i;  // [w, nr] columns of the [w, R] block
    const bool full_ok = panel + (b.w - 1) * b.R + RR <= values_end;  // prefetches may run past it
    for (int64_t t = 0; t < T; t += TT_MAX) {
      const int tt = static_cast<int>(std::min<int64_t>(TT_MAX, T - t));
      if (full_ok)
        TILES<V>[tt](panel, b.R, b.w, x + t * ldx, ldx, b.rows + i, column_scales(b, i), nr, y + t * ldy, ldy);
      else
        tile_tail<V>(panel, b.R, b.w, x + t * ldx, ldx, tt, b.rows + i, column_scales(b, i), nr, y + t * ldy, ldy);
    }
  }
}

// gemm: part[n, T] = values[:, i0:i1].T @ x_v.T by at::mm (MKL reads both as transposed views),
// then yT[rows - a, :] += part (times the column scale for int8): T contiguous adds per kept row,
// where adding a [T, n] part into y was a scalar scatter per number (15% of a lowered SmolLM2
// prefill; AVX2 has no scatter). A row's first block stores instead (`written`), so yT is never
// cleared (clearing yT and y took 3% of a lowered SmolLM2 256-token prefill).
// fp32 values are read in place (a strided view, lda = R,
// n = i1 - i0); bf16/int8 values are first converted into `panel` [w, n] fp32, n = GEMM_CHUNK
// columns at a time. yT: the thread's rows [a, e) of y, transposed ([e - a, T]).
template <class V>
void gemm_rows(const Block<V>& b, int64_t i0, int64_t i1, const at::Tensor& x, const at::Tensor& values,
               float* __restrict yT, uint8_t* __restrict written, int64_t a, at::Tensor& scratch,
               at::Tensor& panel_scratch) {
  const int64_t T = x.size(0);
  const at::Tensor xv = x.narrow(1, b.col, b.w);  // [T, w]
  const int64_t chunk = std::is_same_v<V, float> ? i1 - i0 : GEMM_CHUNK;
  for (int64_t c0 = i0; c0 < i1; c0 += chunk) {
    const int64_t n = std::min(chunk, i1 - c0);
    at::Tensor panel;  // [w, n] fp32
    if constexpr (std::is_same_v<V, float>) {
      const int64_t offset = (b.values - values.data_ptr<float>()) + c0;
      panel = values.as_strided({b.w, n}, {b.R, 1}, values.storage_offset() + offset);
    } else {
      panel = panel_scratch.narrow(0, 0, b.w * n).view({b.w, n});
      float* pp = panel.data_ptr<float>();
      for (int64_t k = 0; k < b.w; ++k) {
        const V* __restrict vk = b.values + k * b.R + c0;
        float* __restrict pk = pp + k * n;
#pragma omp simd
        for (int64_t r = 0; r < n; ++r) pk[r] = to_float(vk[r]);
      }
    }
    at::Tensor part = scratch.narrow(0, 0, n * T).view({n, T});
    at::mm_out(part, panel.t(), xv.t());  // [n, w] @ [w, T]
    const float* pp = part.data_ptr<float>();
    for (int64_t r = 0; r < n; ++r) {
      const int64_t row = b.rows[c0 + r] - a;
      float* __restrict dst = yT + row * T;
      const float* __restrict src = pp + r * T;
      const float scale = SCALED<V> ? b.scales[c0 + r] : 1.0f;
      if (written[row]) {
#pragma omp simd
        for (int64_t t = 0; t < T; ++t) dst[t] += scale * src[t];
      } else {  // the row's first block: yT starts uninitialised
#pragma omp simd
        for (int64_t t = 0; t < T; ++t) dst[t] = scale * src[t];
        written[row] = 1;
      }
    }
  }
}

#if defined(__AVX2__)
// y[c * ldy + r] = yT[r * T + c] + bias[r] for r, c < 8 (bias: null for none): one 8 x 8 tile
// transposed in registers (the rows' unpack, shuffle and 128-bit permute steps), so y and yT are
// both accessed in runs of 8.
inline void store_tile8(float* __restrict y, int64_t ldy, const float* __restrict yT, int64_t T,
                        const float* __restrict bias) {
  __m256 r[8], s[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(yT + i * T);
  for (int i = 0; i < 8; i += 4) {  // rows i..i+3: s[i + j] holds column j (low lane) and j + 4 (high)
    const __m256 t0 = _mm256_unpacklo_ps(r[i], r[i + 1]), t1 = _mm256_unpackhi_ps(r[i], r[i + 1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[i + 2], r[i + 3]), t3 = _mm256_unpackhi_ps(r[i + 2], r[i + 3]);
    s[i] = _mm256_shuffle_ps(t0, t2, 0x44);
    s[i + 1] = _mm256_shuffle_ps(t0, t2, 0xEE);
    s[i + 2] = _mm256_shuffle_ps(t1, t3, 0x44);
    s[i + 3] = _mm256_shuffle_ps(t1, t3, 0xEE);
  }
  const __m256 b = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  for (int c = 0; c < 4; ++c) {
    _mm256_storeu_ps(y + c * ldy, _mm256_add_ps(b, _mm256_permute2f128_ps(s[c], s[c + 4], 0x20)));
    _mm256_storeu_ps(y + (c + 4) * ldy, _mm256_add_ps(b, _mm256_permute2f128_ps(s[c], s[c + 4], 0x31)));
  }
}
#endif

// y[t, a + i] = yT[i, t] + bias[a + i] for the thread's rows [a, e) (bias: null for none): the
// gemm product's only write of y, so y needs no clearing first. On AVX2 8 rows x 8 tokens at a
// time through registers (store_tile8), where one strided load per number took 9% of the op's
// time in a 256-token prefill (perf); the rows and tokens left
// over, and other CPUs, 64 rows of yT at a time, so y is written in runs of 64 and the 64 yT rows
// stay in cache across the tokens.
void write_transposed(float* __restrict y, int64_t ldy, const float* __restrict yT, int64_t T, int64_t a,
                      int64_t e, const float* __restrict bias) {
  int64_t done = 0;  // rows of [a, e) written
#if defined(__AVX2__)
  for (; done + 8 <= e - a; done += 8) {
    const float* b = bias ? bias + a + done : nullptr;
    int64_t t = 0;
    for (; t + 8 <= T; t += 8) store_tile8(y + t * ldy + a + done, ldy, yT + done * T + t, T, b);
    for (; t < T; ++t)
      for (int64_t i = done; i < done + 8; ++i) y[t * ldy + a + i] = yT[i * T + t] + (bias ? bias[a + i] : 0.0f);
  }
#endif
  constexpr int64_t STRIP = 64;
  for (int64_t i0 = done; i0 < e - a; i0 += STRIP) {
    const int64_t i1 = std::min(e - a, i0 + STRIP);
    for (int64_t t = 0; t < T; ++t) {
      float* __restrict yt = y + t * ldy + a;
      for (int64_t i = i0; i < i1; ++i) yt[i] = yT[i * T + t] + (bias ? bias[a + i] : 0.0f);
    }
  }
}

// STREAM_FLOAT: the int4 product in fp32 (x not quantized), the integer product's accuracy reference.
enum Path : int64_t { AUTO = 0, STREAM = 1, TILES_ONLY = 2, GEMM = 3, STREAM_FLOAT = 4 };

// True when row_ptr [n_blocks + 1] and a values buffer of n_values numbers fit R kept rows of one
// packed layer: row_ptr rises from 0 to R and the blocks fill the values exactly (no read past
// them), and for int4 values (n_values bytes) n_scales fp16 numbers fill their scales exactly.
// n_blocks + 1 numbers: checked on every call.
bool blocks_ok(int64_t n_values, int64_t R, const int32_t* ptr, int64_t n_blocks, int64_t d_in, int64_t g_in,
               bool int4 = false, int64_t n_scales = 0) {
  if (ptr[0] != 0 || ptr[n_blocks] != R) return false;
  int64_t expected = 0, expected_scales = 0;
  for (int64_t v = 0; v < n_blocks; ++v) {
    if (ptr[v + 1] < ptr[v]) return false;
    const int64_t rows = ptr[v + 1] - ptr[v], w = std::min(g_in, d_in - v * g_in);
    expected += rows * (int4 ? (w + 7) / 8 * 4 : w);
    expected_scales += rows * 2 * ((w + INT4_GROUP - 1) / INT4_GROUP);
  }
  return expected == n_values && (!int4 || expected_scales == n_scales);
}

// True when row_idx (of a layout blocks_ok accepted) is strictly ascending inside each block and
// within [0, d_out): a thread only visits the rows of its own range (others would be lost or
// written out of bounds). One pass over the indices, 8 bytes per kept row of 256 weights: the
// decode stream checks each chunk's rows as it reaches them instead (stream_rows), so the pass
// is not a serial prologue of every call (6% of a 2-thread int8 decode step: docs/lowering.md).
bool rows_ok(const int64_t* rows, const int32_t* ptr, int64_t n_blocks, int64_t d_out) {
  for (int64_t v = 0; v < n_blocks; ++v)
    if (!rows_rise(rows + ptr[v], ptr[v + 1] - ptr[v], -1, d_out)) return false;
  return true;
}

// Thread p's output of a product split over P threads: y itself for p = 0, started from the bias,
// else its partial in `partial` [P - 1, T, d_out], zeroed.
float* split_output(float* yp, float* partial, int64_t p, int64_t T, int64_t d_out, const float* bp) {
  if (p == 0) {
    init_rows(yp, T, d_out, bp, 0, d_out);
    return yp;
  }
  float* y = partial + (p - 1) * T * d_out;
  std::memset(y, 0, T * d_out * sizeof(float));
  return y;
}

// y [n] += the partials of threads 1 .. P - 1 (split_output).
void add_partials(float* __restrict yp, const float* partial, int64_t P, int64_t n) {
  for (int64_t p = 1; p < P; ++p) {
    const float* __restrict part = partial + (p - 1) * n;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) yp[i] += part[i];
  }
}

// The k row of `b` where thread q of P starts: the layer's blocks laid end to end (b after
// `before` weights of the blocks ahead of it, `total` in all) and cut into P runs of total / P
// weights each, rounded to whole k rows. Thread q takes rows [k_cut(q), k_cut(q + 1)) of every block.
template <class V>
int64_t k_cut(const Block<V>& b, int64_t before, int64_t total, int64_t q, int64_t P) {
  const int64_t into = std::clamp<int64_t>(total * q / P - before, 0, b.w * b.R);
  return std::min(b.w, (into + b.R / 2) / b.R);
}

// The stream product on P threads (P = 1: one pass over every block), split along k: the
// layer's k rows, block after block, cut into P contiguous runs of equal weight (k_cut), so a
// thread takes whole blocks and at most two partial ones, all kept rows of each, into its own
// partial y (thread 0 into y itself), and the partials are added at the end (T * d_out numbers
// each). Splitting output rows instead halves every k row's contiguous run per thread and puts
// both threads' streams side by side: on SmolLM2's shapes two threads were then slower than one;
// splitting every block's k rows in P made every thread scatter and check every block's rows,
// and cut the eight streams of a block to half their length (a compiled int8 step 0.87x on two
// threads with the runs instead).
// Every thread adds the rows of the blocks it reaches, so each checks them (stream_rows): false,
// with y incomplete, when they do not rise inside [0, d_out).
template <class V>
bool stream_split_k(const std::vector<Block<V>>& blocks, const float* xp, int64_t T, int64_t d_in,
                    const float* bp, float* yp, int64_t d_out, const V* values_end, int64_t capacity, int64_t P) {
  float* partial = thread_scratch(1, (P - 1) * T * d_out);  // [P - 1, T, d_out]
  std::atomic<bool> bad{false};
  int64_t total = 0;  // kept weights of the layer
  for (const Block<V>& b : blocks) total += b.w * b.R;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    float* acc = thread_scratch(0, capacity);  // stream_rows clears what it uses
    for (int64_t p = p0; p < p1; ++p) {
      float* y = split_output(yp, partial, p, T, d_out, bp);
      int64_t before = 0;  // weights of the blocks ahead of b
      for (const Block<V>& b : blocks) {
        const int64_t k0 = k_cut(b, before, total, p, P), k1 = k_cut(b, before, total, p + 1, P);
        before += b.w * b.R;
        if (k0 == k1) continue;
        Block<V> part = b;  // rows k0..k1 of the block: same row stride R
        part.values += k0 * b.R;
        part.w = k1 - k0;
        part.col += k0;
        if (bad.load(std::memory_order_relaxed) ||
            !stream_rows(part, 0, b.R, xp + part.col, d_in, T, y, d_out, acc, capacity, values_end, d_out)) {
          bad.store(true, std::memory_order_relaxed);
          return;
        }
      }
    }
  });
  if (bad.load()) return false;
  add_partials(yp, partial, P, T * d_out);
  return true;
}


// ---- int4 products ----

// One subgroup of one token's x for the integer dot products: its codes (int8, one fp32 scale),
// as the 32-bit words each octet's dot products broadcast (lo[o] byte j: x8[8o + 2j], hi[o] byte j:
// x8[8o + 2j + 1], the k rows of the low and high nibbles of byte j), and the sum of x in fp32
// (the offsets' term: m * sum x).
struct XQ {
  int32_t lo[INT4_GROUP / 8], hi[INT4_GROUP / 8];
  float scale, sum;
};

// x [width <= INT4_GROUP] quantized: x8 = round(x * 127 / max|x|), 0 past width. A whole subgroup
// on AVX-512 in registers: two vectors, their even and odd lanes narrowed into the lo and hi words
// (one token of a lowered SmolLM2 quantized 2% of a decode step's time a number at a time).
inline void quantize_x(const float* __restrict x, int64_t width, XQ& out) {
#if defined(__AVX512F__)
  if (width == INT4_GROUP) {
    const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    const float peak = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float inverse = peak > 0.0f ? 127.0f / peak : 0.0f;
    const __m512 sign = _mm512_set1_ps(-0.0f), half = _mm512_set1_ps(0.5f);
    auto codes = [&](__m512 v) {  // round half away from zero: add 0.5 with v's sign, truncate
      v = _mm512_mul_ps(v, _mm512_set1_ps(inverse));
      return _mm512_cvttps_epi32(_mm512_add_ps(v, _mm512_or_ps(_mm512_and_ps(v, sign), half)));
    };
    const __m512i qa = codes(a), qb = codes(b);
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.lo), _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(qa, even, qb)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.hi), _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(qa, odd, qb)));
    out.scale = peak / 127.0f;
    out.sum = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    return;
  }
#endif
  float peak = 0.0f, sum = 0.0f;
  for (int64_t k = 0; k < width; ++k) {
    peak = std::max(peak, std::fabs(x[k]));
    sum += x[k];
  }
  const float inverse = peak > 0.0f ? 127.0f / peak : 0.0f;
  int8_t q[INT4_GROUP] = {};
  // round half away from zero by hand: nearbyint is a library call per number
  for (int64_t k = 0; k < width; ++k) {
    const float v = x[k] * inverse;
    q[k] = static_cast<int8_t>(static_cast<int32_t>(v + (v >= 0.0f ? 0.5f : -0.5f)));
  }
  for (int o = 0; o < INT4_GROUP / 8; ++o) {
    uint32_t lo = 0, hi = 0;
    for (int j = 0; j < 4; ++j) {
      lo |= uint32_t(uint8_t(q[8 * o + 2 * j])) << (8 * j);
      hi |= uint32_t(uint8_t(q[8 * o + 2 * j + 1])) << (8 * j);
    }
    out.lo[o] = int32_t(lo);
    out.hi[o] = int32_t(hi);
  }
  out.scale = peak / 127.0f;
  out.sum = sum;
}

// acc + the dot products of VEC columns' octet words w (8 codes each) with one octet of x: per
// lane, sum_j lo_j(w) * x8_lo_j + hi_j(w) * x8_hi_j (codes unsigned, x signed; the int16 pairs of
// vpmaddubsw stay within 2 * 15 * 127).
inline vint dot_octet(vint acc, vint w, int32_t xlo, int32_t xhi) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512i nibbles = _mm512_set1_epi8(0x0F);
  const __m512i lo = _mm512_and_si512((__m512i)w, nibbles), hi = _mm512_and_si512(_mm512_srli_epi32((__m512i)w, 4), nibbles);
#if defined(__AVX512VNNI__)
  __m512i a = _mm512_dpbusd_epi32((__m512i)acc, lo, _mm512_set1_epi32(xlo));
  return (vint)_mm512_dpbusd_epi32(a, hi, _mm512_set1_epi32(xhi));
#else
  const __m512i ones = _mm512_set1_epi16(1);
  const __m512i plo = _mm512_madd_epi16(_mm512_maddubs_epi16(lo, _mm512_set1_epi32(xlo)), ones);
  const __m512i phi = _mm512_madd_epi16(_mm512_maddubs_epi16(hi, _mm512_set1_epi32(xhi)), ones);
  return (vint)_mm512_add_epi32((__m512i)acc, _mm512_add_epi32(plo, phi));
#endif
#elif defined(__AVX2__) && !defined(__AVX512F__)
  const __m256i nibbles = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256((__m256i)w, nibbles), hi = _mm256_and_si256(_mm256_srli_epi32((__m256i)w, 4), nibbles);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i plo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(xlo)), ones);
  const __m256i phi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_set1_epi32(xhi)), ones);
  return (vint)_mm256_add_epi32((__m256i)acc, _mm256_add_epi32(plo, phi));
#else
  for (int l = 0; l < VEC; ++l) {
    const uint32_t word = uint32_t(w[l]);
    int32_t sum = 0;
    for (int j = 0; j < 4; ++j) {
      const int32_t b = (word >> (8 * j)) & 0xFF;
      sum += (b & 15) * int8_t(uint32_t(xlo) >> (8 * j)) + (b >> 4) * int8_t(uint32_t(xhi) >> (8 * j));
    }
    acc[l] += sum;
  }
  return acc;
#endif
}

inline vint load_words(const uint8_t* p) {
  vint w;
  std::memcpy(&w, p, sizeof(w));
  return w;
}

// The first n of VEC 32-bit words (or fp16 numbers) from p, the rest 0: a narrow tile's vectors.
inline vint load_words(const uint8_t* p, int64_t n) {
  if (n >= VEC) return load_words(p);
  vint w{};
  if (n > 0) std::memcpy(&w, p, n * 4);
  return w;
}
inline vfloat load(const at::Half* p, int64_t n) {
  if (n >= VEC) return load(p);
  at::Half h[VEC];
  for (int j = 0; j < VEC; ++j) h[j] = j < n ? p[j] : at::Half(0.0f);
  return load(h);
}

// Where column r's numbers of an int4 block lie (see the layout at INT4_GROUP): its tile, the
// tile's width, its place in the tile, and the tile's first code byte and first scale.
struct Int4Column {
  int64_t tile_width, c;
  const uint8_t* codes;   // the tile's [octets][tile_width][4] bytes
  const at::Half* halves; // the tile's [subgroups][2][tile_width] scales
};
inline Int4Column int4_column(const Block<int4x2>& b, int64_t r) {
  const int64_t octets = (b.w + 7) / 8, subgroups = (b.w + INT4_GROUP - 1) / INT4_GROUP, first = r / INT4_TILE * INT4_TILE;
  return {std::min(INT4_TILE, b.R - first), r - first,
          reinterpret_cast<const uint8_t*>(b.values) + first * octets * 4, b.halves + first * subgroups * 2};
}

// Tokens an int4 tile product takes at once: its sums stay in registers (AVX-512: one vector a
// token; AVX2 and narrower: two).
constexpr int INT4_TOKENS = INT4_TILE / VEC == 1 ? 8 : 4;
// A prefill's tokens go through a block in runs of this many, so that their rows of y stay in L2
// (a 1x256 50% 1536 x 576 layer, 256 tokens, one thread: 2.0 -> 1.5 ms against all at once).
constexpr int64_t INT4_PREFILL_TOKENS = 32;
static_assert(INT4_TOKENS >= STREAM_MAX_TOKENS, "a decode step is one tile product");

// The int4 product of tile [r0, r0 + tw) of block b over its ns subgroups, T tokens (FULL: tw
// is INT4_TILE; a narrower last tile reads its vectors through zero-padded copies):
// out[t][c] = sum over the subgroups of d * xq.scale * (codes . x8) + m * xq.sum (integer dot
// products; below four tokens two int32 sums a vector, so that two chains are in flight), or with
// `exact` the fp32 product of x itself (xs: [T][subgroups][INT4_GROUP], zero past the width). One
// pass reads the tile's codes and scales front to back: each is one contiguous run. A prefill
// runs each tile for INT4_TOKENS tokens at a time, so each octet's codes are split into nibbles
// once for all of them.
template <int T, bool FULL>
void int4_tile(const Block<int4x2>& b, int64_t r0, int64_t tw, const XQ* xq, const float* xs,
               int64_t ns, bool exact, float (*out)[INT4_TILE]) {
  constexpr int H = INT4_TILE / VEC;  // vectors a tile row
  constexpr int CHAINS = T >= 4 ? 1 : 2;
  if constexpr (FULL) tw = INT4_TILE;
  const Int4Column tile = int4_column(b, r0);
  auto words = [&](const uint8_t* p, int h) { return FULL ? load_words(p) : load_words(p, tw - h * VEC); };
  auto halves = [&](const at::Half* p, int h) { return FULL ? load(p) : load(p, tw - h * VEC); };
  vfloat acc[T][H];
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t)
#pragma GCC unroll 8
    for (int h = 0; h < H; ++h) acc[t][h] = vfloat{};
  for (int64_t s = 0; s < ns; ++s) {
    const int no = static_cast<int>((std::min(INT4_GROUP, b.w - s * INT4_GROUP) + 7) / 8);
    const uint8_t* q = tile.codes + s * (INT4_GROUP / 8) * tw * 4;
    __builtin_prefetch(q + 2048, 0, 2);  // a cache line of codes two kilobytes on, per subgroup
    const at::Half* d = tile.halves + s * 2 * tw;
    if (!exact) {
      vint sums[T][H][CHAINS];
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t)
#pragma GCC unroll 8
        for (int h = 0; h < H; ++h)
#pragma GCC unroll 2
          for (int c = 0; c < CHAINS; ++c) sums[t][h][c] = vint{};
      for (int o = 0; o < no; ++o) {
#pragma GCC unroll 8
        for (int h = 0; h < H; ++h) {
          const vint w = words(q + (o * tw + h * VEC) * 4, h);
#pragma GCC unroll 8
          for (int t = 0; t < T; ++t) {
            const XQ& x = xq[t * ns + s];
            sums[t][h][o % CHAINS] = dot_octet(sums[t][h][o % CHAINS], w, x.lo[o], x.hi[o]);
          }
        }
      }
#pragma GCC unroll 8
      for (int h = 0; h < H; ++h) {
        const vfloat dv = halves(d + h * VEC, h), mv = halves(d + tw + h * VEC, h);
#pragma GCC unroll 8
        for (int t = 0; t < T; ++t) {
          const XQ& x = xq[t * ns + s];
          vint sum = sums[t][h][0];
          if constexpr (CHAINS == 2) sum += sums[t][h][1];
          acc[t][h] += __builtin_convertvector(sum, vfloat) * dv * splat(x.scale) + mv * splat(x.sum);
        }
      }
    } else {
      vfloat sums[T][H];
      for (int t = 0; t < T; ++t)
        for (int h = 0; h < H; ++h) sums[t][h] = vfloat{};
      float xsum[T];
      for (int t = 0; t < T; ++t) {
        xsum[t] = 0.0f;
        for (int k = 0; k < INT4_GROUP; ++k) xsum[t] += xs[(t * ns + s) * INT4_GROUP + k];
      }
      for (int o = 0; o < no; ++o)
        for (int h = 0; h < H; ++h) {
          const vint w = words(q + (o * tw + h * VEC) * 4, h);
          for (int j = 0; j < 4; ++j) {
            const vint byte = (w >> (8 * j)) & 0xFF;
            const vfloat lo = __builtin_convertvector(byte & 15, vfloat), hi = __builtin_convertvector(byte >> 4, vfloat);
            for (int t = 0; t < T; ++t) {
              const float* x = xs + (t * ns + s) * INT4_GROUP + 8 * o + 2 * j;
              sums[t][h] += splat(x[0]) * lo + splat(x[1]) * hi;
            }
          }
        }
      for (int h = 0; h < H; ++h) {
        const vfloat dv = halves(d + h * VEC, h), mv = halves(d + tw + h * VEC, h);
        for (int t = 0; t < T; ++t) acc[t][h] += dv * sums[t][h] + mv * splat(xsum[t]);
      }
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t)
#pragma GCC unroll 8
    for (int h = 0; h < H; ++h) store(out[t] + h * VEC, acc[t][h]);
}

template <bool FULL>
using Int4TileFn = void (*)(const Block<int4x2>&, int64_t, int64_t, const XQ*, const float*, int64_t, bool,
                            float (*)[INT4_TILE]);
template <bool FULL>
constexpr Int4TileFn<FULL> INT4_TILES[9] = {nullptr,
                                            int4_tile<1, FULL>,
                                            int4_tile<2, FULL>,
                                            int4_tile<3, FULL>,
                                            int4_tile<4, FULL>,
                                            int4_tile<std::min(5, INT4_TOKENS), FULL>,
                                            int4_tile<std::min(6, INT4_TOKENS), FULL>,
                                            int4_tile<std::min(7, INT4_TOKENS), FULL>,
                                            int4_tile<std::min(8, INT4_TOKENS), FULL>};

// y[:, rows[i0:i1]] += the product of int4 block b's columns [i0, i1), T tokens (row stride ldy), tile by tile, INT4_TOKENS tokens at a time (a tile cut by i0 or i1 is
// computed whole, its columns outside left out). Each tile's rows in [i0, i1) are checked first
// (rows_rise from the previous row: false, nothing of that tile added, when they do not rise inside
// [0, d_out)). xq / xs: the block's x, quantized / as fp32 (`exact`), [T][subgroups].
bool stream_tiles(const Block<int4x2>& b, int64_t i0, int64_t i1, int64_t T, const XQ* xq, const float* xs,
                  int64_t ns, bool exact, float* __restrict y, int64_t ldy, int64_t d_out) {
  float out[INT4_TOKENS][INT4_TILE];
  for (int64_t r0 = i0 / INT4_TILE * INT4_TILE; r0 < i1; r0 += INT4_TILE) {
    const int64_t tw = std::min(INT4_TILE, b.R - r0), lo = std::max(r0, i0), hi = std::min(r0 + tw, i1);
    if (!rows_rise(b.rows + lo, hi - lo, lo > 0 ? b.rows[lo - 1] : -1, d_out)) return false;
    for (int64_t t0 = 0; t0 < T; t0 += INT4_TOKENS) {
      const int64_t n = std::min<int64_t>(INT4_TOKENS, T - t0);
      const XQ* xqt = exact ? nullptr : xq + t0 * ns;
      const float* xst = exact ? xs + t0 * ns * INT4_GROUP : nullptr;
      if (tw == INT4_TILE) INT4_TILES<true>[n](b, r0, tw, xqt, xst, ns, exact, out);
      else INT4_TILES<false>[n](b, r0, tw, xqt, xst, ns, exact, out);
      for (int64_t t = 0; t < n; ++t)
        scatter_add<float>(y + (t0 + t) * ldy, b.rows + lo, out[t] + (lo - r0), nullptr, hi - lo);
    }
  }
  return true;
}

// x's numbers over the block of width w from column col, for the integer products, T tokens (row
// stride ldx): quantized per subgroup into xq [T][subgroups], or with `exact` copied as fp32 into
// xs (zero past the block's width).
void block_inputs(int64_t col, int64_t w, const float* xp, int64_t T, int64_t ldx, bool exact, std::vector<XQ>& xq,
                  std::vector<float>& xs) {
  const int64_t ns = (w + INT4_GROUP - 1) / INT4_GROUP;
  if (exact) xs.assign(T * ns * INT4_GROUP, 0.0f);
  else xq.resize(T * ns);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s < ns; ++s) {
      const float* x = xp + t * ldx + col + s * INT4_GROUP;
      const int64_t width = std::min(INT4_GROUP, w - s * INT4_GROUP);
      if (exact) std::memcpy(xs.data() + (t * ns + s) * INT4_GROUP, x, width * sizeof(float));
      else quantize_x(x, width, xq[t * ns + s]);
    }
}

// The tile of int4 block `b` where thread q of P starts: the layer's tiles, block after block, cut
// into P runs of equal weight (`before` weights of the blocks ahead of b, `total` in all).
int64_t tile_cut(const Block<int4x2>& b, int64_t before, int64_t total, int64_t q, int64_t P) {
  const int64_t tiles = (b.R + INT4_TILE - 1) / INT4_TILE;
  const int64_t into = total * q / P - before;
  if (into <= 0) return 0;
  if (into >= b.w * b.R) return tiles;
  return std::min(tiles, (into + INT4_TILE * b.w / 2) / (INT4_TILE * b.w));
}

// The int4 decode product (T <= STREAM_MAX_TOKENS) on P threads: the layer's tiles, block after
// block, cut into P contiguous runs of equal weight (tile_cut), each thread into its own partial y
// (thread 0 into y itself), added at the end; x is quantized per block and subgroup by each
// thread for the blocks it reaches (fp32 copies with `exact`). False, y incomplete, when row_idx
// does not rise inside [0, d_out) within a block.
bool stream_int4(const std::vector<Block<int4x2>>& blocks, const float* xp, int64_t T, int64_t d_in,
                 const float* bp, float* yp, int64_t d_out, int64_t P, bool exact) {
  float* partial = thread_scratch(1, (P - 1) * T * d_out);  // [P - 1, T, d_out]
  std::atomic<bool> bad{false};
  int64_t total = 0;
  for (const Block<int4x2>& b : blocks) total += b.w * b.R;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    static thread_local std::vector<XQ> xq;  // kept across calls, as thread_scratch
    static thread_local std::vector<float> xs;
    for (int64_t p = p0; p < p1; ++p) {
      float* y = split_output(yp, partial, p, T, d_out, bp);
      int64_t before = 0;
      for (const Block<int4x2>& b : blocks) {
        const int64_t j0 = tile_cut(b, before, total, p, P), j1 = tile_cut(b, before, total, p + 1, P);
        before += b.w * b.R;
        if (j0 == j1) continue;
        block_inputs(b.col, b.w, xp, T, d_in, exact, xq, xs);
        const int64_t ns = (b.w + INT4_GROUP - 1) / INT4_GROUP;
        if (bad.load(std::memory_order_relaxed) ||
            !stream_tiles(b, j0 * INT4_TILE, std::min(b.R, j1 * INT4_TILE), T, xq.data(), xs.data(), ns, exact, y,
                          d_out, d_out)) {
          bad.store(true, std::memory_order_relaxed);
          return;
        }
      }
    }
  });
  if (bad.load()) return false;
  add_partials(yp, partial, P, T * d_out);
  return true;
}

// The int4 prefill product of block b's columns [i0, i1) (a thread's output rows) into y (T tokens,
// row stride d_out): integer dot products on x quantized per subgroup, as decode's, or the fp32
// product (`exact`). Rows were checked (rows_ok).
void int4_rows(const Block<int4x2>& b, int64_t i0, int64_t i1, const float* xp, int64_t T, int64_t d_in, float* y,
               int64_t d_out, bool exact) {
  std::vector<XQ> xq;
  std::vector<float> xs;
  block_inputs(b.col, b.w, xp, T, d_in, exact, xq, xs);
  const int64_t ns = (b.w + INT4_GROUP - 1) / INT4_GROUP;
  for (int64_t t0 = 0; t0 < T; t0 += INT4_PREFILL_TOKENS) {
    const int64_t n = std::min(INT4_PREFILL_TOKENS, T - t0);
    stream_tiles(b, i0, i1, n, exact ? nullptr : xq.data() + t0 * ns,
                 exact ? xs.data() + t0 * ns * INT4_GROUP : nullptr, ns, exact, y + t0 * d_out, d_out, d_out);
  }
}

// ---- int8 prefill by integer dot products ----
//
// int8 values are stored row-major ([w, R], k rows R apart), so a column's k rows are not one word:
// the prefill product first repacks GEMM_CHUNK columns at a time into `words` (int8_words), the
// int4 tiles' order with a byte a weight: per octet o, column c's lo word holds k rows 8o, 8o + 2,
// 8o + 4, 8o + 6 and its hi word 8o + 1, 3, 5, 7 (the k rows of XQ's lo and hi words), and then
// runs the int4 tile loop over them on the same quantized x: each word against 4 x codes, per 32
// k rows one int32 sum a column and token, times x's scale; the column scale at the end. Repacking
// costs a pass over the weights per chunk, paid once for all of a prefill's tokens.
// vpdpbusd multiplies unsigned by signed bytes: with VNNI x goes in as x8 + 128 (unsigned) against
// the signed weights, and 128 times the weights' sum per subgroup (`wsums`) comes off each sum;
// without it vpmaddubsw takes |w| against x8 with w's sign, whose pairs stay within 2 * 127 * 127.
#if defined(__AVX512VNNI__)
constexpr bool X_OFFSET = true;
#else
constexpr bool X_OFFSET = false;
#endif

// acc + per lane the dot product of 4 signed weights (w) with 4 signed x codes (x, one word).
inline vint dot_quad(vint acc, vint w, int32_t x) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
#if defined(__AVX512VNNI__)
  return (vint)_mm512_dpbusd_epi32((__m512i)acc, _mm512_set1_epi32(x ^ int32_t(0x80808080)), (__m512i)w);
#else
  const __m512i xv = _mm512_set1_epi32(x);
  const __m512i signed_x = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask((__m512i)w), _mm512_setzero_si512(), xv);
  const __m512i p = _mm512_maddubs_epi16(_mm512_abs_epi8((__m512i)w), signed_x);
  return (vint)_mm512_add_epi32((__m512i)acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)));
#endif
#elif defined(__AVX2__) && !defined(__AVX512F__)
  const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8((__m256i)w, (__m256i)w),
                                         _mm256_sign_epi8(_mm256_set1_epi32(x), (__m256i)w));
  return (vint)_mm256_add_epi32((__m256i)acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#else
  for (int l = 0; l < VEC; ++l) {
    const uint32_t word = uint32_t(w[l]);
    int32_t sum = 0;
    for (int j = 0; j < 4; ++j) sum += int8_t(word >> (8 * j)) * int8_t(uint32_t(x) >> (8 * j));
    acc[l] += sum;
  }
  return acc;
#endif
}

// words [octets][2][np] (lo, hi) of columns c0 .. c0 + n of int8 block b, np = n rounded up to
// INT4_TILE (zero past n and past w); wsums [subgroups][np]: each column's sum of weights over a
// subgroup's k rows (with X_OFFSET). 16 columns at a time by byte unpacks (SSE2), the rest by bytes.
void int8_words(const Block<int8_t>& b, int64_t c0, int64_t n, int64_t np, int32_t* __restrict words,
                int32_t* __restrict wsums) {
  const int64_t octets = (b.w + 7) / 8, ns = (b.w + INT4_GROUP - 1) / INT4_GROUP;
  auto weight = [&](int64_t k, int64_t c) -> uint8_t { return k < b.w && c < n ? b.values[k * b.R + c0 + c] : 0; };
  for (int64_t o = 0; o < octets; ++o) {
    int32_t* lo = words + o * 2 * np;
    int32_t* hi = lo + np;
    int64_t c = 0;
#if defined(__AVX2__)
    if (8 * o + 8 <= b.w)
      for (; c + 16 <= n; c += 16) {
        __m128i r[8];
        for (int j = 0; j < 8; ++j)
          r[j] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.values + (8 * o + j) * b.R + c0 + c));
        for (int half = 0; half < 2; ++half) {  // even k rows into lo, odd into hi
          const __m128i a = r[half], bb = r[half + 2], cc = r[half + 4], d = r[half + 6];
          const __m128i ab0 = _mm_unpacklo_epi8(a, bb), ab1 = _mm_unpackhi_epi8(a, bb);
          const __m128i cd0 = _mm_unpacklo_epi8(cc, d), cd1 = _mm_unpackhi_epi8(cc, d);
          __m128i* out = reinterpret_cast<__m128i*>((half ? hi : lo) + c);
          _mm_storeu_si128(out, _mm_unpacklo_epi16(ab0, cd0));
          _mm_storeu_si128(out + 1, _mm_unpackhi_epi16(ab0, cd0));
          _mm_storeu_si128(out + 2, _mm_unpacklo_epi16(ab1, cd1));
          _mm_storeu_si128(out + 3, _mm_unpackhi_epi16(ab1, cd1));
        }
      }
#endif
    for (; c < np; ++c) {
      uint32_t l = 0, h = 0;
      for (int j = 0; j < 4; ++j) {
        l |= uint32_t(weight(8 * o + 2 * j, c)) << (8 * j);
        h |= uint32_t(weight(8 * o + 2 * j + 1, c)) << (8 * j);
      }
      lo[c] = int32_t(l);
      hi[c] = int32_t(h);
    }
  }
  if (!X_OFFSET) return;
  for (int64_t s = 0; s < ns; ++s) {
    int32_t* sum = wsums + s * np;
    for (int64_t c = 0; c < np; ++c) sum[c] = 0;
    for (int64_t o = s * (INT4_GROUP / 8); o < std::min(octets, (s + 1) * (INT4_GROUP / 8)); ++o)
      for (int64_t c = 0; c < np; c += VEC)
        for (int part = 0; part < 2; ++part) {
          vint acc = load_words(reinterpret_cast<const uint8_t*>(sum + c));
          acc = dot_quad(acc, load_words(reinterpret_cast<const uint8_t*>(words + (o * 2 + part) * np + c)),
                         0x01010101 ^ int32_t(0x80808080));  // x8 = 1 each: the sum (offset 128 comes back off)
          std::memcpy(sum + c, &acc, sizeof(acc));
        }
  }
}

// out[t][c] (T tokens, c < INT4_TILE) = sum over the subgroups of x's scale times the int32 dot
// product of repacked columns [c, c + INT4_TILE) of `words` (row stride np words) with x's codes,
// less 128 times the weights' sums (X_OFFSET). xq: [T][ns].
template <int T>
void int8_tile(const int32_t* words, const int32_t* wsums, int64_t np, int64_t c, int64_t w, const XQ* xq, int64_t ns,
               float (*out)[INT4_TILE]) {
  constexpr int H = INT4_TILE / VEC;
  vfloat acc[T][H];
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t)
#pragma GCC unroll 8
    for (int h = 0; h < H; ++h) acc[t][h] = vfloat{};
  for (int64_t s = 0; s < ns; ++s) {
    const int no = static_cast<int>((std::min(INT4_GROUP, w - s * INT4_GROUP) + 7) / 8);
    vint sums[T][H];
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t)
#pragma GCC unroll 8
      for (int h = 0; h < H; ++h) sums[t][h] = vint{};
    for (int o = 0; o < no; ++o) {
      const int32_t* lo = words + ((s * (INT4_GROUP / 8) + o) * 2) * np + c;
#pragma GCC unroll 8
      for (int h = 0; h < H; ++h) {
        const vint wl = load_words(reinterpret_cast<const uint8_t*>(lo + h * VEC));
        const vint wh = load_words(reinterpret_cast<const uint8_t*>(lo + np + h * VEC));
#pragma GCC unroll 8
        for (int t = 0; t < T; ++t) {
          const XQ& x = xq[t * ns + s];
          sums[t][h] = dot_quad(dot_quad(sums[t][h], wl, x.lo[o]), wh, x.hi[o]);
        }
      }
    }
#pragma GCC unroll 8
    for (int h = 0; h < H; ++h) {
      vint offset = vint{};
      if constexpr (X_OFFSET) offset = load_words(reinterpret_cast<const uint8_t*>(wsums + s * np + c + h * VEC)) * 128;
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t)
        acc[t][h] += __builtin_convertvector(sums[t][h] - offset, vfloat) * splat(xq[t * ns + s].scale);
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t)
#pragma GCC unroll 8
    for (int h = 0; h < H; ++h) store(out[t] + h * VEC, acc[t][h]);
}

using Int8TileFn = void (*)(const int32_t*, const int32_t*, int64_t, int64_t, int64_t, const XQ*, int64_t,
                            float (*)[INT4_TILE]);
constexpr Int8TileFn INT8_TILES[9] = {nullptr,
                                      int8_tile<1>,
                                      int8_tile<2>,
                                      int8_tile<3>,
                                      int8_tile<4>,
                                      int8_tile<std::min(5, INT4_TOKENS)>,
                                      int8_tile<std::min(6, INT4_TOKENS)>,
                                      int8_tile<std::min(7, INT4_TOKENS)>,
                                      int8_tile<std::min(8, INT4_TOKENS)>};

// The int8 prefill product of block b's columns [i0, i1) (a thread's output rows) into y (T
// tokens, row stride d_out): GEMM_CHUNK columns at a time repacked (int8_words), then each tile of
// INT4_TILE columns for INT4_TOKENS tokens at a time, in runs of INT4_PREFILL_TOKENS tokens.
// Rows were checked (rows_ok).
void int8_rows(const Block<int8_t>& b, int64_t i0, int64_t i1, const float* xp, int64_t T, int64_t d_in, float* y,
               int64_t d_out) {
  const int64_t octets = (b.w + 7) / 8, ns = (b.w + INT4_GROUP - 1) / INT4_GROUP;
  std::vector<XQ> xq;
  std::vector<float> unused;
  block_inputs(b.col, b.w, xp, T, d_in, false, xq, unused);
  std::vector<int32_t> words(octets * 2 * GEMM_CHUNK), wsums(ns * GEMM_CHUNK);
  float out[INT4_TOKENS][INT4_TILE];
  for (int64_t c0 = i0; c0 < i1; c0 += GEMM_CHUNK) {
    const int64_t n = std::min(GEMM_CHUNK, i1 - c0), np = (n + INT4_TILE - 1) / INT4_TILE * INT4_TILE;
    int8_words(b, c0, n, np, words.data(), wsums.data());
    for (int64_t t1 = 0; t1 < T; t1 += INT4_PREFILL_TOKENS)
      for (int64_t c = 0; c < n; c += INT4_TILE) {
        const int64_t nc = std::min(INT4_TILE, n - c);
        for (int64_t t0 = t1; t0 < std::min(T, t1 + INT4_PREFILL_TOKENS); t0 += INT4_TOKENS) {
          const int64_t nt = std::min<int64_t>({INT4_TOKENS, T - t0, t1 + INT4_PREFILL_TOKENS - t0});
          INT8_TILES[nt](words.data(), wsums.data(), np, c, b.w, xq.data() + t0 * ns, ns, out);
          for (int64_t t = 0; t < nt; ++t)
            scatter_add<int8_t>(y + (t0 + t) * d_out, b.rows + c0 + c, out[t], b.scales + c0 + c, nc);
        }
      }
  }
}

// panel [w, n] fp32 (row stride n) = columns c0 .. c0 + n of int4 block b, dequantized (n <= GEMM_CHUNK).
void dequantize4(const Block<int4x2>& b, int64_t c0, int64_t n, float* __restrict panel) {
  for (int64_t r = 0; r < n; ++r) {
    const Int4Column col = int4_column(b, c0 + r);
    for (int64_t k0 = 0; k0 < b.w; k0 += INT4_GROUP) {
      const at::Half* h = col.halves + (k0 / INT4_GROUP) * 2 * col.tile_width;
      const float d = float(h[col.c]), m = float(h[col.tile_width + col.c]);
      for (int64_t k = k0; k < std::min(b.w, k0 + INT4_GROUP); ++k) {
        const uint8_t byte = col.codes[((k / 8) * col.tile_width + col.c) * 4 + (k % 8) / 2];
        panel[k * n + r] = float((byte >> (4 * (k & 1))) & 15) * d + m;
      }
    }
  }
}

// tiles for int4 block b: GEMM_CHUNK columns at a time dequantized (dequantize4) into this
// thread's panel, whose fp32 tiles then run (tile_rows).
void tile_rows4(const Block<int4x2>& b, int64_t i0, int64_t i1, const float* x, int64_t ldx, int64_t T, float* y,
                int64_t ldy) {
  float* panel = thread_scratch(5, b.w * GEMM_CHUNK + RR);  // RR spare: a full tile may read past n
  for (int64_t c0 = i0; c0 < i1; c0 += GEMM_CHUNK) {
    const int64_t n = std::min(GEMM_CHUNK, i1 - c0);
    dequantize4(b, c0, n, panel);
    const Block<float> fb{panel, b.rows + c0, nullptr, n, b.w, b.col};
    tile_rows<float>(fb, 0, n, x, ldx, T, y, ldy, panel + b.w * n + RR);
  }
}

// gemm for int4 block b: GEMM_CHUNK columns at a time dequantized into `panel_scratch`, which
// then runs as an fp32 block (gemm_rows).
void gemm_rows4(const Block<int4x2>& b, int64_t i0, int64_t i1, const at::Tensor& x, float* __restrict yT,
                uint8_t* __restrict written, int64_t a, at::Tensor& scratch, at::Tensor& panel_scratch) {
  float* panel = panel_scratch.data_ptr<float>();
  for (int64_t c0 = i0; c0 < i1; c0 += GEMM_CHUNK) {
    const int64_t n = std::min(GEMM_CHUNK, i1 - c0);
    dequantize4(b, c0, n, panel);
    const Block<float> fb{panel, b.rows + c0, nullptr, n, b.w, b.col};
    gemm_rows<float>(fb, 0, n, x, panel_scratch, yT, written, a, scratch, panel_scratch);
  }
}

// y [T, d_out] = x [T, d_in] @ W_hat.T + bias, all fp32 (xp, bp, yp: raw memory), with the
// weights stored as V (scales: [R] fp32 column scales of int8 values, the fp16 scales of int4
// values, else null) in a layout blocks_ok
// accepted; false, y incomplete, when row_idx is not one rows_ok accepts (the split-k stream
// checks it as it goes, every other product first). path: which product. Only the gemm product
// makes tensors (at::mm operands); decode touches no dispatcher.
template <class V>
bool run_blocks(const float* xp, int64_t T, int64_t d_in, const at::Tensor& values, const void* scales,
                const int64_t* row_idx, const int32_t* row_ptr, int64_t n_blocks, const float* bp, float* yp,
                int64_t d_out, int64_t g_in, int64_t path) {
  const V* vp = static_cast<const V*>(values.data_ptr());
  const V* values_end = vp + values.numel();
  // kept across calls (decode makes ~120 a token): a fresh vector was a malloc and free each. The
  // parallel regions below must see this thread's vector: they capture the reference, not the name.
  static thread_local std::vector<Block<V>> kept;
  std::vector<Block<V>>& blocks = kept;
  if constexpr (INT4<V>)
    blocks_of4(vp, static_cast<const at::Half*>(scales), row_idx, row_ptr, n_blocks, d_in, g_in, blocks);
  else
    blocks_of<V>(vp, static_cast<const float*>(scales), row_idx, row_ptr, n_blocks, d_in, g_in, blocks);
  const int64_t weights = values.numel() * (INT4<V> ? 2 : 1);
  const bool parallel = weights >= MIN_PARALLEL_NNZ && at::get_num_threads() > 1;
  if ((path == STREAM || path == STREAM_FLOAT) && T <= STREAM_MAX_TOKENS) {  // P = 1: every k row of every block
    const int64_t P = parallel ? at::get_num_threads() : 1;
    if constexpr (INT4<V>) return stream_int4(blocks, xp, T, d_in, bp, yp, d_out, P, path == STREAM_FLOAT);
    else return stream_split_k(blocks, xp, T, d_in, bp, yp, d_out, values_end, stream_capacity(blocks, T), P);
  }
  if (!rows_ok(row_idx, row_ptr, n_blocks, d_out)) return false;
  const at::Tensor x = path == GEMM ? at::from_blob(const_cast<float*>(xp), {T, d_in}, at::kFloat) : at::Tensor();
  const int64_t grain = parallel ? ROW_ALIGN : d_out;
  at::parallel_for(0, d_out, grain, [&](int64_t begin, int64_t end) {
    // ranges partition [0, d_out); rounding both ends the same way keeps a partition
    const int64_t a = begin == 0 ? 0 : std::min(d_out, (begin + ROW_ALIGN - 1) / ROW_ALIGN * ROW_ALIGN);
    const int64_t e = end == d_out ? d_out : std::min(d_out, (end + ROW_ALIGN - 1) / ROW_ALIGN * ROW_ALIGN);
    if (a >= e) return;
    // gemm: the range's rows of y, transposed, uninitialised until a block writes them (written)
    std::unique_ptr<float[]> yT;
    std::vector<uint8_t> written;
    if (path != GEMM) init_rows(yp, T, d_out, bp, a, e);
    at::Tensor scratch, panel;
    for (const Block<V>& b : blocks) {
      const auto [i0, i1] = rows_in(b, a, e);
      if (i0 == i1) continue;
      if (path == GEMM) {
        if (!yT) {  // the range's first block
          scratch = at::empty({T * (e - a)}, x.options());  // >= T * (i1 - i0)
          if (!std::is_same_v<V, float>) panel = at::empty({g_in * GEMM_CHUNK}, x.options());
          yT.reset(new float[(e - a) * T]);
          written.assign(e - a, 0);
        }
        if constexpr (INT4<V>) gemm_rows4(b, i0, i1, x, yT.get(), written.data(), a, scratch, panel);
        else gemm_rows(b, i0, i1, x, values, yT.get(), written.data(), a, scratch, panel);
      } else {
        if constexpr (INT4<V>) {
          if (path == TILES_ONLY) tile_rows4(b, i0, i1, xp + b.col, d_in, T, yp, d_out);
          else int4_rows(b, i0, i1, xp, T, d_in, yp, d_out, path == STREAM_FLOAT);
        } else if constexpr (SCALED<V>) {
          if (path == STREAM) int8_rows(b, i0, i1, xp, T, d_in, yp, d_out);
          else tile_rows(b, i0, i1, xp + b.col, d_in, T, yp, d_out, values_end);
        } else {
          tile_rows(b, i0, i1, xp + b.col, d_in, T, yp, d_out, values_end);
        }
      }
    }
    if (path == GEMM) {
      if (!yT) {  // no block keeps a row of the range
        init_rows(yp, T, d_out, bp, a, e);
        return;
      }
      for (int64_t i = 0; i < e - a; ++i)
        if (!written[i]) std::memset(yT.get() + i * T, 0, T * sizeof(float));
      write_transposed(yp, d_out, yT.get(), T, a, e, bp);
    }
  });
  return true;
}

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
  const int64_t n_blocks = row_ptr.numel() - 1;
  switch (values.scalar_type()) {
    case at::kBFloat16:
      return run_blocks<bf16>(xp, T, d_in, values, nullptr, rows, ptr, n_blocks, bp, yp, d_out, g_in, path);
    case at::kChar:
      return run_blocks<int8_t>(xp, T, d_in, values, scales.data_ptr<float>(), rows, ptr, n_blocks, bp, yp, d_out,
                                g_in, path);
    case at::kByte:
      return run_blocks<int4x2>(xp, T, d_in, values, scales.data_ptr(), rows, ptr, n_blocks, bp, yp, d_out, g_in,
                                path);
    default:
      return run_blocks<float>(xp, T, d_in, values, nullptr, rows, ptr, n_blocks, bp, yp, d_out, g_in, path);
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

// Query heads [g0, g1) of KV head h of batch row b (qf: their rows times scale, s: their scores
// [g1 - g0, L], o: their outputs [g1 - g0, D], all scratch).
template <class V>
void attend_heads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const bool* mp, int64_t mb,
                  int64_t ml, float scale, int64_t b, int64_t h, int64_t g0, int64_t g1, float* qf, float* s,
                  float* o, V* op) {
  const int64_t H = q.size(1), D = q.size(3), L = k.size(2), G = H / k.size(1), n = g1 - g0;
  const int64_t ks = k.stride(2), vs = v.stride(2);
  const V* qp = static_cast<const V*>(q.data_ptr());
  for (int64_t g = 0; g < n; ++g) {
    const V* qg = qp + b * q.stride(0) + (h * G + g0 + g) * q.stride(1);
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_float(qg[d]) * scale;
  }
  const V* kb = static_cast<const V*>(k.data_ptr()) + b * k.stride(0) + h * k.stride(1);
  const V* vb = static_cast<const V*>(v.data_ptr()) + b * v.stride(0) + h * v.stride(1);
  dot_rows(qf, n, D, kb, ks, L, s);
  for (int64_t g = 0; g < n; ++g) {  // softmax; a row with every slot masked is NaN, as in torch
    float* sg = s + g * L;
    if (mp != nullptr)
      for (int64_t l = 0; l < L; ++l)
        if (!mp[b * mb + l * ml]) sg[l] = -std::numeric_limits<float>::infinity();
    const float top = *std::max_element(sg, sg + L);
    const float inv = 1.0f / exp_in_place(sg, L, top);
    for (int64_t l = 0; l < L; ++l) sg[l] *= inv;
  }
  weighted_rows(s, n, L, vb, vs, D, o);
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

template <class V>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask, double scale,
            at::Tensor& out) {
  const int64_t H = q.size(1), D = q.size(3), L = k.size(2), G = H / k.size(1);
  const bool* mp = mask.defined() ? mask.data_ptr<bool>() : nullptr;
  const int64_t mb = mask.defined() && mask.size(0) > 1 ? mask.stride(0) : 0, ml = mask.defined() ? mask.stride(3) : 0;
  V* op = static_cast<V*>(out.data_ptr());
  const int64_t grain = std::max<int64_t>(1, ATTENTION_GRAIN / std::max<int64_t>(1, L * D));
  at::parallel_for(0, q.size(0) * H, grain, [&](int64_t begin, int64_t end) {
    float* qf = thread_scratch(2, G * (2 * D + L));
    for (int64_t i = begin; i < end;) {  // query head i = b * H + h * G + g
      const int64_t b = i / H, h = i % H / G, g0 = i % G, g1 = std::min(G, g0 + end - i);
      attend_heads(q, k, v, mp, mb, ml, float(scale), b, h, g0, g1, qf, qf + G * D, qf + G * (D + L), op);
      i += g1 - g0;
    }
  });
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
  const at::Tensor m = mask.has_value() ? *mask : at::Tensor();
  if (q.scalar_type() == at::kFloat) attend<float>(q, k, v, m, scale, out);
  else attend<bf16>(q, k, v, m, scale, out);
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
