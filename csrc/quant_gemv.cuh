// Weight-only quantized GEMV for skinny batches (M <= 16 rows: decode) on tensor cores, sm_90.
//
// Math (layouts: pagedserve/kernels/quant_ref.py; entry point and parameters: quant_gemv.h):
//   int4 / int8  y[m, n] = sum_steps s[n, g] (P[m, n] - z[n, g] X[m]) (+ b[n]),
//                P[m, n] = sum_{k in step} x[m, k] q[n, k],  X[m] = sum_{k in step} x[m, k],
//                a step = 128 consecutive k of one group g (the group size is a multiple of 128)
//   fp8          y[m, n] = s[n] sum_k x[m, k] q[n, k] (+ b[n])
// where x[m, k] is the activation after the act-order permutation (x[m, perm[k]]), q the exact
// code (an integer, or the E4M3 value), all sums in fp32 and one rounding to x's dtype at the end
// (int4 sums P over q + code_offset and subtracts (z + code_offset) X: the same y).
//
// Tensor cores, "swap AB": mma.m16n8k16 with A = 16 weight rows x 16 k (the dequantized codes:
// exact small integers or E4M3 values, in x's dtype) and B = 16 k x 8 batch rows (x), fp32
// accumulators: output rows n are the MMA's rows, batch rows m its columns (M > 8: two MMAs).
//
// Work: CTA (bx, by) = `warps` warps, warp w owns weight rows [16 (bx warps + w), +16) over the
// K range [by k_per_split, +k_per_split) (a split); the `splits` CTAs of a row block form one
// thread-block cluster and the first of them adds the others' partial outputs from their shared
// memory (distributed shared memory: a fixed order, deterministic; no workspace, no atomics).
// Lane (g, c) = (lane / 4, lane % 4) streams rows g and g + 8 of its warp's tile: per step of 128
// codes a row, its 32 codes [32 c, 32 c + 32), one 16-byte vector (int4) or two (int8 / fp8),
// loaded with ld.global.nc.L1::no_allocate; a ring of `unroll` steps a thread, each slot
// refilled right after its step's MMAs (so unroll - 1 steps of loads are in flight while a step
// computes, and no code is copied).
//
// Dequantization without conversions (the MMA's k order is free: any permutation of k applied to
// both A and B gives the same sum, so x is staged in the order the codes come out):
//   int4  ((word >> 4i) & 0x000F000F) | MAGIC = (MAGIC + q_i, MAGIC + q_{i+4}) in fp16 (1024 +
//         q, 0x6400) or bf16 (128 + q, 0x4300), both exact, one lop3 a pair; MAGIC's value
//         (code_offset) stays in: the step subtracts it with the zero point, (z + offset) X
//   int8  fp16: prmt of the code bytes under 0x64 = 1024 + q, minus 1024; bf16: prmt into fp32
//         2^23 + q, minus 2^23, two codes packed by cvt.rn.bf16x2.f32: pairs (q0, q2), (q1, q3)
//   fp8   fp16: cvt.rn.f16x2.e4m3x2: pairs (q0, q1), (q2, q3); bf16: the sign and the 7 bits of
//         exponent and mantissa moved into bf16 place (value 2^-120 q, subnormals included),
//         times 2^120 (hmul2, exact): pairs (q0, q2), (q1, q3)
// Every code is exact in x's dtype, so each product is exact in the MMA and the scales / zeros
// enter once per step in fp32 (the zero through X, the step's sum of x), as in the formula above.
//
// x staging: each CTA copies its K range of the M rows of x (gathered through perm when given)
// into shared memory once, each 8-column group permuted to the pair order of the scheme's
// codes and placed so that the quad's four lanes read adjacent 16-byte slots (slot 4 w + c for
// group w of lane c: conflict-free, with rows 64 bytes apart mod 128), plus X per (step, row).
// The first `unroll` steps of weight loads are issued before the staging, so that its latency
// hides behind theirs. Launched as a programmatic dependent (PDL, p.dependent_launch), the
// kernel issues those weight loads, then waits for the kernel before it (grid_dependency.h)
// before it stages x: its weights stream while that kernel drains.

#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "grid_dependency.h"
#include "quant_gemv.h"

