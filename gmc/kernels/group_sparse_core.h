// The compute of gmc's group-sparse linear on the packed BSC format (gmc/kernels/packed.py), without
// torch: y [T, d_out] = x [T, d_in] @ W_hat.T + bias from raw pointers and sizes (run_blocks). Two
// libraries include it: the torch op's CPU kernel (cpu_group_sparse.cpp) and the ONNX Runtime custom
// op (ort_group_sparse.cpp); group_sparse_products.h holds the block products it combines.
//
//   y = bias (or 0)                                      // [T, d_out]
//   one parallel region; thread p owns output rows [a_p, b_p) (no two threads write one row)
//   for gemm and small tiles, larger tiles and integer products hand out items of rows (and of
//   tokens) to whichever thread is free (RANGE_BYTES); the stream (decode) splits the layer's
//   weights instead (stream_share):
//     for each input block v:                            // values_v [w_v, R_v] (int8: in words)
//       [i0, i1) = kept rows of block v inside [a_p, b_p)   // row_idx ascending: binary search
//       y[:, row_idx[i0:i1]] += x[:, cols_v] @ values_v[:, i0:i1]   // one of these products:
//
//   stream  (T <= STREAM_MAX_TOKENS): decode. Walk k down the block, reading up to ACC / T
//           contiguous values per k row into an accumulator acc[T, <= ACC / T]; each pass takes one k row from each
//           eighth of the block, so eight streams far apart are in flight at once (one or four
//           nearby streams left DRAM half idle: docs/lowering.md, "Decode kernel").
//   tiles   (T <= GEMM_MIN_TOKENS, or every T > STREAM_MAX_TOKENS on a host without a gemm): a TT x RR
//           register tile (6 x 64 fp32 on AVX-512) over the [w_v, RR] panel, software-prefetched (the
//           panel rows are R_v apart).
//   gemm    (larger T, on a host with one): the host's gemm (at::mm: MKL/oneDNN, single-threaded inside
//           the region) of values_v[:, i0:i1].T @ x_v.T into per-thread scratch, stored (a row's first
//           block) or added row by row into the thread's y rows kept transposed ([rows, T]: contiguous),
//           which are written into y, with the bias, at the end (y is not cleared first). bf16/int8
//           values are first converted to fp32, GEMM_CHUNK columns at a time, into a per-thread panel.
//   integer (int4 and int8 at every T: what paths AUTO and STREAM pick for them): x quantized to
//           int8 per 32 numbers, integer dot products over tiles of INT4_TILE columns, INT4_TOKENS
//           tokens at a time (stream_share, int4_rows, int8_rows), or, int8 decode, the stream's walk
//           over the stored words (stream_rows8).
//
// Dtypes: values are fp32, bf16, int8 (weight-only, with one fp32 scale per packed column) or
// int4 (two codes a byte, an fp16 scale and offset per column and 32 k rows: see INT4_GROUP in
// group_sparse_products.h); every product but the integer one converts them to fp32 as it loads them
// (bf16 by a 16-bit shift) and accumulates in fp32; int8 accumulators are multiplied by their
// column's scale when they are added into y. int4 tiles and gemm dequantize into fp32 panels. x,
// bias and y are fp32.
//
// Every kept weight is read once per token tile (once in total for decode) and no pruned weight
// is read; partial products go straight into y with plain adds (rows are unique within a block
// and owned by one thread), so there are no index_add_ temporaries, no atomics, and one
// fork/join per call. Precondition (what gmc.kernels.packed.pack produces; checked on every call, by the
// decode stream chunk by chunk as it reaches the rows, by the other products before they start:
// blocks_ok, rows_ok): row_idx is strictly ascending inside each block. Thresholds: measured on a 2-vCPU
// AVX-512 Xeon, see docs/lowering.md.
//
// What the includer provides, a Host passed to run_blocks (its threads are the includer's: ATen's
// OpenMP pool in the torch build, ONNX Runtime's intra-op pool in the custom op):
//   int64_t threads() const                      the P of the split products (P > 1: parallel)
//   void parallel_for(begin, end, grain, f) const   f(b, e) over a partition of [begin, end) into at
//                                                  most threads() ranges of at least grain (one range,
//                                                  on the calling thread, when end - begin <= grain)
//   static constexpr bool HAS_GEMM               whether path GEMM runs; without it, GEMM is TILES_ONLY
//   void gemm(a, lda, x, ldx, w, n, T, out) const   out [n, T] = a[w, n].T @ x[T, w].T (row strides lda,
//                                                  ldx; out contiguous), only with HAS_GEMM
// and, before including, GMC_ROW_INDEX if row_idx is not int64_t.
#pragma once

#include <atomic>

#include "group_sparse_products.h"

