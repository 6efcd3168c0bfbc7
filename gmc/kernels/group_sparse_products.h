// The products of gmc's group-sparse linear on the packed BSC format (gmc/kernels/packed.py): the
// value types, vector helpers, one block's view (Block), the layout checks, and every block product
// (stream, register tiles, gemm through the includer's hook, the int4 and int8 integer products).
// group_sparse_core.h says how they combine into one layer's y (run_blocks) and what the includer
// provides; it is the header to include. No torch header: raw pointers and sizes in.
//
// RowIndex: the type of row_idx, GMC_ROW_INDEX if the includer defines it (the ONNX Runtime op reads
// ONNX's int32 indices as they are), else int64_t (what gmc.kernels.packed.pack makes).
#pragma once

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#ifndef GMC_ROW_INDEX
#define GMC_ROW_INDEX int64_t
#endif

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
struct fp16 {  // IEEE half bits (int4 scales)
  uint16_t bits;
};
using RowIndex = GMC_ROW_INDEX;  // row_idx's numbers

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
// A column's octet word is what an integer dot product takes: decode (stream_share) quantizes each
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
inline float to_float(fp16 h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.bits);
#else  // exact: widen the exponent, normalise a subnormal
  const uint32_t sign = uint32_t(h.bits & 0x8000) << 16, exponent = (h.bits >> 10) & 0x1F;
  uint32_t mantissa = h.bits & 0x3FF, bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000 | (mantissa << 13);  // inf, NaN
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {
    uint32_t e = 113;
    for (; !(mantissa & 0x400); mantissa <<= 1) --e;
    bits = sign | (e << 23) | ((mantissa & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

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
inline vfloat load(const fp16* p) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  return (vfloat)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vfloat v;
  for (int j = 0; j < VEC; ++j) v[j] = to_float(p[j]);
  return v;
#endif
}

inline vfloat splat(float c) { return vfloat{} + c; }

// y[rows[r]] += acc[r] (times scale[r] for int8 values), r < n; rows strictly ascending (every
// caller checks them first: rows_ok, rows_rise). Rows in one run (a dense layer's, a 2-D group's,
// a block's consecutive kept rows) take a vector add: a dense int4 256-token prefill's projections
// on two AVX2 threads 10-19% faster than by indexed adds (docs/speed.md).
template <class V>
inline void scatter_add(float* __restrict y, const RowIndex* __restrict rows, const float* __restrict acc,
                        const float* __restrict scale, int64_t n) {
  if (n > 0 && rows[n - 1] - rows[0] == n - 1) {
    float* __restrict run = y + rows[0];
    if constexpr (SCALED<V>) {
#pragma omp simd
      for (int64_t r = 0; r < n; ++r) run[r] += acc[r] * scale[r];
    } else {
#pragma omp simd
      for (int64_t r = 0; r < n; ++r) run[r] += acc[r];
    }
    return;
  }
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
                      int64_t ldx, const RowIndex* __restrict rows, const float* __restrict scale, int nr,
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
                      int64_t ldx, int tt, const RowIndex* __restrict rows, const float* __restrict scale,
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
using TileFn = void (*)(const V*, int64_t, int64_t, const float*, int64_t, const RowIndex*, const float*, int,
                        float*, int64_t);
template <class V>
constexpr TileFn<V> TILES[TT_MAX + 1] = {nullptr,         tile_full<V, 1>, tile_full<V, 2>, tile_full<V, 3>,
                                         tile_full<V, 4>, tile_full<V, 5>, tile_full<V, 6>};

template <class V>
struct Block {
  const V* values;       // [w, R] row-major (int8: in words, see int8_code; int4: tiles)
  const RowIndex* rows;  // [R] ascending output rows
  const float* scales;   // [R] column scales (int8 values), else null
  int64_t R, w, col;     // kept rows, width, first input column
  const fp16* halves = nullptr;  // int4 values: [ceil(w / INT4_GROUP), 2, R] scales and offsets
};

// The non-empty blocks of a layer into `blocks` (cleared first).
template <class V>
void blocks_of(const V* values, const float* scales, const RowIndex* row_idx, const int32_t* row_ptr,
               int64_t n_blocks, int64_t d_in, int64_t g_in, std::vector<Block<V>>& blocks) {
  blocks.clear();
  for (int64_t v = 0; v < n_blocks; ++v) {
    const int64_t start = row_ptr[v], R = row_ptr[v + 1] - row_ptr[v];
    const int64_t col = v * g_in, w = std::min(g_in, d_in - col);
    if (R > 0) blocks.push_back({values + start * g_in, row_idx + start, scales ? scales + start : nullptr, R, w, col});
  }
}

// The non-empty int4 blocks of a layer (see INT4_GROUP for their layout) into `blocks`.
void blocks_of4(const int4x2* values, const fp16* scales, const RowIndex* row_idx, const int32_t* row_ptr,
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

// ---- the int8 layout ----
//
// An int8 block's codes are stored in words of 4 (gmc/kernels/packed.py): for each octet o of k rows
// below w8 = w rounded down to 8, two rows of R words, word (2o, c) holding column c's k rows 8o,
// 8o + 2, 8o + 4, 8o + 6 and word (2o + 1, c) its k rows 8o + 1, 3, 5, 7 (the k rows of XQ's lo and
// hi words); k rows from w8 on row-major after them. k row 8o starts at byte 8o * R in either part,
// as a float block's rows do.
inline int8_t int8_code(const int8_t* values, int64_t R, int64_t w, int64_t k, int64_t c) {
  if (k >= w / 8 * 8) return values[k * R + c];
  return values[((k / 8 * 2 + (k & 1)) * R + c) * 4 + (k % 8) / 2];
}

// panel [w, n] fp32 (row stride n) = columns c0 .. c0 + n of int8 block b, times their column
// scales when `scaled` (n <= GEMM_CHUNK).
void int8_panel(const Block<int8_t>& b, int64_t c0, int64_t n, float* __restrict panel, bool scaled) {
  for (int64_t k = 0; k < b.w; ++k)
    for (int64_t r = 0; r < n; ++r) {
      const float q = float(int8_code(b.values, b.R, b.w, k, c0 + r));
      panel[k * n + r] = scaled ? q * b.scales[c0 + r] : q;
    }
}

// Kept rows of `b` whose output row lies in [a, e): [i0, i1) by binary search.
template <class V>
inline std::pair<int64_t, int64_t> rows_in(const Block<V>& b, int64_t a, int64_t e) {
  const RowIndex* lo = std::lower_bound(b.rows, b.rows + b.R, a);
  const RowIndex* hi = std::lower_bound(lo, b.rows + b.R, e);
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
inline bool rows_rise(const RowIndex* __restrict rows, int64_t n, int64_t prev, int64_t d_out) {
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
// accumulator, 1 split-k partials, 2 decode attention's rows and 3, 4 the gated MLP's rows (in
// cpu_group_sparse.cpp), 5 an int4 tile panel), kept across calls and grown as needed,
// uninitialised: decode makes ~120 calls per token, and a fresh accumulator per call was a malloc
// and free each (an mmap and page faults past glibc's 128 KB threshold).
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

// gemm: part[n, T] = values[:, i0:i1].T @ x_v.T by the includer's gemm (at::mm in the torch build:
// MKL reads both as transposed views), then yT[rows - a, :] += part (times the column scale for
// int8): T contiguous adds per kept row, where adding a [T, n] part into y was a scalar scatter per
// number (15% of a lowered SmolLM2 prefill; AVX2 has no scatter). A row's first block stores
// instead (`written`), so yT is never cleared (clearing yT and y took 3% of a lowered SmolLM2
// 256-token prefill). fp32 values are read in place (a strided panel, lda = R, n = i1 - i0);
// bf16/int8 values are first converted into `panel_scratch` [w, n] fp32, n = GEMM_CHUNK columns at
// a time. x: [T, d_in] (row stride ldx); yT: the thread's rows [a, e) of y, transposed ([e - a,
// T]); scratch: >= n * T floats.
template <class V, class Host>
void gemm_rows(const Host& host, const Block<V>& b, int64_t i0, int64_t i1, const float* x, int64_t ldx, int64_t T,
               float* __restrict yT, uint8_t* __restrict written, int64_t a, float* scratch, float* panel_scratch) {
  const int64_t chunk = std::is_same_v<V, float> ? i1 - i0 : GEMM_CHUNK;
  for (int64_t c0 = i0; c0 < i1; c0 += chunk) {
    const int64_t n = std::min(chunk, i1 - c0);
    const float* panel;  // [w, n] fp32, row stride lda
    int64_t lda;
    if constexpr (std::is_same_v<V, float>) {
      panel = b.values + c0;
      lda = b.R;
    } else {
      if constexpr (SCALED<V>) {
        int8_panel(b, c0, n, panel_scratch, false);
      } else {
        for (int64_t k = 0; k < b.w; ++k) {
          const V* __restrict vk = b.values + k * b.R + c0;
          float* __restrict pk = panel_scratch + k * n;
#pragma omp simd
          for (int64_t r = 0; r < n; ++r) pk[r] = to_float(vk[r]);
        }
      }
      panel = panel_scratch;
      lda = n;
    }
    host.gemm(panel, lda, x + b.col, ldx, b.w, n, T, scratch);  // scratch [n, T] = panel.T @ x_v.T
    const float* pp = scratch;
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
bool rows_ok(const RowIndex* rows, const int32_t* ptr, int64_t n_blocks, int64_t d_out) {
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
// weights each, rounded to whole k rows (int8: to whole subgroups of INT4_GROUP rows, which x is
// quantized by). Thread q takes rows [k_cut(q), k_cut(q + 1)) of every block.
template <class V>
int64_t k_cut(const Block<V>& b, int64_t before, int64_t total, int64_t q, int64_t P) {
  const int64_t into = std::clamp<int64_t>(total * q / P - before, 0, b.w * b.R);
  const int64_t unit = SCALED<V> ? INT4_GROUP : 1;
  return into == b.w * b.R ? b.w : std::min(b.w, (into + unit * b.R / 2) / (unit * b.R) * unit);
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
#elif defined(__AVX2__)
  if (width == INT4_GROUP) {
    __m256 v[4];
    const __m256 sign = _mm256_set1_ps(-0.0f), half = _mm256_set1_ps(0.5f);
    __m256 peak8 = _mm256_setzero_ps(), sum8 = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + 8 * i);
      peak8 = _mm256_max_ps(peak8, _mm256_andnot_ps(sign, v[i]));
      sum8 = _mm256_add_ps(sum8, v[i]);
    }
    auto reduce = [](__m256 r, auto op) {
      __m128 q = op(_mm256_castps256_ps128(r), _mm256_extractf128_ps(r, 1));
      q = op(q, _mm_movehl_ps(q, q));
      return _mm_cvtss_f32(op(q, _mm_movehdup_ps(q)));
    };
    const float peak = reduce(peak8, [](__m128 a, __m128 b) { return _mm_max_ps(a, b); });
    const float inverse = peak > 0.0f ? 127.0f / peak : 0.0f;
    __m256i q[4];
    for (int i = 0; i < 4; ++i) {  // round half away from zero: add 0.5 with v's sign, truncate
      const __m256 w = _mm256_mul_ps(v[i], _mm256_set1_ps(inverse));
      q[i] = _mm256_cvttps_epi32(_mm256_add_ps(w, _mm256_or_ps(_mm256_and_ps(w, sign), half)));
    }
    // int32 -> int8 by two saturating packs (lane-interleaved), the dwords back in order, then per
    // 128-bit lane the even bytes ahead of the odd ones, and the lanes' halves gathered: 16 even, 16 odd
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    bytes = _mm256_shuffle_epi8(bytes, _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                                        0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.lo), _mm256_castsi256_si128(bytes));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.hi), _mm256_extracti128_si256(bytes, 1));
    out.scale = peak / 127.0f;
    out.sum = reduce(sum8, [](__m128 a, __m128 b) { return _mm_add_ps(a, b); });
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

// Where column r's numbers of an int4 block lie (see the layout at INT4_GROUP): its tile, the
// tile's width, its place in the tile, and the tile's first code byte and first scale.
struct Int4Column {
  int64_t tile_width, c;
  const uint8_t* codes;   // the tile's [octets][tile_width][4] bytes
  const fp16* halves; // the tile's [subgroups][2][tile_width] scales
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
// A parallel product of more tokens than the stream takes (tiles and the integer products; gemm
// splits rows equally) is cut into items: ranges of output rows of at most RANGE_BYTES of values each
// (so that a range stays in a core's L2 while its tokens go through it), by runs of
// INT4_PREFILL_TOKENS tokens for int4's integer tiles (every other product repacks or reloads its
// weights per call: all tokens at once). With ITEMS_PER_THREAD items a thread or more, whichever
// thread is free takes the next item, where fewer give each thread one equal range of rows: an equal
// split waits on the slowest core (a hybrid CPU's efficiency cores, a core another process shares)
// and on the range that kept the most rows. Each output is one item's, computed as at any split.
constexpr int64_t RANGE_BYTES = 512 * 1024, ITEMS_PER_THREAD = 4;
static_assert(INT4_TOKENS >= STREAM_MAX_TOKENS, "a decode step is one tile product");

// Bytes of codes a tile product prefetches ahead of the subgroup it reads (two tiles of a 256-wide
// block): without it the stream waited on each line (4 -> 9 GB/s, one AVX2 thread).
constexpr int64_t INT4_PREFETCH = 4096;

// The int4 product of one full-width tile (tile.tile_width == INT4_TILE: a narrower last tile runs
// on a zero-padded copy, padded_tile) of a block w rows deep over its ns subgroups, T tokens:
// out[t][c] = sum over the subgroups of d * xq.scale * (codes . x8) + m * xq.sum (integer dot
// products; below four tokens two int32 sums a vector, so that two chains are in flight), or with
// `exact` the fp32 product of x itself (xs: [T][subgroups][INT4_GROUP], zero past the width). One
// pass reads the tile's codes and scales front to back: each is one contiguous run, prefetched
// INT4_PREFETCH bytes ahead. A prefill runs each tile for INT4_TOKENS tokens at a time, so each
// octet's codes are split into nibbles once for all of them.
template <int T>
void int4_tile(const Int4Column& tile, int64_t w, const XQ* xq, const float* xs, int64_t ns, bool exact,
               float (*out)[INT4_TILE]) {
  constexpr int H = INT4_TILE / VEC;  // vectors a tile row
  constexpr int CHAINS = T >= 4 ? 1 : 2;
  constexpr int64_t tw = INT4_TILE, SUBGROUP_BYTES = (INT4_GROUP / 8) * tw * 4;
  vfloat acc[T][H];
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t)
#pragma GCC unroll 8
    for (int h = 0; h < H; ++h) acc[t][h] = vfloat{};
  for (int64_t s = 0; s < ns; ++s) {
    const int no = static_cast<int>((std::min(INT4_GROUP, w - s * INT4_GROUP) + 7) / 8);
    const uint8_t* q = tile.codes + s * SUBGROUP_BYTES;
    const fp16* d = tile.halves + s * 2 * tw;
#pragma GCC unroll 4
    for (int64_t line = 0; line < SUBGROUP_BYTES; line += 64) __builtin_prefetch(q + INT4_PREFETCH + line, 0, 2);
    __builtin_prefetch(reinterpret_cast<const uint8_t*>(d) + INT4_PREFETCH / 4, 0, 2);  // 64 bytes a subgroup
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
          const vint wv = load_words(q + (o * tw + h * VEC) * 4);
#pragma GCC unroll 8
          for (int t = 0; t < T; ++t) {
            const XQ& x = xq[t * ns + s];
            sums[t][h][o % CHAINS] = dot_octet(sums[t][h][o % CHAINS], wv, x.lo[o], x.hi[o]);
          }
        }
      }
#pragma GCC unroll 8
      for (int h = 0; h < H; ++h) {
        const vfloat dv = load(d + h * VEC), mv = load(d + tw + h * VEC);
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
          const vint wv = load_words(q + (o * tw + h * VEC) * 4);
          for (int j = 0; j < 4; ++j) {
            const vint byte = (wv >> (8 * j)) & 0xFF;
            const vfloat lo = __builtin_convertvector(byte & 15, vfloat), hi = __builtin_convertvector(byte >> 4, vfloat);
            for (int t = 0; t < T; ++t) {
              const float* x = xs + (t * ns + s) * INT4_GROUP + 8 * o + 2 * j;
              sums[t][h] += splat(x[0]) * lo + splat(x[1]) * hi;
            }
          }
        }
      for (int h = 0; h < H; ++h) {
        const vfloat dv = load(d + h * VEC), mv = load(d + tw + h * VEC);
        for (int t = 0; t < T; ++t) acc[t][h] += dv * sums[t][h] + mv * splat(xsum[t]);
      }
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t)
#pragma GCC unroll 8
    for (int h = 0; h < H; ++h) store(out[t] + h * VEC, acc[t][h]);
}

using Int4TileFn = void (*)(const Int4Column&, int64_t, const XQ*, const float*, int64_t, bool, float (*)[INT4_TILE]);
constexpr Int4TileFn INT4_TILES[9] = {nullptr,
                                      int4_tile<1>,
                                      int4_tile<2>,
                                      int4_tile<3>,
                                      int4_tile<4>,
                                      int4_tile<std::min(5, INT4_TOKENS)>,
                                      int4_tile<std::min(6, INT4_TOKENS)>,
                                      int4_tile<std::min(7, INT4_TOKENS)>,
                                      int4_tile<std::min(8, INT4_TOKENS)>};

// The narrower last tile of int4 block b (tile.tile_width < INT4_TILE) copied into this thread's
// buffer at INT4_TILE columns, zero past its width: the full tile's loads read it.
Int4Column padded_tile(const Block<int4x2>& b, const Int4Column& tile) {
  const int64_t octets = (b.w + 7) / 8, ns = (b.w + INT4_GROUP - 1) / INT4_GROUP, tw = tile.tile_width;
  const int64_t code_bytes = octets * INT4_TILE * 4, bytes = code_bytes + ns * 2 * INT4_TILE * sizeof(fp16);
  thread_local std::vector<uint8_t> buffer;
  if (int64_t(buffer.size()) < bytes) buffer.resize(bytes);
  std::memset(buffer.data(), 0, bytes);
  for (int64_t o = 0; o < octets; ++o) std::memcpy(buffer.data() + o * INT4_TILE * 4, tile.codes + o * tw * 4, tw * 4);
  fp16* halves = reinterpret_cast<fp16*>(buffer.data() + code_bytes);
  for (int64_t i = 0; i < ns * 2; ++i) std::memcpy(halves + i * INT4_TILE, tile.halves + i * tw, tw * sizeof(fp16));
  return {INT4_TILE, 0, buffer.data(), halves};
}

// y[:, rows[i0:i1]] += the product of int4 block b's columns [i0, i1), T tokens (row stride ldy),
// tile by tile, INT4_TOKENS tokens at a time (a tile cut by i0 or i1 is computed whole, its columns
// outside left out). Each tile's rows in [i0, i1) are checked first (rows_rise from the previous
// row: false, nothing of that tile added, when they do not rise inside [0, d_out)). xq / xs: the
// block's x, quantized / as fp32 (`exact`), [T][subgroups].
bool stream_tiles(const Block<int4x2>& b, int64_t i0, int64_t i1, int64_t T, const XQ* xq, const float* xs,
                  int64_t ns, bool exact, float* __restrict y, int64_t ldy, int64_t d_out) {
  float out[INT4_TOKENS][INT4_TILE];
  for (int64_t r0 = i0 / INT4_TILE * INT4_TILE; r0 < i1; r0 += INT4_TILE) {
    Int4Column tile = int4_column(b, r0);
    const int64_t lo = std::max(r0, i0), hi = std::min(r0 + tile.tile_width, i1);
    if (!rows_rise(b.rows + lo, hi - lo, lo > 0 ? b.rows[lo - 1] : -1, d_out)) return false;
    if (tile.tile_width < INT4_TILE) tile = padded_tile(b, tile);
    for (int64_t t0 = 0; t0 < T; t0 += INT4_TOKENS) {
      const int64_t n = std::min<int64_t>(INT4_TOKENS, T - t0);
      INT4_TILES[n](tile, b.w, exact ? nullptr : xq + t0 * ns, exact ? xs + t0 * ns * INT4_GROUP : nullptr, ns, exact,
                    out);
      for (int64_t t = 0; t < n; ++t)
        scatter_add<float>(y + (t0 + t) * ldy, b.rows + lo, out[t] + (lo - r0), nullptr, hi - lo);
    }
  }
  return true;
}

// x's numbers over the block of width w from column col, for the integer products, tokens [t0, t1)
// (row stride ldx) of the block's [T][subgroups] inputs: quantized per subgroup into xq, or with
// `exact` copied as fp32 into xs ([T][subgroups][INT4_GROUP], zero past the block's width).
void quantize_inputs(int64_t col, int64_t w, const float* xp, int64_t t0, int64_t t1, int64_t ldx, bool exact, XQ* xq,
                     float* xs) {
  const int64_t ns = (w + INT4_GROUP - 1) / INT4_GROUP;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t s = 0; s < ns; ++s) {
      const float* x = xp + t * ldx + col + s * INT4_GROUP;
      const int64_t width = std::min(INT4_GROUP, w - s * INT4_GROUP);
      if (exact) {
        float* to = xs + (t * ns + s) * INT4_GROUP;
        std::memcpy(to, x, width * sizeof(float));
        std::fill(to + width, to + INT4_GROUP, 0.0f);
      } else {
        quantize_x(x, width, xq[t * ns + s]);
      }
    }
}

// quantize_inputs of all T tokens into xq or xs, sized here.
void block_inputs(int64_t col, int64_t w, const float* xp, int64_t T, int64_t ldx, bool exact, std::vector<XQ>& xq,
                  std::vector<float>& xs) {
  const int64_t ns = (w + INT4_GROUP - 1) / INT4_GROUP;
  if (exact) xs.resize(T * ns * INT4_GROUP);
  else xq.resize(T * ns);
  quantize_inputs(col, w, xp, 0, T, ldx, exact, xq.data(), xs.data());
}

// What a decode tile of int4 costs beyond its k rows, in k rows: the tile's own work (its rows
// checked, the sums scaled subgroup by subgroup and scattered into y, a narrow last tile padded).
// A tile of a 64-row block (SmolLM2's 576 = 2 x 256 + 64) then weighs half a 256-row tile where its
// values weigh a quarter. Cut by values alone, the share holding the 64-row blocks ran 10-35%
// longer than the other on two threads and the first waited for it at every join (an AVX2 build on
// a 2-core AMD EPYC, each share timed apart: docs/speed.md, "Two threads' shares by cost").
constexpr int64_t INT4_TILE_COST_ROWS = 128;

// The decode cost of one tile of int4 block b: its columns by its k rows and INT4_TILE_COST_ROWS.
inline int64_t tile_cost(const Block<int4x2>& b) { return INT4_TILE * (b.w + INT4_TILE_COST_ROWS); }

// What a block adds to a decode share (stream_split): int4, its tiles' cost; other values, its weights.
template <class V>
int64_t share_weight(const Block<V>& b) {
  if constexpr (INT4<V>) return (b.R + INT4_TILE - 1) / INT4_TILE * tile_cost(b);
  else return b.w * b.R;
}

// The tile of int4 block `b` where thread q of P starts: the layer's tiles, block after block, cut
// into P runs of equal cost (share_weight: `before` of the blocks ahead of b, `total` in all).
int64_t tile_cut(const Block<int4x2>& b, int64_t before, int64_t total, int64_t q, int64_t P) {
  const int64_t tiles = (b.R + INT4_TILE - 1) / INT4_TILE, per_tile = tile_cost(b);
  const int64_t into = total * q / P - before;
  if (into <= 0) return 0;
  if (into >= tiles * per_tile) return tiles;
  return std::min(tiles, (into + per_tile / 2) / per_tile);
}

// The int4 prefill product of block b's columns [i0, i1) (a thread's output rows) into y (T tokens,
// row stride d_out): integer dot products on x quantized per subgroup (xq: the block's
// [T][subgroups] of quantize_inputs), as decode's, or the fp32 product (`exact`: xs). Rows were
// checked (rows_ok).
void int4_rows(const Block<int4x2>& b, int64_t i0, int64_t i1, const XQ* xq, const float* xs, int64_t T, float* y,
               int64_t d_out, bool exact) {
  const int64_t ns = (b.w + INT4_GROUP - 1) / INT4_GROUP;
  for (int64_t t0 = 0; t0 < T; t0 += INT4_PREFILL_TOKENS) {
    const int64_t n = std::min(INT4_PREFILL_TOKENS, T - t0);
    stream_tiles(b, i0, i1, n, exact ? nullptr : xq + t0 * ns, exact ? xs + t0 * ns * INT4_GROUP : nullptr, ns, exact,
                 y + t0 * d_out, d_out, d_out);
  }
}

// ---- int8 prefill by integer dot products ----
//
// int8 values are stored in words (int8_code): per octet o, column c's lo word holds k rows 8o,
// 8o + 2, 8o + 4, 8o + 6 and its hi word 8o + 1, 3, 5, 7 (the k rows of XQ's lo and hi words). The
// prefill product copies GEMM_CHUNK columns of them at a time into `words` (int8_words: whole
// tiles of INT4_TILE columns, zero past the block's last octet and columns), and then runs the int4
// tile loop over them on the same quantized x: each word against 4 x codes, per 32 k rows one
// int32 sum a column and token, times x's scale; the column scale at the end.
// vpdpbusd multiplies unsigned by signed bytes: with VNNI x goes in as x8 + 128 (unsigned) against
// the signed weights, and 128 times the weights' sum per subgroup (`wsums`) comes off each sum;
// without it vpmaddubsw takes |w| against x8 with w's sign, whose pairs stay within 2 * 127 * 127.
#if defined(__AVX512VNNI__)
constexpr bool X_OFFSET = true;
#else
constexpr bool X_OFFSET = false;
#endif

// The dot product of two words of 4 signed bytes.
inline int32_t word_dot(int32_t w, int32_t x) {
  int32_t sum = 0;
  for (int j = 0; j < 4; ++j) sum += int8_t(uint32_t(w) >> (8 * j)) * int8_t(uint32_t(x) >> (8 * j));
  return sum;
}

// Per lane the dot product of 4 signed weights (w) with 4 signed x codes (x, one word), exact: |w|
// (unsigned) against x with w's sign, whose int16 pairs stay within 2 * 127 * 127.
inline vint quad_products(vint w, int32_t x) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512i xv = _mm512_set1_epi32(x);
  const __m512i signed_x = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask((__m512i)w), _mm512_setzero_si512(), xv);
#if defined(__AVX512VNNI__)
  return (vint)_mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8((__m512i)w), signed_x);
#else
  return (vint)_mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8((__m512i)w), signed_x), _mm512_set1_epi16(1));