namespace pagedserve_quant {

namespace cg = cooperative_groups;

constexpr int kThreads = 256;     // launch bound: kMaxWarps warps
constexpr int kStageUnroll = 4;   // x vectors a thread loads at once while staging
static_assert(kMaxWarps * 32 == kThreads, "the launch bound is kMaxWarps warps");

// The order of x's 8-column groups in shared memory: pair i (32 bits) of a staged group holds
// the two x values that the codes' pair i multiplies.
enum class XOrder { kIdentity, kStride2, kStride4 };

template <Scheme S, typename T>
__host__ __device__ constexpr XOrder x_order() {
  if constexpr (S == Scheme::kInt4) return XOrder::kStride4;  // (x0, x4) (x1, x5) ...
  if constexpr (S == Scheme::kFp8 && std::is_same_v<T, __half>) return XOrder::kIdentity;
  return XOrder::kStride2;  // (x0, x2) (x1, x3) (x4, x6) (x5, x7)
}

// ------------------------------------------------------------------ bits and small operations

template <typename V>
__device__ __forceinline__ uint32_t bits_of(V v) {
  static_assert(sizeof(V) == 4, "a 32-bit pair");
  uint32_t u;
  memcpy(&u, &v, 4);
  return u;
}

template <typename V>
__device__ __forceinline__ V from_bits(uint32_t u) {
  V v;
  memcpy(&v, &u, 4);
  return v;
}

template <typename T>
using Pair = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;

template <typename T>
__device__ __forceinline__ uint32_t sub2(uint32_t a, uint32_t b) {
  return bits_of(__hsub2(from_bits<Pair<T>>(a), from_bits<Pair<T>>(b)));
}

template <typename T>
__device__ __forceinline__ float to_float(uint32_t raw16) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(raw16)));
  } else {
    return __uint_as_float(raw16 << 16);
  }
}

template <typename T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(v);
  } else {
    return __float2bfloat16_rn(v);
  }
}

// 16 bytes of weights, streamed: not kept in L1, the L2 fetching 256-byte lines.
__device__ __forceinline__ uint4 load_stream(const unsigned char* ptr) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(ptr));
  return v;
}

// d += A B: A 16 x 16 (registers a0..a3: rows g / g + 8, k pairs 2c / 2c + 8), B 16 x 8
// (b0, b1: k pairs 2c / 2c + 8, column g), d 16 x 8 (rows g / g + 8, columns 2c, 2c + 1).
template <typename T>
__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                    uint32_t a3, uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// ------------------------------------------------------------------ dequantization

// (a & mask) | bits in one instruction
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t mask, uint32_t bits) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(mask), "r"(bits));
  return d;
}

// What the int4 codes' values carry on top of the code (the MAGIC of the dequantization, left
// in: the steps subtract it with the zero point, kOffset X), 0 for the other schemes.
template <Scheme S, typename T>
__host__ __device__ constexpr float code_offset() {
  if constexpr (S != Scheme::kInt4) return 0.0f;
  return std::is_same_v<T, __half> ? 1024.0f : 128.0f;
}

// The codes of one 8-column group of a row (int4: one word; int8 / fp8: two) -> 4 pairs of
// exact values of type T (int4: code_offset + q), in the pair order x_order<S, T>() stages x in.
template <Scheme S, typename T>
__device__ __forceinline__ void dequant8(const uint32_t* words, uint32_t (&a)[4]) {
  if constexpr (S == Scheme::kInt4) {
    constexpr uint32_t kMagic = std::is_same_v<T, __half> ? 0x64006400u : 0x43004300u;
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = and_or(words[0] >> (4 * i), 0x000F000Fu, kMagic);
  } else if constexpr (S == Scheme::kInt8 && std::is_same_v<T, __half>) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      a[2 * j] = sub2<T>(__byte_perm(words[j], 0x64646464u, 0x4240), 0x64006400u);
      a[2 * j + 1] = sub2<T>(__byte_perm(words[j], 0x64646464u, 0x4341), 0x64006400u);
    }
  } else if constexpr (S == Scheme::kInt8) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float f[4];
