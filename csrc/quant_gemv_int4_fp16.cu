// Weight-only quantized GEMV, int4 weights and fp16 activations: one of the units that instantiate
// the entry point of quant_gemv.h (one per scheme and dtype, compiled in parallel; the binding is
// quant_gemv.cpp).

#include "quant_gemv.cuh"

PAGEDSERVE_QUANT_INSTANTIATE(kInt4, __half)
