// Paged-attention decode: what the torch binding (paged_attention_decode.cpp) sees of the kernels
// (paged_attention_decode.cuh). Plain C++ that host compilers and nvcc both read: the kernels'
// parameter block, the split plan, and the entry points plan / plan_with_splits / launch, which
// are declared here, defined in the .cuh and explicitly instantiated by one translation unit per
// (dtype, head_dim), paged_attention_decode_<dtype>_hd<head_dim>.cu, for every GQA group of
// PAGEDSERVE_DECODE_FOR_EACH_GROUP. So the instantiations compile in parallel, none of them reads
// torch's headers, and the binding compiles no device code.

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace pagedserve_decode {

// What the kernels read (by value, in the kernel parameter space).
struct Params {
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const int* block_tables;
  const int* seq_lens;
  void* out;       // [batch, num_heads, head_dim], contiguous
  float* part_out;  // [batch, num_heads, num_splits, head_dim] (num_splits > 1)
  float* part_m;    // [batch, num_heads, num_splits]
  float* part_l;    // [batch, num_heads, num_splits]
  float qk_scale;   // scale * log2(e)
  int batch;
  int num_heads;
  int block_size;
  // t / block_size = (umulhi(t, block_magic) + t) >> block_shift for 0 <= t < 2^31
  // (block_magic 1 and block_shift log2(block_size) for a power of two): see block_divider.
  uint32_t block_magic;
  int block_shift;
  int keys_per_split;
  int num_splits;
  int64_t q_stride_b;
  int64_t q_stride_h;
  int stride_block;  // cache strides in elements (k and v share them; < 2^31)
  int stride_tok;
  int stride_head;
  int64_t bt_stride;  // block_tables row stride
  int split_tile;     // keys a split's size is a multiple of (set by launch: the kernel's TILE)
};

// Division by block_size as a multiply (round-up method, exact for 0 <= t < 2^31):
// shift = ceil(log2(block_size)), magic = 2^32 (2^shift - block_size) / block_size + 1.
inline void block_divider(int block_size, uint32_t& magic, int& shift) {
  shift = 0;
  while ((int64_t{1} << shift) < block_size) ++shift;
  magic = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - block_size)) /
                                    static_cast<uint64_t>(block_size) +
                                1);
}

struct SplitPlan {
  int num_splits;
  int keys_per_split;
};

// The split plan of the heuristic (plan_splits in the .cuh) for this device.
template <typename T, int HEAD_DIM, int GROUP>
SplitPlan plan(int batch, int num_kv_heads, int64_t max_seq_len, int device);

// The plan for a split count the caller chose (benchmarks), clamped to what the kernels support.
template <typename T, int HEAD_DIM, int GROUP>
SplitPlan plan_with_splits(int64_t max_seq_len, int64_t num_splits);

// Launch the decode kernel (and the reduce when p.num_splits > 1) on `stream`; dependent: as
// programmatic dependents of the kernel before them (PDL, sm_90+: grid_dependency.h).
template <typename T, int HEAD_DIM, int GROUP>
cudaError_t launch(const Params& p, int num_kv_heads, cudaStream_t stream, bool dependent);

}  // namespace pagedserve_decode

// X(T, HEAD_DIM, GROUP) for every GQA group the kernels are instantiated for (the binding's
// dispatch and the instantiation units both expand this list).
#define PAGEDSERVE_DECODE_FOR_EACH_GROUP(X, T, HEAD_DIM) \
  X(T, HEAD_DIM, 1)                                      \
  X(T, HEAD_DIM, 2)                                      \
  X(T, HEAD_DIM, 4)                                      \
  X(T, HEAD_DIM, 8)

// Explicit instantiation of the entry points for one (T, HEAD_DIM, GROUP); needs the .cuh.
#define PAGEDSERVE_DECODE_INSTANTIATE_ONE(T, HEAD_DIM, GROUP)                                 \
  template pagedserve_decode::SplitPlan pagedserve_decode::plan<T, HEAD_DIM, GROUP>(         \
      int, int, int64_t, int);                                                                \
  template pagedserve_decode::SplitPlan pagedserve_decode::plan_with_splits<T, HEAD_DIM, GROUP>( \
      int64_t, int64_t);                                                                      \
  template cudaError_t pagedserve_decode::launch<T, HEAD_DIM, GROUP>(                        \
      const pagedserve_decode::Params&, int, cudaStream_t, bool);

// Every GQA group of one (T, HEAD_DIM): the body of an instantiation unit.
#define PAGEDSERVE_DECODE_INSTANTIATE(T, HEAD_DIM) \
  PAGEDSERVE_DECODE_FOR_EACH_GROUP(PAGEDSERVE_DECODE_INSTANTIATE_ONE, T, HEAD_DIM)
