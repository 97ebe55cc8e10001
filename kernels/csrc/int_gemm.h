// The integer GEMM of the quantized linears: rows of float32 activations, quantized per block of 32
// in two 8-bit levels, times q4 or q8 weights packed in panels of 16 output columns, at any number
// of rows. Included by cpu_decode.cpp (the quant_linear op and the decode layer call it); the
// formats' torch twin and packers are kernels/quant_linear.py.
//
// Why a GEMM: the matrix-vector kernel it replaces read a weight row and unpacked its codes once
// for every 4 activation rows, so a step's cost grew with every row (64 rows: 40x one row on
// AVX2). Here a panel of 16 output columns is unpacked once in registers and multiplied against a
// tile of activation rows, its lanes the output columns, so each row costs only its multiply-adds:
// vpdpbusd (AVX-512 VNNI: 64 u8 x s8 products into 16 int32 lanes), vpmaddubsw + 16-bit adds or
// vpmaddwd (AVX2, see its q4_tile and q8_tile), or plain C++.
//
// One order of sums, whatever the rows, the threads or the instruction set: a row's integer sums
// per block are exact, and its float result is, per output column, the same sequence of IEEE
// operations on every path: for blocks b = 0, 1, ...: acc = fma(float(isum_b), d_w[b] * d_x[b], acc)
// and mt = fma(m_w[b], s_x[b], mt) (q4); out = acc + mt (+ bias). Threads split the panels (output
// columns), never a sum; a row never depends on the rows beside it. So a row's bits are the same
// alone or in a batch of 500, on 1 thread or 2, built for AVX2 or for AVX-512
// (tests/test_cpu_kernels.py, tests/test_deterministic.py).
//
// Formats (kernels/quant_linear.py packs them; NR = 16 output columns a panel, the last panel's
// missing columns zero):
// * q4 [panels, K/32, 320] uint8: per block of 32 inputs, 4 groups of 64 bytes, then the panel's 16
//   fp16 scales d, then its 16 fp16 minimums m (w = q * d + m). In group g, bytes 4l..4l+3 belong to
//   column l: the low nibble of byte 4l+i is the code of input 8g+i, the high nibble of input 8g+4+i
//   (so one AND gives the quad of inputs 8g..8g+3 for all 16 columns, a shift and an AND the next).
// * q8 [panels, K/32, 512] uint8: per block, 8 quads of 64 bytes, bytes 4l..4l+3 of quad j the codes
//   of column l's inputs 4j..4j+3 plus 128 (unsigned, as vpdpbusd wants them); a float scale per
//   column: w = (code - 128) * scale.

#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

// The path this build takes, decided once here.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define INTGEMM_VNNI 1
#elif defined(__AVX2__)
#define INTGEMM_AVX2 1
#endif

