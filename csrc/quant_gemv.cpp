// Weight-only quantized GEMV for skinny batches (decode): the torch binding. The kernel, its math
// and its work split are in quant_gemv.cuh; the launch geometry (warps, splits, k_per_split,
// unroll) is chosen by the Python launcher (pagedserve/kernels/cuda_quant.py, which also checks
// every operand before calling here); this unit checks again what the kernel relies on.
//
// Build layout: this unit is host C++ only (the one unit that reads torch's headers); the
// kernels are instantiated by quant_gemv_<scheme>_<dtype>.cu through the entry point declared in
// quant_gemv.h, so that the units compile in parallel.

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>

#include "quant_gemv.h"

namespace {

namespace pq = pagedserve_quant;

pq::Scheme scheme_of(const std::string& name) {
  if (name == "int4") return pq::Scheme::kInt4;
  if (name == "int8") return pq::Scheme::kInt8;
  TORCH_CHECK(name == "fp8", "unknown scheme ", name, " (int4, int8 or fp8)");
  return pq::Scheme::kFp8;
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

void check_weight(pq::Scheme scheme, const at::Tensor& w, const at::Tensor& scales,
                  const std::optional<at::Tensor>& zeros, int64_t n, int64_t k,
                  int64_t group_size, at::ScalarType dtype) {
  const bool int4 = scheme == pq::Scheme::kInt4;
  const at::ScalarType code_type =
      int4 ? at::kInt : (scheme == pq::Scheme::kInt8 ? at::kByte : at::kFloat8_e4m3fn);
  TORCH_CHECK(w.scalar_type() == code_type && w.dim() == 2 && w.size(0) == n &&
                  w.size(1) == (int4 ? k / 8 : k) && w.stride(1) == 1,
              "w must be ", code_type, " [N, ", int4 ? "K / 8" : "K", "] with contiguous rows");
  TORCH_CHECK(aligned16(w.data_ptr()) && (w.stride(0) * w.element_size()) % 16 == 0,
              "weight rows must be 16-byte aligned");
  if (scheme == pq::Scheme::kFp8) {
    TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 1 && scales.size(0) == n &&
                    scales.is_contiguous(),
                "fp8 scales must be float32 [N], contiguous");
    return;
  }
  TORCH_CHECK(zeros.has_value(), "the integer schemes need zeros");
  TORCH_CHECK(group_size > 0 && group_size % pq::kStepK == 0 && k % group_size == 0,
              "the group size must be a multiple of ", pq::kStepK, " dividing K");
  TORCH_CHECK(scales.scalar_type() == dtype && zeros->scalar_type() == dtype &&
                  scales.dim() == 2 && scales.size(0) == n && scales.size(1) == k / group_size &&
                  zeros->sizes() == scales.sizes() && zeros->strides() == scales.strides(),
              "scales and zeros must be x's dtype, [N, K / group], with the same strides");
}

template <typename T>
cudaError_t dispatch_scheme(pq::Scheme scheme, const pq::Params& p, cudaStream_t stream) {
  switch (scheme) {
    case pq::Scheme::kInt4: return pq::launch<pq::Scheme::kInt4, T>(p, stream);
    case pq::Scheme::kInt8: return pq::launch<pq::Scheme::kInt8, T>(p, stream);
    case pq::Scheme::kFp8: return pq::launch<pq::Scheme::kFp8, T>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

// out [M, N] = x [M, K] (perm applied) @ W^T (+ bias) for the weight of `scheme` (int4: codes
// int32 [N, K / 8], int8: uint8 [N, K], fp8: float8_e4m3fn [N, K] with float32 scales [N]).
void quant_gemv(at::Tensor out, at::Tensor x, at::Tensor w, at::Tensor scales,
                std::optional<at::Tensor> zeros, std::optional<at::Tensor> perm,
                std::optional<at::Tensor> bias, const std::string& scheme_name,
                int64_t group_size, int64_t warps, int64_t splits, int64_t k_per_split,
                int64_t unroll, bool dependent_launch) {
  const pq::Scheme scheme = scheme_of(scheme_name);
  TORCH_CHECK(x.is_cuda() && w.device() == x.device() && scales.device() == x.device() &&
                  out.device() == x.device(),
              "CUDA tensors on one device expected");
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "x must be bf16 or fp16");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= pq::kMaxRows && x.stride(1) == 1,
              "x must be [M <= ", pq::kMaxRows, ", K] with contiguous rows");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(k % pq::kStepK == 0 && k < pq::kMaxK && n < (int64_t{1} << 30),
              "K must be a multiple of ", pq::kStepK, " below ", pq::kMaxK);
  TORCH_CHECK(perm.has_value() || (aligned16(x.data_ptr()) && x.stride(0) % 8 == 0),
              "x rows must be 16-byte aligned");
  check_weight(scheme, w, scales, zeros, n, k, group_size, dtype);
  TORCH_CHECK(!perm.has_value() || (perm->scalar_type() == at::kLong && perm->dim() == 1 &&
                                    perm->size(0) == k && perm->is_contiguous()),
              "perm must be int64 [K], contiguous");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == dtype && bias->dim() == 1 &&
                                    bias->size(0) == n && bias->is_contiguous()),
              "bias must be [N] of x's dtype, contiguous");
  TORCH_CHECK(out.scalar_type() == dtype && out.dim() == 2 && out.size(0) == m &&
                  out.size(1) == n && out.is_contiguous(),
              "out must be [M, N] of x's dtype, contiguous");
  TORCH_CHECK(warps >= 1 && warps <= pq::kMaxWarps && splits >= 1 && splits <= pq::kMaxSplits &&
                  (unroll == 2 || unroll == 4),
              "warps 1..", pq::kMaxWarps, ", splits 1..", pq::kMaxSplits, ", unroll 2 or 4");
  TORCH_CHECK(k_per_split > 0 && k_per_split % pq::kStepK == 0 && splits * k_per_split >= k &&
                  (splits - 1) * k_per_split < k,
              "the splits must tile K in multiples of ", pq::kStepK);

  pq::Params p{};
  p.x = x.data_ptr();
  p.w = w.data_ptr();
  p.scales = scales.data_ptr();
  p.zeros = zeros.has_value() ? zeros->data_ptr() : nullptr;
  p.perm = perm.has_value() ? perm->data_ptr<int64_t>() : nullptr;
  p.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  p.out = out.data_ptr();
  p.m = static_cast<int>(m);
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  p.group_size = static_cast<int>(scheme == pq::Scheme::kFp8 ? k : group_size);
  p.group_magic = pq::group_magic(p.group_size / pq::kStepK);
  p.x_stride = x.stride(0);
  p.w_stride_bytes = w.stride(0) * w.element_size();
  p.s_stride_n = scales.stride(0);
  p.s_stride_g = scales.dim() == 2 ? scales.stride(1) : 0;
  p.warps = static_cast<int>(warps);
  p.splits = static_cast<int>(splits);
  p.k_per_split = static_cast<int>(k_per_split);
  p.unroll = static_cast<int>(unroll);
  p.dependent_launch = dependent_launch;

  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.get_device()).stream();
  const cudaError_t err = dtype == at::kHalf ? dispatch_scheme<__half>(scheme, p, stream)
                                             : dispatch_scheme<__nv_bfloat16>(scheme, p, stream);
  TORCH_CHECK(err == cudaSuccess, "quant_gemv launch failed: ", cudaGetErrorString(err));
}

// The dynamic shared memory a launch of this geometry takes (bytes).
int64_t shared_bytes(const std::string& scheme, int64_t m, int64_t k_per_split, int64_t warps,
                     int64_t splits) {
  return pq::shared_bytes(scheme_of(scheme), static_cast<int>(m), static_cast<int>(k_per_split),
                          static_cast<int>(warps), static_cast<int>(splits));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_gemv", &quant_gemv,
        "out = x[:, perm] @ W^T (+ bias) for an int4 / int8 / fp8 weight, M <= 16 rows",
        pybind11::arg("out"), pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("scales"),
        pybind11::arg("zeros"), pybind11::arg("perm"), pybind11::arg("bias"),
        pybind11::arg("scheme"), pybind11::arg("group_size"), pybind11::arg("warps"),
        pybind11::arg("splits"), pybind11::arg("k_per_split"), pybind11::arg("unroll"),
        pybind11::arg("dependent_launch") = false);
  m.def("shared_bytes", &shared_bytes, "dynamic shared memory of a launch (bytes)",
        pybind11::arg("scheme"), pybind11::arg("m"), pybind11::arg("k_per_split"),
        pybind11::arg("warps"), pybind11::arg("splits"));
}