namespace {

// Thread p's share of the decode product (T <= STREAM_MAX_TOKENS) of `blocks` (`total`: the sum of
// their share_weight) on P threads, added into y (this thread's partial, or y itself for p = 0:
// split_output). The layer's weights, block after block, are cut into P contiguous runs of equal cost:
//   int4 by tiles of output rows (tile_cut, a tile weighed by its k rows and INT4_TILE_COST_ROWS):
//     x quantized per block and subgroup for the blocks the share reaches (fp32 copies with
//     `exact`), then the integer tile products (stream_tiles);
//   the rest by k rows (k_cut): whole blocks and at most two partial ones, all kept rows of each,
//     through the stream's walk (stream_rows8 for int8, stream_rows), `capacity` accumulator floats.
// Splitting output rows for the walk instead halves every k row's contiguous run per thread and
// puts both threads' streams side by side: on SmolLM2's shapes two threads were then slower than
// one; splitting every block's k rows in P made every thread scatter and check every block's rows,
// and cut the eight streams of a block to half their length (a compiled int8 step 0.87x on two
// threads with the runs instead). Every share checks the rows it adds (stream_rows): false, with y
// incomplete, when they do not rise inside [0, d_out).
template <class V>
bool stream_share(const std::vector<Block<V>>& blocks, int64_t total, int64_t p, int64_t P, const float* xp,
                  int64_t T, int64_t d_in, float* y, int64_t d_out, const V* values_end, int64_t capacity,
                  bool exact) {
  int64_t before = 0;  // weights of the blocks ahead of b
  if constexpr (INT4<V>) {
    static thread_local std::vector<XQ> xq;  // kept across calls, as thread_scratch
    static thread_local std::vector<float> xs;
    for (const Block<int4x2>& b : blocks) {
      const int64_t j0 = tile_cut(b, before, total, p, P), j1 = tile_cut(b, before, total, p + 1, P);
      before += share_weight(b);
      if (j0 == j1) continue;
      block_inputs(b.col, b.w, xp, T, d_in, exact, xq, xs);
      const int64_t ns = (b.w + INT4_GROUP - 1) / INT4_GROUP;
      if (!stream_tiles(b, j0 * INT4_TILE, std::min(b.R, j1 * INT4_TILE), T, xq.data(), xs.data(), ns, exact, y,
                        d_out, d_out))
        return false;
    }
  } else {
    float* acc = thread_scratch(0, capacity);  // stream_rows clears what it uses
    for (const Block<V>& b : blocks) {
      const int64_t k0 = k_cut(b, before, total, p, P), k1 = k_cut(b, before, total, p + 1, P);
      before += b.w * b.R;
      if (k0 == k1) continue;
      Block<V> part = b;  // rows k0..k1 of the block: same row stride R
      part.values += k0 * b.R;
      part.w = k1 - k0;
      part.col += k0;
      bool ok;
      if constexpr (SCALED<V>) ok = stream_rows8(part, xp + part.col, d_in, T, y, d_out, acc, capacity, values_end, d_out);
      else ok = stream_rows(part, 0, b.R, xp + part.col, d_in, T, y, d_out, acc, capacity, values_end, d_out);
      if (!ok) return false;
    }
  }
  return true;
}

// The decode product on P threads (P = 1: the whole layer on the calling thread): each thread's
// share (stream_share) into its own partial y (thread 0 into y itself), the partials added at the
// end in thread order (T * d_out numbers each), so no result depends on which thread finished first.
template <class V, class Host>
bool stream_split(const Host& host, const std::vector<Block<V>>& blocks, const float* xp, int64_t T, int64_t d_in,
                  const float* bp, float* yp, int64_t d_out, const V* values_end, int64_t capacity, int64_t P,
                  bool exact) {
  float* partial = thread_scratch(1, (P - 1) * T * d_out);  // [P - 1, T, d_out]
  std::atomic<bool> bad{false};
  int64_t total = 0;  // the layer's cost (share_weight: its kept weights, int4 its tiles)
  for (const Block<V>& b : blocks) total += share_weight(b);
  host.parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1 && !bad.load(std::memory_order_relaxed); ++p) {
      float* y = split_output(yp, partial, p, T, d_out, bp);
      if (!stream_share(blocks, total, p, P, xp, T, d_in, y, d_out, values_end, capacity, exact))
        bad.store(true, std::memory_order_relaxed);
    }
  });
  if (bad.load()) return false;
  add_partials(yp, partial, P, T * d_out);
  return true;
}

// n uninitialised floats on a 64-byte boundary, as at::empty gave the gemm's operands (MKL may pick
// its code path, and so its rounding, by their alignment).
struct FreeFloats {
  void operator()(float* p) const { std::free(p); }
};
using AlignedFloats = std::unique_ptr<float[], FreeFloats>;
inline AlignedFloats aligned_floats(int64_t n) {
  return AlignedFloats(static_cast<float*>(std::aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64)));
}