namespace intgemm {

constexpr int64_t QK = 32;             // inputs a block
constexpr int64_t NR = 16;             // output columns a panel
constexpr int64_t Q4_BLOCK = 320;      // bytes of a panel's block: 256 of codes, 32 of d, 32 of m
constexpr int64_t Q8_BLOCK = 512;      // bytes of a panel's q8 block
constexpr int64_t ROW_CHUNK = 64;      // rows whose activations stay in cache while the panels pass

// One row of activations quantized per block of 32 in two 8-bit levels: x ~= d * (q + r / 256),
// where r codes what q rounded off. 8 bits alone were too coarse for this model's activations
// (outliers set a block's scale): mean |logprob error| of short prompts against float32 went from
// 0.057 (bfloat16 activations) to 0.18; the second level brings them to ~15 bits. Per block: d (the
// scale / 256: the levels' integer sums combine as (q.w << 8) + r.w), the float sum s (for the
// q4 minimum term) and the integer sum t of q * 256 + r (for q8's offset codes).
//
// The block's float sum runs in one order on every path (the AVX2 one is the reference): 8 lane
// sums (x[j] + x[8+j]) + (x[16+j] + x[24+j]), then lanes (0+4, 1+5, 2+6, 3+7), then (0+2, 1+3),
// then the two; so a row's bits do not depend on the instruction set. (Quantizing was 15% of a
// 256-token prefill in scalar code.)
inline void quantize_row(const float* x, int64_t k, int8_t* q, int8_t* r, float* d, float* s, int32_t* t) {
  for (int64_t b = 0; b < k / QK; ++b) {
    const float* xb = x + b * QK;
    float amax = 0.f, sum;
#if defined(__AVX2__)
    const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
    const __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(x0, absmask), _mm256_and_ps(x1, absmask)),
                             _mm256_max_ps(_mm256_and_ps(x2, absmask), _mm256_and_ps(x3, absmask)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const __m256 lanes = _mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps(lanes, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    sum = _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
#else
    float lane[8];
    for (int j = 0; j < 8; ++j) lane[j] = (xb[j] + xb[8 + j]) + (xb[16 + j] + xb[24 + j]);
    const float h0 = lane[0] + lane[4], h1 = lane[1] + lane[5], h2 = lane[2] + lane[6], h3 = lane[3] + lane[7];
    sum = (h0 + h2) + (h1 + h3);
    for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(xb[i]));
#endif
    const float scale = amax / 127.f;
    const float inv = scale > 0.f ? 1.f / scale : 0.f;
    int32_t total = 0;
#if defined(__AVX2__)
    const __m256 vinv = _mm256_set1_ps(inv);
    const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f), k256 = _mm256_set1_ps(256.f);
    __m256i tot = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xb + 8 * j), vinv);
      const __m256 c = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      // |v - c| <= 0.5: the remainder's code is within +-128; 128 itself is clamped (an error of
      // 1/256 of a code at most). Neither level is ever -128, which the 16-bit sums rely on.
      const __m256 rr = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(v, c), k256),
                                                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
      const __m256i ci = _mm256_cvtps_epi32(c), ri = _mm256_cvtps_epi32(rr);
      tot = _mm256_add_epi32(tot, _mm256_add_epi32(_mm256_slli_epi32(ci, 8), ri));
      // int32 -> int8 (values within +-127): pack to 16 bits, then 8, lanes back in order.
      const __m128i c16 = _mm_packs_epi32(_mm256_castsi256_si128(ci), _mm256_extracti128_si256(ci, 1));
      const __m128i r16 = _mm_packs_epi32(_mm256_castsi256_si128(ri), _mm256_extracti128_si256(ri, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(q + b * QK + 8 * j), _mm_packs_epi16(c16, c16));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(r + b * QK + 8 * j), _mm_packs_epi16(r16, r16));
    }
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(tot), _mm256_extracti128_si256(tot, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
    total = _mm_cvtsi128_si32(_mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1)));
#else
    for (int i = 0; i < QK; ++i) {
      const float v = xb[i] * inv;
      const float c = std::nearbyint(v);
      const int8_t qc = static_cast<int8_t>(c);
      const int8_t rc = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint((v - c) * 256.f))));
      q[b * QK + i] = qc;
      r[b * QK + i] = rc;
      total += qc * 256 + rc;
    }
#endif
    d[b] = scale / 256.f;
    s[b] = sum;
    t[b] = total;
  }
}

