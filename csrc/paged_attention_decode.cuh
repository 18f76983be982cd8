// Paged-attention decode (one query token per request), GQA, flash-decoding: device code and the
// host-side launch plan, in plain CUDA C++ (no torch; the binding is paged_attention_decode.cpp,
// the parameter block and the entry points are declared in paged_attention_decode.h, and
// paged_attention_decode_<dtype>_hd<head_dim>.cu instantiate them).
//
// Layout (as pagedserve.kernels.attention): q [batch, num_heads, head_dim] (head_dim contiguous);
// k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim] (any strides whose head_dim is
// contiguous and whose rows are 16-byte aligned); token t of request b lives in block
// block_tables[b, t / block_size] at offset t % block_size. With G = num_heads / num_kv_heads,
// query head h reads kv head h / G over the keys j = 0 .. L_b - 1 (L_b = seq_lens[b]):
//     s_j = scale * <q[b, h], K[b, j, h / G]>,   out[b, h] = sum_j softmax(s)_j V[b, j, h / G]
// computed in base 2: q is pre-multiplied by scale * log2(e), so e^(s - m) = 2^(s' - m').
//
// Grid (num_kv_heads, batch, num_splits), 128 threads (4 warps) a CTA. CTA (kv, b, split) owns
// the G query heads of kv head `kv` of request b over keys [split * KPS, min(L_b, ...)) (KPS:
// L_b spread over the splits in whole TILEs, at most the plan's keys_per_split; the last split
// runs to L_b; see request_keys_per_split), so every K/V row is read
// from memory once for all G heads. A split past L_b writes an empty partial (max -1e30, sum 0).
//
// Lane groups. A K or V row of head_dim elements is LANES 16-byte vectors (bf16/fp16: 8 elements,
// fp32: 4), so LANES = head_dim * sizeof(T) / 16 consecutive lanes (a lane group; 16 for bf16
// head_dim 128, i.e. half a warp) own one key: lane `gl` of the group holds dims
// [gl * VEC, gl * VEC + VEC) of the row and, in registers, the same dims of q for all G heads
// (fp32, scaled) and of the output accumulator acc[G][VEC]. The CTA's NUM_LG lane groups walk
// the split in stages of TILE = NUM_LG * U keys: lane group lg takes keys
// stage_start + lg * U + u, u < U (U = min(4, LANES / G), so N = G * U <= LANES scores).
//
// Memory pipeline. Each thread copies its own 16-byte pieces of the K and V rows of its U keys
// with cp.async into a private slot of a STAGES-deep ring in shared memory (zero-filled for keys
// past the end) and reads back only what it copied itself, so no barrier is needed: the copies
// of stage st + STAGES - 1 are issued before stage st is computed (STAGES - 1 stages, 32 KB a CTA
// for bf16 head_dim 128, stay in flight), and cp.async.wait_group STAGES - 1 makes stage st
// visible to the thread. Block ids are read from the block table one stage before their copies
// are issued, so the dependent address never stalls the issue.
//
// One stage, per lane group (all in registers, fp32):
//   1. partial dots: d[g * U + u] = sum over the lane's VEC dims of q[g] * K[key u].
//   2. reduce-scatter over the LANES lanes (xor shuffles that halve the live values each step):
//      afterwards lane gl holds the full score of pair n = gl / R (R = LANES / N lanes each),
//      i.e. head g = n / U, key u = n % U; keys past the split end get -inf.
//   3. online softmax, one pair per lane: tile max over the U keys of head g (xor shuffles),
//      m' = max(m, tile max), alpha = 2^(m - m'), p = 2^(s - m'), l = l * alpha + p (l: this
//      lane's keys only, summed over the group's U key lanes at the end).
//   4. acc[g][:] *= alpha_g (only if some alpha != 1 in the warp), then acc[g][:] += p[g, u] *
//      V[key u][lane's dims], p and alpha broadcast from their owner lanes by shuffles.
// End: the lane groups of a warp merge by shuffles (m = max, weights 2^(m_i - m)), the 4 warps
// through shared memory (reusing the ring). One split: out = acc / l. Several: the unnormalised
// partial acc, its max m and sum l go to part_out [B, H, S, D], part_m / part_l [B, H, S], and
// `reduce_kernel` (a CTA per (b, h)) computes out = sum_s 2^(m_s - M) acc_s / sum_s
// 2^(m_s - M) l_s over the splits s that hold keys (M = max_s m_s; none: zeros).
//
// num_splits is chosen on the host from max_seq_len (never from seq_lens' contents, so CUDA
// graphs captured with max_model_len stay valid) by a small wave/bandwidth model of the device
// (SM count and this kernel's occupancy): enough CTAs to keep HBM busy for small batches, few
// splits (no reduce pass) when the batch alone fills the GPU. Nothing syncs with the host.
//
// Launched as programmatic dependents (PDL, `dependent`), both kernels wait for the kernel
// before them at their top (grid_dependency.h) and then let the next one start.

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "grid_dependency.h"
#include "paged_attention_decode.h"