#pragma unroll
      for (int b = 0; b < 4; ++b)
        f[b] = __uint_as_float(__byte_perm(words[j], 0x4B000000u, 0x7650 + b)) - 8388608.0f;
      a[2 * j] = bits_of(__floats2bfloat162_rn(f[0], f[2]));
      a[2 * j + 1] = bits_of(__floats2bfloat162_rn(f[1], f[3]));
    }
  } else if constexpr (std::is_same_v<T, __half>) {  // fp8 -> fp16
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const auto lo = static_cast<__nv_fp8x2_storage_t>(words[j] & 0xFFFFu);
      const auto hi = static_cast<__nv_fp8x2_storage_t>(words[j] >> 16);
      a[2 * j] = bits_of(__half2(__nv_cvt_fp8x2_to_halfraw2(lo, __NV_E4M3)));
      a[2 * j + 1] = bits_of(__half2(__nv_cvt_fp8x2_to_halfraw2(hi, __NV_E4M3)));
    }
  } else {  // fp8 -> bf16: bytes 1, 3 in place, then bytes 0, 2; times 2^120 (bf16 0x7B80)
    const __nv_bfloat162 k2e120 = from_bits<__nv_bfloat162>(0x7B807B80u);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const uint32_t u = words[j], v = words[j] << 8;
      const uint32_t odd = (u & 0x80008000u) | ((u & 0x7F007F00u) >> 4);
      const uint32_t even = (v & 0x80008000u) | ((v & 0x7F007F00u) >> 4);
      a[2 * j] = bits_of(__hmul2(from_bits<__nv_bfloat162>(even), k2e120));
      a[2 * j + 1] = bits_of(__hmul2(from_bits<__nv_bfloat162>(odd), k2e120));
    }
  }
}

// ------------------------------------------------------------------ staging x

template <XOrder O>
__device__ __forceinline__ uint4 arrange(uint4 v) {
  if constexpr (O == XOrder::kStride4) {
    return make_uint4(__byte_perm(v.x, v.z, 0x5410), __byte_perm(v.x, v.z, 0x7632),
                      __byte_perm(v.y, v.w, 0x5410), __byte_perm(v.y, v.w, 0x7632));
  } else if constexpr (O == XOrder::kStride2) {
    return make_uint4(__byte_perm(v.x, v.y, 0x5410), __byte_perm(v.x, v.y, 0x7632),
                      __byte_perm(v.z, v.w, 0x5410), __byte_perm(v.z, v.w, 0x7632));
  } else {
    return v;
  }
}

template <typename T>
__device__ __forceinline__ float sum8(uint4 v) {
  const uint32_t pairs[4] = {v.x, v.y, v.z, v.w};
  float total = 0.0f;
#pragma unroll
  for (const uint32_t pair : pairs) {
    const float2 f = std::is_same_v<T, __half> ? __half22float2(from_bits<__half2>(pair))
                                               : __bfloat1622float2(from_bits<__nv_bfloat162>(pair));
    total += f.x + f.y;
  }
  return total;
}

// x[m, k .. k + 8) after the permutation: one 16-byte load, or 8 gathers through perm.
__device__ __forceinline__ uint4 load_x8(const Params& p, int m, int k) {
  const auto* row = static_cast<const unsigned short*>(p.x) + m * p.x_stride;
  if (p.perm == nullptr) return __ldg(reinterpret_cast<const uint4*>(row + k));
  uint32_t h[8];
#pragma unroll
  for (int t = 0; t < 8; ++t) h[t] = __ldg(row + __ldg(p.perm + k + t));
  return make_uint4(h[0] | h[1] << 16, h[2] | h[3] << 16, h[4] | h[5] << 16, h[6] | h[7] << 16);
}

