// Paged-attention decode (one query token per request), GQA, split-K over the context.
//
// Layout (as pagedserve.kernels.attention): q [batch, num_heads, head_dim];
// k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]; token t of request b
// lives in block block_tables[b, t / block_size] at offset t % block_size.
// With G = num_heads / num_kv_heads, query head h reads kv head h / G over keys 0..L_b-1:
//     s_j = scale * <q[b, h], K[b, j, h / G]>,   out[b, h] = sum_j softmax(s)_j V[b, j, h / G]
//
// Grid (num_kv_heads, batch, num_partitions); one CTA of NUM_THREADS threads owns the G query
// heads of one kv head for one partition of PARTITION keys, so each K/V row is read from HBM
// once for all G heads. Phase 1: each warp takes keys round-robin; a lane holds HEAD_DIM/32
// elements of the row (vectorised loads) and warp shuffles reduce the G dot products. Phase 2:
// per-head max and sum over the partition's scores (in shared memory). Phase 3: thread d sums
// p_j * V[j, d] for every head of the group. With more than one partition each CTA writes an
// unnormalised partial output plus its max and sum, and `reduce_partitions` merges them.

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/extension.h>

#include <cfloat>

namespace {

constexpr int WARP = 32;
constexpr int NUM_THREADS = 128;
constexpr int NUM_WARPS = NUM_THREADS / WARP;
constexpr int PARTITION = 512;
constexpr int MAX_GROUP = 8;

template <typename T> __device__ inline float to_float(T x);
template <> __device__ inline float to_float(float x) { return x; }
template <> __device__ inline float to_float(__half x) { return __half2float(x); }
template <> __device__ inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ inline T from_float(float x);
template <> __device__ inline float from_float(float x) { return x; }
template <> __device__ inline __half from_float(float x) { return __float2half(x); }
template <> __device__ inline __nv_bfloat16 from_float(float x) { return __float2bfloat16(x); }

__device__ inline float warp_sum(float x) {
#pragma unroll
  for (int offset = WARP / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffff, x, offset);
  return x;
}

template <typename T, int HEAD_DIM, int GROUP>
__global__ void decode_kernel(
    const T* __restrict__ q, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
    const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
    T* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_max,
    float* __restrict__ part_sum, float scale, int block_size, int max_blocks,
    int64_t q_stride_b, int64_t q_stride_h, int64_t cache_stride_block, int64_t cache_stride_tok,
    int64_t cache_stride_head, int num_partitions) {
  constexpr int PER_LANE = HEAD_DIM / WARP;
  const int kv_head = blockIdx.x, b = blockIdx.y, part = blockIdx.z;
  const int num_kv_heads = gridDim.x;
  const int seq_len = seq_lens[b];
  const int start = part * PARTITION;
  if (start >= seq_len) return;
  const int end = min(start + PARTITION, seq_len);
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;

  __shared__ float scores[GROUP][PARTITION];
  __shared__ float red[GROUP][NUM_WARPS];
  __shared__ float head_max[GROUP], head_sum[GROUP];

  float qr[GROUP][PER_LANE];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    const T* qh = q + b * q_stride_b + (kv_head * GROUP + g) * q_stride_h;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) qr[g][i] = to_float(qh[lane * PER_LANE + i]) * scale;
  }
  const int* table = block_tables + (int64_t)b * max_blocks;

  // Phase 1: scores.
  for (int j = start + warp; j < end; j += NUM_WARPS) {
    const int64_t row = (int64_t)table[j / block_size] * cache_stride_block +
                        (j % block_size) * cache_stride_tok + kv_head * cache_stride_head;
    const T* kr = k_cache + row + lane * PER_LANE;
    float kv[PER_LANE];
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) kv[i] = to_float(kr[i]);
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      float dot = 0.f;
#pragma unroll
      for (int i = 0; i < PER_LANE; ++i) dot += qr[g][i] * kv[i];
      dot = warp_sum(dot);
      if (lane == 0) scores[g][j - start] = dot;
    }
  }
  __syncthreads();

  // Phase 2: per-head max and sum of exp over this partition.
  const int n = end - start;
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    float m = -FLT_MAX;
    for (int j = threadIdx.x; j < n; j += NUM_THREADS) m = fmaxf(m, scores[g][j]);