#endif
#elif defined(__AVX2__) && !defined(__AVX512F__)
  const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8((__m256i)w, (__m256i)w),
                                         _mm256_sign_epi8(_mm256_set1_epi32(x), (__m256i)w));
  return (vint)_mm256_madd_epi16(p, _mm256_set1_epi16(1));
#else
  vint out;
  for (int l = 0; l < VEC; ++l) out[l] = word_dot(w[l], x);
  return out;
#endif
}

// acc + quad_products(w, x); with VNNI x goes in as x8 + 128 (unsigned) against the signed weights,
// and the caller takes 128 times the weights' sum off (X_OFFSET).
inline vint dot_quad(vint acc, vint w, int32_t x) {
#if defined(__AVX512VNNI__)
  return (vint)_mm512_dpbusd_epi32((__m512i)acc, _mm512_set1_epi32(x ^ int32_t(0x80808080)), (__m512i)w);
#else
  return acc + quad_products(w, x);
#endif
}

// ---- int8 decode by integer dot products ----
//
// The stream of an int8 block (T <= STREAM_MAX_TOKENS): x quantized per subgroup as for the
// prefill (quantize_x), then the float stream's walk (stream_rows: eight rows of words far apart
// per pass, accumulators in L1, the column scales applied as they are added into y), each word of
// 4 codes against the word of 4 x codes of its k rows: per VEC columns and row of words one
// integer dot product (2 instructions with AVX2, 1 with VNNI, after |w| and x's sign), a
// conversion and one FMA by x's scale, where the row-major float stream converted and multiplied
// each weight. The k rows past the last whole octet go as fp32 rows against x's quantized values,
// so every k row is multiplied by x8 * scale, as the prefill's integer product does.

