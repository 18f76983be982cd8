// The C++ CPU kernels of pagedserve (float32; AVX-512, or AVX2 + FMA); what each computes is in
// pagedserve/kernels/cpu_kernels.py's docstring, which also picks the CPU's instruction set for
// the build (at install: python -m pagedserve.kernels.build).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <immintrin.h>

namespace {

// ---- 16 float lanes ---------------------------------------------------------------------------
// The kernels compute on V16: one __m512 where the build targets AVX-512, two __m256 (lanes 0-7,
// 8-15) where it targets AVX2 + FMA. Each operation is the AVX-512 instruction or its AVX2 pair.

#if defined(__AVX512F__)

using V16 = __m512;

using Mask16 = __mmask16;  // lanes kept by a masked load, store or move

inline Mask16 first_lanes(int64_t n) { return static_cast<Mask16>((1u << n) - 1u); }  // n <= 16
inline V16 load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, V16 v) { _mm512_storeu_ps(p, v); }
// the kept lanes of p (zeros elsewhere); store only the kept lanes; zero the others of v
inline V16 load_masked(const float* p, Mask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline void store_masked(float* p, V16 v, Mask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline V16 keep_masked(V16 v, Mask16 m) { return _mm512_maskz_mov_ps(m, v); }
inline V16 set1(float x) { return _mm512_set1_ps(x); }
inline V16 zeros() { return _mm512_setzero_ps(); }
inline V16 add(V16 a, V16 b) { return _mm512_add_ps(a, b); }
inline V16 sub(V16 a, V16 b) { return _mm512_sub_ps(a, b); }
inline V16 mul(V16 a, V16 b) { return _mm512_mul_ps(a, b); }
inline V16 div(V16 a, V16 b) { return _mm512_div_ps(a, b); }
inline V16 max(V16 a, V16 b) { return _mm512_max_ps(a, b); }
inline V16 fmadd(V16 a, V16 b, V16 c) { return _mm512_fmadd_ps(a, b, c); }    // a b + c
inline V16 fnmadd(V16 a, V16 b, V16 c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b
inline V16 round_nearest(V16 v) {
  return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline V16 times_pow2(V16 y, V16 n) { return _mm512_scalef_ps(y, n); }  // y 2^n, n integral
inline float sum_lanes(V16 v) { return _mm512_reduce_add_ps(v); }
inline float max_lane(V16 v) { return _mm512_reduce_max_ps(v); }

// r[l] = sum of the 16 lanes of a[l], for 16 vectors at once (a transpose-and-add tree:
// 45 shuffles and adds instead of 16 horizontal reductions).
inline V16 reduce16(V16* a) {
  V16 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88),
                       _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

#else  // AVX2 + FMA

struct V16 {
  __m256 lo, hi;
};

struct Mask16 {  // all-ones lanes are kept
  __m256i lo, hi;
};

inline Mask16 first_lanes(int64_t n) {  // n <= 16
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return {_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane),
          _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n) - 8), lane)};
}
inline V16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store(float* p, V16 v) { _mm256_storeu_ps(p, v.lo), _mm256_storeu_ps(p + 8, v.hi); }
inline V16 load_masked(const float* p, Mask16 m) {
  return {_mm256_maskload_ps(p, m.lo), _mm256_maskload_ps(p + 8, m.hi)};
}
inline void store_masked(float* p, V16 v, Mask16 m) {
  _mm256_maskstore_ps(p, m.lo, v.lo);
  _mm256_maskstore_ps(p + 8, m.hi, v.hi);
}
inline V16 keep_masked(V16 v, Mask16 m) {
  return {_mm256_and_ps(v.lo, _mm256_castsi256_ps(m.lo)),
          _mm256_and_ps(v.hi, _mm256_castsi256_ps(m.hi))};
}
inline V16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 zeros() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 add(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 sub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 mul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 div(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline V16 max(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V16 fmadd(V16 a, V16 b, V16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline V16 fnmadd(V16 a, V16 b, V16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline V16 round_nearest(V16 v) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(v.lo, kMode), _mm256_round_ps(v.hi, kMode)};
}
// y 2^n for integral n >= -126 (exp16's range; larger n saturate at 254, past overflow) and y
// in [0.5, 2): y 2^(n / 2) (exact) times 2^(n - n / 2), so that the result over- or underflows
// in one rounding, as scalef's does
inline __m256 times_pow2(__m256 y, __m256 n) {
  const __m256i k = _mm256_cvtps_epi32(_mm256_min_ps(n, _mm256_set1_ps(254.0f)));
  const __m256i half = _mm256_srai_epi32(k, 1);
  const auto pow2 = [](__m256i e) {  // 2^e for e in [-126, 127]
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
  };
  return _mm256_mul_ps(_mm256_mul_ps(y, pow2(half)), pow2(_mm256_sub_epi32(k, half)));
}
inline V16 times_pow2(V16 y, V16 n) { return {times_pow2(y.lo, n.lo), times_pow2(y.hi, n.hi)}; }
inline float sum_lanes(V16 v) {
  const __m256 s8 = _mm256_add_ps(v.lo, v.hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
inline float max_lane(V16 v) {
  const __m256 m8 = _mm256_max_ps(v.lo, v.hi);
  const __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  const __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
}

// reduce16 of the AVX-512 build, each step on the two halves: unpack and shuffle_ps act within
// 128-bit lanes (so on each half alike); shuffle_f32x4 0x88 / 0xDD pick 128-bit lanes (0, 2) /
// (1, 3) of each operand, which are the low / high lanes of its two halves (permute2f128).
inline V16 reduce16(V16* a) {
  V16 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i) {
    const V16 x = a[2 * i], y = a[2 * i + 1];
    b[i] = {_mm256_add_ps(_mm256_unpacklo_ps(x.lo, y.lo), _mm256_unpackhi_ps(x.lo, y.lo)),
            _mm256_add_ps(_mm256_unpacklo_ps(x.hi, y.hi), _mm256_unpackhi_ps(x.hi, y.hi))};
  }
  for (int i = 0; i < 4; ++i) {
    const V16 x = b[2 * i], y = b[2 * i + 1];
    c[i] = {_mm256_add_ps(_mm256_shuffle_ps(x.lo, y.lo, 0x44), _mm256_shuffle_ps(x.lo, y.lo, 0xEE)),
            _mm256_add_ps(_mm256_shuffle_ps(x.hi, y.hi, 0x44), _mm256_shuffle_ps(x.hi, y.hi, 0xEE))};
  }
  const auto lanes_02 = [](__m256 lo, __m256 hi) { return _mm256_permute2f128_ps(lo, hi, 0x20); };
  const auto lanes_13 = [](__m256 lo, __m256 hi) { return _mm256_permute2f128_ps(lo, hi, 0x31); };
  const auto shuffle_add = [&](V16 x, V16 y) {  // shuffle_f32x4(x, y, 0x88) + (.., 0xDD)
    return V16{_mm256_add_ps(lanes_02(x.lo, x.hi), lanes_13(x.lo, x.hi)),
               _mm256_add_ps(lanes_02(y.lo, y.hi), lanes_13(y.lo, y.hi))};
  };
  for (int i = 0; i < 2; ++i) d[i] = shuffle_add(c[2 * i], c[2 * i + 1]);
  return shuffle_add(d[0], d[1]);
}

#endif

// exp(x) (Cephes expf: range reduction by ln 2, degree-6 polynomial), exact to ~1 ulp for
// x <= 0; x >= -87 after the clamp, and large x overflow to inf (silu_and_mul's exp(-g)).
inline V16 exp16(V16 x) {
  x = max(x, set1(-87.0f));
  const V16 fx = round_nearest(mul(x, set1(1.44269504088896341f)));
  x = fnmadd(fx, set1(0.693359375f), x);
  x = fnmadd(fx, set1(-2.12194440e-4f), x);
  V16 y = set1(1.9875691500e-4f);
  y = fmadd(y, x, set1(1.3981999507e-3f));
  y = fmadd(y, x, set1(8.3334519073e-3f));
  y = fmadd(y, x, set1(4.1665795894e-2f));
  y = fmadd(y, x, set1(1.6666665459e-1f));
  y = fmadd(y, x, set1(5.0000001201e-1f));
  y = fmadd(y, mul(x, x), add(x, set1(1.0f)));
  return times_pow2(y, fx);
}

constexpr int MAX_GROUP = 8;

// One (request, kv head): G query heads against the request's L keys. D = 16 * C.
template <int C, int G>
void decode_one(const float* const* q_rows, float* const* out_rows, const float* k_base,
                const float* v_base, const int32_t* table, int64_t L, int64_t block_size,
                float scale, float* scores) {
  constexpr int D = 16 * C;
  V16 qv[G][C];
  float row_max[G], row_sum[G];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < C; ++c)
      qv[g][c] = mul(load(q_rows[g] + 16 * c), set1(scale));
    row_max[g] = -std::numeric_limits<float>::infinity();
  }
  V16 tile_max[G];
  for (int g = 0; g < G; ++g) tile_max[g] = set1(-std::numeric_limits<float>::infinity());
  for (int64_t j0 = 0, i = 0; j0 < L; j0 += block_size, ++i) {  // pass 1: scores
    const float* kb = k_base + static_cast<int64_t>(table[i]) * block_size * D;
    const int64_t n = std::min<int64_t>(block_size, L - j0);
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {  // 16 keys at a time
      V16 partial[G][16];
      for (int u = 0; u < 16; ++u) {
        V16 kv[C];
        for (int c = 0; c < C; ++c) kv[c] = load(kb + (t + u) * D + 16 * c);
        for (int g = 0; g < G; ++g) {
          V16 acc = mul(qv[g][0], kv[0]);
          for (int c = 1; c < C; ++c) acc = fmadd(qv[g][c], kv[c], acc);
          partial[g][u] = acc;
        }
      }
      for (int g = 0; g < G; ++g) {
        const V16 sv = reduce16(partial[g]);
        store(scores + g * L + j0 + t, sv);
        tile_max[g] = max(tile_max[g], sv);
      }
    }
    for (; t < n; ++t) {
      V16 kv[C];
      for (int c = 0; c < C; ++c) kv[c] = load(kb + t * D + 16 * c);
      for (int g = 0; g < G; ++g) {
        V16 acc = mul(qv[g][0], kv[0]);
        for (int c = 1; c < C; ++c) acc = fmadd(qv[g][c], kv[c], acc);
        const float s = sum_lanes(acc);
        scores[g * L + j0 + t] = s;
        row_max[g] = std::max(row_max[g], s);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    row_max[g] = std::max(row_max[g], max_lane(tile_max[g]));
  for (int g = 0; g < G; ++g) {  // pass 2: p = exp(s - max), sums
    float* s = scores + g * L;
    const V16 m = set1(row_max[g]);
    V16 sum = zeros();
    int64_t j = 0;
    for (; j + 16 <= L; j += 16) {
      const V16 e = exp16(sub(load(s + j), m));
      store(s + j, e);
      sum = add(sum, e);
    }
    if (j < L) {
      const Mask16 tail = first_lanes(L - j);
      const V16 e = exp16(sub(load_masked(s + j, tail), m));
      store_masked(s + j, e, tail);
      sum = add(sum, keep_masked(e, tail));
    }
    row_sum[g] = sum_lanes(sum);
  }
  V16 acc[G][C];  // pass 3: sum_j p_j V_j
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = zeros();
  for (int64_t j0 = 0, i = 0; j0 < L; j0 += block_size, ++i) {
    const float* vb = v_base + static_cast<int64_t>(table[i]) * block_size * D;
    const int64_t n = std::min<int64_t>(block_size, L - j0);
    for (int64_t t = 0; t < n; ++t) {
      V16 vv[C];
      for (int c = 0; c < C; ++c) vv[c] = load(vb + t * D + 16 * c);
      for (int g = 0; g < G; ++g) {
        const V16 p = set1(scores[g * L + j0 + t]);
        for (int c = 0; c < C; ++c) acc[g][c] = fmadd(p, vv[c], acc[g][c]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const V16 inv = set1(1.0f / row_sum[g]);
    for (int c = 0; c < C; ++c)
      store(out_rows[g] + 16 * c, mul(acc[g][c], inv));
  }
}

// out[rows[b], h] = softmax(scale * q[rows[b], h] K_b^T) V_b for each decode request b.
// q, out [T, H, D] float32 with a unit last stride; caches [Hkv, num_blocks, block_size, D]
// contiguous; block_tables [B, W] int32 contiguous; seq_lens, rows [B] int64.
void paged_decode(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, const at::Tensor& rows, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
              k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat);
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4);
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "unit last stride expected");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kLong &&
              rows.scalar_type() == at::kLong);
  const int64_t B = rows.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(0), N = k_cache.size(1), block_size = k_cache.size(2);
  TORCH_CHECK(H % Hkv == 0 && H / Hkv <= MAX_GROUP && k_cache.size(3) == D);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && out.size(1) == H && out.size(2) == D);
  TORCH_CHECK(D == 16 || D == 32 || D == 64 || D == 128, "head_dim must be 16, 32, 64 or 128");
  TORCH_CHECK(seq_lens.size(0) == B && block_tables.size(0) == B);
  const int G = static_cast<int>(H / Hkv);
  const int64_t W = block_tables.size(1);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* tp = block_tables.data_ptr<int32_t>();
  const int64_t* lp = seq_lens.data_ptr<int64_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  int64_t max_len = 1;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= W * block_size, "seq_len outside the block table");
    TORCH_CHECK(rp[b] >= 0 && rp[b] < q.size(0) && rp[b] < out.size(0), "row out of range");
    for (int64_t i = 0; i * block_size < lp[b]; ++i)
      TORCH_CHECK(tp[b * W + i] >= 0 && tp[b * W + i] < N, "block id out of range");
    max_len = std::max(max_len, lp[b]);
  }
  const float fscale = static_cast<float>(scale);
  using Kernel = void (*)(const float* const*, float* const*, const float*, const float*,
                         const int32_t*, int64_t, int64_t, float, float*);
  static const Kernel kernels[4][4] = {
      {&decode_one<1, 1>, &decode_one<1, 2>, &decode_one<1, 4>, &decode_one<1, 8>},
      {&decode_one<2, 1>, &decode_one<2, 2>, &decode_one<2, 4>, &decode_one<2, 8>},
      {&decode_one<4, 1>, &decode_one<4, 2>, &decode_one<4, 4>, &decode_one<4, 8>},
      {&decode_one<8, 1>, &decode_one<8, 2>, &decode_one<8, 4>, &decode_one<8, 8>}};
  TORCH_CHECK(G == 1 || G == 2 || G == 4 || G == 8, "num_heads / num_kv_heads: 1, 2, 4 or 8");
  const int gi = G == 1 ? 0 : G == 2 ? 1 : G == 4 ? 2 : 3;
  const Kernel kernel = kernels[D == 16 ? 0 : D == 32 ? 1 : D == 64 ? 2 : 3][gi];
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(G) * max_len);
    const float* q_rows[MAX_GROUP];
    float* out_rows[MAX_GROUP];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / B, b = task % B;
      for (int g = 0; g < G; ++g) {
        q_rows[g] = qp + rp[b] * qs0 + (h * G + g) * qs1;
        out_rows[g] = op + rp[b] * os0 + (h * G + g) * os1;
      }
      const float* kb = kp + h * N * block_size * D;
      const float* vb = vp + h * N * block_size * D;
      const int32_t* table = tp + b * W;
      kernel(q_rows, out_rows, kb, vb, table, lp[b], block_size, fscale, scores.data());
    }
  });
}

