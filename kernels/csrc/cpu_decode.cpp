// CPU decode kernels: the quantized linears (the integer GEMM of int_gemm.h), paged decode attention,
// and a whole decoder layer for a step of decodes in one call. Built at first use by
// kernels/cpu_ext.py (-O3 -march=native -fopenmp, or an AVX2 build: MOONCAKE_ISA); each op is pinned
// to its torch twin by tests/test_cpu_kernels.py.
//
// Why: a decode step reads every weight once for its rows, and the eager layer costs ~200 ATen
// calls. The linears quantize activations per block of 32 in two 8-bit levels and multiply with
// integer dot products (GGUF's Q4_1 x Q8_1 scheme with a second level for accuracy), and one call
// runs a layer with the threads kept in one OpenMP region. The OpenMP runtime is torch's own (same
// soname, loaded first), so torch.set_num_threads sets this code's threads too.

#include <torch/extension.h>
#include <omp.h>

#include <algorithm>
#include <limits>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "int_gemm.h"

namespace {

using intgemm::PanelWeight;
using intgemm::Q8Batch;

// Ask for the cache lines of n values from p (one 64-byte line at a time).
template <typename T>
inline void prefetch_tile(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64) __builtin_prefetch(c + i);
}

// KV head kvh's tile [bs, d] in block `block` of a paged cache [blocks, hkv, bs, d].
template <typename T>
inline const T* head_tile(const T* cache, int32_t block, int64_t hkv, int64_t kvh, int64_t bs, int64_t d) {
  return cache + (static_cast<int64_t>(block) * hkv + kvh) * bs * d;
}

#if defined(__AVX2__)
inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}
#endif

// A quantized weight as the GEMM reads it: q4 [panels, K/32, 320] uint8, or q8 [panels, K/32, 512]
// uint8 with a float32 scale per column (padded to whole panels); n output columns.
PanelWeight panel_weight(const torch::Tensor& packed, const c10::optional<torch::Tensor>& scale, int64_t n,
                         int64_t k) {
  TORCH_CHECK(k % intgemm::QK == 0, "quantized weights need input features divisible by ", intgemm::QK, ", got ", k);
  TORCH_CHECK(n >= 1, "a quantized weight has at least one output column");
  const int64_t panels = (n + intgemm::NR - 1) / intgemm::NR;
  const bool q4 = !scale.has_value();
  const int64_t block = q4 ? intgemm::Q4_BLOCK : intgemm::Q8_BLOCK;
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == panels && packed.size(1) == k / intgemm::QK && packed.size(2) == block,
              q4 ? "q4" : "q8", " weight of ", n, "x", k, ": uint8 [", panels, ", ", k / intgemm::QK, ", ", block,
              "] expected, got ", packed.scalar_type(), " ", packed.sizes());
  PanelWeight w;
  w.data = packed.data_ptr<uint8_t>();
  w.n = n;
  w.k = k;
  w.q4 = q4;
  if (!q4) {
    TORCH_CHECK(scale->scalar_type() == torch::kFloat && scale->is_contiguous() &&
                    scale->numel() == panels * intgemm::NR,
                "q8 weight: a float32 scale per column, padded to ", panels * intgemm::NR);
    w.scale = scale->data_ptr<float>();
  }
  return w;
}

// Split [0, n) evenly over the threads of the enclosing parallel region (or run it all outside one).
inline void my_share(int64_t n, int64_t* lo, int64_t* hi) {
  const int t = omp_get_thread_num(), nt = omp_get_num_threads();
  *lo = n * t / nt;
  *hi = n * (t + 1) / nt;
}

// x [M, K] float32 times a quantized weight of n columns: [M, n] float32.
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> scale, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "x: float32 [M, K]");
  x = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  const PanelWeight w = panel_weight(packed, scale, n, k);
  auto out = torch::empty({m, n}, x.options());
  Q8Batch q;
  q.resize(m, k);
  float* o = out.data_ptr<float>();
  const float* xin = x.data_ptr<float>();
#pragma omp parallel
  {
#pragma omp for
    for (int64_t r = 0; r < m; ++r) q.quantize(r, xin + r * k);
    int64_t lo, hi;
    my_share(w.panels(), &lo, &hi);
    w.rows(q, m, lo, hi, o, n, nullptr);
  }
  return out;
}

// Rows of the KV cache as float32 vectors of 8 (head_dim is a multiple of 8: checked in PagedKV).
#if defined(__AVX2__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// exp(x) for x <= 0 (scores minus their maximum), 8 at a time: 2^n * p(r) with r = x - n ln 2,
// p a degree-6 polynomial (relative error ~1e-7, as std::exp's float result).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

#if defined(__AVX2__)
// The lane sums of eight vectors, as one vector: [sum(a[0]), ..., sum(a[7])].
inline __m256 hsum8x8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}
#endif

