// Standalone int8 decode-stream loops (no torch): how fast one thread reads a block's int8 codes in
// the kernel's walk (eight k regions far apart per pass, accumulators in L1), one token, blocks of
// 256 k rows x R kept rows, ~60 MB of codes (past L3), best of 15 sweeps; prints GB/s of codes read.
//   rowmajor: codes [w, R] row-major, widened to fp32 (vpmovsxbd + vcvtdq2ps) and FMA'd with x
//   words:    codes in words of 4 k rows ([w / 4, R, 4]) against words of x's int8 codes: one integer
//             dot product per lane (vpmaddubsw + vpmaddwd after |w| and x with w's sign), a conversion
//             and an FMA by x's scale per row of words (what gmc's int8 stream does)
//   read:     the words walk reading the same bytes and adding them (the walk's memory bound)
//
//   g++ -O3 -march=x86-64-v3 -ffp-contract=fast -o /tmp/int8_stream bench/int8_stream.cpp
//   for R in 576 1536 192; do /tmp/int8_stream $R; done
//
// docs/lowering.md has the figures (needs immintrin's AVX2 intrinsics).
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

// rowmajor: 8 k rows a pass, one from each eighth of the block, fp32 accumulators
void rowmajor(const int8_t* v, int64_t R, int64_t w, const float* x, float* acc) {
  const int64_t seg = w / 8;
  for (int64_t r = 0; r < R; ++r) acc[r] = 0;
  for (int64_t k = 0; k < seg; ++k) {
    __m256 xv[8];
    for (int i = 0; i < 8; ++i) xv[i] = _mm256_set1_ps(x[k + i * seg]);
    const int8_t* p = v + k * R;
    for (int64_t r = 0; r + 8 <= R; r += 8) {
      __m256 s0 = _mm256_loadu_ps(acc + r), s1 = _mm256_setzero_ps();
      for (int i = 0; i < 8; i += 2) {
        auto widen = [&](int j) {
          return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + j * seg * R + r))));
        };
        s0 = _mm256_fmadd_ps(xv[i], widen(i), s0);
        s1 = _mm256_fmadd_ps(xv[i + 1], widen(i + 1), s1);
      }
      _mm256_storeu_ps(acc + r, _mm256_add_ps(s0, s1));
    }
  }
}

// words: 8 rows of words a pass, one from each eighth, 16 columns an iteration
void words(const int8_t* v, int64_t R, int64_t w, const int32_t* xw, const float* xs, float* acc) {
  const int64_t seg = w / 32;  // rows of words per eighth
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t r = 0; r < R; ++r) acc[r] = 0;
  for (int64_t k = 0; k < seg; ++k) {
    const int8_t* p = v + k * R * 4;
    for (int64_t r = 0; r + 16 <= R; r += 16) {
      __m256 s0 = _mm256_loadu_ps(acc + r), s1 = _mm256_loadu_ps(acc + r + 8);
      for (int i = 0; i < 8; ++i) {
        const __m256i x = _mm256_set1_epi32(xw[k + i * seg]);
        const __m256 scale = _mm256_set1_ps(xs[i]);
        auto dot = [&](const int8_t* q) {
          const __m256i a = _mm256_loadu_si256((const __m256i*)q);
          return _mm256_cvtepi32_ps(
              _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(x, a)), ones));
        };
        const int8_t* q = p + i * seg * R * 4 + 4 * r;
        s0 = _mm256_fmadd_ps(scale, dot(q), s0);
        s1 = _mm256_fmadd_ps(scale, dot(q + 32), s1);
      }
      _mm256_storeu_ps(acc + r, s0);
      _mm256_storeu_ps(acc + r + 8, s1);
    }
  }
}

// read: the words walk, the bytes added and nothing else
void read(const int8_t* v, int64_t R, int64_t w, int32_t* acc) {
  const int64_t seg = w / 32;
  for (int64_t k = 0; k < seg; ++k) {
    const int8_t* p = v + k * R * 4;
    for (int64_t r = 0; r + 8 <= R; r += 8) {
      __m256i s = _mm256_loadu_si256((const __m256i*)(acc + r));
      for (int i = 0; i < 8; ++i) s = _mm256_add_epi8(s, _mm256_loadu_si256((const __m256i*)(p + i * seg * R * 4 + 4 * r)));
      _mm256_storeu_si256((__m256i*)(acc + r), s);
    }
  }
}

int main(int argc, char** argv) {
  const int64_t R = argc > 1 ? atoi(argv[1]) : 576, w = 256, nb = int64_t(60e6 / double(R * w));
  std::vector<int8_t> vals(nb * R * w);
  for (auto& q : vals) q = int8_t(rand() % 255 - 127);
  std::vector<float> x(w), xs(8), acc(R + 64);
  std::vector<int32_t> xw(w / 4), acci(R + 64);
  for (auto& f : x) f = rand() / float(RAND_MAX);
  for (auto& f : xs) f = rand() / float(RAND_MAX);
  for (auto& f : xw) f = rand();
  const char* names[3] = {"rowmajor", "words", "read"};
  double best[3] = {1e9, 1e9, 1e9};
  for (int rep = 0; rep < 15; ++rep)
    for (int m = 0; m < 3; ++m) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int64_t b = 0; b < nb; ++b) {
        const int8_t* v = vals.data() + b * R * w;
        if (m == 0) rowmajor(v, R, w, x.data(), acc.data());
        else if (m == 1) words(v, R, w, xw.data(), xs.data(), acc.data());
        else read(v, R, w, acci.data());
      }
      best[m] = std::min(best[m], std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  const double mb = double(nb * R * w) / 1e6;
  printf("R=%ld MB=%.1f", long(R), mb);
  for (int m = 0; m < 3; ++m) printf("  %s %.2f GB/s", names[m], mb / best[m] / 1e3);
  printf("  [%f %d]\n", acc[3], acci[3]);
}
