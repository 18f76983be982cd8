// Paged-attention decode (one query token per request), GQA, flash-decoding: the torch binding.
// The kernels, their math and the launch plan are in paged_attention_decode.cuh; in short:
//
//   q [batch, num_heads, head_dim]; k_cache, v_cache [num_blocks, block_size, num_kv_heads,
//   head_dim]; token t of request b in block block_tables[b, t / block_size] at offset
//   t % block_size; G = num_heads / num_kv_heads query heads share kv head h / G:
//       out[b, h] = sum_j softmax_j(scale * <q[b, h], K[b, j, h / G]>) V[b, j, h / G]
//
//   Grid (num_kv_heads, batch, num_splits) of 128-thread CTAs, each owning the G heads of one kv
//   head over one split of the context (num_splits from max_seq_len, the SM count and the
//   kernel's occupancy). A lane group (head_dim * sizeof(T) / 16 lanes: half a warp for bf16
//   head_dim 128) owns a key row, one 16-byte vector a lane; the 8 groups of a CTA take 4 keys
//   each per stage (32 keys). Each thread cp.asyncs its vectors of the K and V rows of its keys
//   into a private 3-stage ring in shared memory (two stages in flight while one is computed)
//   and keeps q (scaled by scale * log2 e) and the fp32 output accumulators of its dims for the
//   G heads in registers. Per stage: partial dot products, a reduce-scatter over the lane group
//   (each lane ends with one (head, key) score), an online softmax (base 2) on that score,
//   then acc[g] = acc[g] * 2^(m - m') + sum_keys p * V with p broadcast by shuffles. The lane
//   groups and warps merge (max / rescale / sum) at the end; one split writes out = acc / l,
//   several write partial acc, max and sum that a second small kernel merges.
//
// Supported: bf16, fp16, fp32; head_dim 64 and 128; G in {1, 2, 4, 8}; any block size (t /
// block_size by a multiply); caches with any strides whose head_dim is contiguous and whose rows
// are 16-byte aligned.
// No host sync and no data-dependent allocation, so the launch can be captured in a CUDA graph
// (the split count and scratch size depend only on shapes, max_seq_len and num_splits).
//
// Build layout: this unit is host C++ only (the one unit that reads torch's headers); the
// kernels are instantiated by paged_attention_decode_<dtype>_hd<head_dim>.cu through the entry
// points declared in paged_attention_decode.h, so that the units compile in parallel.

// torch's headers: only what the binding uses (not <torch/extension.h>, whose whole C++ frontend
// doubles this unit's compile time, the critical path of the parallel build).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/utils/pybind.h>

#include "paged_attention_decode.h"