template <typename T>
inline float to_float(T v) {
  return static_cast<float>(v);
}

#if defined(__AVX2__)
// out[0:8*NV] = sum_t p[t - t0] * v_t over tokens [t0, t1): the output in NV registers.
template <typename T, int NV>
void accumulate_values(const T* v_cache, int64_t hkv, int64_t bs, int64_t kvh, const int32_t* table, int64_t t0,
                       int64_t t1, const float* p, float* out) {
  __m256 acc[NV];
  for (int i = 0; i < NV; ++i) acc[i] = _mm256_setzero_ps();
  const int64_t d = 8 * NV;
  for (int64_t t = t0; t < t1;) {
    const int64_t off = t % bs, run = std::min(bs - off, t1 - t);
    const T* vt = head_tile(v_cache, table[t / bs], hkv, kvh, bs, d) + off * d;
    if (t + run < t1) prefetch_tile(head_tile(v_cache, table[(t + run) / bs], hkv, kvh, bs, d), std::min(bs, t1 - t - run) * d);
    for (int64_t j = 0; j < run; ++j) {
      const __m256 pv = _mm256_set1_ps(p[t - t0 + j]);
      for (int i = 0; i < NV; ++i) acc[i] = _mm256_fmadd_ps(pv, load8(vt + j * d + 8 * i), acc[i]);
    }
    t += run;
  }
  for (int i = 0; i < NV; ++i) _mm256_storeu_ps(out + 8 * i, acc[i]);
}
#endif

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The two 8-lane halves of v added: its lane sums kept as 8 partial sums.
inline __m256 fold16(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// AVX-512: out_g[0:16*NV] = sum_t p_g[t - t0] * v_t for G query heads at once, so each value row
// is loaded (and widened) once for the G heads; their outputs in G * NV registers.
template <typename T, int NV, int G>
void accumulate_values_heads(const T* v_cache, int64_t hkv, int64_t bs, int64_t kvh, const int32_t* table, int64_t t0,
                             int64_t t1, const float* const* p, float* const* out) {
  __m512 acc[G][NV];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) acc[g][i] = _mm512_setzero_ps();
  const int64_t d = 16 * NV;
  for (int64_t t = t0; t < t1;) {
    const int64_t off = t % bs, run = std::min(bs - off, t1 - t);
    const T* vt = head_tile(v_cache, table[t / bs], hkv, kvh, bs, d) + off * d;
    if (t + run < t1) prefetch_tile(head_tile(v_cache, table[(t + run) / bs], hkv, kvh, bs, d), std::min(bs, t1 - t - run) * d);
    for (int64_t j = 0; j < run; ++j) {
      __m512 v[NV];
      for (int i = 0; i < NV; ++i) v[i] = load16(vt + j * d + 16 * i);
      for (int g = 0; g < G; ++g) {
        const __m512 pv = _mm512_set1_ps(p[g][t - t0 + j]);
        for (int i = 0; i < NV; ++i) acc[g][i] = _mm512_fmadd_ps(pv, v[i], acc[g][i]);
      }
    }
    t += run;
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(out[g] + 16 * i, acc[g][i]);
}

// The group's query heads in chunks of up to G (G * NV accumulators and NV operands fit the 32
// registers: G = 4 at head_dim 64, 2 at 128).
template <typename T, int NV, int G>
void accumulate_values_group(const T* v_cache, int64_t hkv, int64_t bs, int64_t kvh, const int32_t* table, int64_t t0,
                             int64_t t1, const float* scores, int64_t n, int64_t group, float* part) {
  const int64_t d = 16 * NV;
  for (int64_t g0 = 0; g0 < group; g0 += G) {
    const float* p[G];
    float* o[G];
    const int64_t gn = std::min<int64_t>(G, group - g0);
    for (int64_t g = 0; g < gn; ++g) p[g] = scores + (g0 + g) * n, o[g] = part + (g0 + g) * (d + 2) + 2;
    switch (gn) {
      case 1: accumulate_values_heads<T, NV, 1>(v_cache, hkv, bs, kvh, table, t0, t1, p, o); break;
      case 2: if constexpr (G >= 2) accumulate_values_heads<T, NV, 2>(v_cache, hkv, bs, kvh, table, t0, t1, p, o); break;
      case 3: if constexpr (G >= 3) accumulate_values_heads<T, NV, 3>(v_cache, hkv, bs, kvh, table, t0, t1, p, o); break;
      case 4: if constexpr (G >= 4) accumulate_values_heads<T, NV, 4>(v_cache, hkv, bs, kvh, table, t0, t1, p, o); break;
    }
  }
}
#endif

// One (sequence, KV head, span of its context) of decode attention: the `group` query heads that
// share KV head `kvh` against tokens [t0, t1), read tile by tile through the block table. Writes
// the span's softmax partial: per query head its max score, its sum of exp(score - max) and its
// unnormalised output (D values), into part [group, D + 2].
template <typename T>
void attend_span(const float* q, int64_t group, int64_t d, const T* k_cache, const T* v_cache, int64_t hkv, int64_t bs,
                 int64_t kvh, const int32_t* table, int64_t t0, int64_t t1, float scale, float* part,
                 std::vector<float>& scores) {
  const int64_t n = t1 - t0;
  scores.resize(group * n);
  for (int64_t t = t0; t < t1;) {
    const int64_t off = t % bs, run = std::min(bs - off, t1 - t);
    const T* kt = head_tile(k_cache, table[t / bs], hkv, kvh, bs, d) + off * d;
    if (t + run < t1) {
      // The next tile is elsewhere in memory (a block of its own): its fetch overlaps this one's work.
      prefetch_tile(head_tile(k_cache, table[(t + run) / bs], hkv, kvh, bs, d), std::min(bs, t1 - t - run) * d);
      if (t == t0) prefetch_tile(head_tile(v_cache, table[t / bs], hkv, kvh, bs, d) + off * d, run * d);
    }
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * d;
      float* sg = scores.data() + g * n + t - t0;
      int64_t j = 0;
#if defined(__AVX512F__)
      if (d % 16 == 0) {  // 16 lanes; each key's sum folded to 8 partials, then as below
        for (; j + 8 <= run; j += 8) {
          __m512 a[8];
          for (int jj = 0; jj < 8; ++jj) a[jj] = _mm512_setzero_ps();
          for (int64_t i = 0; i < d; i += 16) {
            const __m512 qv = _mm512_loadu_ps(qg + i);
            for (int jj = 0; jj < 8; ++jj) a[jj] = _mm512_fmadd_ps(qv, load16(kt + (j + jj) * d + i), a[jj]);
          }
          __m256 h[8];
          for (int jj = 0; jj < 8; ++jj) h[jj] = fold16(a[jj]);
          _mm256_storeu_ps(sg + j, _mm256_mul_ps(hsum8x8(h), _mm256_set1_ps(scale)));
        }
      }
#endif
#if defined(__AVX2__)
      // Eight keys at a time: eight accumulators summed across their lanes together.
      for (; j + 8 <= run; j += 8) {
        __m256 a[8];
        for (int jj = 0; jj < 8; ++jj) a[jj] = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 8) {
          const __m256 qv = _mm256_loadu_ps(qg + i);
          for (int jj = 0; jj < 8; ++jj) a[jj] = _mm256_fmadd_ps(qv, load8(kt + (j + jj) * d + i), a[jj]);
        }
        _mm256_storeu_ps(sg + j, _mm256_mul_ps(hsum8x8(a), _mm256_set1_ps(scale)));
      }
      for (; j < run; ++j) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), load8(kt + j * d + i), acc);
        sg[j] = hsum(acc) * scale;
      }
