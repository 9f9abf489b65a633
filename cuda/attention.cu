// Attention kernels: decode attention over a KV buffer (with the fused score accumulation of
// H2O-style policies) and prefill attention with per-key column sums, computed tile by tile.
#include <math.h>

#include "common.cuh"

namespace {

using fe::kWarp;

// ------------------------------------------------------------------------------ decode

constexpr int kDecodeThreads = 256;
constexpr int kDecodeWarps = kDecodeThreads / kWarp;
constexpr int kHeadChunk = 4;                 // query heads handled per pass over K or V
constexpr int kDecodeMaxDim = FE_DECODE_MAX_DIM;
constexpr int kDimPerLane = kDecodeMaxDim / kWarp;
constexpr int kUnroll = 4;                    // slots a warp loads before using any

// One block per buffer row. The logits go straight into `probs` (global, fp32), which later
// passes turn into probabilities in place: the row's n logits never need to fit on chip.
template <typename T>
__global__ void __launch_bounds__(kDecodeThreads) decode_attention_kernel(FeDecodeAttention p) {
  extern __shared__ float smem[];
  const int64_t r = blockIdx.x, g = p.group, n = p.n, d = p.dim;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  float* qs = smem;                                 // (g, d) this row's queries
  float* row_max = qs + g * d;                      // (g)
  float* row_sum = row_max + g;                     // (g)
  float* part = row_sum + g;                        // (warps, kHeadChunk) partial reductions
  float* acc_out = part + kDecodeWarps * kHeadChunk;   // (kHeadChunk, d)
  const T* q = static_cast<const T*>(p.q) + r * p.q_row;
  const T* k = static_cast<const T*>(p.k) + r * p.k_row;
  const T* v = static_cast<const T*>(p.v) + r * p.v_row;
  const uint8_t* valid = p.valid + r;
  float* probs = p.probs + r * g * n;

  for (int64_t i = threadIdx.x; i < g * d; i += blockDim.x)
    qs[i] = fe::to_f(q[(i / d) * p.q_head + i % d]);
  __syncthreads();

  // 1. logits of valid slots (rounded to T like the reference's matmul in T), -inf elsewhere;
  //    each warp loads kUnroll keys before reducing any, to keep loads in flight
  for (int64_t j0 = 0; j0 < g; j0 += kHeadChunk) {
    const int jn = g - j0 < kHeadChunk ? (int)(g - j0) : kHeadChunk;
    float wmax[kHeadChunk];
#pragma unroll
    for (int jj = 0; jj < kHeadChunk; ++jj) wmax[jj] = -INFINITY;
    for (int64_t i0 = warp * kUnroll; i0 < n; i0 += kDecodeWarps * kUnroll) {
      float kx[kUnroll][kDimPerLane];
      bool live[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = i0 + u;
        live[u] = i < n && valid[i * p.valid_slot];
#pragma unroll
        for (int c = 0; c < kDimPerLane; ++c) {
          const int64_t e = lane + c * kWarp;
          kx[u][c] = live[u] && e < d ? fe::to_f(k[i * p.k_slot + e]) : 0.f;
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = i0 + u;                   // i and live[u] are the same for the warp
        if (i >= n) break;
        if (!live[u]) {
          if (lane < jn) probs[(j0 + lane) * n + i] = -INFINITY;
          continue;
        }
        float dot[kHeadChunk] = {};
#pragma unroll
        for (int c = 0; c < kDimPerLane; ++c) {
          const int64_t e = lane + c * kWarp;
          if (e < d) {
#pragma unroll
            for (int jj = 0; jj < kHeadChunk; ++jj)
              if (jj < jn) dot[jj] = fmaf(qs[(j0 + jj) * d + e], kx[u][c], dot[jj]);
          }
        }
#pragma unroll
        for (int jj = 0; jj < kHeadChunk; ++jj) {
          if (jj >= jn) break;
          const float logit = fe::round_to<T>(fe::warp_sum(dot[jj]) * p.scale);
          wmax[jj] = fmaxf(wmax[jj], logit);
          if (lane == 0) probs[(j0 + jj) * n + i] = logit;
        }
      }
    }
    if (lane == 0) {
#pragma unroll
      for (int jj = 0; jj < kHeadChunk; ++jj) part[warp * kHeadChunk + jj] = wmax[jj];
    }
    __syncthreads();
    if (threadIdx.x < jn) {
      float m = -INFINITY;
      for (int w = 0; w < kDecodeWarps; ++w) m = fmaxf(m, part[w * kHeadChunk + threadIdx.x]);
      row_max[j0 + threadIdx.x] = m;
    }
    __syncthreads();
  }

  // 2. softmax denominators (a row with no valid slot keeps max -inf and sum 0)
  for (int64_t j0 = 0; j0 < g; j0 += kHeadChunk) {
    const int jn = g - j0 < kHeadChunk ? (int)(g - j0) : kHeadChunk;
    float s[kHeadChunk] = {};
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
#pragma unroll
      for (int jj = 0; jj < kHeadChunk; ++jj) {
        const float logit = jj < jn ? probs[(j0 + jj) * n + i] : -INFINITY;
        if (logit != -INFINITY) s[jj] += expf(logit - row_max[j0 + jj]);
      }
    }
#pragma unroll
    for (int jj = 0; jj < kHeadChunk; ++jj) {
      const float total = fe::warp_sum(s[jj]);
      if (lane == 0) part[warp * kHeadChunk + jj] = total;
    }
    __syncthreads();
    if (threadIdx.x < jn) {
      float total = 0.f;
      for (int w = 0; w < kDecodeWarps; ++w) total += part[w * kHeadChunk + threadIdx.x];
      row_sum[j0 + threadIdx.x] = total;
    }
    __syncthreads();
  }

  // 3. probabilities in place; a slot's score gains the sum over the group (valid slots only)
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    float total = 0.f;
    for (int64_t j = 0; j < g; ++j) {
      const float logit = probs[j * n + i];
      const float pr = logit == -INFINITY ? 0.f : expf(logit - row_max[j]) / row_sum[j];
      probs[j * n + i] = pr;
      total += pr;
    }
    if (p.score != nullptr && valid[i * p.valid_slot]) p.score[i * p.score_slot + r] += total;
  }
  __syncthreads();