#pragma unroll
    for (int offset = WARP / 2; offset > 0; offset /= 2)
      m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, offset));
    if (lane == 0) red[g][warp] = m;
  }
  __syncthreads();
  if (threadIdx.x < GROUP) {
    float m = -FLT_MAX;
    for (int w = 0; w < NUM_WARPS; ++w) m = fmaxf(m, red[threadIdx.x][w]);
    head_max[threadIdx.x] = m;
  }
  __syncthreads();
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    float s = 0.f;
    for (int j = threadIdx.x; j < n; j += NUM_THREADS) {
      const float p = __expf(scores[g][j] - head_max[g]);
      scores[g][j] = p;
      s += p;
    }
    s = warp_sum(s);
    if (lane == 0) red[g][warp] = s;
  }
  __syncthreads();
  if (threadIdx.x < GROUP) {
    float s = 0.f;
    for (int w = 0; w < NUM_WARPS; ++w) s += red[threadIdx.x][w];
    head_sum[threadIdx.x] = s;
  }
  __syncthreads();

  // Phase 3: out[g, d] = sum_j p[g, j] V[j, d]; thread d (and d + NUM_THREADS, ...) of the row.
  for (int d = threadIdx.x; d < HEAD_DIM; d += NUM_THREADS) {
    float acc[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) acc[g] = 0.f;
    for (int j = start; j < end; ++j) {
      const int64_t row = (int64_t)table[j / block_size] * cache_stride_block +
                          (j % block_size) * cache_stride_tok + kv_head * cache_stride_head;
      const float v = to_float(v_cache[row + d]);
#pragma unroll
      for (int g = 0; g < GROUP; ++g) acc[g] += scores[g][j - start] * v;
    }
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      const int h = kv_head * GROUP + g;
      if (num_partitions == 1) {
        out[(int64_t)b * num_kv_heads * GROUP * HEAD_DIM + h * HEAD_DIM + d] =
            from_float<T>(acc[g] / head_sum[g]);
      } else {
        const int64_t idx = ((int64_t)b * num_kv_heads * GROUP + h) * num_partitions + part;
        part_out[idx * HEAD_DIM + d] = acc[g];
        if (d == 0) {
          part_max[idx] = head_max[g];
          part_sum[idx] = head_sum[g];
        }
      }
    }
  }
}

// Merge partitions: out = sum_p e^{m_p - M} o_p / sum_p e^{m_p - M} s_p, one CTA per (b, h).
template <typename T, int HEAD_DIM>
__global__ void reduce_partitions(T* __restrict__ out, const float* __restrict__ part_out,
                                  const float* __restrict__ part_max,
                                  const float* __restrict__ part_sum,
                                  const int* __restrict__ seq_lens, int num_heads,
                                  int num_partitions) {
  const int h = blockIdx.x, b = blockIdx.y;
  const int used = (seq_lens[b] + PARTITION - 1) / PARTITION;
  const int64_t base = ((int64_t)b * num_heads + h) * num_partitions;
  float m = -FLT_MAX;
  for (int p = 0; p < used; ++p) m = fmaxf(m, part_max[base + p]);
  float denom = 0.f;
  for (int p = 0; p < used; ++p) denom += __expf(part_max[base + p] - m) * part_sum[base + p];
  for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
    float acc = 0.f;
    for (int p = 0; p < used; ++p)
      acc += __expf(part_max[base + p] - m) * part_out[(base + p) * HEAD_DIM + d];
    out[((int64_t)b * num_heads + h) * HEAD_DIM + d] = from_float<T>(acc / denom);
  }
}