#else
      for (; j < run; ++j) {
        float acc = 0.f;
        for (int64_t i = 0; i < d; ++i) acc += qg[i] * to_float(kt[j * d + i]);
        sg[j] = acc * scale;
      }
#endif
    }
    t += run;
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores.data() + g * n;
    float mx = -INFINITY, sum = 0.f;
    for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sg[t]);
    int64_t t = 0;
#if defined(__AVX2__)
    __m256 vs = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), _mm256_set1_ps(mx)));
      _mm256_storeu_ps(sg + t, e);
      vs = _mm256_add_ps(vs, e);
    }
    sum = hsum(vs);
#endif
    for (; t < n; ++t) {
      sg[t] = std::exp(sg[t] - mx);
      sum += sg[t];
    }
    float* pg = part + g * (d + 2);
    pg[0] = mx;
    pg[1] = sum;
    std::fill(pg + 2, pg + 2 + d, 0.f);
  }
#if defined(__AVX512F__)
  if (d == 64) {  // the common head size: four query heads' outputs at a time, 4 registers each
    accumulate_values_group<T, 4, 4>(v_cache, hkv, bs, kvh, table, t0, t1, scores.data(), n, group, part);
    return;
  }
  if (d == 128) {
    accumulate_values_group<T, 8, 2>(v_cache, hkv, bs, kvh, table, t0, t1, scores.data(), n, group, part);
    return;
  }
#elif defined(__AVX2__)
  if (d == 64) {  // the common head size: each query head's output stays in 8 registers
    for (int64_t g = 0; g < group; ++g) accumulate_values<T, 8>(v_cache, hkv, bs, kvh, table, t0, t1, scores.data() + g * n, part + g * (d + 2) + 2);
    return;
  }
  if (d == 128) {
    for (int64_t g = 0; g < group; ++g) accumulate_values<T, 16>(v_cache, hkv, bs, kvh, table, t0, t1, scores.data() + g * n, part + g * (d + 2) + 2);
    return;
  }