// ---- per-token kernels (float32, rows contiguous in the last dim) -----------------------------

// y = weight * (x * rsqrt(mean(x^2) + eps)) for one row of n floats (sum of squares in float32,
// 16 lanes then a tree; x * r and the weight product rounded separately, as in transformers).
inline void rms_row(const float* x, const float* w, float* y, int64_t n, float eps) {
  V16 acc = zeros();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const V16 v = load(x + i);
    acc = add(acc, mul(v, v));
  }
  if (i < n) {
    const V16 v = load_masked(x + i, first_lanes(n - i));
    acc = add(acc, mul(v, v));
  }
  const float mean = sum_lanes(acc) / static_cast<float>(n);
  const V16 r = set1(1.0f / std::sqrt(mean + eps));
  for (i = 0; i + 16 <= n; i += 16)
    store(y + i, mul(load(w + i),
                                          mul(load(x + i), r)));
  if (i < n) {
    const Mask16 tail = first_lanes(n - i);
    const V16 xr = mul(load_masked(x + i, tail), r);
    store_masked(y + i, mul(load_masked(w + i, tail), xr), tail);
  }
}

void check_rows(const at::Tensor& t, int64_t n) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.stride(1) == 1 && t.size(1) == n);
}

// out = rms_norm(x); x, out [T, n]
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t T = x.size(0), n = x.size(1);
  check_rows(x, n), check_rows(out, n);
  TORCH_CHECK(out.size(0) == T);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == n && weight.scalar_type() == at::kFloat);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) rms_row(xp + t * xs, wp, op + t * os, n, float(eps));
  });
}