// Shared memory: x rows [m][row_bytes) (step s at 256 s, 8-column group w of lane c at slot
// 4 w + c of 16 bytes), then, when SUMS, X[step][kMaxRows] (float).
template <Scheme S, typename T>
__device__ void stage_x(const Params& p, unsigned char* xs, float* sums, int k0, int steps,
                        int row_bytes) {
  constexpr bool kSums = S != Scheme::kFp8;
  const int groups = steps * (kStepK / 8);  // 8-column groups of a row, a multiple of 16
  const int items = p.m * groups;
  for (int base = 0; base < items; base += kStageUnroll * blockDim.x) {
    uint4 v[kStageUnroll];
#pragma unroll
    for (int u = 0; u < kStageUnroll; ++u) {
      const int i = base + u * blockDim.x + threadIdx.x;
      v[u] = i < items ? load_x8(p, i / groups, k0 + 8 * (i % groups)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kStageUnroll; ++u) {
      const int i = base + u * blockDim.x + threadIdx.x;  // 16 lanes: one (row, step)
      const int m = i / groups, j = i % groups, step = j / 16, q = j % 16;
      if (i < items) {
        const int slot = 4 * (q % 4) + q / 4;
        *reinterpret_cast<uint4*>(xs + m * row_bytes + step * 256 + slot * 16) =
            arrange<x_order<S, T>()>(v[u]);
      }
      if constexpr (kSums) {
        float sum = sum8<T>(v[u]);
#pragma unroll
        for (int offset = 8; offset > 0; offset /= 2) sum += __shfl_xor_sync(~0u, sum, offset);
        if (q == 0 && i < items) sums[step * kMaxRows + m] = sum;
      }
    }
  }
}

// ------------------------------------------------------------------ the kernel

template <Scheme S>
struct Stage {
  static constexpr int kVectors = S == Scheme::kInt4 ? 1 : 2;  // 16-byte vectors a row a step
  uint4 g[kVectors];  // row g's 32 codes of the step
  uint4 h[kVectors];  // row g + 8's
  uint32_t scale_g, zero_g, scale_h, zero_h;  // int schemes: raw 16-bit scale / zero
};

// The 32-bit words of 8-column group w of a stage's row (int4: 1 word; int8 / fp8: 2).
template <Scheme S>
__device__ __forceinline__ void group_words(const uint4 (&v)[Stage<S>::kVectors], int w,
                                            uint32_t (&out)[2]) {
  if constexpr (S == Scheme::kInt4) {
    const uint32_t words[4] = {v[0].x, v[0].y, v[0].z, v[0].w};
    out[0] = words[w];
    out[1] = 0;
  } else {
    const uint32_t words[8] = {v[0].x, v[0].y, v[0].z, v[0].w, v[1].x, v[1].y, v[1].z, v[1].w};
    out[0] = words[2 * w];
    out[1] = words[2 * w + 1];
  }
}

// Row g's (and g + 8's) clamped index of the warp owning rows [n0, n0 + kTileN): the rows past N
// read the last row.
__device__ __forceinline__ int lane_row(const Params& p, int n0, int half) {
  return min(n0 + (threadIdx.x % 32) / 4 + 8 * half, p.n - 1);
}

// Where lane (g, c) reads, computed once before the steps (pointers, not offsets: a step adds
// only its own byte and group offsets to them).
struct Rows {
  const unsigned char* w_g;      // row g's weights at the split's first step, lane c's vector
  const unsigned char* w_h;
  const unsigned char* scale_g;  // row g's scale of group 0 (int schemes)
  const unsigned char* scale_h;
  int64_t zeros_from_scales;     // bytes from a scale to its zero point (same strides)
  int step0;                     // the split's first step (k0 / kStepK)
};

// The value, opaque to the compiler: computed here once and kept in registers (ptxas otherwise
// recomputes the row clamps and addresses below at every step, ~35 instructions of ~160).
template <typename P>
__device__ __forceinline__ P* kept(P* ptr) {
  asm volatile("" : "+l"(ptr));
  return ptr;
}

template <Scheme S>
__device__ __forceinline__ Rows lane_rows(const Params& p, int n0, int k0) {
  constexpr int kLaneBytes = (S == Scheme::kInt4 ? kStepK / 2 : kStepK) / 4;  // a row and step
  const int c = threadIdx.x % 4, row_g = lane_row(p, n0, 0), row_h = lane_row(p, n0, 1);
  const int64_t k0_bytes = S == Scheme::kInt4 ? k0 / 2 : k0;
  const auto* base = static_cast<const unsigned char*>(p.w) + k0_bytes + c * kLaneBytes;
  Rows rows{kept(base + row_g * p.w_stride_bytes), kept(base + row_h * p.w_stride_bytes),
            nullptr, nullptr, 0, k0 / kStepK};
  if constexpr (S != Scheme::kFp8) {  // fp8's per-channel scales are read once, after the steps
    const auto* scales = static_cast<const unsigned char*>(p.scales);
    rows.scale_g = kept(scales + row_g * p.s_stride_n * 2);
    rows.scale_h = kept(scales + row_h * p.s_stride_n * 2);
    rows.zeros_from_scales =
        reinterpret_cast<intptr_t>(p.zeros) - reinterpret_cast<intptr_t>(p.scales);
  }
  return rows;
}

// A 16-bit scale or zero point at a byte address.
__device__ __forceinline__ uint32_t load_half_bits(const unsigned char* at) {
  return __ldg(reinterpret_cast<const unsigned short*>(at));
}

template <Scheme S, typename T>
__device__ __forceinline__ void load_stage(const Params& p, const Rows& r, int s, Stage<S>& st) {
  constexpr int kStepBytes = S == Scheme::kInt4 ? kStepK / 2 : kStepK;
#pragma unroll
  for (int v = 0; v < Stage<S>::kVectors; ++v) {
    st.g[v] = load_stream(r.w_g + s * kStepBytes + 16 * v);
    st.h[v] = load_stream(r.w_h + s * kStepBytes + 16 * v);
  }
  if constexpr (S != Scheme::kFp8) {
    // the step's group: (step0 + s) / (group_size / kStepK) as one multiply-high (group_magic)
    const int group = __umulhi(2u * static_cast<unsigned>(r.step0 + s), p.group_magic);
    const int64_t offset = int64_t{group} * p.s_stride_g * 2;  // bytes
    const unsigned char* sg = r.scale_g + offset;
    const unsigned char* sh = r.scale_h + offset;
    st.scale_g = load_half_bits(sg);
    st.zero_g = load_half_bits(sg + r.zeros_from_scales);
    st.scale_h = load_half_bits(sh);
    st.zero_h = load_half_bits(sh + r.zeros_from_scales);
  }
}

// One step: 8 MMAs a batch tile over the lane's 32 codes of rows g and g + 8, then (int
// schemes) acc += s (P - z X).
template <Scheme S, typename T, int MT>
__device__ __forceinline__ void compute_step(const Params& p, const Stage<S>& st,
                                             const unsigned char* xs_step, int row_bytes,
                                             const float* sums_step, float (&acc)[MT][4]) {
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  float part[MT][4] = {};
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    uint32_t words_g[2], words_h[2], ag[4], ah[4];
    group_words<S>(st.g, w, words_g);
    group_words<S>(st.h, w, words_h);
    dequant8<S, T>(words_g, ag);
    dequant8<S, T>(words_h, ah);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int row = 8 * mt + g;
      uint4 b = make_uint4(0, 0, 0, 0);
      if (row < p.m)
        b = *reinterpret_cast<const uint4*>(xs_step + row * row_bytes + (4 * w + c) * 16);
      float(&d)[4] = S == Scheme::kFp8 ? acc[mt] : part[mt];  // fp8: no per-step scale
      mma<T>(d, ag[0], ah[0], ag[1], ah[1], b.x, b.y);
      mma<T>(d, ag[2], ah[2], ag[3], ah[3], b.z, b.w);
    }
  }
  if constexpr (S != Scheme::kFp8) {
    constexpr float kOffset = code_offset<S, T>();
    const float sg = to_float<T>(st.scale_g), zg = to_float<T>(st.zero_g) + kOffset;
    const float sh = to_float<T>(st.scale_h), zh = to_float<T>(st.zero_h) + kOffset;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const float2 x = *reinterpret_cast<const float2*>(sums_step + 8 * mt + 2 * c);
      acc[mt][0] = fmaf(sg, fmaf(-zg, x.x, part[mt][0]), acc[mt][0]);
      acc[mt][1] = fmaf(sg, fmaf(-zg, x.y, part[mt][1]), acc[mt][1]);
      acc[mt][2] = fmaf(sh, fmaf(-zh, x.x, part[mt][2]), acc[mt][2]);
      acc[mt][3] = fmaf(sh, fmaf(-zh, x.y, part[mt][3]), acc[mt][3]);
    }
  }
}