namespace pagedserve_decode {

constexpr int WARP = 32;
constexpr int NUM_WARPS = 4;
constexpr int NUM_THREADS = NUM_WARPS * WARP;
constexpr int MAX_SPLITS = 128;
constexpr unsigned FULL_MASK = 0xffffffffu;
// The running max before any key: finite, so 2^(m - m') is 0 or 1 and never NaN (-inf - -inf);
// masked scores are -inf, whose 2^(s - m') is 0.
constexpr float NEG_BIG = -1e30f;
constexpr float LOG2E = 1.4426950408889634f;

template <typename T, int HEAD_DIM, int GROUP>
struct Config {
  static constexpr int VEC = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte vector
  static constexpr int LANES = HEAD_DIM / VEC;                   // lanes per key row
  static constexpr int GROUPS_PER_WARP = WARP / LANES;
  static constexpr int NUM_LG = NUM_WARPS * GROUPS_PER_WARP;    // lane groups per CTA
  static constexpr int U = LANES / GROUP < 4 ? LANES / GROUP : 4;  // keys per group per stage
  static constexpr int N = GROUP * U;  // scores per lane group per stage
  static constexpr int R = LANES / N;  // lanes holding each score after the reduce-scatter
  static constexpr int TILE = NUM_LG * U;  // keys per CTA per stage
  static constexpr int STAGES = U >= 4 ? 3 : 4;
  static constexpr int SLOT_BYTES = U * 2 * NUM_THREADS * 16;  // one stage of the ring
  static constexpr int RING_BYTES = STAGES * SLOT_BYTES;
  static constexpr int COMBINE_BYTES = NUM_WARPS * GROUP * (HEAD_DIM + 2) * 4;
  static constexpr int SMEM_BYTES = RING_BYTES > COMBINE_BYTES ? RING_BYTES : COMBINE_BYTES;
  static constexpr int BYTES_PER_KEY = 2 * HEAD_DIM * static_cast<int>(sizeof(T));  // K + V
  // Register budget: 4 CTAs (16 warps) an SM for up to 4 heads of a group, 3 for 8 heads.
  static constexpr int MIN_BLOCKS = GROUP * VEC <= 32 ? 4 : 3;

  static_assert(HEAD_DIM % VEC == 0, "head_dim must be a whole number of 16-byte vectors");
  static_assert(LANES >= 1 && LANES <= WARP && (LANES & (LANES - 1)) == 0,
                "a key row must be 1..32 (a power of two) 16-byte vectors");
  static_assert(U >= 1 && (U & (U - 1)) == 0, "keys per lane group: a power of two");
  static_assert(N <= LANES && LANES % N == 0, "scores per stage must fit the lane group");
  static_assert(SMEM_BYTES <= 48 * 1024, "dynamic shared memory above 48 KB needs an opt-in");
};

// ------------------------------------------------------------------------------ device helpers

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float(float x) { return x; }
template <>
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }

// 16 bytes (one cp.async vector) -> VEC floats.
template <typename T>
__device__ __forceinline__ void unpack(const uint4& r, float (&f)[16 / sizeof(T)]);
template <>
__device__ __forceinline__ void unpack<float>(const uint4& r, float (&f)[4]) {
  f[0] = __uint_as_float(r.x);
  f[1] = __uint_as_float(r.y);
  f[2] = __uint_as_float(r.z);
  f[3] = __uint_as_float(r.w);
}
template <>
__device__ __forceinline__ void unpack<__nv_bfloat16>(const uint4& r, float (&f)[8]) {
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // element 2j is the low half of word j
    f[2 * j] = __uint_as_float(w[j] << 16);
    f[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
  }
}
template <>
__device__ __forceinline__ void unpack<__half>(const uint4& r, float (&f)[8]) {
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    __half2 h;
    memcpy(&h, &w[j], sizeof(h));
    const float2 x = __half22float2(h);
    f[2 * j] = x.x;
    f[2 * j + 1] = x.y;
  }
}