// residual += x; x = rms_norm(residual) (both in place); x, residual [T, n]
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  const int64_t T = x.size(0), n = x.size(1);
  check_rows(x, n), check_rows(residual, n);
  TORCH_CHECK(residual.size(0) == T);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == n && weight.scalar_type() == at::kFloat);
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      float* xr = xp + t * xs;
      float* rr = rp + t * rs;
      int64_t i = 0;
      for (; i + 16 <= n; i += 16)
        store(rr + i, add(load(xr + i), load(rr + i)));
      for (; i < n; ++i) rr[i] = xr[i] + rr[i];
      rms_row(rr, wp, xr, n, static_cast<float>(eps));
    }
  });
}

// In place on qk [T, heads, D] (unit last stride): x = [x1, x2] -> [x1 c - x2 s, x2 c + x1 s],
// c = cos_cache[positions[t]], s = sin_cache[positions[t]] ([P, D / 2] each).
void rotary_inplace(at::Tensor qk, const at::Tensor& positions, const at::Tensor& cos_cache,
                    const at::Tensor& sin_cache) {
  TORCH_CHECK(qk.scalar_type() == at::kFloat && qk.dim() == 3 && qk.stride(2) == 1);
  TORCH_CHECK(cos_cache.is_contiguous() && sin_cache.is_contiguous() &&
              cos_cache.scalar_type() == at::kFloat && sin_cache.scalar_type() == at::kFloat);
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous());
  const int64_t T = qk.size(0), heads = qk.size(1), half = qk.size(2) / 2;
  TORCH_CHECK(cos_cache.size(1) == half && qk.size(2) == 2 * half);
  float* p = qk.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cc = cos_cache.data_ptr<float>();
  const float* sc = sin_cache.data_ptr<float>();
  const int64_t s0 = qk.stride(0), s1 = qk.stride(1), P = cos_cache.size(0);
  at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "position outside the rotary cache");
      const float* c = cc + pos[t] * half;
      const float* s = sc + pos[t] * half;
      for (int64_t h = 0; h < heads; ++h) {
        float* x = p + t * s0 + h * s1;
        int64_t i = 0;
        for (; i + 16 <= half; i += 16) {
          const V16 x1 = load(x + i), x2 = load(x + half + i);
          const V16 cv = load(c + i), sv = load(s + i);
          const V16 y1 = sub(mul(x1, cv), mul(x2, sv));
          const V16 y2 = add(mul(x2, cv), mul(x1, sv));
          store(x + i, y1);
          store(x + half + i, y2);
        }
        for (; i < half; ++i) {
          const float x1 = x[i], x2 = x[half + i];
          x[i] = x1 * c[i] - x2 * s[i];
          x[half + i] = x2 * c[i] + x1 * s[i];
        }
      }
    }
  });
}