  // 4. output: warps split the slots, lanes the head dim; partials meet in shared memory
  T* out = static_cast<T*>(p.out) + r * g * d;
  for (int64_t j0 = 0; j0 < g; j0 += kHeadChunk) {
    const int jn = g - j0 < kHeadChunk ? (int)(g - j0) : kHeadChunk;
    for (int64_t i = threadIdx.x; i < jn * d; i += blockDim.x) acc_out[i] = 0.f;
    __syncthreads();
    float acc[kHeadChunk][kDimPerLane] = {};
    for (int64_t i0 = warp * kUnroll; i0 < n; i0 += kDecodeWarps * kUnroll) {
      float vx[kUnroll][kDimPerLane], pr[kUnroll][kHeadChunk];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {             // masked slots: probability 0, V unread
        const int64_t i = i0 + u;
        const bool live = i < n && valid[i * p.valid_slot];
#pragma unroll
        for (int c = 0; c < kDimPerLane; ++c) {
          const int64_t e = lane + c * kWarp;
          vx[u][c] = live && e < d ? fe::to_f(v[i * p.v_slot + e]) : 0.f;
        }
#pragma unroll
        for (int jj = 0; jj < kHeadChunk; ++jj)      // the reference multiplies p rounded to T
          pr[u][jj] = live && jj < jn ? fe::round_to<T>(probs[(j0 + jj) * n + i]) : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int c = 0; c < kDimPerLane; ++c)
#pragma unroll
          for (int jj = 0; jj < kHeadChunk; ++jj)
            acc[jj][c] = fmaf(pr[u][jj], vx[u][c], acc[jj][c]);
    }
#pragma unroll
    for (int jj = 0; jj < kHeadChunk; ++jj)
#pragma unroll
      for (int c = 0; c < kDimPerLane; ++c) {
        const int64_t e = lane + c * kWarp;
        if (jj < jn && e < d) atomicAdd(&acc_out[jj * d + e], acc[jj][c]);
      }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < jn * d; i += blockDim.x)
      out[j0 * d + i] = fe::from_f<T>(acc_out[i]);
    __syncthreads();
  }
}