__device__ __forceinline__ float fast_exp2(float x) {  // 2^x; 2^-inf = 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, bypassing L1; src_bytes 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

// Reduce-scatter of v[0..CNT) over the lanes xor-linked by OFF, OFF / 2, .., 1: each step keeps
// the half of the live values selected by the lane's bit OFF and adds the partner's copy of it.
// Afterwards v[0] holds the full sum of value (gl >> log2(R)) (the leading bits of the lane index
// pick the leading bits of the value index); steps past CNT == 1 are plain butterflies.
template <int CNT, int OFF, int NV>
__device__ __forceinline__ void reduce_scatter(float (&v)[NV], int lane) {
  if constexpr (OFF >= 1) {
    if constexpr (CNT > 1) {
      constexpr int HALF = CNT / 2;
      const bool upper = (lane & OFF) != 0;
#pragma unroll
      for (int i = 0; i < HALF; ++i) {
        const float send = upper ? v[i] : v[i + HALF];
        const float keep = upper ? v[i + HALF] : v[i];
        v[i] = keep + __shfl_xor_sync(FULL_MASK, send, OFF);
      }
      reduce_scatter<HALF, OFF / 2>(v, lane);
    } else {
      v[0] += __shfl_xor_sync(FULL_MASK, v[0], OFF);
      reduce_scatter<1, OFF / 2>(v, lane);
    }
  }
}

// Token t's block-table column t / block_size (t >= 0), division by a multiply (no branch).
__device__ __forceinline__ int block_column(int t, uint32_t magic, int shift) {
  const uint32_t ut = static_cast<uint32_t>(t);
  return static_cast<int>((__umulhi(ut, magic) + ut) >> shift);
}

// ------------------------------------------------------------------------------ decode kernel

// A request's keys per split: its own context spread over the planned splits in whole tiles,
// at most the planned keys_per_split (which covers max_seq_len). A plan made for a longer
// context than the request's (CUDA graphs plan for max_model_len) still spreads the request's
// keys over every split, rather than over the first few; the reduce derives the same size.
__host__ __device__ __forceinline__ int request_keys_per_split(int seq_len, const Params& p) {
  const int tiles = ((seq_len > 0 ? seq_len : 0) + p.split_tile - 1) / p.split_tile;
  const int tiles_per_split = (tiles + p.num_splits - 1) / p.num_splits;
  const int keys = (tiles_per_split > 1 ? tiles_per_split : 1) * p.split_tile;
  return keys < p.keys_per_split ? keys : p.keys_per_split;
}

template <typename T, int HEAD_DIM, int GROUP>
__global__ void __launch_bounds__(NUM_THREADS, (Config<T, HEAD_DIM, GROUP>::MIN_BLOCKS))
    decode_kernel(const Params p) {
  using C = Config<T, HEAD_DIM, GROUP>;
  constexpr int VEC = C::VEC, LANES = C::LANES, U = C::U, R = C::R, TILE = C::TILE;
  constexpr int STAGES = C::STAGES;
  extern __shared__ __align__(16) unsigned char smem[];

  const int kv_head = blockIdx.x, b = blockIdx.y, split = blockIdx.z;
  const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
  const int gl = lane % LANES;                                // lane in its lane group
  const int lg = warp * C::GROUPS_PER_WARP + lane / LANES;   // lane group in the CTA
  const int num_heads = p.num_heads;
  const bool direct = p.num_splits == 1;

  pagedserve_pdl::await_previous_grid();  // q and this step's k/v come from the kernels before
  pagedserve_pdl::allow_dependent_grid();
  const int seq_len = p.seq_lens[b];
  const int keys_per_split = request_keys_per_split(seq_len, p);
  const int k_begin = split * keys_per_split;
  const int k_end = split == p.num_splits - 1 ? seq_len : min(seq_len, k_begin + keys_per_split);
  if (k_begin >= k_end) {  // nothing to attend (padding request, split past the context)
    for (int i = tid; i < GROUP * HEAD_DIM; i += NUM_THREADS) {
      const int64_t row = (int64_t)b * num_heads + kv_head * GROUP + i / HEAD_DIM;
      if (direct) {
        reinterpret_cast<T*>(p.out)[row * HEAD_DIM + i % HEAD_DIM] = from_float<T>(0.f);
      } else if (i % HEAD_DIM == 0) {
        p.part_m[row * p.num_splits + split] = NEG_BIG;
        p.part_l[row * p.num_splits + split] = 0.f;
      }
    }
    return;
  }
  const int n_stages = (k_end - k_begin + TILE - 1) / TILE;
  const int key0 = k_begin + lg * U;  // this lane group's first key of stage 0
  const int* table = p.block_tables + (int64_t)b * p.bt_stride;
  const int64_t lane_off = (int64_t)kv_head * p.stride_head + gl * VEC;
  const T* k_base = reinterpret_cast<const T*>(p.k_cache) + lane_off;
  const T* v_base = reinterpret_cast<const T*>(p.v_cache) + lane_off;
  const uint32_t ring = shared_address(smem) + tid * 16;
  const unsigned char* ring_ptr = smem + tid * 16;
  const int shift = p.block_shift, block_size = p.block_size;
  const uint32_t magic = p.block_magic;
  const int stride_block = p.stride_block, stride_tok = p.stride_tok;
  // A group's U keys of a stage start at a multiple of U: one block holds them all when U
  // divides block_size.
  const bool one_block = block_size % U == 0;

  // Block ids of the group's keys in stage st (0 past the end).
  int ids[U];
  auto load_ids = [&](int st) {
    const int t0 = key0 + st * TILE;
    if (one_block) {
      const int id = t0 < k_end ? __ldg(table + block_column(t0, magic, shift)) : 0;
#pragma unroll
      for (int u = 0; u < U; ++u) ids[u] = id;
    } else {
#pragma unroll
      for (int u = 0; u < U; ++u)
        ids[u] = t0 + u < k_end ? __ldg(table + block_column(t0 + u, magic, shift)) : 0;
    }
  };
  // cp.async this thread's pieces of stage st's K and V rows into ring slot `slot` (one commit
  // group per call, empty past the last stage).
  auto issue = [&](int st, int slot) {
    if (st < n_stages) {
      const int t0 = key0 + st * TILE;
      const uint32_t dst = ring + slot * C::SLOT_BYTES;
      if (one_block) {  // rows u = row 0 + u * stride_tok
        const int off0 = t0 - block_column(t0, magic, shift) * block_size;
        const int64_t row0 = (int64_t)ids[0] * stride_block + (int64_t)off0 * stride_tok;
        const T* kp = k_base + row0;
        const T* vp = v_base + row0;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const bool valid = t0 + u < k_end;
          cp_async16(dst + (2 * u) * NUM_THREADS * 16, kp + u * stride_tok, valid);
          cp_async16(dst + (2 * u + 1) * NUM_THREADS * 16, vp + u * stride_tok, valid);
        }
      } else {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int t = t0 + u;
          const int off = t - block_column(t, magic, shift) * block_size;
          const int64_t row = (int64_t)ids[u] * stride_block + (int64_t)off * stride_tok;
          const bool valid = t < k_end;
          cp_async16(dst + (2 * u) * NUM_THREADS * 16, k_base + row, valid);
          cp_async16(dst + (2 * u + 1) * NUM_THREADS * 16, v_base + row, valid);
        }
      }
    }
    cp_async_commit();
  };

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    load_ids(s);
    issue(s, s);
  }
  load_ids(STAGES - 1);

  // q for the G heads, this lane's dims, scaled by scale * log2(e).
  float qf[GROUP][VEC];
  {
    const T* qb = reinterpret_cast<const T*>(p.q) + (int64_t)b * p.q_stride_b +
                  (int64_t)(kv_head * GROUP) * p.q_stride_h + gl * VEC;
#pragma unroll
    for (int g = 0; g < GROUP; ++g)
#pragma unroll
      for (int i = 0; i < VEC; ++i) qf[g][i] = to_float(qb[g * p.q_stride_h + i]) * p.qk_scale;
  }

  float acc[GROUP][VEC];
