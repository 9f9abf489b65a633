// Split-slot decode attention (flash-decoding) over a KV buffer: the slots of each row (one kv
// head of one sequence) are split across blocks, each block reads its split's K and V rows once
// for every query head of the row's group (GQA) and leaves per head a partial output, max and
// sum of exponentials; a second short pass merges the splits, writes the attention output and
// each slot's probabilities normalised with the merged max and sum (per head, summed over the
// group, added to the policy's score). The contract: FeSplitDecode in flexevict_kernels.h; the
// specification: `split_decode_attention` in flexevict/core/kernels/reference.py.
#include <math.h>

#include "common.cuh"

namespace {

using fe::kFull;
using fe::kWarp;

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / kWarp;
constexpr int kVec = 8;            // head-dim elements per lane: one 16-byte load in fp16/bf16
constexpr int kMaxGroup = FE_SPLIT_DECODE_MAX_GROUP;
constexpr int64_t kTargetBlocks = 2048;     // pass-1 blocks the split count aims at
constexpr int64_t kMinChunk = 64, kMaxChunk = 1024;

static_assert(FE_SPLIT_DECODE_DIM_MULTIPLE == kVec, "one lane loads kVec elements");
static_assert(FE_SPLIT_DECODE_MAX_DIM <= kWarp * kVec, "a key fits one warp");

__device__ __forceinline__ int64_t lower(int64_t a, int64_t b) { return a < b ? a : b; }

// kVec consecutive elements at x (16-byte aligned) as fp32.
__device__ __forceinline__ void load_vec(const float* x, float (&out)[kVec]) {
  const float4 a = reinterpret_cast<const float4*>(x)[0];
  const float4 b = reinterpret_cast<const float4*>(x)[1];
  out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
  out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}

template <typename T>
__device__ __forceinline__ void load_vec(const T* x, float (&out)[kVec]) {
  static_assert(sizeof(T) * kVec == sizeof(uint4), "16-bit types: one 16-byte word");
  const uint4 word = *reinterpret_cast<const uint4*>(x);
  T h[kVec];
  memcpy(h, &word, sizeof(word));       // not a cast of &word: no type punning (aliasing)
#pragma unroll
  for (int c = 0; c < kVec; ++c) out[c] = fe::to_f(h[c]);
}

// The slots [first, end) of split `split`: every split but the last holds `chunk` slots.
struct Span {
  int64_t first, end;
};

__device__ __forceinline__ Span split_span(const FeSplitDecode& p, int64_t chunk, int64_t split) {
  const int64_t first = lower(split * chunk, p.n);
  return {first, lower(first + chunk, p.n)};
}

// ------------------------------------------------------------------------------ pass 1

// Block (row r, split s). A key (or value) row is read by a group of L lanes, kVec elements
// each (L * kVec >= dim); a warp reads 32 / L rows at once, the block kSlots, each lane group
// kUnroll of them before using any (fewer for large groups: registers). G >= group: the query heads held in registers.
// (a) logits of the split's valid slots (q . k in fp32, times scale, rounded to T as the
//     reference's matmul in T rounds them; -inf at masked slots) into p.logits, and each
//     head's max over the split;
// (b) exponentials exp(logit - max), their sum, and the output sum_i exp(.) v_i per head (V of
//     masked slots is never read); lane groups meet in registers (shuffles), warps in shared
//     memory; part[r][s][j] = (output[0..dim), max, sum).
template <typename T, int L, int G>
__global__ void __launch_bounds__(kThreads) split_partial_kernel(FeSplitDecode p, int64_t chunk) {
  extern __shared__ float part_out[];     // (kWarps, G, L * kVec): each warp's output
  __shared__ float max_of_warp[kWarps][G];
  __shared__ float sum_of_warp[kWarps][G];
  constexpr int kRowsPerWarp = kWarp / L;
  constexpr int kSlots = kWarps * kRowsPerWarp;         // rows the block reads at once
  constexpr int kWidth = L * kVec;                      // padded head dim in shared memory
  constexpr int kUnroll = G >= 4 ? 2 : 4;               // rows a lane group loads before using
  const int64_t split = blockIdx.x % p.splits, r = blockIdx.x / p.splits;
  const int64_t g = p.group, n = p.n, d = p.dim;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int sub = lane % L;                             // this lane's part of a row
  const int at = warp * kRowsPerWarp + lane / L;        // this lane group's row of kSlots
  const int64_t e0 = (int64_t)sub * kVec;
  const bool has_dims = e0 < d;                         // dim % kVec == 0
  const Span span = split_span(p, chunk, split);
  const T* k = static_cast<const T*>(p.k) + r * p.k_row + e0;
  const T* v = static_cast<const T*>(p.v) + r * p.v_row + e0;
  const uint8_t* valid = p.valid + r;
  float* logits = p.logits + r * g * n;

  float qr[G][kVec];
  const T* q = static_cast<const T*>(p.q) + r * p.q_row + e0;
#pragma unroll
  for (int j = 0; j < G; ++j)
#pragma unroll
    for (int c = 0; c < kVec; ++c) qr[j][c] = j < g && has_dims ? fe::to_f(q[j * p.q_head + c]) : 0.f;

  // (a) logits and each head's max
  float mx[G];
#pragma unroll
  for (int j = 0; j < G; ++j) mx[j] = -INFINITY;
  for (int64_t i0 = span.first; i0 < span.end; i0 += kSlots * kUnroll) {   // block-uniform
    float kx[kUnroll][kVec];
    bool live[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = i0 + u * kSlots + at;
      live[u] = i < span.end && valid[i * p.valid_slot];
      if (live[u] && has_dims) {
        load_vec(k + i * p.k_slot, kx[u]);
      } else {
#pragma unroll
        for (int c = 0; c < kVec; ++c) kx[u][c] = 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = i0 + u * kSlots + at;
      float dot[G];
#pragma unroll
      for (int j = 0; j < G; ++j) {
        float acc = 0.f;
#pragma unroll
        for (int c = 0; c < kVec; ++c) acc = fmaf(qr[j][c], kx[u][c], acc);
        dot[j] = acc;
      }
#pragma unroll
      for (int o = L / 2; o > 0; o >>= 1)                // within the lane group
#pragma unroll
        for (int j = 0; j < G; ++j) dot[j] += __shfl_xor_sync(kFull, dot[j], o);
#pragma unroll
      for (int j = 0; j < G; ++j) {
        if (j >= g) break;
        const float logit = live[u] ? fe::round_to<T>(dot[j] * p.scale) : -INFINITY;
        mx[j] = fmaxf(mx[j], logit);
        if (sub == 0 && i < span.end) logits[j * n + i] = logit;
      }
    }
  }
#pragma unroll
  for (int j = 0; j < G; ++j) {
    const float m = fe::warp_max(mx[j]);
    if (lane == 0) max_of_warp[warp][j] = m;
  }
  __syncthreads();            // the maxima, and the logits of every lane group, are visible
  float m[G];
#pragma unroll
  for (int j = 0; j < G; ++j) {
    m[j] = max_of_warp[0][j];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) m[j] = fmaxf(m[j], max_of_warp[w][j]);
  }

  // (b) exponentials, their sums and the unnormalised output
  float acc[G][kVec], sum[G];
#pragma unroll
  for (int j = 0; j < G; ++j) {
    sum[j] = 0.f;
#pragma unroll
    for (int c = 0; c < kVec; ++c) acc[j][c] = 0.f;
  }
  for (int64_t i0 = span.first; i0 < span.end; i0 += kSlots * kUnroll) {
    float vx[kUnroll][kVec], pr[kUnroll][G];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = i0 + u * kSlots + at;
      const bool live = i < span.end && valid[i * p.valid_slot];
#pragma unroll
      for (int j = 0; j < G; ++j)          // a live slot's logit is finite and <= m[j]
        pr[u][j] = live && j < g ? expf(logits[j * n + i] - m[j]) : 0.f;
      if (live && has_dims) {
        load_vec(v + i * p.v_slot, vx[u]);
      } else {
#pragma unroll
        for (int c = 0; c < kVec; ++c) vx[u][c] = 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int j = 0; j < G; ++j) {
        sum[j] += pr[u][j];
#pragma unroll
        for (int c = 0; c < kVec; ++c) acc[j][c] = fmaf(pr[u][j], vx[u][c], acc[j][c]);
      }
  }
  // lane groups of a warp: lanes holding the same dims (and the same sums) meet
#pragma unroll
  for (int o = kWarp / 2; o >= L; o >>= 1)
#pragma unroll
    for (int j = 0; j < G; ++j) {
      sum[j] += __shfl_xor_sync(kFull, sum[j], o);
#pragma unroll
      for (int c = 0; c < kVec; ++c) acc[j][c] += __shfl_xor_sync(kFull, acc[j][c], o);
    }
  if (lane < L) {                          // the warp's first lane group: its total
#pragma unroll
    for (int j = 0; j < G; ++j) {
#pragma unroll
      for (int c = 0; c < kVec; ++c) part_out[(warp * G + j) * kWidth + e0 + c] = acc[j][c];
      if (lane == 0) sum_of_warp[warp][j] = sum[j];
    }
  }
  __syncthreads();
  float* part = p.part + (r * p.splits + split) * g * (d + 2);
  for (int64_t x = threadIdx.x; x < g * d; x += blockDim.x) {
    const int64_t j = x / d, e = x % d;
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) o += part_out[(w * G + j) * kWidth + e];
    part[j * (d + 2) + e] = o;
  }
  if (threadIdx.x < g) {                   // (shared memory, not m[]: no dynamic index)
    const int j = threadIdx.x;
    float mj = max_of_warp[0][j], s = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mj = fmaxf(mj, max_of_warp[w][j]), s += sum_of_warp[w][j];
    part[j * (d + 2) + d] = mj;
    part[j * (d + 2) + d + 1] = s;
  }
}