template <typename T>
__device__ __forceinline__ void store_out(const Params& p, int m, int n, float v) {
  if (m >= p.m || n >= p.n) return;
  if (p.bias != nullptr) v += to_float<T>(static_cast<const unsigned short*>(p.bias)[n]);
  static_cast<T*>(p.out)[int64_t{m} * p.n + n] = from_float<T>(v);
}

// The lane's outputs (rows g / g + 8 of the warp's tile, batch columns 8 mt + 2c (+1)): stored
// (one split), or reduced over the cluster's splits by its first CTA in split order.
template <typename T, int MT>
__device__ void epilogue(const Params& p, const float (&acc)[MT][4], float* partials) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, c = lane % 4;
  const int n_cta = blockIdx.x * p.warps * kTileN;
  constexpr int kCols = 8 * MT;
  if (gridDim.y == 1) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        store_out<T>(p, 8 * mt + 2 * c + i % 2, n_cta + warp * kTileN + g + 8 * (i / 2),
                     acc[mt][i]);
    return;
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i)
      partials[(warp * kTileN + g + 8 * (i / 2)) * kCols + 8 * mt + 2 * c + i % 2] = acc[mt][i];
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every split's partials written (release / acquire over the cluster)
  if (cluster.block_rank() == 0) {
    for (int idx = threadIdx.x; idx < p.warps * kTileN * kCols; idx += blockDim.x) {
      float total = 0.0f;
      for (int r = 0; r < p.splits; ++r) total += cluster.map_shared_rank(partials, r)[idx];
      store_out<T>(p, idx % kCols, n_cta + idx / kCols, total);
    }
  }
  cluster.sync();  // no CTA leaves while its shared memory is being read
}