#pragma unroll
  for (int g = 0; g < GROUP; ++g)
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[g][i] = 0.f;
  float m_own = NEG_BIG, l_own = 0.f;  // for this lane's score pair's head
  const int n_own = gl / R, u_own = n_own % U;

  int slot = 0;
  for (int st = 0; st < n_stages; ++st) {
    issue(st + STAGES - 1, slot == 0 ? STAGES - 1 : slot - 1);  // the slot freed last stage
    load_ids(st + STAGES);
    cp_async_wait<STAGES - 1>();  // stage st has landed (this thread's copies)
    const unsigned char* src = ring_ptr + slot * C::SLOT_BYTES;

    // 1. partial dot products of this lane's dims
    float d[C::N];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[VEC];
      unpack<T>(*reinterpret_cast<const uint4*>(src + (2 * u) * NUM_THREADS * 16), kf);
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        float x = 0.f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) x = fmaf(qf[g][i], kf[i], x);
        d[g * U + u] = x;
      }
    }
    // 2. full scores, one (head, key) pair per lane
    reduce_scatter<C::N, LANES / 2>(d, gl);
    const float s = key0 + st * TILE + u_own < k_end ? d[0] : -INFINITY;
    // 3. online softmax
    float tile_max = s;
#pragma unroll
    for (int off = R; off < R * U; off *= 2)
      tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL_MASK, tile_max, off));
    const float m_new = fmaxf(m_own, tile_max);
    const float alpha = fast_exp2(m_own - m_new);
    const float prob = fast_exp2(s - m_new);
    l_own = fmaf(l_own, alpha, prob);
    m_own = m_new;
    // 4. rescale and accumulate p V
    if (__any_sync(FULL_MASK, alpha != 1.f)) {
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        const float a = __shfl_sync(FULL_MASK, alpha, g * U * R, LANES);
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[g][i] *= a;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float vf[VEC];
      unpack<T>(*reinterpret_cast<const uint4*>(src + (2 * u + 1) * NUM_THREADS * 16), vf);
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        const float pg = __shfl_sync(FULL_MASK, prob, (g * U + u) * R, LANES);
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[g][i] = fmaf(pg, vf[i], acc[g][i]);
      }
    }
    slot = slot == STAGES - 1 ? 0 : slot + 1;
  }

  // Per lane group: the sum over the U key lanes of each head, then every head's m and l.