// ------------------------------------------------------------------------------ pass 2

// Block (row r, split s): each head's merged max M and sum L = sum_s exp(m_s - M) l_s (a split
// with no valid slot has m_s = -inf and adds nothing); this block's share of the row's
// group * dim output elements, sum_s exp(m_s - M) o_s / L; the probabilities exp(logit - M) / L
// of the split's slots (0 at masked slots, and everywhere in a row with no valid slot).
template <typename T>
__global__ void __launch_bounds__(kThreads) split_merge_kernel(FeSplitDecode p, int64_t chunk) {
  __shared__ float head_max[kMaxGroup];
  __shared__ float head_sum[kMaxGroup];
  const int64_t split = blockIdx.x % p.splits, r = blockIdx.x / p.splits;
  const int64_t g = p.group, n = p.n, d = p.dim, splits = p.splits, w = d + 2;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const float* part = p.part + r * splits * g * w;      // (splits, g, dim + 2)

  for (int64_t j = warp; j < g; j += kWarps) {          // warp-uniform
    float m = -INFINITY;
    for (int64_t s = lane; s < splits; s += kWarp) m = fmaxf(m, part[(s * g + j) * w + d]);
    m = fe::warp_max(m);
    float l = 0.f;
    for (int64_t s = lane; s < splits; s += kWarp) {
      const float ms = part[(s * g + j) * w + d];
      if (ms != -INFINITY) l += expf(ms - m) * part[(s * g + j) * w + d + 1];
    }
    l = fe::warp_sum(l);
    if (lane == 0) {
      head_max[j] = m;
      head_sum[j] = l;
    }
  }
  __syncthreads();

  const int64_t total = g * d, per = (total + splits - 1) / splits;
  const int64_t x1 = lower(total, (split + 1) * per);
  T* out = static_cast<T*>(p.out) + r * total;
  for (int64_t x = split * per + threadIdx.x; x < x1; x += blockDim.x) {
    const int64_t j = x / d, e = x % d;
    const float m = head_max[j], l = head_sum[j];
    float o = 0.f;
    if (l > 0.f) {
      for (int64_t s = 0; s < splits; ++s) {
        const float ms = part[(s * g + j) * w + d];
        if (ms != -INFINITY) o = fmaf(expf(ms - m), part[(s * g + j) * w + e], o);
      }
      o /= l;
    }
    out[x] = fe::from_f<T>(o);
  }

  const Span span = split_span(p, chunk, split);
  float* logits = p.logits + r * g * n;
  for (int64_t i = span.first + threadIdx.x; i < span.end; i += blockDim.x) {
    float mass = 0.f;
    for (int64_t j = 0; j < g; ++j) {
      const float logit = logits[j * n + i], l = head_sum[j];
      const float pr = logit == -INFINITY || !(l > 0.f) ? 0.f : expf(logit - head_max[j]) / l;
      if (p.heads) logits[j * n + i] = pr;
      mass += pr;
    }
    if (p.mass != nullptr) p.mass[r * n + i] = mass;
    if (p.score != nullptr && p.valid[i * p.valid_slot + r]) p.score[i * p.score_slot + r] += mass;
  }
}