#endif
  for (int64_t t = t0; t < t1;) {
    const int64_t off = t % bs, run = std::min(bs - off, t1 - t);
    const T* vt = head_tile(v_cache, table[t / bs], hkv, kvh, bs, d) + off * d;
    for (int64_t j = 0; j < run; ++j) {
      const T* vr = vt + j * d;
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * n + t - t0 + j];
        float* og = part + g * (d + 2) + 2;
#if defined(__AVX2__)
        const __m256 pv = _mm256_set1_ps(p);
        for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(og + i, _mm256_fmadd_ps(pv, load8(vr + i), _mm256_loadu_ps(og + i)));
#else
        for (int64_t i = 0; i < d; ++i) og[i] += p * to_float(vr[i]);
#endif
      }
    }
    t += run;
  }
}

struct PagedKV {
  torch::Tensor k_cache, v_cache, block_tables, seq_lens;
  int64_t hkv, bs, d, width, max_len = 0;
  PagedKV(torch::Tensor k, torch::Tensor v, torch::Tensor tables, torch::Tensor lens)
      : k_cache(k), v_cache(v), block_tables(tables), seq_lens(lens) {
    TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.is_contiguous() && v.is_contiguous() &&
                    k.scalar_type() == v.scalar_type(),
                "caches: contiguous [num_blocks, Hkv, block_size, D], K and V alike");
    TORCH_CHECK(k.scalar_type() == torch::kFloat || k.scalar_type() == torch::kBFloat16,
                "the CPU kernels read a float32 or bfloat16 KV cache, got ", k.scalar_type());
    TORCH_CHECK(k.size(3) % 8 == 0, "the CPU kernels take a head_dim that is a multiple of 8, got ", k.size(3));
    TORCH_CHECK(tables.scalar_type() == torch::kInt && tables.is_contiguous() && tables.dim() == 2,
                "block_tables: contiguous int32 [S, max_blocks]");
    TORCH_CHECK(lens.scalar_type() == torch::kInt && lens.is_contiguous() && lens.numel() == tables.size(0),
                "seq_lens: contiguous int32 [S]");
    hkv = k.size(1);
    bs = k.size(2);
    d = k.size(3);
    width = tables.size(1);
    const int32_t* l = lens.data_ptr<int32_t>();
    const int32_t* t = tables.data_ptr<int32_t>();
    for (int64_t s = 0; s < lens.numel(); ++s) {
      TORCH_CHECK(l[s] >= 1 && l[s] <= width * bs, "sequence ", s, ": length ", l[s], " beyond its block table");
      max_len = std::max<int64_t>(max_len, l[s]);
      for (int64_t b = 0; b < (l[s] + bs - 1) / bs; ++b) {
        TORCH_CHECK(t[s * width + b] >= 0 && t[s * width + b] < k.size(0), "sequence ", s, ": block ",
                    t[s * width + b], " outside the cache");
      }
    }
  }

  // Each (sequence, KV head) pair's context is cut into this many spans, so that a step of few
  // sequences (one, at batch 1, with 3 KV heads on 2 threads) still splits evenly over the threads.
  // With span_tokens > 0 a span is instead that many tokens from the context's start, whatever
  // the step holds or the threads are: a row's sums then depend on its own context alone (the
  // batch-invariant mode, engine.config.EngineConfig.deterministic).
  int64_t spans(int64_t threads, int64_t span_tokens = 0) const {
    if (span_tokens > 0) return std::max<int64_t>(1, (max_len + span_tokens - 1) / span_tokens);
    const int64_t pairs = seq_lens.numel() * hkv;
    return pairs >= 4 * threads ? 1 : (4 * threads + pairs - 1) / pairs;
  }

  // out [S, Hq, D] float32 from q [S, Hq, D] float32, inside a parallel region; parts: scratch of
  // pairs * spans(threads, span_tokens) * group * (D + 2) floats, sized by the caller before the region.
  void attention(const float* q, int64_t hq, float scale, float* out, float* parts, int64_t nspans,
                 int64_t span_tokens = 0) const {
    const int64_t group = hq / hkv, pairs = seq_lens.numel() * hkv, part = group * (d + 2);
    thread_local std::vector<float> scores;
    int64_t lo, hi;
    my_share(pairs * nspans, &lo, &hi);
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t pair = i / nspans, span = i % nspans, seq = pair / hkv, kvh = pair % hkv;
      const int32_t* table = block_tables.data_ptr<int32_t>() + seq * width;
      const int64_t len = seq_lens.data_ptr<int32_t>()[seq];
      const int64_t t0 = span_tokens > 0 ? std::min(len, span * span_tokens) : len * span / nspans;
      const int64_t t1 = span_tokens > 0 ? std::min(len, (span + 1) * span_tokens) : len * (span + 1) / nspans;
      const float* qp = q + (seq * hq + kvh * group) * d;
      float* pp = parts + i * part;
      if (t0 == t1) {  // an empty span: no weight in the merge
        for (int64_t g = 0; g < group; ++g) pp[g * (d + 2)] = -INFINITY, pp[g * (d + 2) + 1] = 0.f;
      } else if (k_cache.scalar_type() == torch::kFloat) {
        attend_span(qp, group, d, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), hkv, bs, kvh, table, t0, t1,
                    scale, pp, scores);
      } else {
        attend_span(qp, group, d, k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>(), hkv, bs, kvh,
                    table, t0, t1, scale, pp, scores);
      }
    }