#pragma unroll
  for (int off = R; off < R * U; off *= 2) l_own += __shfl_xor_sync(FULL_MASK, l_own, off);
  float mg[GROUP], lsum[GROUP];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    mg[g] = __shfl_sync(FULL_MASK, m_own, g * U * R, LANES);
    lsum[g] = __shfl_sync(FULL_MASK, l_own, g * U * R, LANES);
  }
  // Merge the lane groups of the warp.
#pragma unroll
  for (int off = LANES; off < WARP; off *= 2) {
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      const float mo = __shfl_xor_sync(FULL_MASK, mg[g], off);
      const float lo = __shfl_xor_sync(FULL_MASK, lsum[g], off);
      const float m = fmaxf(mg[g], mo);
      const float fa = fast_exp2(mg[g] - m), fb = fast_exp2(mo - m);
      lsum[g] = lsum[g] * fa + lo * fb;
#pragma unroll
      for (int i = 0; i < VEC; ++i)
        acc[g][i] = acc[g][i] * fa + __shfl_xor_sync(FULL_MASK, acc[g][i], off) * fb;
      mg[g] = m;
    }
  }
  // Merge the warps through shared memory (the ring is free once every thread is past it).
  cp_async_wait<0>();
  __syncthreads();
  float* sm_acc = reinterpret_cast<float*>(smem);                // [NUM_WARPS][GROUP][HEAD_DIM]
  float* sm_ml = sm_acc + NUM_WARPS * GROUP * HEAD_DIM;          // [NUM_WARPS][GROUP][2]
  if (lane < LANES) {
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      float* dst = sm_acc + (warp * GROUP + g) * HEAD_DIM + gl * VEC;
#pragma unroll
      for (int i = 0; i < VEC; i += 4)
        *reinterpret_cast<float4*>(dst + i) =
            make_float4(acc[g][i], acc[g][i + 1], acc[g][i + 2], acc[g][i + 3]);
    }
    if (lane == 0) {
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        sm_ml[(warp * GROUP + g) * 2] = mg[g];
        sm_ml[(warp * GROUP + g) * 2 + 1] = lsum[g];
      }
    }
  }
  __syncthreads();
  for (int i = tid; i < GROUP * HEAD_DIM; i += NUM_THREADS) {
    const int g = i / HEAD_DIM, dim = i % HEAD_DIM;
    float m = NEG_BIG;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) m = fmaxf(m, sm_ml[(w * GROUP + g) * 2]);
    float l = 0.f, a = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) {
      const float f = fast_exp2(sm_ml[(w * GROUP + g) * 2] - m);
      l = fmaf(f, sm_ml[(w * GROUP + g) * 2 + 1], l);
      a = fmaf(f, sm_acc[(w * GROUP + g) * HEAD_DIM + dim], a);
    }
    const int64_t row = (int64_t)b * num_heads + kv_head * GROUP + g;
    if (direct) {
      reinterpret_cast<T*>(p.out)[row * HEAD_DIM + dim] = from_float<T>(l > 0.f ? a / l : 0.f);
    } else {
      const int64_t part = row * p.num_splits + split;
      p.part_out[part * HEAD_DIM + dim] = a;
      if (dim == 0) {
        p.part_m[part] = m;
        p.part_l[part] = l;
      }
    }
  }
}