// The gemm product of the thread's output rows [a, e) (see gemm_rows): the rows of y transposed in
// yT, uninitialised until a block writes them (written), then written into y with the bias.
template <class V, class Host>
void gemm_range(const Host& host, const std::vector<Block<V>>& blocks, int64_t a, int64_t e, const float* xp,
                int64_t T, int64_t d_in, const float* bp, float* yp, int64_t d_out, int64_t g_in) {
  std::unique_ptr<float[]> yT;
  std::vector<uint8_t> written;
  AlignedFloats scratch, panel;
  for (const Block<V>& b : blocks) {
    const auto [i0, i1] = rows_in(b, a, e);
    if (i0 == i1) continue;
    if (!yT) {  // the range's first block
      scratch = aligned_floats(T * (e - a));  // >= T * (i1 - i0)
      if (!std::is_same_v<V, float>) panel = aligned_floats(g_in * GEMM_CHUNK);
      yT.reset(new float[(e - a) * T]);
      written.assign(e - a, 0);
    }
    if constexpr (INT4<V>)
      gemm_rows4(host, b, i0, i1, xp, d_in, T, yT.get(), written.data(), a, scratch.get(), panel.get());
    else
      gemm_rows(host, b, i0, i1, xp, d_in, T, yT.get(), written.data(), a, scratch.get(), panel.get());
  }
  if (!yT) {  // no block keeps a row of the range
    init_rows(yp, T, d_out, bp, a, e);
    return;
  }
  for (int64_t i = 0; i < e - a; ++i)
    if (!written[i]) std::memset(yT.get() + i * T, 0, T * sizeof(float));
  write_transposed(yp, d_out, yT.get(), T, a, e, bp);
}

// The non-empty blocks of a layer stored as V (vp; scales as run_blocks takes them) into `blocks`.
template <class V>
void blocks_for(const V* vp, const void* scales, const RowIndex* row_idx, const int32_t* row_ptr, int64_t n_blocks,
                int64_t d_in, int64_t g_in, std::vector<Block<V>>& blocks) {
  if constexpr (INT4<V>)
    blocks_of4(vp, static_cast<const fp16*>(scales), row_idx, row_ptr, n_blocks, d_in, g_in, blocks);
  else
    blocks_of<V>(vp, static_cast<const float*>(scales), row_idx, row_ptr, n_blocks, d_in, g_in, blocks);
}

// Whether a layer of n_values stored values (int4: bytes of two weights) splits over threads:
// below MIN_PARALLEL_NNZ weights the fork and join cost more than the second thread saves.
inline bool splits(int64_t n_values, bool int4) { return n_values * (int4 ? 2 : 1) >= MIN_PARALLEL_NNZ; }