template <typename T, int HEAD_DIM, int GROUP>
void launch(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
            const torch::Tensor& v_cache, const torch::Tensor& block_tables,
            const torch::Tensor& seq_lens, double scale, int64_t max_seq_len) {
  const int batch = q.size(0), num_heads = q.size(1);
  const int num_kv_heads = k_cache.size(2), block_size = k_cache.size(1);
  const int num_partitions = std::max<int64_t>(1, (max_seq_len + PARTITION - 1) / PARTITION);
  auto stream = at::cuda::getCurrentCUDAStream();
  auto opts = q.options().dtype(torch::kFloat32);
  torch::Tensor part_out, part_max, part_sum;
  if (num_partitions > 1) {
    part_out = torch::empty({batch, num_heads, num_partitions, HEAD_DIM}, opts);
    part_max = torch::empty({batch, num_heads, num_partitions}, opts);
    part_sum = torch::empty({batch, num_heads, num_partitions}, opts);
  }
  dim3 grid(num_kv_heads, batch, num_partitions);
  decode_kernel<T, HEAD_DIM, GROUP><<<grid, NUM_THREADS, 0, stream>>>(
      reinterpret_cast<const T*>(q.data_ptr()), reinterpret_cast<const T*>(k_cache.data_ptr()),
      reinterpret_cast<const T*>(v_cache.data_ptr()), block_tables.data_ptr<int>(),
      seq_lens.data_ptr<int>(), reinterpret_cast<T*>(out.data_ptr()),
      num_partitions > 1 ? part_out.data_ptr<float>() : nullptr,
      num_partitions > 1 ? part_max.data_ptr<float>() : nullptr,
      num_partitions > 1 ? part_sum.data_ptr<float>() : nullptr, static_cast<float>(scale),
      block_size, block_tables.size(1), q.stride(0), q.stride(1), k_cache.stride(0),
      k_cache.stride(1), k_cache.stride(2), num_partitions);
  if (num_partitions > 1) {
    reduce_partitions<T, HEAD_DIM><<<dim3(num_heads, batch), NUM_THREADS, 0, stream>>>(
        reinterpret_cast<T*>(out.data_ptr()), part_out.data_ptr<float>(),
        part_max.data_ptr<float>(), part_sum.data_ptr<float>(), seq_lens.data_ptr<int>(),
        num_heads, num_partitions);
  }
}

template <typename T, int HEAD_DIM>
void dispatch_group(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k,
                    const torch::Tensor& v, const torch::Tensor& bt, const torch::Tensor& sl,
                    double scale, int64_t max_seq_len) {
  const int group = q.size(1) / k.size(2);
  switch (group) {
    case 1: return launch<T, HEAD_DIM, 1>(out, q, k, v, bt, sl, scale, max_seq_len);
    case 2: return launch<T, HEAD_DIM, 2>(out, q, k, v, bt, sl, scale, max_seq_len);
    case 4: return launch<T, HEAD_DIM, 4>(out, q, k, v, bt, sl, scale, max_seq_len);
    case 8: return launch<T, HEAD_DIM, 8>(out, q, k, v, bt, sl, scale, max_seq_len);
    default: TORCH_CHECK(false, "unsupported GQA group size ", group);
  }
}

template <typename T>
void dispatch_head_dim(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k,
                       const torch::Tensor& v, const torch::Tensor& bt, const torch::Tensor& sl,
                       double scale, int64_t max_seq_len) {
  switch (q.size(2)) {
    case 64: return dispatch_group<T, 64>(out, q, k, v, bt, sl, scale, max_seq_len);
    case 128: return dispatch_group<T, 128>(out, q, k, v, bt, sl, scale, max_seq_len);
    default: TORCH_CHECK(false, "unsupported head_dim ", q.size(2));
  }
}

}  // namespace

void paged_attention_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor block_tables,
                            torch::Tensor seq_lens, double scale, int64_t max_seq_len) {
  TORCH_CHECK(q.is_cuda() && k_cache.is_cuda() && v_cache.is_cuda(), "CUDA tensors expected");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q [B, H, D], cache [N, bs, KVH, D]");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1 && out.is_contiguous(), "inner stride");
  TORCH_CHECK(k_cache.strides() == v_cache.strides(), "k and v caches must share strides");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(1) / k_cache.size(2) <= MAX_GROUP,
              "num_heads must be a multiple (<= 8x) of num_kv_heads");
  const at::cuda::OptionalCUDAGuard guard(q.device());
  switch (q.scalar_type()) {
    case torch::kBFloat16:
      return dispatch_head_dim<__nv_bfloat16>(out, q, k_cache, v_cache, block_tables, seq_lens,
                                              scale, max_seq_len);
    case torch::kFloat32:
      return dispatch_head_dim<float>(out, q, k_cache, v_cache, block_tables, seq_lens, scale,
                                      max_seq_len);
    default: TORCH_CHECK(false, "unsupported dtype");
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_decode", &paged_attention_decode,
        "paged attention for decode steps (one query per request)");
}