// ------------------------------------------------------------------------------ split merge

// out[b, h] = sum_s 2^(m_s - M) part_out[b, h, s] / sum_s 2^(m_s - M) l_s over the splits that
// hold keys of request b (M = max m_s; no split: zeros). A CTA per (b, h) row: every warp gets
// M and the denominator from the (at most MAX_SPLITS) maxima and sums, one register load a
// lane; then thread t sums float4 chunk t % CHUNKS of the splits s = t / CHUNKS (mod
// SPLIT_GROUPS), and the split groups add up through shared memory.
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(NUM_THREADS) reduce_kernel(const Params p) {
  constexpr int CHUNKS = HEAD_DIM / 4;
  constexpr int SPLIT_GROUPS = NUM_THREADS / CHUNKS;
  constexpr int PER_LANE = MAX_SPLITS / WARP;
  static_assert(HEAD_DIM % 4 == 0 && NUM_THREADS % CHUNKS == 0, "head_dim: 4..512, 4 | head_dim");
  static_assert(MAX_SPLITS % WARP == 0, "MAX_SPLITS must be a multiple of 32");
  __shared__ float4 partial[SPLIT_GROUPS][CHUNKS];
  const int tid = threadIdx.x, lane = tid % WARP;
  const int64_t row = blockIdx.x;
  const int b = static_cast<int>(row / p.num_heads);
  pagedserve_pdl::await_previous_grid();  // the partials of the decode kernel
  pagedserve_pdl::allow_dependent_grid();
  const int seq_len = p.seq_lens[b];
  const int keys_per_split = request_keys_per_split(seq_len, p);
  const int used =
      seq_len <= 0 ? 0 : min(p.num_splits, (seq_len + keys_per_split - 1) / keys_per_split);
  const int64_t base = row * p.num_splits;
  float ms[PER_LANE], ls[PER_LANE];
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int s = lane + i * WARP;
    ms[i] = s < used ? p.part_m[base + s] : NEG_BIG;
    ls[i] = s < used ? p.part_l[base + s] : 0.f;
  }
  float m = NEG_BIG;
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) m = fmaxf(m, ms[i]);
#pragma unroll
  for (int off = WARP / 2; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, off));
  float l = 0.f;
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) l = fmaf(fast_exp2(ms[i] - m), ls[i], l);
#pragma unroll
  for (int off = WARP / 2; off > 0; off /= 2) l += __shfl_xor_sync(FULL_MASK, l, off);

  const int chunk = tid % CHUNKS;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
  for (int s = tid / CHUNKS; s < used; s += SPLIT_GROUPS) {
    const float w = fast_exp2(p.part_m[base + s] - m);
    const float4 x =
        *reinterpret_cast<const float4*>(p.part_out + (base + s) * HEAD_DIM + chunk * 4);
    acc.x = fmaf(w, x.x, acc.x);
    acc.y = fmaf(w, x.y, acc.y);
    acc.z = fmaf(w, x.z, acc.z);
    acc.w = fmaf(w, x.w, acc.w);
  }
  partial[tid / CHUNKS][chunk] = acc;
  __syncthreads();
  if (tid < CHUNKS) {
    float4 sum = partial[0][tid];
#pragma unroll
    for (int g = 1; g < SPLIT_GROUPS; ++g) {
      const float4 x = partial[g][tid];
      sum.x += x.x;
      sum.y += x.y;
      sum.z += x.z;
      sum.w += x.w;
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    T* out = reinterpret_cast<T*>(p.out) + row * HEAD_DIM + tid * 4;
    out[0] = from_float<T>(sum.x * inv);
    out[1] = from_float<T>(sum.y * inv);
    out[2] = from_float<T>(sum.z * inv);
    out[3] = from_float<T>(sum.w * inv);
  }
}