namespace {

namespace pd = pagedserve_decode;

// One instantiation of the kernels, as a value the dispatch hands to its callback.
template <typename T, int HEAD_DIM, int GROUP>
struct Instance {
  using type = T;
  static constexpr int head_dim = HEAD_DIM;
  static constexpr int group = GROUP;
};

// f(Instance<T, HEAD_DIM, group>{}) for the instantiated GQA group `group`.
template <typename T, int HEAD_DIM, typename F>
void dispatch_group(int64_t group, F&& f) {
  switch (group) {
#define PAGEDSERVE_DECODE_CASE(T_, HEAD_DIM_, GROUP_) \
  case GROUP_: return f(Instance<T_, HEAD_DIM_, GROUP_>{});
    PAGEDSERVE_DECODE_FOR_EACH_GROUP(PAGEDSERVE_DECODE_CASE, T, HEAD_DIM)
#undef PAGEDSERVE_DECODE_CASE
    default: TORCH_CHECK(false, "unsupported GQA group size ", group);
  }
}

template <typename T, typename F>
void dispatch_head_dim(int64_t head_dim, int64_t group, F&& f) {
  switch (head_dim) {
    case 64: return dispatch_group<T, 64>(group, f);
    case 128: return dispatch_group<T, 128>(group, f);
    default: TORCH_CHECK(false, "unsupported head_dim ", head_dim);
  }
}

// f(Instance<T, head_dim, group>{}) for the element type T of `dtype`; the instantiations are
// those of the paged_attention_decode_<dtype>_hd<head_dim>.cu units.
template <typename F>
void dispatch(at::ScalarType dtype, int64_t head_dim, int64_t group, F&& f) {
  switch (dtype) {
    case at::kBFloat16: return dispatch_head_dim<__nv_bfloat16>(head_dim, group, f);
    case at::kHalf: return dispatch_head_dim<__half>(head_dim, group, f);
    case at::kFloat: return dispatch_head_dim<float>(head_dim, group, f);
    default: TORCH_CHECK(false, "unsupported dtype ", dtype);
  }
}

// The heuristic's plan, or the caller's split count when num_splits > 0.
template <typename T, int HEAD_DIM, int GROUP>
pd::SplitPlan choose_plan(int batch, int num_kv_heads, int64_t max_seq_len, int64_t num_splits,
                          int device) {
  if (num_splits > 0) return pd::plan_with_splits<T, HEAD_DIM, GROUP>(max_seq_len, num_splits);
  return pd::plan<T, HEAD_DIM, GROUP>(batch, num_kv_heads, max_seq_len, device);
}

template <typename T, int HEAD_DIM, int GROUP>
void run(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
         int64_t max_seq_len, int64_t num_splits, bool dependent_launch) {
  const int batch = static_cast<int>(q.size(0));
  const int num_heads = static_cast<int>(q.size(1));
  const int num_kv_heads = static_cast<int>(k_cache.size(2));
  const int block_size = static_cast<int>(k_cache.size(1));
  const int device = q.get_device();
  const pd::SplitPlan plan =
      choose_plan<T, HEAD_DIM, GROUP>(batch, num_kv_heads, max_seq_len, num_splits, device);

  pd::Params p{};
  p.q = q.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.block_tables = block_tables.data_ptr<int>();
  p.seq_lens = seq_lens.data_ptr<int>();
  p.out = out.data_ptr();
  p.qk_scale = static_cast<float>(scale * 1.4426950408889634);
  p.batch = batch;
  p.num_heads = num_heads;
  p.block_size = block_size;
  pd::block_divider(block_size, p.block_magic, p.block_shift);
  p.keys_per_split = plan.keys_per_split;
  p.num_splits = plan.num_splits;
  p.q_stride_b = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.stride_block = static_cast<int>(k_cache.stride(0));
  p.stride_tok = static_cast<int>(k_cache.stride(1));
  p.stride_head = static_cast<int>(k_cache.stride(2));
  p.bt_stride = block_tables.stride(0);

  at::Tensor part_out, part_ml;
  if (plan.num_splits > 1) {  // scratch from torch's caching allocator (graph-safe)
    auto opts = q.options().dtype(at::kFloat);
    part_out = at::empty({batch, num_heads, plan.num_splits, HEAD_DIM}, opts);
    part_ml = at::empty({2, batch, num_heads, plan.num_splits}, opts);
    p.part_out = part_out.data_ptr<float>();
    p.part_m = part_ml[0].data_ptr<float>();
    p.part_l = part_ml[1].data_ptr<float>();
  }
  const cudaError_t err = pd::launch<T, HEAD_DIM, GROUP>(
      p, num_kv_heads, c10::cuda::getCurrentCUDAStream(device).stream(), dependent_launch);
  TORCH_CHECK(err == cudaSuccess, "paged_attention_decode launch failed: ",
              cudaGetErrorString(err));
}

bool aligned16(const at::Tensor& cache) {
  const int64_t elt = cache.element_size();
  if (reinterpret_cast<uintptr_t>(cache.data_ptr()) % 16 != 0) return false;
  for (int d = 0; d < 3; ++d)
    if ((cache.stride(d) * elt) % 16 != 0) return false;
  return true;
}

}  // namespace