#pragma omp barrier
    // Merge each pair's spans: rescale each to the common max, sum, normalise.
    my_share(pairs * group, &lo, &hi);
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t pair = i / group, g = i % group, seq = pair / hkv, kvh = pair % hkv;
      float mx = -INFINITY;
      for (int64_t sp = 0; sp < nspans; ++sp) mx = std::max(mx, parts[(pair * nspans + sp) * part + g * (d + 2)]);
      float* o = out + (seq * hq + kvh * group + g) * d;
      std::fill(o, o + d, 0.f);
      float total = 0.f;
      for (int64_t sp = 0; sp < nspans; ++sp) {
        const float* pg = parts + (pair * nspans + sp) * part + g * (d + 2);
        if (pg[1] == 0.f) continue;
        const float w = std::exp(pg[0] - mx);
        total += w * pg[1];
        for (int64_t j = 0; j < d; ++j) o[j] += w * pg[2 + j];
      }
      const float inv = 1.f / total;
      for (int64_t j = 0; j < d; ++j) o[j] *= inv;
    }
  }

  int64_t parts_size(int64_t hq, int64_t nspans) const { return seq_lens.numel() * hkv * nspans * (hq / hkv) * (d + 2); }
};

// Paged decode attention (the twin: kernels.decode_attention.decode_attention_torch).
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3, "q: [S, Hq, D]");
  const PagedKV kv(k_cache, v_cache, block_tables, seq_lens);
  TORCH_CHECK(q.size(0) == seq_lens.numel() && q.size(2) == kv.d && q.size(1) % kv.hkv == 0,
              "q [S, Hq, D] with Hq a multiple of the cache's heads");
  auto qf = q.to(torch::kFloat).contiguous();
  auto out = torch::empty_like(qf);
  const int64_t nspans = kv.spans(omp_get_max_threads());
  std::vector<float> parts(kv.parts_size(q.size(1), nspans));
#pragma omp parallel
  kv.attention(qf.data_ptr<float>(), q.size(1), static_cast<float>(scale), out.data_ptr<float>(), parts.data(), nspans);
  return out.to(q.scalar_type());
}

inline void rms_norm_row(const float* x, const float* w, int64_t n, float eps, float* out) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
}

inline void rotate(float* x, const float* cos_sin, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float c = cos_sin[i], s = cos_sin[half + i], a = x[i], b = x[half + i];
    x[i] = a * c - b * s;
    x[half + i] = b * c + a * s;
  }
}

torch::Tensor f32(const torch::Tensor& t) { return t.to(torch::kFloat).contiguous(); }

c10::optional<torch::Tensor> f32(const c10::optional<torch::Tensor>& t) {
  return t.has_value() ? c10::optional<torch::Tensor>(f32(*t)) : c10::nullopt;
}

// One projection of a decoder layer: its q4 weight (the integer kernels, up to int_rows
// activation rows), its dense weight packed for oneDNN (bfloat16 or float32, past them), or both.
struct Projection {
  c10::optional<torch::Tensor> q4, dense;
  int64_t n = 0, k = 0;

  Projection(c10::optional<torch::Tensor> q4_, c10::optional<torch::Tensor> dense_, int64_t n_, int64_t k_,
             const char* name)
      : q4(std::move(q4_)), dense(std::move(dense_)), n(n_), k(k_) {
    TORCH_CHECK(q4.has_value() || dense.has_value(), "decoder layer: the ", name, " projection has no weight");
    if (q4.has_value()) panel_weight(*q4, c10::nullopt, n, k);  // checks its shape
    if (dense.has_value()) {
      TORCH_CHECK(dense->dim() == 2 && dense->size(0) == n && dense->size(1) == k, "decoder layer: the ", name,
                  " projection's dense weight is ", dense->sizes(), ", expected [", n, ", ", k, "]");
      TORCH_CHECK(dense->scalar_type() == torch::kFloat || dense->scalar_type() == torch::kBFloat16,
                  "decoder layer: dense weights are float32 or bfloat16");
    }
  }