// ------------------------------------------------------------------------------ host side

// The split count for `programs` = batch * num_kv_heads CTAs of work over max_seq_len keys,
// from a wave model: `slots` = SMs x resident CTAs per SM run at once; a CTA streams its keys at
// min(its own in-flight bytes / latency, HBM bandwidth / CTAs running) after a fixed start-up
// cost; several splits cost a reduce pass. Splits cover whole tiles, at least two each. The
// fastest modelled plan wins (the fewest splits among equals): on an H200 a sweep of forced
// split counts (scripts/gpu/sweep_decode_splits.py) found it within noise of the fastest
// measured count at batch 1-16, where preferring more CTAs in one wave (the earlier rule) took
// 43-64 splits at batch 1 and lost 1-2 us to the extra CTAs and the longer reduce.
inline SplitPlan plan_splits(int64_t programs, int64_t max_seq_len, int tile, int sms, int slots,
                             double bytes_per_key, double cta_inflight_bytes,
                             double partial_bytes_per_split) {
  constexpr double kHbmBytesPerUsPerSm = 4.0e6 / 132;  // ~4.0 TB/s on an H200's 132 SMs
  constexpr double kLatencyUs = 1.5;                    // loaded DRAM latency
  constexpr double kCtaFixedUs = 2.0;                   // prologue latency + epilogue
  constexpr double kReduceUs = 2.5;                     // the reduce kernel's own latency
  const int64_t num_tiles = std::max<int64_t>(1, (max_seq_len + tile - 1) / tile);
  const int64_t max_splits = std::max<int64_t>(1, std::min<int64_t>(num_tiles / 2, MAX_SPLITS));
  programs = std::max<int64_t>(1, programs);
  sms = std::max(1, sms);
  slots = std::max(sms, slots);
  const double hbm = kHbmBytesPerUsPerSm * sms;
  const double cta_bw = cta_inflight_bytes / kLatencyUs;
  auto model_us = [&](int64_t s, int64_t per_split) {
    const int64_t ctas = programs * s;
    const double bytes = static_cast<double>(per_split) * tile * bytes_per_key;
    const int64_t waves = ctas / slots, rest = ctas % slots;
    double us = waves * (kCtaFixedUs + bytes / std::min(cta_bw, hbm / slots));
    if (rest > 0) us += kCtaFixedUs + bytes / std::min(cta_bw, hbm / rest);
    if (s > 1) us += kReduceUs + 2.0 * ctas * partial_bytes_per_split / hbm;
    return us;
  };
  SplitPlan best{1, static_cast<int>(num_tiles * tile)};
  double best_us = model_us(1, num_tiles);
  for (int64_t s = 2; s <= max_splits; ++s) {
    const int64_t per_split = (num_tiles + s - 1) / s;  // tiles
    if ((num_tiles + per_split - 1) / per_split != s) continue;  // same plan as a smaller s
    const double us = model_us(s, per_split);
    if (us < best_us) {
      best_us = us;
      best = SplitPlan{static_cast<int>(s), static_cast<int>(per_split * tile)};
    }
  }
  return best;
}

inline int device_sm_count(int device) {
  static int cache[64] = {0};
  if (device >= 0 && device < 64 && cache[device] > 0) return cache[device];
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      sms <= 0) {
    (void)cudaGetLastError();
    sms = 132;
  }
  if (device >= 0 && device < 64) cache[device] = sms;
  return sms;
}