// Activations of M rows, quantized into buffers owned by the caller's scratch.
struct Q8Batch {
  std::vector<int8_t> q, r;
  std::vector<float> d, s;
  std::vector<int32_t> t;
  std::vector<int16_t> x16;  // q * 256 + r: both levels in one 16-bit code (the AVX2 path's q8 operand)
  int64_t k = 0;
  void resize(int64_t m, int64_t k_) {
    k = k_;
    q.resize(m * k);
    r.resize(m * k);
#if defined(INTGEMM_AVX2)
    x16.resize(m * k);
#endif
    d.resize(m * (k / QK));
    s.resize(m * (k / QK));
    t.resize(m * (k / QK));
  }
  void quantize(int64_t row, const float* x) {
    const int64_t nb = k / QK;
    quantize_row(x, k, q.data() + row * k, r.data() + row * k, d.data() + row * nb, s.data() + row * nb,
                 t.data() + row * nb);
#if defined(INTGEMM_AVX2)
    for (int64_t i = row * k; i < (row + 1) * k; ++i) x16[i] = static_cast<int16_t>(q[i] * 256 + r[i]);
#endif
  }
};

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  // IEEE half to float, normals, subnormals and zeros (no infinities or NaNs in packed scales).
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  float f = exp == 0 ? std::ldexp(static_cast<float>(man), -24) : std::ldexp(static_cast<float>(man | 0x400), static_cast<int>(exp) - 25);
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits |= sign;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The rows [r0, r0 + R) of a tile: pointers into the batch.
template <int R>
struct Tile {
  const int8_t* q[R];
  const int8_t* r[R];
  const float* d[R];
  const float* s[R];
  const int32_t* t[R];
  const int16_t* x16[R];
  Tile(const Q8Batch& x, int64_t r0) {
    const int64_t nb = x.k / QK;
    for (int i = 0; i < R; ++i) {
      q[i] = x.q.data() + (r0 + i) * x.k;
      r[i] = x.r.data() + (r0 + i) * x.k;
      d[i] = x.d.data() + (r0 + i) * nb;
      s[i] = x.s.data() + (r0 + i) * nb;
      t[i] = x.t.data() + (r0 + i) * nb;
      x16[i] = x.x16.empty() ? nullptr : x.x16.data() + (r0 + i) * x.k;
    }
  }
};

// ---- the float step every path shares, one column at a time (the reference for the vector ones) ----

inline void q4_step(int32_t isum, float dw, float mw, float dx, float sx, float& acc, float& mt) {
  acc = std::fma(static_cast<float>(isum), dw * dx, acc);
  mt = std::fma(mw, sx, mt);
}

// ---- the tiles: R activation rows x one panel, every block, into out[row * ldo + col] ----

#if defined(INTGEMM_VNNI)
#define INTGEMM_PATH "avx512-vnni"
constexpr int MR = 4;  // activation rows a register tile holds: 4 accumulators a row of 32 registers

inline void store_cols(float* out, __m512 v, int64_t cols) {
  _mm512_mask_storeu_ps(out, static_cast<__mmask16>(cols >= 16 ? 0xFFFF : (1u << cols) - 1), v);
}

template <int R>
void q4_tile(const uint8_t* panel, int64_t nb, const Q8Batch& x, int64_t r0, float* out, int64_t ldo, int64_t cols) {
  const Tile<R> t(x, r0);
  __m512 acc[R], mt[R];
  for (int i = 0; i < R; ++i) acc[i] = mt[i] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = panel + b * Q4_BLOCK;
    __m512i iq[R], ir[R];
    for (int i = 0; i < R; ++i) iq[i] = ir[i] = _mm512_setzero_si512();
    for (int g = 0; g < 4; ++g) {
      const __m512i v = _mm512_loadu_si512(blk + 64 * g);
      const __m512i c0 = _mm512_and_si512(v, low);
      const __m512i c1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      const int64_t at = b * QK + 8 * g;
      for (int i = 0; i < R; ++i) {
        iq[i] = _mm512_dpbusd_epi32(iq[i], c0, _mm512_set1_epi32(load_i32(t.q[i] + at)));
        ir[i] = _mm512_dpbusd_epi32(ir[i], c0, _mm512_set1_epi32(load_i32(t.r[i] + at)));
        iq[i] = _mm512_dpbusd_epi32(iq[i], c1, _mm512_set1_epi32(load_i32(t.q[i] + at + 4)));
        ir[i] = _mm512_dpbusd_epi32(ir[i], c1, _mm512_set1_epi32(load_i32(t.r[i] + at + 4)));
      }
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 256)));
    const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 288)));
    for (int i = 0; i < R; ++i) {
      const __m512i is = _mm512_add_epi32(_mm512_slli_epi32(iq[i], 8), ir[i]);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(dw, _mm512_set1_ps(t.d[i][b])), acc[i]);
      mt[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(t.s[i][b]), mt[i]);
    }
  }
  for (int i = 0; i < R; ++i) store_cols(out + (r0 + i) * ldo, _mm512_add_ps(acc[i], mt[i]), cols);
}