// ------------------------------------------------------------------------------ prefill

constexpr int kPrefillThreads = 128;
constexpr int kPrefillWarps = kPrefillThreads / kWarp;
constexpr int kQueriesPerWarp = 4;
constexpr int kQueryTile = kPrefillWarps * kQueriesPerWarp;
constexpr int kKeyTile = kWarp;                 // lane j owns key j of a tile
constexpr int kPrefillMaxDim = FE_PREFILL_MAX_DIM;
constexpr int kPad = kPrefillMaxDim + 1;        // row stride of key tiles: no bank conflicts
constexpr int kPrefillDimPerLane = kPrefillMaxDim / kWarp;

// Load keys [k0, k0 + 32) of one head as fp32 into a padded tile (zeros past the end).
template <typename T>
__device__ void load_tile(float (*tile)[kPad], const T* x, int64_t stride, int64_t k0,
                          int64_t seq, int64_t d) {
  for (int64_t i = threadIdx.x; i < kKeyTile * d; i += blockDim.x) {
    const int64_t j = i / d, e = i % d;
    tile[j][e] = k0 + j < seq ? fe::to_f(x[(k0 + j) * stride + e]) : 0.f;
  }
}

// q . k over e = 0..d-1 in order: both prefill kernels must get bit-identical logits.
__device__ __forceinline__ float dot_row(const float* q, const float* k, int64_t d) {
  float dot = 0.f;
  for (int64_t e = 0; e < d; ++e) dot = fmaf(q[e], k[e], dot);
  return dot;
}