  PanelWeight int_weight() const { return panel_weight(*q4, c10::nullopt, n, k); }

  // out[r * ldo + j] = x_r . w_j (+ bias) for all m rows through oneDNN's matmul on the packed
  // weight (mkldnn::_linear_pointwise, what kernels.dense_linear calls from Python), outside any
  // parallel region of ours: oneDNN runs its own on the same OpenMP threads.
  void dense_rows(const float* x, int64_t m, int64_t ldx, float* out, int64_t ldo, const float* bias) const {
    static const c10::OperatorHandle op =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    const auto opts = torch::TensorOptions().dtype(torch::kFloat);
    torch::Tensor xt =
        torch::from_blob(const_cast<float*>(x), {m, k}, {ldx, 1}, opts).to(dense->scalar_type()).contiguous();
    torch::jit::Stack stack{xt, *dense, c10::IValue(), std::string("none"), c10::List<c10::optional<at::Scalar>>(),
                            c10::IValue()};
    op.callBoxed(&stack);
    torch::Tensor y = torch::from_blob(out, {m, n}, {ldo, 1}, opts);
    y.copy_(stack[0].toTensor());
    if (bias) y.add_(torch::from_blob(const_cast<float*>(bias), {n}, opts));
  }
};

// What a decoder layer's step keeps between its phases, for M rows. One per calling thread, shared
// by every layer: the layers of a step run one after another, so a step needs one layer's scratch,
// not one per layer. (Each layer held its own once: 30 layers times the largest batch ever seen,
// ~1 MiB a row, kept for good: a decode instance stayed 244 MiB above its rest after 256 rows,
// issue 40.) Its capacity is the largest step since the thread started: ~23 KB a row.
struct LayerScratch {
  std::vector<float> xn, gu, qkv_out, attn, q, parts;
  Q8Batch xq, oq, aq;

  static LayerScratch& of_this_thread() {
    thread_local LayerScratch scratch;
    return scratch;
  }
};

// A decoder layer (engine.model.DecoderLayer, its twin) for a step whose tokens are all decodes,
// any number of them: up to int_rows with the integer kernels inside one parallel region, past
// them with oneDNN's matmuls on the dense weights between four regions that do the rest (norms,
// rotary, the KV write, attention, SiLU): no eager op, every row's elementwise work threaded.
class DecodeLayer {
 public:
  DecodeLayer(torch::Tensor input_norm, torch::Tensor post_norm, c10::optional<torch::Tensor> qkv,
              c10::optional<torch::Tensor> qkv_dense, c10::optional<torch::Tensor> qkv_bias,
              c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm, c10::optional<torch::Tensor> o,
              c10::optional<torch::Tensor> o_dense, c10::optional<torch::Tensor> gate_up,
              c10::optional<torch::Tensor> gate_up_dense, c10::optional<torch::Tensor> down,
              c10::optional<torch::Tensor> down_dense, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
              int64_t intermediate, double eps, int64_t int_rows, int64_t span_tokens)
      : input_norm_(f32(input_norm)), post_norm_(f32(post_norm)), qkv_bias_(f32(qkv_bias)), q_norm_(f32(q_norm)),
        k_norm_(f32(k_norm)), hq_(num_heads), hkv_(num_kv_heads), d_(head_dim), hidden_(input_norm.numel()),
        inter_(intermediate), eps_(static_cast<float>(eps)), int_rows_(int_rows), span_tokens_(span_tokens),
        qkv_(qkv, qkv_dense, (num_heads + 2 * num_kv_heads) * head_dim, hidden_, "qkv"),
        o_(o, o_dense, hidden_, num_heads * head_dim, "output"),
        gate_up_(gate_up, gate_up_dense, 2 * intermediate, hidden_, "gate/up"),
        down_(down, down_dense, hidden_, intermediate, "down") {
    for (const Projection* p : {&qkv_, &o_, &gate_up_, &down_}) {
      // Rows the integer kernels take need every q4 weight; rows past them every dense one.
      TORCH_CHECK(int_rows_ <= 0 || p->q4.has_value(), "decoder layer: int_rows > 0 needs every q4 weight");
      all_dense_ = all_dense_ && p->dense.has_value();
    }
    TORCH_CHECK(int_rows_ > 0 || all_dense_, "decoder layer: without q4 weights every dense weight is needed");
  }

  // The most rows a step may have: any, with the dense weights; else the integer kernels' limit.
  int64_t max_rows() const { return all_dense_ ? std::numeric_limits<int64_t>::max() : int_rows_; }