template <int R>
void q8_tile(const uint8_t* panel, const float* scale, int64_t nb, const Q8Batch& x, int64_t r0, float* out,
             int64_t ldo, int64_t cols) {
  const Tile<R> t(x, r0);
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = panel + b * Q8_BLOCK;
    __m512i iq[R], ir[R];
    for (int i = 0; i < R; ++i) iq[i] = ir[i] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      const __m512i c = _mm512_loadu_si512(blk + 64 * j);
      const int64_t at = b * QK + 4 * j;
      for (int i = 0; i < R; ++i) {
        iq[i] = _mm512_dpbusd_epi32(iq[i], c, _mm512_set1_epi32(load_i32(t.q[i] + at)));
        ir[i] = _mm512_dpbusd_epi32(ir[i], c, _mm512_set1_epi32(load_i32(t.r[i] + at)));
      }
    }
    for (int i = 0; i < R; ++i) {
      // The codes carry +128: take 128 * the block's activation sum back off.
      const __m512i is = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(iq[i], 8), ir[i]),
                                          _mm512_set1_epi32(128 * t.t[i][b]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_set1_ps(t.d[i][b]), acc[i]);
    }
  }
  const __m512 sc = _mm512_loadu_ps(scale);
  for (int i = 0; i < R; ++i) store_cols(out + (r0 + i) * ldo, _mm512_mul_ps(acc[i], sc), cols);
}

#elif defined(INTGEMM_AVX2)
#define INTGEMM_PATH "avx2"
constexpr int MR = 4;  // rows a tile: 4 measured ahead of 2 and 3 (the accumulators spill to L1, the codes are reused)

inline void store_cols(float* out, __m256 v, int64_t cols) {
  if (cols >= 8) {
    _mm256_storeu_ps(out, v);
  } else if (cols > 0) {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, v);
    std::copy(tmp, tmp + cols, out);
  }
}