// Pass 1, grid (query tiles, B * H): online-softmax attention output, and each query's logit
// max and softmax denominator for pass 2. Key tiles no query of the block may see are skipped
// (the causal upper triangle).
template <typename T>
__global__ void __launch_bounds__(kPrefillThreads) prefill_rows_kernel(FePrefillAttention p) {
  __shared__ float qs[kQueryTile][kPrefillMaxDim];
  __shared__ float ks[kKeyTile][kPad];
  __shared__ float vs[kKeyTile][kPad];
  __shared__ float ps[kPrefillWarps][kKeyTile];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t b = blockIdx.y / p.heads, h = blockIdx.y % p.heads;
  const int64_t hk = h / (p.heads / p.kv_heads), seq = p.seq, d = p.dim;
  const int64_t q0 = (int64_t)blockIdx.x * kQueryTile;
  const T* q = static_cast<const T*>(p.q) + b * p.q_b + h * p.q_h;
  const T* k = static_cast<const T*>(p.k) + b * p.k_b + hk * p.k_h;
  const T* v = static_cast<const T*>(p.v) + b * p.v_b + hk * p.v_h;
  const uint8_t* mask = p.mask + b * p.m_b;

  for (int64_t i = threadIdx.x; i < kQueryTile * d; i += blockDim.x) {
    const int64_t qi = i / d, e = i % d;
    qs[qi][e] = q0 + qi < seq ? fe::to_f(q[(q0 + qi) * p.q_s + e]) : 0.f;
  }
  float m[kQueriesPerWarp], l[kQueriesPerWarp], acc[kQueriesPerWarp][kPrefillDimPerLane];
#pragma unroll
  for (int qi = 0; qi < kQueriesPerWarp; ++qi) {
    m[qi] = -INFINITY;
    l[qi] = 0.f;
#pragma unroll
    for (int c = 0; c < kPrefillDimPerLane; ++c) acc[qi][c] = 0.f;
  }

  for (int64_t k0 = 0; k0 < seq; k0 += kKeyTile) {
    int any = 0;
    for (int i = threadIdx.x; i < kQueryTile * kKeyTile; i += blockDim.x) {
      const int64_t qq = q0 + i / kKeyTile, kk = k0 + i % kKeyTile;
      any |= qq < seq && kk < seq && mask[qq * p.m_q + kk * p.m_k];
    }
    if (!__syncthreads_or(any)) continue;
    load_tile<T>(ks, k, p.k_s, k0, seq, d);
    load_tile<T>(vs, v, p.v_s, k0, seq, d);
    __syncthreads();
    const int64_t kk = k0 + lane;
#pragma unroll
    for (int qi = 0; qi < kQueriesPerWarp; ++qi) {
      const int64_t qq = q0 + warp * kQueriesPerWarp + qi;
      const bool seen = qq < seq && kk < seq && mask[qq * p.m_q + kk * p.m_k];
      const float logit = seen ? fe::round_to<T>(dot_row(qs[warp * kQueriesPerWarp + qi],
                                                         ks[lane], d)) * p.scale
                               : -INFINITY;
      const float m_new = fmaxf(m[qi], fe::warp_max(logit));
      const float pr = seen ? expf(logit - m_new) : 0.f;
      const float corr = m[qi] == -INFINITY ? 0.f : expf(m[qi] - m_new);
      l[qi] = l[qi] * corr + fe::warp_sum(pr);
      m[qi] = m_new;
      ps[warp][lane] = pr;
      __syncwarp();
#pragma unroll
      for (int c = 0; c < kPrefillDimPerLane; ++c) acc[qi][c] *= corr;
      for (int j = 0; j < kKeyTile; ++j) {
        const float pj = ps[warp][j];
#pragma unroll
        for (int c = 0; c < kPrefillDimPerLane; ++c) {
          const int e = lane + c * kWarp;
          if (e < d) acc[qi][c] = fmaf(pj, vs[j][e], acc[qi][c]);
        }
      }
      __syncwarp();
    }
    __syncthreads();
  }

  T* out = static_cast<T*>(p.out) + (b * p.heads + h) * seq * d;
#pragma unroll
  for (int qi = 0; qi < kQueriesPerWarp; ++qi) {
    const int64_t qq = q0 + warp * kQueriesPerWarp + qi;
    if (qq >= seq) continue;
    const float inv = l[qi] > 0.f ? 1.f / l[qi] : 0.f;     // no visible key: output 0
#pragma unroll
    for (int c = 0; c < kPrefillDimPerLane; ++c) {
      const int64_t e = lane + c * kWarp;
      if (e < d) out[qq * d + e] = fe::from_f<T>(acc[qi][c] * inv);
    }
    if (lane == 0) {
      p.row_max[(b * p.heads + h) * seq + qq] = m[qi];
      p.row_sum[(b * p.heads + h) * seq + qq] = l[qi];
    }
  }
}