// num_splits > 0 replaces the planned split count (clamped to 1..min(key tiles, 128); for
// benchmarks); 0 keeps the plan. dependent_launch: the kernels start as programmatic dependents
// of the kernel before them (PDL; sm_90+, grid_dependency.h).
void paged_attention_decode(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor block_tables, at::Tensor seq_lens, double scale,
                            int64_t max_seq_len, int64_t num_splits, bool dependent_launch) {
  TORCH_CHECK(q.is_cuda() && k_cache.is_cuda() && v_cache.is_cuda() && out.is_cuda() &&
                  block_tables.is_cuda() && seq_lens.is_cuda(),
              "CUDA tensors expected");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "q [B, H, D], caches [N, bs, KVH, D]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k and v caches must have the same shape");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "q and the caches must share head_dim");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() &&
                  k_cache.scalar_type() == v_cache.scalar_type() &&
                  out.scalar_type() == q.scalar_type(),
              "q, the caches and out must share a dtype");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous(), "out must be contiguous like q");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1, "head_dim must be contiguous");
  TORCH_CHECK(k_cache.strides() == v_cache.strides(), "k and v caches must share strides");
  TORCH_CHECK(k_cache.size(1) > 0, "block_size must be positive");
  for (int d = 0; d < 3; ++d)
    TORCH_CHECK(k_cache.stride(d) >= 0 && k_cache.stride(d) < (int64_t{1} << 31),
                "cache strides must fit in int32");
  TORCH_CHECK(aligned16(k_cache) && aligned16(v_cache),
              "cache rows must be 16-byte aligned (base pointer and strides)");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1 &&
                  block_tables.size(0) >= q.size(0),
              "block_tables must be [>= batch, max_blocks] with contiguous rows");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == q.size(0) && seq_lens.is_contiguous(),
              "seq_lens must be [batch], contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(q.size(0) <= 65535 && k_cache.size(2) <= 65535, "batch / kv heads too large");
  if (q.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  dispatch(q.scalar_type(), q.size(2), q.size(1) / k_cache.size(2), [&](auto instance) {
    using I = decltype(instance);
    run<typename I::type, I::head_dim, I::group>(out, q, k_cache, v_cache, block_tables,
                                                 seq_lens, scale, max_seq_len, num_splits,
                                                 dependent_launch);
  });
}

// The split count paged_attention_decode plans (num_splits 0) for these shapes on the current
// CUDA device.
int64_t planned_num_splits(int64_t batch, int64_t num_kv_heads, int64_t max_seq_len,
                           int64_t head_dim, int64_t group, at::ScalarType dtype) {
  TORCH_CHECK(batch >= 0 && batch <= 65535 && num_kv_heads > 0 && num_kv_heads <= 65535,
              "batch must be in 0..65535 and num_kv_heads in 1..65535");
  const int device = c10::cuda::current_device();
  int64_t num_splits = 0;
  dispatch(dtype, head_dim, group, [&](auto instance) {
    using I = decltype(instance);
    num_splits = pd::plan<typename I::type, I::head_dim, I::group>(
                     static_cast<int>(batch), static_cast<int>(num_kv_heads), max_seq_len, device)
                     .num_splits;
  });
  return num_splits;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_decode", &paged_attention_decode,
        "paged attention for decode steps (one query per request); num_splits > 0 overrides the "
        "planned split count",
        pybind11::arg("out"), pybind11::arg("q"), pybind11::arg("k_cache"),
        pybind11::arg("v_cache"), pybind11::arg("block_tables"), pybind11::arg("seq_lens"),
        pybind11::arg("scale"), pybind11::arg("max_seq_len"), pybind11::arg("num_splits") = 0,
        pybind11::arg("dependent_launch") = false);
  m.def("planned_num_splits", &planned_num_splits,
        "the split count paged_attention_decode plans for these shapes on the current device",
        pybind11::arg("batch"), pybind11::arg("num_kv_heads"), pybind11::arg("max_seq_len"),
        pybind11::arg("head_dim"), pybind11::arg("group"), pybind11::arg("dtype"));
}
