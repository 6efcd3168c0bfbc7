// Standalone int8 decode-stream variants (no torch): is a k-pair interleaved int8 layout worth a
// format change? One token, blocks of 256 k rows x R kept rows, ~60 MB of int8 values (past L3),
// best of 15 sweeps; prints GB/s of values read.
//   A: the kernel's stream today: 8 distant k-row streams, vpmovsxbd + vcvtdq2ps + FMA into fp32
//   B: values stored [w/2, R, 2] (k pairs adjacent), x as int16 pairs: vpmovsxbw + vpmaddwd into int32
//   C: today's layout, pairs interleaved at run time (punpcklbw/punpckhbw) for vpmaddwd
//
//   g++ -O3 -march=native -ffp-contract=fast -o /tmp/int8_stream bench/int8_stream.cpp
//   for R in 96 288 576 768 1536; do /tmp/int8_stream $R; done
//
// docs/lowering.md has the figures (AVX2 only: needs immintrin's AVX2 intrinsics).
#include <immintrin.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <vector>
#include <algorithm>
typedef float vfloat __attribute__((vector_size(32)));
static inline vfloat ld8(const int8_t* p) { return (vfloat)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
static inline vfloat ldf(const float* p) { vfloat v; memcpy(&v, p, 32); return v; }
static inline void stf(float* p, vfloat v) { memcpy(p, &v, 32); }
// A: current: 8 streams, fp cvt
void blockA(const int8_t* v, int64_t R, int64_t w, const float* x, float* acc) {
  int64_t seg = w / 8;
  for (int64_t r = 0; r < R; ++r) acc[r] = 0;
  for (int64_t k = 0; k < seg; ++k) {
    vfloat xv[8];
    for (int i = 0; i < 8; ++i) xv[i] = vfloat{} + x[k + i * seg];
    const int8_t* p = v + k * R;
    for (int64_t r = 0; r + 8 <= R; r += 8) {
      vfloat s0 = ldf(acc + r), s1 = vfloat{};
#pragma GCC unroll 8
      for (int i = 0; i < 8; i += 2) { s0 += xv[i] * ld8(p + i * seg * R + r); s1 += xv[i+1] * ld8(p + (i+1) * seg * R + r); }
      stf(acc + r, s0 + s1);
    }
  }
}
// B: pre-interleaved pairs [w/2, R, 2], x int16 pairs, 8 streams of pairs (seg pairs each), int32 acc
void blockB(const int8_t* v, int64_t R, int64_t w, const int32_t* xp /* w/2 pairs packed */, int32_t* acc) {
  int64_t seg = w / 16;  // pairs per eighth
  for (int64_t r = 0; r < R; ++r) acc[r] = 0;
  for (int64_t k = 0; k < seg; ++k) {
    __m256i xv[8];
    for (int i = 0; i < 8; ++i) xv[i] = _mm256_set1_epi32(xp[k + i * seg]);
    const int8_t* p = v + k * R * 2;
    for (int64_t r = 0; r + 8 <= R; r += 8) {
      __m256i s0 = _mm256_loadu_si256((const __m256i*)(acc + r)), s1 = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int i = 0; i < 8; i += 2) {
        __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(p + i * seg * R * 2 + 2 * r)));
        __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(p + (i+1) * seg * R * 2 + 2 * r)));
        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(a, xv[i]));
        s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(b, xv[i+1]));
      }
      _mm256_storeu_si256((__m256i*)(acc + r), _mm256_add_epi32(s0, s1));
    }
  }
}
// C: plain layout, runtime interleave of rows k, k+1 (int16 unpack), 8 streams of row-pairs
void blockC(const int8_t* v, int64_t R, int64_t w, const int32_t* xp, int32_t* acc) {
  int64_t seg = w / 16;  // pairs per eighth
  for (int64_t r = 0; r < R; ++r) acc[r] = 0;
  for (int64_t k = 0; k < seg; ++k) {
    __m256i xv[8];
    for (int i = 0; i < 8; ++i) xv[i] = _mm256_set1_epi32(xp[k + i * seg]);
    const int8_t* p = v + 2 * k * R;
    for (int64_t r = 0; r + 16 <= R; r += 16) {
      __m256i s0 = _mm256_loadu_si256((const __m256i*)(acc + r)), s1 = _mm256_loadu_si256((const __m256i*)(acc + r + 8));
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        const int8_t* q = p + i * seg * 2 * R + r;
        __m128i a = _mm_loadu_si128((const __m128i*)q), b = _mm_loadu_si128((const __m128i*)(q + R));
        __m256i lo = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a, b)), hi = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(a, b));
        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(lo, xv[i]));
        s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(hi, xv[i]));
      }
      _mm256_storeu_si256((__m256i*)(acc + r), s0);
      _mm256_storeu_si256((__m256i*)(acc + r + 8), s1);
    }
  }
}
int main(int argc, char** argv) {
  int64_t R = atoi(argv[1]), w = 256, nb = (int64_t)(60e6 / (R * w));
  std::vector<int8_t> vals(nb * R * w);
  for (auto& q : vals) q = rand() % 255 - 127;
  std::vector<float> x(w), acc(R + 64);
  std::vector<int32_t> xp(w / 2), acci(R + 64);
  for (auto& f : x) f = rand() / (float)RAND_MAX;
  for (auto& f : xp) f = rand();
  double best[3] = {1e9, 1e9, 1e9};
  for (int rep = 0; rep < 15; ++rep)
    for (int m = 0; m < 3; ++m) {
      auto t0 = std::chrono::steady_clock::now();
      for (int64_t b = 0; b < nb; ++b) {
        const int8_t* v = vals.data() + b * R * w;
        if (m == 0) blockA(v, R, w, x.data(), acc.data());
        else if (m == 1) blockB(v, R, w, xp.data(), acci.data());
        else blockC(v, R, w, xp.data(), acci.data());
      }
      double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best[m] = std::min(best[m], dt);
    }
  double mb = nb * R * w / 1e6;
  printf("R=%ld MB=%.1f  A(cvt) %.2f GB/s  B(pairs) %.2f GB/s  C(runtime interleave) %.2f GB/s  [acc %f %d]\n", R, mb, mb / best[0] / 1e3, mb / best[1] / 1e3, mb / best[2] / 1e3, acc[3], acci[3]);
}