// a[r] += sum_i xs[i] * (words[i * step + r] . xw[i]) for r < n: K rows of words (step words apart)
// into one accumulator row, VEC columns at a time in two chains.
template <int K>
inline void add_quads(float* __restrict a, const int32_t* __restrict words, int64_t step, const int32_t* xw,
                      const float* xs, int64_t n) {
  vfloat sv[K];
#pragma GCC unroll 8
  for (int i = 0; i < K; ++i) sv[i] = splat(xs[i]);
  int64_t r = 0;
  for (; r + 2 * VEC <= n; r += 2 * VEC) {  // two vectors of columns: each x broadcast serves both
    vfloat s0 = load(a + r), s1 = load(a + r + VEC);
#pragma GCC unroll 8
    for (int i = 0; i < K; ++i) {
      const int32_t* wi = words + i * step + r;
      const vint p0 = quad_products(load_words(reinterpret_cast<const uint8_t*>(wi)), xw[i]);
      const vint p1 = quad_products(load_words(reinterpret_cast<const uint8_t*>(wi + VEC)), xw[i]);
      s0 += __builtin_convertvector(p0, vfloat) * sv[i];
      s1 += __builtin_convertvector(p1, vfloat) * sv[i];
    }
    store(a + r, s0);
    store(a + r + VEC, s1);
  }
  for (; r + VEC <= n; r += VEC) {
    vfloat s0 = load(a + r);
#pragma GCC unroll 8
    for (int i = 0; i < K; ++i)
      s0 += __builtin_convertvector(
                quad_products(load_words(reinterpret_cast<const uint8_t*>(words + i * step + r)), xw[i]), vfloat) *
            sv[i];
    store(a + r, s0);
  }
  for (; r < n; ++r) {
    float sum = a[r];
    for (int i = 0; i < K; ++i) {
      int32_t word;
      std::memcpy(&word, words + i * step + r, sizeof(word));
      sum += xs[i] * float(word_dot(word, xw[i]));
    }
    a[r] = sum;
  }
}