// Resident decode CTAs per SM for this instantiation (cached per device).
template <typename T, int HEAD_DIM, int GROUP>
int resident_ctas(int device) {
  using C = Config<T, HEAD_DIM, GROUP>;
  static int cache[64] = {0};
  if (device >= 0 && device < 64 && cache[device] > 0) return cache[device];
  int blocks = 0;
  // Shared memory over L1: the K/V stream bypasses L1 (cp.async.cg), the ring needs the space.
  (void)cudaFuncSetAttribute(decode_kernel<T, HEAD_DIM, GROUP>,
                             cudaFuncAttributePreferredSharedMemoryCarveout,
                             cudaSharedmemCarveoutMaxShared);
  (void)cudaGetLastError();
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, decode_kernel<T, HEAD_DIM, GROUP>,
                                                    NUM_THREADS, C::SMEM_BYTES) != cudaSuccess ||
      blocks <= 0) {
    (void)cudaGetLastError();
    blocks = 2;
  }
  if (device >= 0 && device < 64) cache[device] = blocks;
  return blocks;
}

template <typename T, int HEAD_DIM, int GROUP>
SplitPlan plan(int batch, int num_kv_heads, int64_t max_seq_len, int device) {
  using C = Config<T, HEAD_DIM, GROUP>;
  const int sms = device_sm_count(device);
  const int slots = sms * resident_ctas<T, HEAD_DIM, GROUP>(device);
  return plan_splits(static_cast<int64_t>(batch) * num_kv_heads, max_seq_len, C::TILE, sms, slots,
                     C::BYTES_PER_KEY, (C::STAGES - 1.0) * C::TILE * C::BYTES_PER_KEY,
                     GROUP * (HEAD_DIM * 4.0 + 8.0));
}

// A caller's split count (benchmarks) instead of plan_splits' choice: clamped to 1..min(tiles,
// MAX_SPLITS), whole tiles a split, and counted as plan_splits counts (ceil(tiles / tiles a
// split), so e.g. 6 requested over 10 tiles gives 5 splits of 2 tiles).
inline SplitPlan fixed_splits(int64_t max_seq_len, int tile, int64_t requested) {
  const int64_t num_tiles = std::max<int64_t>(1, (max_seq_len + tile - 1) / tile);
  const int64_t most = std::min<int64_t>(num_tiles, MAX_SPLITS);
  const int64_t splits = std::min(std::max<int64_t>(requested, 1), most);
  const int64_t per_split = (num_tiles + splits - 1) / splits;  // tiles
  return SplitPlan{static_cast<int>((num_tiles + per_split - 1) / per_split),
                   static_cast<int>(per_split * tile)};
}

template <typename T, int HEAD_DIM, int GROUP>
SplitPlan plan_with_splits(int64_t max_seq_len, int64_t num_splits) {
  return fixed_splits(max_seq_len, Config<T, HEAD_DIM, GROUP>::TILE, num_splits);
}

// One kernel on `stream`, a programmatic dependent of the kernel before it when `dependent`
// (grid_dependency.h; the kernels here wait for it at their top).
template <typename Kernel>
cudaError_t launch_kernel(Kernel kernel, dim3 grid, int smem, cudaStream_t stream, bool dependent,
                          const Params& p) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(NUM_THREADS, 1, 1);
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = stream;
  cudaLaunchAttribute attributes[1] = {pagedserve_pdl::dependent_launch_attribute()};
  config.attrs = attributes;
  config.numAttrs = dependent ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, p);
}

// Launch the decode kernel (and the reduce when p.num_splits > 1) on `stream`; p carries the
// plan (keys_per_split, num_splits) and, for several splits, the partial buffers. dependent:
// both launched as programmatic dependents (PDL).
template <typename T, int HEAD_DIM, int GROUP>
cudaError_t launch(const Params& plan_params, int num_kv_heads, cudaStream_t stream,
                   bool dependent) {
  using C = Config<T, HEAD_DIM, GROUP>;
  Params p = plan_params;
  p.split_tile = C::TILE;
  if (p.batch == 0) return cudaSuccess;
  const dim3 grid(num_kv_heads, p.batch, p.num_splits);
  cudaError_t err =
      launch_kernel(decode_kernel<T, HEAD_DIM, GROUP>, grid, C::SMEM_BYTES, stream, dependent, p);
  if (err != cudaSuccess || p.num_splits == 1) return err;
  const unsigned rows = static_cast<unsigned>(static_cast<int64_t>(p.batch) * p.num_heads);
  return launch_kernel(reduce_kernel<T, HEAD_DIM>, dim3(rows), 0, stream, dependent, p);
}

}  // namespace pagedserve_decode