// ------------------------------------------------------------------------------ launch

template <typename T, int L>
void launch_partial(const FeSplitDecode& p, int64_t chunk, unsigned blocks, int group_regs,
                    cudaStream_t stream) {
  const size_t bytes = sizeof(float) * kWarps * L * kVec;   // times G below
  switch (group_regs) {
    case 1: split_partial_kernel<T, L, 1><<<blocks, kThreads, bytes, stream>>>(p, chunk); break;
    case 2: split_partial_kernel<T, L, 2><<<blocks, kThreads, 2 * bytes, stream>>>(p, chunk); break;
    case 4: split_partial_kernel<T, L, 4><<<blocks, kThreads, 4 * bytes, stream>>>(p, chunk); break;
    default: split_partial_kernel<T, L, 8><<<blocks, kThreads, 8 * bytes, stream>>>(p, chunk);
  }
}

template <typename T>
void launch(const FeSplitDecode& p, int64_t chunk, cudaStream_t stream) {
  const unsigned blocks = (unsigned)(p.rows * p.splits);
  const int group_regs = p.group <= 1 ? 1 : p.group <= 2 ? 2 : p.group <= 4 ? 4 : 8;
  if (p.dim <= 8 * kVec)
    launch_partial<T, 8>(p, chunk, blocks, group_regs, stream);
  else if (p.dim <= 16 * kVec)
    launch_partial<T, 16>(p, chunk, blocks, group_regs, stream);
  else
    launch_partial<T, 32>(p, chunk, blocks, group_regs, stream);
  split_merge_kernel<T><<<blocks, kThreads, 0, stream>>>(p, chunk);
}

