// Paged-attention decode kernels for bf16, head_dim 64, every GQA group: one of the units that
// instantiate the entry points of paged_attention_decode.h (one per dtype and head_dim, compiled in
// parallel; the binding is paged_attention_decode.cpp).

#include "paged_attention_decode.cuh"

PAGEDSERVE_DECODE_INSTANTIATE(__nv_bfloat16, 64)