template <Scheme S, typename T, int MT, int UNROLL>
__global__ void __launch_bounds__(kThreads, 2) quant_gemv_kernel(const Params p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x / 32;
  const int k0 = blockIdx.y * p.k_per_split;
  const int steps = max(0, min(p.k_per_split, p.k - k0)) / kStepK;
  const int row_bytes = p.k_per_split * 2 + kXRowPad;
  float* sums = reinterpret_cast<float*>(smem + int64_t{p.m} * row_bytes);
  float* partials = sums + (S == Scheme::kFp8 ? 0 : (p.k_per_split / kStepK) * kMaxRows);
  const int n0 = (blockIdx.x * p.warps + warp) * kTileN;
  const bool active = n0 < p.n;

  const Rows rows = lane_rows<S>(p, n0, k0);

  Stage<S> ring[UNROLL];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u)
    if (active && u < steps) load_stage<S, T>(p, rows, u, ring[u]);
  pagedserve_pdl::await_previous_grid();  // x, and the output's last readers, come before
  pagedserve_pdl::allow_dependent_grid();
  stage_x<S, T>(p, smem, sums, k0, steps, row_bytes);
  __syncthreads();

  float acc[MT][4] = {};
  if (active) {
    for (int s0 = 0; s0 < steps; s0 += UNROLL) {
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int s = s0 + u;
        if (s < steps) {  // the slot's codes used, then refilled (no copy of them)
          compute_step<S, T, MT>(p, ring[u], smem + s * 256, row_bytes, sums + s * kMaxRows, acc);
          if (s + UNROLL < steps) load_stage<S, T>(p, rows, s + UNROLL, ring[u]);
        }
      }
    }
  }
  if constexpr (S == Scheme::kFp8) {
    const auto* scale = static_cast<const float*>(p.scales);
    const float sg = __ldg(scale + lane_row(p, n0, 0)), sh = __ldg(scale + lane_row(p, n0, 1));
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      acc[mt][0] *= sg, acc[mt][1] *= sg, acc[mt][2] *= sh, acc[mt][3] *= sh;
    }
  }
  epilogue<T, MT>(p, acc, partials);
}

// ------------------------------------------------------------------ launch

template <Scheme S, typename T, int MT, int UNROLL>
cudaError_t launch_instance(const Params& p, cudaStream_t stream) {
  auto* kernel = quant_gemv_kernel<S, T, MT, UNROLL>;
  const int64_t smem = shared_bytes(S, p.m, p.k_per_split, p.warps, p.splits);
  static std::atomic<int64_t> allowed{48 * 1024};  // the dynamic shared memory granted so far
  if (smem > allowed.load()) {
    const cudaError_t err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    allowed.store(smem);
  }
  const int tiles = (p.n + kTileN - 1) / kTileN;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3((tiles + p.warps - 1) / p.warps, p.splits, 1);
  config.blockDim = dim3(p.warps * 32, 1, 1);
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = stream;
  cudaLaunchAttribute attributes[2];
  int count = 0;
  if (p.splits > 1) {
    attributes[count].id = cudaLaunchAttributeClusterDimension;
    attributes[count].val.clusterDim.x = 1;
    attributes[count].val.clusterDim.y = p.splits;
    attributes[count].val.clusterDim.z = 1;
    ++count;
  }
  if (p.dependent_launch) attributes[count++] = pagedserve_pdl::dependent_launch_attribute();
  config.attrs = attributes;
  config.numAttrs = count;
  return cudaLaunchKernelEx(&config, kernel, p);
}

template <Scheme S, typename T>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  const bool two_tiles = p.m > 8;
  if (p.unroll == 4) {
    return two_tiles ? launch_instance<S, T, 2, 4>(p, stream) : launch_instance<S, T, 1, 4>(p, stream);
  }
  return two_tiles ? launch_instance<S, T, 2, 2>(p, stream) : launch_instance<S, T, 1, 2>(p, stream);
}

}  // namespace pagedserve_quant