inline __m256i bcast_pair(const int16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// q8's codes (+128) reach 255, where vpmaddubsw's 16-bit sums of two products could saturate; so on
// AVX2 both activation levels go in as one 16-bit code (q * 256 + r: the same integer sums) against
// the codes widened to 16 bits less 128: one vpmaddwd gives a column's two products in 32 bits, one
// vpaddd adds them up. A panel's 16 columns are two halves of 8 (bytes 0..31 and 32..63 of a quad);
// a vpshufb puts each half's bytes in pairs of inputs per column, a zero-extension makes the pairs
// vpmaddwd takes:
//   per 128-bit lane (4 columns x 4 inputs): [c0 i0 i1, c1 i0 i1, c2 .., c3 ..; c0 i2 i3, c1 i2 i3, ...]
inline __m256i pair_shuffle() {
  return _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                          0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
}

inline __m256i bcast4(const int8_t* p) { return _mm256_set1_epi32(load_i32(p)); }

// q4: the codes are at most 15 and the two levels within +-127, so vpmaddubsw's 16-bit sums of two
// products are at most 2 * 15 * 127 = 3810 and a block's 8 of them add up in 16 bits (<= 30480)
// before one vpmaddwd widens them: per 4 inputs x 8 columns a vpmaddubsw and a vpaddw for each level.
// (q8's way, one 16-bit code against codes widened to 16 bits, measured 0.6x this for q4: the
// widening served only 2 rows, all that 16 registers hold.) The two halves of a panel go in the
// same pass so that each broadcast serves 16 columns; the float sums wait in memory between blocks.
template <int R>
void q4_tile(const uint8_t* panel, int64_t nb, const Q8Batch& x, int64_t r0, float* out, int64_t ldo, int64_t cols) {
  const Tile<R> t(x, r0);
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  alignas(32) float acc[R][NR] = {}, mt[R][NR] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = panel + b * Q4_BLOCK;
    __m256i iq[R][2], ir[R][2];
    for (int i = 0; i < R; ++i) iq[i][0] = iq[i][1] = ir[i][0] = ir[i][1] = _mm256_setzero_si256();
    for (int g = 0; g < 4; ++g) {
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * g));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * g + 32));
      const __m256i c[2][2] = {{_mm256_and_si256(v0, low), _mm256_and_si256(_mm256_srli_epi16(v0, 4), low)},
                               {_mm256_and_si256(v1, low), _mm256_and_si256(_mm256_srli_epi16(v1, 4), low)}};
      const int64_t at = b * QK + 8 * g;
      for (int i = 0; i < R; ++i) {
        for (int e = 0; e < 2; ++e) {  // the quad of inputs at + 4e: the low (e = 0) or high nibbles
          const __m256i xq = bcast4(t.q[i] + at + 4 * e), xr = bcast4(t.r[i] + at + 4 * e);
          for (int h = 0; h < 2; ++h) {
            iq[i][h] = _mm256_add_epi16(iq[i][h], _mm256_maddubs_epi16(c[h][e], xq));
            ir[i][h] = _mm256_add_epi16(ir[i][h], _mm256_maddubs_epi16(c[h][e], xr));
          }
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 256 + 16 * h)));
      const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 288 + 16 * h)));
      for (int i = 0; i < R; ++i) {
        const __m256i is = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(iq[i][h], ones), 8),
                                            _mm256_madd_epi16(ir[i][h], ones));
        float* a = acc[i] + 8 * h;
        float* m = mt[i] + 8 * h;
        _mm256_store_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(dw, _mm256_set1_ps(t.d[i][b])),
                                           _mm256_load_ps(a)));
        _mm256_store_ps(m, _mm256_fmadd_ps(mw, _mm256_set1_ps(t.s[i][b]), _mm256_load_ps(m)));
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int h = 0; h < 2; ++h)
      store_cols(out + (r0 + i) * ldo + 8 * h, _mm256_add_ps(_mm256_load_ps(acc[i] + 8 * h), _mm256_load_ps(mt[i] + 8 * h)),
                 cols - 8 * h);
}

// q8: the codes (+128) to 16 bits, less 128, against the 16-bit activations as above; per block of
// 8 quads, two vpmaddwd a quad.
template <int R>
void q8_tile(const uint8_t* panel, const float* scale, int64_t nb, const Q8Batch& x, int64_t r0, float* out,
             int64_t ldo, int64_t cols) {
  const Tile<R> t(x, r0);
  const __m256i shuf = pair_shuffle(), off = _mm256_set1_epi16(128);
  alignas(32) float acc[R][NR] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = panel + b * Q8_BLOCK;
    for (int h = 0; h < 2; ++h) {
      __m256i is[R];
      for (int i = 0; i < R; ++i) is[i] = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        const __m256i v = _mm256_shuffle_epi8(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * j + 32 * h)), shuf);
        const __m256i w0 = _mm256_sub_epi16(_mm256_unpacklo_epi8(v, _mm256_setzero_si256()), off);  // inputs 4j + (0,1)
        const __m256i w1 = _mm256_sub_epi16(_mm256_unpackhi_epi8(v, _mm256_setzero_si256()), off);  // 4j + (2,3)
        const int64_t at = b * QK + 4 * j;
        for (int i = 0; i < R; ++i) {
          const int16_t* xp = t.x16[i] + at;
          is[i] = _mm256_add_epi32(is[i], _mm256_add_epi32(_mm256_madd_epi16(w0, bcast_pair(xp)),
                                                           _mm256_madd_epi16(w1, bcast_pair(xp + 2))));
        }
      }
      for (int i = 0; i < R; ++i) {
        float* a = acc[i] + 8 * h;
        _mm256_store_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[i]), _mm256_set1_ps(t.d[i][b]), _mm256_load_ps(a)));
      }
    }
  }
  for (int h = 0; h < 2; ++h) {
    const __m256 sc = _mm256_loadu_ps(scale + 8 * h);
    for (int i = 0; i < R; ++i)
      store_cols(out + (r0 + i) * ldo + 8 * h, _mm256_mul_ps(_mm256_load_ps(acc[i] + 8 * h), sc), cols - 8 * h);
  }
}