  // (hidden states, residual) of the layer, float32 [M, hidden]; residual None on the first layer.
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                                   torch::Tensor cos_sin, torch::Tensor k_cache, torch::Tensor v_cache,
                                                   torch::Tensor slots, torch::Tensor block_tables,
                                                   torch::Tensor seq_lens, double scale) {
    TORCH_CHECK(x.scalar_type() == torch::kFloat && x.is_contiguous() && x.dim() == 2 && x.size(1) == hidden_,
                "x: contiguous float32 [M, hidden]");
    const int64_t m = x.size(0);
    TORCH_CHECK(m >= 1 && m <= max_rows(), "decoder layer: ", m, " rows, this layer takes 1 to ", max_rows());
    const PagedKV kv(k_cache, v_cache, block_tables, seq_lens);
    TORCH_CHECK(kv.hkv == hkv_ && kv.d == d_ && seq_lens.numel() == m, "the KV cache does not match the layer");
    TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.numel() == m && slots.is_contiguous(), "slots: int64 [M]");
    TORCH_CHECK(cos_sin.scalar_type() == torch::kFloat && cos_sin.is_contiguous() && cos_sin.size(0) == m &&
                    cos_sin.size(1) == d_,
                "cos_sin: float32 [M, head_dim]");
    const int64_t num_slots = k_cache.size(0) * kv.bs;
    for (int64_t r = 0; r < m; ++r) {
      const int64_t s = slots.data_ptr<int64_t>()[r];
      TORCH_CHECK(s >= 0 && s < num_slots, "slot ", s, " outside the cache");
    }
    torch::Tensor res = residual.has_value() ? residual->contiguous() : x;
    TORCH_CHECK(res.scalar_type() == torch::kFloat && res.sizes() == x.sizes(), "residual: float32 like x");
    auto new_res = torch::empty_like(x);
    auto out = torch::empty_like(x);
    const int64_t nqkv = qkv_.n;
    const bool integer = m <= int_rows_;
    // Taken here, on the calling thread: the parallel regions below share this one.
    LayerScratch& w = LayerScratch::of_this_thread();
    w.xn.resize(m * hidden_);
    w.gu.resize(m * 2 * inter_);
    w.qkv_out.resize(m * nqkv);
    w.attn.resize(m * hq_ * d_);
    w.q.resize(m * hq_ * d_);
    const int64_t nspans = kv.spans(omp_get_max_threads(), span_tokens_);
    w.parts.resize(kv.parts_size(hq_, nspans));
    if (integer) {
      w.xq.resize(m, hidden_);
      w.oq.resize(m, hq_ * d_);
      w.aq.resize(m, inter_);
    }
    const float* xin = x.data_ptr<float>();
    const float* rin = res.data_ptr<float>();
    float* rout = new_res.data_ptr<float>();
    float* o = out.data_ptr<float>();
    float* xn = w.xn.data();
    float* gu = w.gu.data();
    const bool first = !residual.has_value();
    const float* bias = qkv_bias_.has_value() ? qkv_bias_->data_ptr<float>() : nullptr;
    const float* cs = cos_sin.data_ptr<float>();

    // The phases between the projections, each inside a parallel region (orphaned worksharing):
    // every row's work is independent, and the threads share the rows.
    auto input_norm = [&] {
#pragma omp for
      for (int64_t r = 0; r < m; ++r) {
        float* rr = rout + r * hidden_;
        for (int64_t i = 0; i < hidden_; ++i) rr[i] = first ? xin[r * hidden_ + i] : xin[r * hidden_ + i] + rin[r * hidden_ + i];
        rms_norm_row(rr, input_norm_.data_ptr<float>(), hidden_, eps_, xn + r * hidden_);
        if (integer) w.xq.quantize(r, xn + r * hidden_);
      }
    };
    auto attention = [&] {
#pragma omp for
      for (int64_t r = 0; r < m; ++r) store_and_rotate(w, r, cs + r * d_, kv, slots);
      kv.attention(w.q.data(), hq_, static_cast<float>(scale), w.attn.data(), w.parts.data(), nspans, span_tokens_);
#pragma omp barrier
      if (integer) {
#pragma omp for
        for (int64_t r = 0; r < m; ++r) w.oq.quantize(r, w.attn.data() + r * hq_ * d_);
      }
    };
    auto post_norm = [&] {
#pragma omp for
      for (int64_t r = 0; r < m; ++r) {
        float* rr = rout + r * hidden_;
        const float* orow = o + r * hidden_;
        for (int64_t i = 0; i < hidden_; ++i) rr[i] += orow[i];
        rms_norm_row(rr, post_norm_.data_ptr<float>(), hidden_, eps_, xn + r * hidden_);
        if (integer) w.xq.quantize(r, xn + r * hidden_);
      }
    };
    auto silu_mul = [&] {
#pragma omp for
      for (int64_t r = 0; r < m; ++r) {
        float* g = gu + r * 2 * inter_;
        for (int64_t i = 0; i < inter_; ++i) g[i] = g[i] / (1.f + std::exp(-g[i])) * g[inter_ + i];
        if (integer) w.aq.quantize(r, g);
      }
    };

    if (integer) {
      const PanelWeight wqkv = qkv_.int_weight(), wo = o_.int_weight(), wgu = gate_up_.int_weight(), wd = down_.int_weight();
#pragma omp parallel
      {
        int64_t lo, hi;
        input_norm();
        my_share(wqkv.panels(), &lo, &hi);
        wqkv.rows(w.xq, m, lo, hi, w.qkv_out.data(), nqkv, bias);
#pragma omp barrier
        attention();
        my_share(wo.panels(), &lo, &hi);
        wo.rows(w.oq, m, lo, hi, o, hidden_, nullptr);
#pragma omp barrier
        post_norm();
        my_share(wgu.panels(), &lo, &hi);
        wgu.rows(w.xq, m, lo, hi, gu, 2 * inter_, nullptr);
#pragma omp barrier
        silu_mul();
        my_share(wd.panels(), &lo, &hi);
        wd.rows(w.aq, m, lo, hi, o, hidden_, nullptr);
      }
    } else {
#pragma omp parallel
      input_norm();
      qkv_.dense_rows(xn, m, hidden_, w.qkv_out.data(), nqkv, bias);
#pragma omp parallel
      attention();
      o_.dense_rows(w.attn.data(), m, hq_ * d_, o, hidden_, nullptr);
#pragma omp parallel
      post_norm();
      gate_up_.dense_rows(xn, m, hidden_, gu, 2 * inter_, nullptr);
#pragma omp parallel
      silu_mul();
      down_.dense_rows(gu, m, 2 * inter_, o, hidden_, nullptr);
    }
    return {out, new_res};
  }

 private:
  // qk-norm (Qwen3) and rotary on q and k, K and V into the cache, q to where attention reads it.
  void store_and_rotate(LayerScratch& w, int64_t r, const float* cs, const PagedKV& kv, const torch::Tensor& slots) {
    float* row = w.qkv_out.data() + r * qkv_.n;
    for (int64_t hh = 0; hh < hq_ + hkv_; ++hh) {
      float* v = row + hh * d_;
      if (q_norm_.has_value()) rms_norm_row(v, (hh < hq_ ? *q_norm_ : *k_norm_).data_ptr<float>(), d_, eps_, v);
      rotate(v, cs, d_);
    }
    const int64_t slot = slots.data_ptr<int64_t>()[r], blk = slot / kv.bs, off = slot % kv.bs;
    for (int64_t hh = 0; hh < hkv_; ++hh) {
      const float* k = row + (hq_ + hh) * d_;
      const float* v = row + (hq_ + hkv_ + hh) * d_;
      const int64_t at = ((blk * kv.hkv + hh) * kv.bs + off) * d_;
      if (kv.k_cache.scalar_type() == torch::kFloat) {
        std::copy(k, k + d_, kv.k_cache.data_ptr<float>() + at);
        std::copy(v, v + d_, kv.v_cache.data_ptr<float>() + at);
      } else {
        c10::BFloat16* kc = kv.k_cache.data_ptr<c10::BFloat16>() + at;
        c10::BFloat16* vc = kv.v_cache.data_ptr<c10::BFloat16>() + at;
        for (int64_t i = 0; i < d_; ++i) {
          kc[i] = c10::BFloat16(k[i]);
          vc[i] = c10::BFloat16(v[i]);
        }
      }
    }
    // Attention reads q as [M, Hq, D]: copy this row's q heads there.
    std::copy(row, row + hq_ * d_, w.q.data() + r * hq_ * d_);
  }

  torch::Tensor input_norm_, post_norm_;
  c10::optional<torch::Tensor> qkv_bias_, q_norm_, k_norm_;
  int64_t hq_, hkv_, d_, hidden_, inter_;
  float eps_;
  int64_t int_rows_, span_tokens_;
  Projection qkv_, o_, gate_up_, down_;
  bool all_dense_ = true;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear", &quant_linear, "x [M, K] float32 times a q4 or q8 (with column scales) weight of n columns");
  m.def("int_gemm_path", [] { return std::string(INTGEMM_PATH); }, "the instruction set the integer GEMM was built for");
  m.def("int8_dot_rate", &intgemm::dot_rate, "int8 multiply-adds per second of the GEMM's dot instruction, all threads");
  m.def("decode_attention", &decode_attention, "paged decode attention");
  pybind11::class_<DecodeLayer>(m, "DecodeLayer")
      .def(pybind11::init<torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                          c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                          c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                          c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                          int64_t, int64_t, int64_t, int64_t, double, int64_t, int64_t>())
      .def("max_rows", &DecodeLayer::max_rows)
      .def("forward", &DecodeLayer::forward);
}