// x's word of codes against row of words q of a block (k rows 8 (q / 2) + q % 2 + 2j), from its
// subgroups' words xq; int8_code's order.
inline int32_t x_word(const XQ* xq, int64_t q) {
  const XQ& z = xq[q / 8];
  return (q & 1 ? z.hi : z.lo)[(q % 8) / 2];
}

// x's code of k row k (the tail rows past the last whole octet).
inline int8_t x_code(const XQ* xq, int64_t k) {
  return int8_t(uint32_t(x_word(xq, k / 8 * 2 + (k & 1))) >> (8 * ((k % 8) / 2)));
}

// stream_rows for int8 block b (all its R columns; b.w rows from a multiple of INT4_GROUP of its
// block: k_cut), x at b's first column: y[:, rows] += x @ W_hat in chunks of cw columns (acc: [T,
// cw] scratch of `capacity` floats). False, nothing of that chunk added, when a chunk's rows do not
// rise inside [0, d_out).
bool stream_rows8(const Block<int8_t>& b, const float* __restrict x, int64_t ldx, int64_t T, float* __restrict y,
                  int64_t ldy, float* __restrict acc, int64_t capacity, const int8_t* values_end, int64_t d_out) {
  const int64_t R = b.R, w = b.w, w8 = w / 8 * 8, nq = w8 / 4, ns = (w + INT4_GROUP - 1) / INT4_GROUP;
  static thread_local std::vector<XQ> xq;  // [T][ns], kept across calls, as thread_scratch
  xq.resize(T * ns);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s < ns; ++s)
      quantize_x(x + t * ldx + s * INT4_GROUP, std::min(INT4_GROUP, w - s * INT4_GROUP), xq[t * ns + s]);
  const int32_t* words = reinterpret_cast<const int32_t*>(b.values);
  const int64_t cw = capacity / T / VEC * VEC, seg = nq / 8;  // rows of words per eighth
  for (int64_t c0 = 0; c0 < R; c0 += cw) {
    const int64_t n = std::min(cw, R - c0);
    if (!rows_rise(b.rows + c0, n, c0 > 0 ? b.rows[c0 - 1] : -1, d_out)) return false;
    // whole vectors, as stream_rows, unless the last row read would then run past the buffer
    const int64_t np = (n + VEC - 1) / VEC * VEC;
    const int8_t* last = w > w8 ? b.values + (w - 1) * R + c0 + np : b.values + ((nq - 1) * R + c0 + np) * 4;
    const int64_t m = last <= values_end ? np : n;
    for (int64_t t = 0; t < T; ++t) std::memset(acc + t * cw, 0, m * sizeof(float));
    for (int64_t j = 0; j < seg; ++j)
      for (int64_t t = 0; t < T; ++t) {
        int32_t xw[8];
        float xs[8];
        for (int i = 0; i < 8; ++i) {
          xw[i] = x_word(xq.data() + t * ns, j + i * seg);
          xs[i] = xq[t * ns + (j + i * seg) / 8].scale;
        }
        add_quads<8>(acc + t * cw, words + j * R + c0, seg * R, xw, xs, m);
      }
    for (int64_t q = 8 * seg; q < nq; ++q)
      for (int64_t t = 0; t < T; ++t) {
        const int32_t xw = x_word(xq.data() + t * ns, q);
        add_quads<1>(acc + t * cw, words + q * R + c0, R, &xw, &xq[t * ns + q / 8].scale, m);
      }
    for (int64_t k = w8; k < w; ++k)
      for (int64_t t = 0; t < T; ++t) {
        const float xv = float(x_code(xq.data() + t * ns, k)) * xq[t * ns + k / INT4_GROUP].scale;
        add_rows<1>(acc + t * cw, b.values + k * R + c0, R, &xv, m);
      }
    for (int64_t t = 0; t < T; ++t) scatter_add<int8_t>(y + t * ldy, b.rows + c0, acc + t * cw, b.scales + c0, n);
  }
  return true;
}