#else
#define INTGEMM_PATH "scalar"
constexpr int MR = 4;

template <int R>
void q4_tile(const uint8_t* panel, int64_t nb, const Q8Batch& x, int64_t r0, float* out, int64_t ldo, int64_t cols) {
  const Tile<R> t(x, r0);
  for (int i = 0; i < R; ++i) {
    for (int64_t l = 0; l < cols; ++l) {
      float acc = 0.f, mt = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = panel + b * Q4_BLOCK;
        int32_t iq = 0, ir = 0;
        for (int g = 0; g < 4; ++g) {
          for (int j = 0; j < 4; ++j) {
            const uint8_t byte = blk[64 * g + 4 * l + j];
            const int64_t at = b * QK + 8 * g + j;
            iq += (byte & 0x0F) * t.q[i][at] + (byte >> 4) * t.q[i][at + 4];
            ir += (byte & 0x0F) * t.r[i][at] + (byte >> 4) * t.r[i][at + 4];
          }
        }
        uint16_t dh, mh;
        std::memcpy(&dh, blk + 256 + 2 * l, 2);
        std::memcpy(&mh, blk + 288 + 2 * l, 2);
        q4_step(iq * 256 + ir, half_to_float(dh), half_to_float(mh), t.d[i][b], t.s[i][b], acc, mt);
      }
      out[(r0 + i) * ldo + l] = acc + mt;
    }
  }
}

template <int R>
void q8_tile(const uint8_t* panel, const float* scale, int64_t nb, const Q8Batch& x, int64_t r0, float* out,
             int64_t ldo, int64_t cols) {
  const Tile<R> t(x, r0);
  for (int i = 0; i < R; ++i) {
    for (int64_t l = 0; l < cols; ++l) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = panel + b * Q8_BLOCK;
        int32_t is = 0;
        for (int j = 0; j < 8; ++j) {
          for (int e = 0; e < 4; ++e) {
            const int32_t w = static_cast<int32_t>(blk[64 * j + 4 * l + e]) - 128;
            const int64_t at = b * QK + 4 * j + e;
            is += w * (t.q[i][at] * 256 + t.r[i][at]);
          }
        }
        acc = std::fma(static_cast<float>(is), t.d[i][b], acc);
      }
      out[(r0 + i) * ldo + l] = acc * scale[l];
    }
  }
}
#endif

