// Weight-only quantized GEMV for skinny batches (decode): what the torch binding
// (quant_gemv.cpp) sees of the kernels (quant_gemv.cuh). Plain C++ that host compilers and nvcc
// both read: the parameter block, the launch geometry and the entry point `launch`, declared
// here, defined in the .cuh and explicitly instantiated by one translation unit per (scheme,
// activation dtype), quant_gemv_<scheme>_<dtype>.cu, so that they compile in parallel and none
// of them reads torch's headers.
//
//   y[m, n] = sum_k x[m, perm[k]] W[n, k] (+ bias[n]),  0 <= m < M <= 16
//   int4 / int8:  W[n, k] = (q[n, k] - z[n, k / G]) s[n, k / G]   (layouts: kernels.quant_ref)
//   fp8 (E4M3):   W[n, k] = q[n, k] s[n]                          (s float32, per channel)

#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace pagedserve_quant {

enum class Scheme : int { kInt4 = 0, kInt8 = 1, kFp8 = 2 };

constexpr int kMaxRows = 16;    // M: two 8-column MMA tiles of the batch
constexpr int kStepK = 128;     // codes of a row a warp's quad consumes per step (32 a thread)
constexpr int kTileN = 16;      // weight rows a warp owns (the MMA's 16 rows)
constexpr int kMaxSplits = 8;   // CTAs along K: one thread-block cluster (portable size)
constexpr int kMaxWarps = 8;    // warps a CTA (256 threads)
constexpr int kXRowPad = 64;    // bytes after each staged x row: conflict-free 16-byte reads
constexpr int64_t kMaxK = int64_t{kStepK} << 15;  // group_magic's range

// What the kernels read (by value, in the kernel parameter space). Strides in elements unless
// named _bytes.
struct Params {
  const void* x;          // [M, K] activations (bf16 / fp16), rows 16-byte aligned
  const void* w;          // int4: int32 words [N, K / 8]; int8 / fp8: bytes [N, K]
  const void* scales;     // int: [N, K / G] of x's dtype; fp8: float32 [N]
  const void* zeros;      // int: like scales (same strides); fp8: unused
  const int64_t* perm;    // [K] act-order permutation of x's columns, or nullptr
  const void* bias;       // [N] of x's dtype, or nullptr
  void* out;              // [M, N] of x's dtype, contiguous
  int m;
  int n;
  int k;
  int group_size;         // int schemes: a multiple of kStepK dividing K
  unsigned group_magic;   // group_magic(group_size / kStepK): a step's group by multiply-high
  int64_t x_stride;       // x row stride
  int64_t w_stride_bytes; // weight row stride
  int64_t s_stride_n;     // scales / zeros strides (row, group)
  int64_t s_stride_g;
  int warps;              // warps a CTA, 1..kMaxWarps: CTA x covers warps * kTileN rows
  int splits;             // CTAs along K (grid y, one cluster), 1..kMaxSplits
  int k_per_split;        // a multiple of kStepK; splits * k_per_split >= K
  int unroll;             // steps of weights a thread's ring holds: 2 or 4
  bool dependent_launch;  // launched as a programmatic dependent (PDL, sm_90: grid_dependency.h)
};

// ceil(2^31 / d) for the d = group_size / kStepK steps of a group: for every step index t and
// d below 2^15, t / d == umulhi(2 t, group_magic(d)) (the rounding up adds t e / (d 2^31) with
// e < d to t / d: less than 1 / d, so the floor is the same). Hence K < kMaxK.
inline unsigned group_magic(int steps_per_group) {
  return static_cast<unsigned>(((uint64_t{1} << 31) + steps_per_group - 1) / steps_per_group);
}

// Dynamic shared memory of one CTA: the staged x rows, the per-step sums of x (int schemes) and,
// with splits > 1, the CTA's partial outputs that the cluster's first CTA reduces.
inline int64_t shared_bytes(Scheme scheme, int m, int k_per_split, int warps, int splits) {
  const int64_t x_rows = int64_t{m} * (int64_t{k_per_split} * 2 + kXRowPad);
  const int64_t sums = scheme == Scheme::kFp8 ? 0 : int64_t{k_per_split / kStepK} * kMaxRows * 4;
  const int tiles_m = m > 8 ? 2 : 1;
  const int64_t partials = splits > 1 ? int64_t{warps} * kTileN * 8 * tiles_m * 4 : 0;
  return x_rows + sums + partials;
}

// Launch the GEMV for activations of type T (__half or __nv_bfloat16) on `stream`: grid
// (ceil(ceil(N / 16) / warps), splits), clusters of (1, splits, 1).
template <Scheme S, typename T>
cudaError_t launch(const Params& p, cudaStream_t stream);

}  // namespace pagedserve_quant

// Explicit instantiation of the entry point for one (scheme, T); needs the .cuh.
#define PAGEDSERVE_QUANT_INSTANTIATE(SCHEME, T)                                          \
  template cudaError_t pagedserve_quant::launch<pagedserve_quant::Scheme::SCHEME, T>( \
      const pagedserve_quant::Params&, cudaStream_t);