// y [T, d_out] = x [T, d_in] @ W_hat.T + bias, all fp32 (xp, bp, yp: raw memory; bp null for no
// bias), with the weights stored as V (vp: n_values of them, int4: bytes; scales: [R] fp32 column
// scales of int8 values, the fp16 scales of int4 values, else null) in a layout blocks_ok
// accepted; false, y incomplete, when row_idx is not one rows_ok accepts (the split-k stream
// checks it as it goes, every other product first). path: which product (not AUTO: the includer
// picks). Decode allocates nothing: its blocks and scratch are kept per thread across calls.
template <class V, class Host>
bool run_blocks(const Host& host, const float* xp, int64_t T, int64_t d_in, const V* vp, int64_t n_values,
                const void* scales, const RowIndex* row_idx, const int32_t* row_ptr, int64_t n_blocks, const float* bp,
                float* yp, int64_t d_out, int64_t g_in, int64_t path) {
  if constexpr (!Host::HAS_GEMM)
    if (path == GEMM) path = TILES_ONLY;
  const V* values_end = vp + n_values;
  // kept across calls (decode makes ~120 a token): a fresh vector was a malloc and free each. The
  // parallel regions below must see this thread's vector: they capture the reference, not the name.
  static thread_local std::vector<Block<V>> kept;
  std::vector<Block<V>>& blocks = kept;
  blocks_for(vp, scales, row_idx, row_ptr, n_blocks, d_in, g_in, blocks);
  const int64_t threads = host.threads();
  const bool parallel = splits(n_values, INT4<V>) && threads > 1;
  // int8's fp32 product (STREAM_FLOAT) is its tiles at every T: its stream is integer
  if ((path == STREAM || (path == STREAM_FLOAT && !SCALED<V>)) && T <= STREAM_MAX_TOKENS) {  // P = 1: every k row
    return stream_split(host, blocks, xp, T, d_in, bp, yp, d_out, values_end, stream_capacity(blocks, T),
                        parallel ? threads : 1, path == STREAM_FLOAT);
  }
  if (!rows_ok(row_idx, row_ptr, n_blocks, d_out)) return false;
  // the integer products' x, quantized once for the whole call: block v's [T][subgroups] from first[v]
  const bool integer = (INT4<V> && path != TILES_ONLY) || (SCALED<V> && path == STREAM);
  const bool exact = path == STREAM_FLOAT;
  std::vector<int64_t> first(blocks.size() + 1, 0);
  for (size_t v = 0; integer && v < blocks.size(); ++v)
    first[v + 1] = first[v] + T * ((blocks[v].w + INT4_GROUP - 1) / INT4_GROUP);
  std::vector<XQ> xq(exact ? 0 : first.back());
  std::vector<float> xs(exact ? first.back() * INT4_GROUP : 0);
  if (integer)
    host.parallel_for(0, T, parallel ? 1 : T, [&](int64_t t0, int64_t t1) {
      for (size_t v = 0; v < blocks.size(); ++v)
        quantize_inputs(blocks[v].col, blocks[v].w, xp, t0, t1, d_in, exact, exact ? nullptr : xq.data() + first[v],
                        exact ? xs.data() + first[v] * INT4_GROUP : nullptr);
    });
  // y's rows [a, e) of tokens [t0, t0 + n)
  const auto product = [&](int64_t t0, int64_t n, int64_t a, int64_t e) {
    float* yt = yp + t0 * d_out;
    if (path == GEMM) {
      if constexpr (Host::HAS_GEMM) gemm_range(host, blocks, a, e, xp + t0 * d_in, n, d_in, bp, yt, d_out, g_in);
      return;
    }
    init_rows(yt, n, d_out, bp, a, e);
    for (size_t v = 0; v < blocks.size(); ++v) {
      const Block<V>& b = blocks[v];
      const auto [i0, i1] = rows_in(b, a, e);
      if (i0 == i1) continue;
      const int64_t ns = (b.w + INT4_GROUP - 1) / INT4_GROUP, at = first[v] + t0 * ns;
      if constexpr (INT4<V>) {
        if (path == TILES_ONLY) tile_rows4(b, i0, i1, xp + t0 * d_in + b.col, d_in, n, yt, d_out);
        else int4_rows(b, i0, i1, exact ? nullptr : xq.data() + at, exact ? xs.data() + at * INT4_GROUP : nullptr, n, yt,
                       d_out, exact);
      } else if constexpr (SCALED<V>) {
        if (path == STREAM) int8_rows(b, i0, i1, xq.data() + at, n, yt, d_out);
        else tile_rows8(b, i0, i1, xp + t0 * d_in + b.col, d_in, n, yt, d_out);
      } else {
        tile_rows(b, i0, i1, xp + t0 * d_in + b.col, d_in, n, yt, d_out, values_end);
      }
    }
  };
  // Items: `ranges` ranges of rows (by RANGE_BYTES) by runs of `run` tokens (int4's integer tiles;
  // every other product repacks or reloads its weights per call and takes all T at once).
  const int64_t run = INT4<V> && integer ? INT4_PREFILL_TOKENS : std::max<int64_t>(T, 1), runs = (T + run - 1) / run;
  const int64_t units = (d_out + ROW_ALIGN - 1) / ROW_ALIGN;
  const int64_t ranges = std::clamp<int64_t>((n_values * int64_t(sizeof(V)) + RANGE_BYTES - 1) / RANGE_BYTES, 1, units);
  if (parallel && path != GEMM && ranges * runs >= ITEMS_PER_THREAD * threads) {
    std::atomic<int64_t> next{0};
    host.parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < ranges * runs;
           i = next.fetch_add(1, std::memory_order_relaxed)) {
        const int64_t r = i / runs, t0 = i % runs * run;
        const int64_t a = std::min(d_out, units * r / ranges * ROW_ALIGN);
        const int64_t e = std::min(d_out, units * (r + 1) / ranges * ROW_ALIGN);
        if (a < e) product(t0, std::min(run, T - t0), a, e);
      }
    });
    return true;
  }
  host.parallel_for(0, d_out, parallel ? ROW_ALIGN : d_out, [&](int64_t begin, int64_t end) {
    // ranges partition [0, d_out); rounding both ends the same way keeps a partition
    const int64_t a = begin == 0 ? 0 : std::min(d_out, (begin + ROW_ALIGN - 1) / ROW_ALIGN * ROW_ALIGN);
    const int64_t e = end == d_out ? d_out : std::min(d_out, (end + ROW_ALIGN - 1) / ROW_ALIGN * ROW_ALIGN);
    if (a < e) product(0, T, a, e);
  });
  return true;
}

}  // namespace