// Pass 2, grid (key tiles, B * Hk): lane j accumulates the probability key j receives from
// every valid query of every query head of the kv head, recomputing the logits of pass 1.
template <typename T>
__global__ void __launch_bounds__(kPrefillThreads) prefill_colsum_kernel(FePrefillAttention p) {
  __shared__ float ks[kKeyTile][kPad];
  __shared__ float qs[kPrefillWarps][kPrefillMaxDim];
  __shared__ float part[kPrefillWarps][kKeyTile];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t b = blockIdx.y / p.kv_heads, hk = blockIdx.y % p.kv_heads;
  const int64_t group = p.heads / p.kv_heads, seq = p.seq, d = p.dim;
  const int64_t k0 = (int64_t)blockIdx.x * kKeyTile, kk = k0 + lane;
  const T* k = static_cast<const T*>(p.k) + b * p.k_b + hk * p.k_h;
  const uint8_t* mask = p.mask + b * p.m_b;
  load_tile<T>(ks, k, p.k_s, k0, seq, d);
  __syncthreads();

  float col = 0.f;
  for (int64_t qq = warp; qq < seq; qq += kPrefillWarps) {
    if (!p.valid[b * p.valid_b + qq]) continue;     // pad queries do not vote
    const bool seen = kk < seq && mask[qq * p.m_q + kk * p.m_k];
    if (!__any_sync(fe::kFull, seen)) continue;
    for (int64_t hh = 0; hh < group; ++hh) {
      const int64_t h = hk * group + hh;
      const T* qrow = static_cast<const T*>(p.q) + b * p.q_b + h * p.q_h + qq * p.q_s;
      for (int64_t e = lane; e < d; e += kWarp) qs[warp][e] = fe::to_f(qrow[e]);
      __syncwarp();
      const float dot = dot_row(qs[warp], ks[lane], d);
      __syncwarp();
      if (seen) {
        const int64_t at = (b * p.heads + h) * seq + qq;
        col += expf(fe::round_to<T>(dot) * p.scale - p.row_max[at]) / p.row_sum[at];
      }
    }
  }
  part[warp][lane] = col;
  __syncthreads();
  if (warp == 0 && kk < seq) {
    float total = 0.f;
    for (int w = 0; w < kPrefillWarps; ++w) total += part[w][lane];
    p.colsum[(b * p.kv_heads + hk) * seq + kk] = total;
  }
}

}  // namespace

extern "C" int64_t fe_decode_attention_shared_bytes(int64_t group, int64_t dim) {
  const int64_t floats = (group + kHeadChunk) * dim + 2 * group + kDecodeWarps * kHeadChunk;
  return floats * (int64_t)sizeof(float);
}

extern "C" const char* fe_decode_attention(const FeDecodeAttention* p, cudaStream_t stream) {
  if (p->dim > kDecodeMaxDim)
    return "flexevict: decode attention supports head_dim <= " FE_STR(FE_DECODE_MAX_DIM);
  const size_t bytes = (size_t)fe_decode_attention_shared_bytes(p->group, p->dim);
  if (bytes > FE_SHARED_BYTES) return "flexevict: decode attention: group * head_dim too large";
  if (p->rows == 0) return nullptr;
  FE_DISPATCH_DTYPE(p->dtype, T,
      decode_attention_kernel<T><<<(unsigned)p->rows, kDecodeThreads, bytes, stream>>>(*p));
  return fe::launch_status();
}

extern "C" const char* fe_prefill_attention(const FePrefillAttention* p, cudaStream_t stream) {
  if (p->dim > kPrefillMaxDim)
    return "flexevict: prefill attention supports head_dim <= " FE_STR(FE_PREFILL_MAX_DIM);
  if (p->batch == 0 || p->seq == 0) return nullptr;
  if (p->batch * p->heads > FE_PREFILL_MAX_BATCH_HEADS)
    return "flexevict: prefill attention: batch * heads > " FE_STR(FE_PREFILL_MAX_BATCH_HEADS);
  const dim3 rows_grid((unsigned)((p->seq + kQueryTile - 1) / kQueryTile),
                       (unsigned)(p->batch * p->heads));
  const dim3 cols_grid((unsigned)((p->seq + kKeyTile - 1) / kKeyTile),
                       (unsigned)(p->batch * p->kv_heads));
  // two launches: the column sums need every query's softmax denominator first
  FE_DISPATCH_DTYPE(p->dtype, T,
      prefill_rows_kernel<T><<<rows_grid, kPrefillThreads, 0, stream>>>(*p);
      prefill_colsum_kernel<T><<<cols_grid, kPrefillThreads, 0, stream>>>(*p));
  return fe::launch_status();
}