// The roofline of the GEMM's integer dot instruction on this machine (bench.kernels prints it):
// int8 multiply-adds per second over every thread of the enclosing OpenMP team, from `iters` steps
// of 12 independent accumulators (more than latency / throughput on the cores we have), each step
// one vpdpbusd (64 products) or, on AVX2, one vpmaddubsw + vpaddw (32). The two-level GEMM does
// two of them a product, so its ceiling is half this rate.
#define INTGEMM_TWELVE(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
inline double dot_rate(int64_t iters) {
  double macs = 0;
  const double t0 = omp_get_wtime();
#pragma omp parallel reduction(+ : macs)
  {
    // Twelve named accumulators, each pinned to a register by an empty asm: an array would live
    // in memory and time its stores instead. On AVX2 the asm also takes u, or the product of two
    // loop constants would be hoisted and only the adds timed.
#if defined(INTGEMM_VNNI)
    const __m512i u = _mm512_set1_epi8(static_cast<char>(3 + omp_get_thread_num())), v = _mm512_set1_epi8(5);
#define INTGEMM_DECL(i) __m512i a##i = _mm512_setzero_si512();
#define INTGEMM_STEP(i) a##i = _mm512_dpbusd_epi32(a##i, u, v); asm volatile("" : "+v"(a##i));
#define INTGEMM_SUM(i) sink += _mm512_reduce_add_epi32(a##i);
    constexpr double per_step = 64.0;
#elif defined(INTGEMM_AVX2)
    __m256i u = _mm256_set1_epi8(static_cast<char>(3 + omp_get_thread_num()));
    const __m256i v = _mm256_set1_epi8(5);
#define INTGEMM_DECL(i) __m256i a##i = _mm256_setzero_si256();
#define INTGEMM_STEP(i) a##i = _mm256_add_epi16(a##i, _mm256_maddubs_epi16(u, v)); asm volatile("" : "+x"(a##i), "+x"(u));
#define INTGEMM_SUM(i) sink += _mm256_extract_epi32(a##i, 0);
    constexpr double per_step = 32.0;
#else
    const int32_t u = 3 + omp_get_thread_num();
#define INTGEMM_DECL(i) int32_t a##i = 0;
#define INTGEMM_STEP(i) a##i += u * 5; asm volatile("" : "+r"(a##i));
#define INTGEMM_SUM(i) sink += a##i;
    constexpr double per_step = 1.0;
#endif
    INTGEMM_TWELVE(INTGEMM_DECL)
    for (int64_t it = 0; it < iters; ++it) {
      INTGEMM_TWELVE(INTGEMM_STEP)
    }
    int64_t sink = 0;
    INTGEMM_TWELVE(INTGEMM_SUM)
#undef INTGEMM_DECL
#undef INTGEMM_STEP
#undef INTGEMM_SUM
    macs += per_step * 12 * iters + (sink == 42 ? 1 : 0);
  }
  return macs / (omp_get_wtime() - t0);
}
#undef INTGEMM_TWELVE

// A weight of either format, as the GEMM reads it.
struct PanelWeight {
  const uint8_t* data = nullptr;
  const float* scale = nullptr;  // q8: a float per column, padded to whole panels
  int64_t n = 0, k = 0;
  bool q4 = true;

  int64_t panels() const { return (n + NR - 1) / NR; }
  int64_t panel_bytes() const { return (k / QK) * (q4 ? Q4_BLOCK : Q8_BLOCK); }

  // out[r * ldo + c] (+ bias[c]) for every activation row r < m and the columns of panels [p0, p1).
  void rows(const Q8Batch& x, int64_t m, int64_t p0, int64_t p1, float* out, int64_t ldo, const float* bias) const {
    const int64_t nb = k / QK, bytes = panel_bytes();
    for (int64_t c0 = 0; c0 < m; c0 += ROW_CHUNK) {
      const int64_t c1 = std::min(m, c0 + ROW_CHUNK);
      for (int64_t p = p0; p < p1; ++p) {
        const uint8_t* panel = data + p * bytes;
        const int64_t cols = std::min(NR, n - p * NR);
        float* o = out + p * NR;
        int64_t r = c0;
        if (q4) {
          for (; r + MR <= c1; r += MR) q4_tile<MR>(panel, nb, x, r, o, ldo, cols);
          for (; r + 2 <= c1; r += 2) q4_tile<2>(panel, nb, x, r, o, ldo, cols);
          for (; r < c1; ++r) q4_tile<1>(panel, nb, x, r, o, ldo, cols);
        } else {
          const float* sc = scale + p * NR;
          for (; r + MR <= c1; r += MR) q8_tile<MR>(panel, sc, nb, x, r, o, ldo, cols);
          for (; r + 2 <= c1; r += 2) q8_tile<2>(panel, sc, nb, x, r, o, ldo, cols);
          for (; r < c1; ++r) q8_tile<1>(panel, sc, nb, x, r, o, ldo, cols);
        }
        if (bias) {
          for (int64_t i = c0; i < c1; ++i)
            for (int64_t c = 0; c < cols; ++c) o[i * ldo + c] += bias[p * NR + c];
        }
      }
    }
  }
};

}  // namespace intgemm