// out = silu(x[:, :n]) * x[:, n:], x [T, 2n], out [T, n]; silu(g) = g / (1 + exp(-g))
void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  const int64_t T = x.size(0), n = out.size(1);
  check_rows(x, 2 * n), check_rows(out, n);
  TORCH_CHECK(out.size(0) == T);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  const V16 one = set1(1.0f);
  at::parallel_for(0, T, 32, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* g = xp + t * xs;
      const float* u = g + n;
      float* o = op + t * os;
      for (int64_t i = 0; i < n; i += 16) {
        const Mask16 lanes = first_lanes(std::min<int64_t>(16, n - i));
        const V16 gv = load_masked(g + i, lanes);
        const V16 e = exp16(sub(zeros(), gv));
        const V16 sig = div(gv, add(one, e));
        store_masked(o + i, mul(sig, load_masked(u + i, lanes)), lanes);
      }
    }
  });
}

// Head-major caches [Hkv, num_blocks, block_size, D]: cache[h].flat[slots[t]] = k[t, h] (and v);
// k, v [T, Hkv, D] with a unit last stride; negative slots are skipped.
void write_kv_head_major(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                         at::Tensor v_cache, const at::Tensor& slots) {
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
              k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat);
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous());
  const int64_t T = k.size(0), Hkv = k.size(1), D = k.size(2);
  TORCH_CHECK(k_cache.size(0) == Hkv && k_cache.size(3) == D && slots.numel() == T);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v.size(0) == T && v.size(1) == Hkv &&
              v.size(2) == D);
  const int64_t per_head = k_cache.size(1) * k_cache.size(2);
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  at::parallel_for(0, T, 256, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t slot = sp[t];
      if (slot < 0) continue;
      TORCH_CHECK(slot < per_head, "slot outside the cache");
      for (int64_t h = 0; h < Hkv; ++h) {
        std::memcpy(kc + (h * per_head + slot) * D, kp + t * ks0 + h * ks1, D * sizeof(float));
        std::memcpy(vc + (h * per_head + slot) * D, vp + t * vs0 + h * vs1, D * sizeof(float));
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(pagedserve_cpu, m) {
  m.def("paged_decode(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor seq_lens, Tensor rows, float scale) -> ()");
  m.impl("paged_decode", c10::DispatchKey::CPU, &paged_decode);
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.impl("fused_add_rms_norm", c10::DispatchKey::CPU, &fused_add_rms_norm);
  m.def("rotary_inplace(Tensor(a!) qk, Tensor positions, Tensor cos_cache, Tensor sin_cache) "
        "-> ()");
  m.impl("rotary_inplace", c10::DispatchKey::CPU, &rotary_inplace);
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
  m.def("write_kv_head_major(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slots) -> ()");
  m.impl("write_kv_head_major", c10::DispatchKey::CPU, &write_kv_head_major);
}