// words [octets][2][np] (lo, hi) of columns c0 .. c0 + n of int8 block b, np = n rounded up to
// INT4_TILE (zero past n and past w): the stored words of a whole octet's rows, copied; a last
// partial octet's built by bytes. wsums [subgroups][np]: each column's sum of weights over a
// subgroup's k rows (with X_OFFSET).
void int8_words(const Block<int8_t>& b, int64_t c0, int64_t n, int64_t np, int32_t* __restrict words,
                int32_t* __restrict wsums) {
  const int64_t octets = (b.w + 7) / 8, ns = (b.w + INT4_GROUP - 1) / INT4_GROUP;
  auto weight = [&](int64_t k, int64_t c) -> uint8_t {
    return k < b.w && c < n ? uint8_t(int8_code(b.values, b.R, b.w, k, c0 + c)) : 0;
  };
  for (int64_t o = 0; o < octets; ++o) {
    int32_t* lo = words + o * 2 * np;
    int32_t* hi = lo + np;
    int64_t c = 0;
    if (8 * o + 8 <= b.w) {
      std::memcpy(lo, b.values + (2 * o * b.R + c0) * 4, n * 4);
      std::memcpy(hi, b.values + ((2 * o + 1) * b.R + c0) * 4, n * 4);
      c = n;
    }
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
// INT4_TILE columns for INT4_TOKENS tokens at a time, in runs of INT4_PREFILL_TOKENS tokens, on x
// quantized per subgroup (xq: the block's [T][subgroups] of quantize_inputs). Rows were checked
// (rows_ok).
void int8_rows(const Block<int8_t>& b, int64_t i0, int64_t i1, const XQ* xq, int64_t T, float* y, int64_t d_out) {
  const int64_t octets = (b.w + 7) / 8, ns = (b.w + INT4_GROUP - 1) / INT4_GROUP;
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
          INT8_TILES[nt](words.data(), wsums.data(), np, c, b.w, xq + t0 * ns, ns, out);
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
      const fp16* h = col.halves + (k0 / INT4_GROUP) * 2 * col.tile_width;
      const float d = to_float(h[col.c]), m = to_float(h[col.tile_width + col.c]);
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

// tiles for int8 block b (paths TILES_ONLY, STREAM_FLOAT): GEMM_CHUNK columns at a time converted into this
// thread's panel with their column scales (int8_panel), whose fp32 tiles then run (tile_rows).
void tile_rows8(const Block<int8_t>& b, int64_t i0, int64_t i1, const float* x, int64_t ldx, int64_t T, float* y,
                int64_t ldy) {
  float* panel = thread_scratch(5, b.w * GEMM_CHUNK + RR);  // RR spare: a full tile may read past n
  for (int64_t c0 = i0; c0 < i1; c0 += GEMM_CHUNK) {
    const int64_t n = std::min(GEMM_CHUNK, i1 - c0);
    int8_panel(b, c0, n, panel, true);
    const Block<float> fb{panel, b.rows + c0, nullptr, n, b.w, b.col};
    tile_rows<float>(fb, 0, n, x, ldx, T, y, ldy, panel + b.w * n + RR);
  }
}

// gemm for int4 block b: GEMM_CHUNK columns at a time dequantized into `panel_scratch`, which
// then runs as an fp32 block (gemm_rows).
template <class Host>
void gemm_rows4(const Host& host, const Block<int4x2>& b, int64_t i0, int64_t i1, const float* x, int64_t ldx,
                int64_t T, float* __restrict yT, uint8_t* __restrict written, int64_t a, float* scratch,
                float* panel_scratch) {
  for (int64_t c0 = i0; c0 < i1; c0 += GEMM_CHUNK) {
    const int64_t n = std::min(GEMM_CHUNK, i1 - c0);
    dequantize4(b, c0, n, panel_scratch);
    const Block<float> fb{panel_scratch, b.rows + c0, nullptr, n, b.w, b.col};
    gemm_rows<float>(host, fb, 0, n, x, ldx, T, yT, written, a, scratch, panel_scratch);
  }
}

}  // namespace