bool aligned(const void* x, int64_t slot, int64_t row) {
  return reinterpret_cast<uintptr_t>(x) % 16 == 0 && slot % kVec == 0 && row % kVec == 0;
}

}  // namespace

extern "C" int64_t fe_split_decode_splits(int64_t rows, int64_t n) {
  if (n <= 0) return 1;
  int64_t chunk = kMaxChunk;          // the longest split that still gives enough blocks
  while (chunk > kMinChunk && rows * ((n + chunk - 1) / chunk) < kTargetBlocks) chunk /= 2;
  return (n + chunk - 1) / chunk;
}

extern "C" const char* fe_split_decode(const FeSplitDecode* p, cudaStream_t stream) {
  if (p->dim <= 0 || p->dim > FE_SPLIT_DECODE_MAX_DIM || p->dim % kVec != 0)
    return "flexevict: split decode attention needs head_dim a multiple of "
           FE_STR(FE_SPLIT_DECODE_DIM_MULTIPLE) " up to " FE_STR(FE_SPLIT_DECODE_MAX_DIM);
  if (p->group < 1 || p->group > kMaxGroup)
    return "flexevict: split decode attention takes 1 to " FE_STR(FE_SPLIT_DECODE_MAX_GROUP)
           " query heads per kv head";
  if (!aligned(p->k, p->k_slot, p->k_row) || !aligned(p->v, p->v_slot, p->v_row))
    return "flexevict: split decode attention needs 16-byte aligned K and V rows";
  if (p->splits < 1 || p->n < 0) return "flexevict: split decode attention needs splits >= 1";
  if (p->rows * p->splits > 0x7fffffff) return "flexevict: split decode attention: too many blocks";
  if (p->rows == 0) return nullptr;
  const int64_t chunk = p->n > 0 ? (p->n + p->splits - 1) / p->splits : 1;
  FE_DISPATCH_DTYPE(p->dtype, T, launch<T>(*p, chunk, stream));
  return fe::launch_status();
}
