// Prompt and buffer compaction kernels: the top-k gather of RingPolicy's prefill (H2O, VATP,
// Scissorhands, StreamingLLM, local), one BUZZ pass (sinks, interval-sampled old tokens,
// chunk-local maxima of new tokens, window), and recall's top-k pages by Quest's bound, each
// one block per buffer row.
#include <math.h>

#include "common.cuh"

namespace {

using fe::kWarp;

// A float mapped to an unsigned int of the same order (-0 and +0 equal, as torch.sort sees them).
__device__ __forceinline__ uint32_t orderable(float f) {
  if (f == 0.f) f = 0.f;
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Ascending bitonic sort of n2 (a power of two) keys in shared memory by the whole block.
__device__ void bitonic_sort(uint64_t* a, int64_t n2) {
  __syncthreads();
  for (int64_t size = 2; size <= n2; size <<= 1) {
    for (int64_t stride = size >> 1; stride > 0; stride >>= 1) {
      for (int64_t i = threadIdx.x; i < n2 / 2; i += blockDim.x) {
        const int64_t lo = 2 * stride * (i / stride) + i % stride, hi = lo + stride;
        const bool up = (lo & size) == 0;
        const uint64_t x = a[lo], y = a[hi];
        if ((x > y) == up) {
          a[lo] = y;
          a[hi] = x;
        }
      }
      __syncthreads();
    }
  }
}

__host__ __device__ __forceinline__ int64_t pow2_at_least(int64_t n) {
  int64_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

// ------------------------------------------------------------------------------ prompt top-k

constexpr int kCompactThreads = 512;
constexpr int64_t kCompactMaxSeq = FE_COMPACT_MAX_SEQ;

// order[a] = the prompt index of the a-th token of the row once left-aligned (real tokens
// first, in order, then the pads); returns the number of real tokens.
__device__ int64_t left_align(const uint8_t* valid, int64_t seq, int64_t rows, int32_t* order,
                              int* scratch) {
  int64_t real = 0;
  for (int64_t i0 = 0; i0 < seq; i0 += blockDim.x) {
    const int64_t i = i0 + threadIdx.x;
    int tile;
    fe::block_exclusive_scan(i < seq && valid[i * rows], scratch, &tile);
    real += tile;
  }
  int64_t real_before = 0, pads_before = 0;
  for (int64_t i0 = 0; i0 < seq; i0 += blockDim.x) {
    const int64_t i = i0 + threadIdx.x;
    const bool is_real = i < seq && valid[i * rows];
    int real_tile, pad_tile;
    const int r = fe::block_exclusive_scan(is_real, scratch, &real_tile);
    const int q = fe::block_exclusive_scan(i < seq && !is_real, scratch, &pad_tile);
    if (i < seq) order[is_real ? real_before + r : real + pads_before + q] = (int32_t)i;
    real_before += real_tile;
    pads_before += pad_tile;
  }
  __syncthreads();
  return real;
}

template <typename T>
__global__ void __launch_bounds__(kCompactThreads) compact_prompt_kernel(FeCompactPrompt p) {
  extern __shared__ uint64_t keys[];                // (n2) sort keys, then order (seq) int32
  __shared__ int scratch[kWarp + 1];
  const int64_t r = blockIdx.x, R = p.rows, seq = p.seq, d = p.dim;
  const int64_t n2 = pow2_at_least(seq);
  int32_t* order = reinterpret_cast<int32_t*>(keys + n2);
  const int64_t real = left_align(p.valid + r, seq, R, order, scratch);
  const int64_t ring_begin = real > p.ring ? real - p.ring : 0;   // older tokens compete

  if (p.prefix > 0) {
    // key = ~(rank bits, ~aligned index): ascending order = best rank first, ties -> earliest
    for (int64_t a = threadIdx.x; a < n2; a += blockDim.x) {
      uint64_t key = ~0ull;                         // padding sorts last
      if (a < seq) {
        const float rank = a < ring_begin ? p.rank[order[a] * R + r] : -INFINITY;
        key = ~(((uint64_t)orderable(rank) << 32) | (uint32_t)~(uint32_t)a);
      }
      keys[a] = key;
    }
    bitonic_sort(keys, n2);
    // the winners' aligned indices, sorted ascending (position order)
    const int64_t p2 = pow2_at_least(p.prefix);
    for (int64_t c = threadIdx.x; c < p2; c += blockDim.x)
      keys[c] = c < p.prefix ? (uint64_t)(~(uint32_t)(~keys[c])) : ~0ull;
    bitonic_sort(keys, p2);
  }

  // slot c < prefix: a winner (a hole when it was not eligible); then the ring's tokens
  const int64_t cap = p.prefix + p.ring;
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  T* out_k = static_cast<T*>(p.out_k);
  T* out_v = static_cast<T*>(p.out_v);
  for (int64_t x = threadIdx.x; x < cap * d; x += blockDim.x) {
    const int64_t c = x / d, e = x % d;
    const int64_t a = c < p.prefix ? (int64_t)keys[c] : min(ring_begin + c - p.prefix, seq - 1);
    const int64_t i = order[a];
    out_k[(c * R + r) * d + e] = k[i * p.k_slot + r * p.k_row + e];
    out_v[(c * R + r) * d + e] = v[i * p.v_slot + r * p.v_row + e];
  }
  for (int64_t c = threadIdx.x; c < cap; c += blockDim.x) {
    const bool heavy = c < p.prefix;
    const int64_t a_raw = heavy ? (int64_t)keys[c] : ring_begin + c - p.prefix;
    const int64_t a = min(a_raw, seq - 1);
    const bool hole = heavy ? a >= ring_begin : a_raw >= real;
    const int64_t i = order[a];
    p.out_pos[c * R + r] = p.pos[i * R + r];
    p.out_valid[c * R + r] = p.valid[i * R + r] && !hole;
    p.out_score[c * R + r] = p.scores != nullptr ? p.scores[i * R + r] : 0.f;
    p.out_state[c * R + r] = 0.f;
  }
}

// ------------------------------------------------------------------------------ BUZZ pass

constexpr int kBuzzThreads = 256;
constexpr int64_t kBuzzMaxSlots = FE_BUZZ_MAX_SLOTS;
constexpr int kBuzzChunk = 8;                       // tokens staged per in-place move step
constexpr int kBuzzPerThread = kBuzzChunk * FE_BUZZ_MAX_DIM / kBuzzThreads;
static_assert(kBuzzPerThread * kBuzzThreads == kBuzzChunk * FE_BUZZ_MAX_DIM,
              "a chunk of FE_BUZZ_MAX_DIM-wide tokens must split evenly over the threads");

template <typename T>
__global__ void __launch_bounds__(kBuzzThreads) buzz_pass_kernel(FeBuzzPass p) {
  extern __shared__ int32_t sh[];
  __shared__ int scratch[kWarp + 1];
  const int64_t r = blockIdx.x, R = p.rows, n = p.n, d = p.dim;
  int32_t* rank_of = sh;                            // (n) rank among valid slots, -1 if empty
  int32_t* slot_of = sh + n;                        // (n) inverse: slot of rank
  int32_t* src_of = sh + 2 * n;                     // (n) source slot of compacted slot
  uint8_t* keep = reinterpret_cast<uint8_t*>(sh + 3 * n);   // (n)
  uint8_t* old_after = keep + n;                    // (n)

  // ranks of valid slots, and the row's counts
  int64_t count = 0, old = 0;
  for (int64_t i0 = 0; i0 < n; i0 += blockDim.x) {
    const int64_t i = i0 + threadIdx.x;
    const bool live = i < n && p.valid[i * R + r];
    int tile, old_tile;
    const int rk = fe::block_exclusive_scan(live, scratch, &tile);
    fe::block_exclusive_scan(live && p.state[i * R + r] > 0.5f, scratch, &old_tile);
    if (i < n) rank_of[i] = live ? (int32_t)(count + rk) : -1;
    if (live) slot_of[count + rk] = (int32_t)i;
    count += tile;
    old += old_tile;
  }
  __syncthreads();
  const int64_t k = p.sinks, w = p.window, s = p.stride, sh_stride = (s + 1) / 2;
  const bool hit = count - k - w > p.threshold;
  const int64_t new_begin = k + old, new_end = count - w;   // ranks of new middle tokens

  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t rk = rank_of[i];
    const bool live = rk >= 0, is_old = live && p.state[i * R + r] > 0.5f;
    const bool middle = live && rk >= k && rk < count - w;
    const bool old_keep = middle && rk < new_begin && (rk - k) % sh_stride == 0;
    const bool edge = live && !middle;              // a sink or in the window
    keep[i] = hit ? (edge || old_keep) : live;
    old_after[i] = hit ? old_keep : is_old;
  }
  __syncthreads();
  if (hit) {                                        // each chunk of s new tokens keeps its max
    for (int64_t c0 = new_begin + threadIdx.x * s; c0 < new_end; c0 += (int64_t)blockDim.x * s) {
      int64_t best = slot_of[c0];
      for (int64_t rk = c0 + 1; rk < min(c0 + s, new_end); ++rk)
        if (p.score[slot_of[rk] * R + r] > p.score[best * R + r]) best = slot_of[rk];
      keep[best] = 1;                               // first maximum on ties
      old_after[best] = 1;
    }
  }
  __syncthreads();

  // compacted slot of each kept slot, in slot order
  int64_t kept = 0;
  for (int64_t i0 = 0; i0 < n; i0 += blockDim.x) {
    const int64_t i = i0 + threadIdx.x;
    int tile;
    const int at = fe::block_exclusive_scan(i < n && keep[i], scratch, &tile);
    if (i < n && keep[i]) src_of[kept + at] = (int32_t)i;
    kept += tile;
  }
  __syncthreads();

  // in place, chunk by chunk: a kept slot moves down (src_of[j] >= j), so every source of a
  // later chunk is past the slots written so far; within a chunk all reads precede all writes
  T* kb = static_cast<T*>(p.k);
  T* vb = static_cast<T*>(p.v);
  for (int64_t j0 = 0; j0 < kept; j0 += kBuzzChunk) {
    const int64_t jn = kept - j0 < kBuzzChunk ? kept - j0 : kBuzzChunk;
    T kx[kBuzzPerThread], vx[kBuzzPerThread];
    float score = 0.f;
    int32_t pos = -1;
#pragma unroll
    for (int u = 0; u < kBuzzPerThread; ++u) {
      const int64_t x = threadIdx.x + (int64_t)u * blockDim.x, j = j0 + x / d;
      if (x < jn * d) {
        kx[u] = kb[(src_of[j] * R + r) * d + x % d];
        vx[u] = vb[(src_of[j] * R + r) * d + x % d];
      }
    }
    if (threadIdx.x < jn) {
      score = p.score[src_of[j0 + threadIdx.x] * R + r];
      pos = p.pos[src_of[j0 + threadIdx.x] * R + r];
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < kBuzzPerThread; ++u) {
      const int64_t x = threadIdx.x + (int64_t)u * blockDim.x, j = j0 + x / d;
      if (x < jn * d) {
        kb[(j * R + r) * d + x % d] = kx[u];
        vb[(j * R + r) * d + x % d] = vx[u];
      }
    }
    if (threadIdx.x < jn) {
      const int64_t j = j0 + threadIdx.x;
      p.score[j * R + r] = score;
      p.pos[j * R + r] = pos;
      p.state[j * R + r] = old_after[src_of[j]] ? 1.f : 0.f;
      p.valid[j * R + r] = 1;
    }
    __syncthreads();
  }
  for (int64_t j = kept + threadIdx.x; j < n; j += blockDim.x) {   // the freed tail
    p.valid[j * R + r] = 0;
    p.pos[j * R + r] = -1;
    p.score[j * R + r] = 0.f;
    p.state[j * R + r] = 0.f;
  }
  if (threadIdx.x == 0) p.kept[r] = (int32_t)kept;
}

// ------------------------------------------------------------------------------ recall's pages

constexpr int kPageThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kPageThreads) page_select_kernel(FePageSelect p) {
  extern __shared__ uint64_t keys[];                // (n2) sort keys, then s+ and s- (2 dim)
  const int64_t r = blockIdx.x, d = p.dim, n = p.n_pages;
  const int64_t n2 = pow2_at_least(n);
  float* s = reinterpret_cast<float*>(keys + n2);
  const T* q = static_cast<const T*>(p.q) + r * p.group * d;
  for (int64_t e = threadIdx.x; e < d; e += blockDim.x) {
    float plus = 0.f, minus = 0.f;
    for (int64_t g = 0; g < p.group; ++g) {
      const float x = fe::to_f(q[g * d + e]);
      plus += fmaxf(x, 0.f);
      minus += fminf(x, 0.f);
    }
    s[e] = fe::to_f(fe::from_f<T>(plus));             // the sums in the dtype, as the reference
    s[d + e] = fe::to_f(fe::from_f<T>(minus));
  }
  __syncthreads();
  const T* most = static_cast<const T*>(p.summary) + r * 2 * d * n;
  const T* least = most + d * n;
  const int64_t limit = p.limit[r];
  // key = ~(bound bits, ~page): ascending order = highest bound first, ties -> the lower page
  for (int64_t a = threadIdx.x; a < n2; a += blockDim.x) {
    uint64_t key = ~0ull;                           // padding sorts last
    if (a < n) {
      const int64_t first = a * p.page;
      float bound = -INFINITY;                      // not a candidate (an empty page: NaN)
      if (first < limit && first + p.page > p.sinks) {
        bound = 0.f;
        for (int64_t e = 0; e < d; ++e)             // threads read consecutive pages
          bound += s[e] * fe::to_f(most[e * n + a]) + s[d + e] * fe::to_f(least[e * n + a]);
      }
      key = ~(((uint64_t)orderable(bound) << 32) | (uint32_t)~(uint32_t)a);
    }
    keys[a] = key;
  }
  bitonic_sort(keys, n2);
  for (int64_t c = threadIdx.x; c < p.pages; c += blockDim.x)
    p.out[r * p.pages + c] = (int64_t)(~(uint32_t)(~keys[c]));
}

}  // namespace

extern "C" const char* fe_compact_prompt(const FeCompactPrompt* p, cudaStream_t stream) {
  if (p->seq > kCompactMaxSeq)
    return "flexevict: prompt compaction supports at most " FE_STR(FE_COMPACT_MAX_SEQ) " tokens";
  if (p->prefix + p->ring <= 0 || p->seq == 0) return "flexevict: nothing to compact";
  if (p->rows == 0) return nullptr;
  const size_t bytes = pow2_at_least(p->seq) * sizeof(uint64_t) + p->seq * sizeof(int32_t);
  FE_DISPATCH_DTYPE(p->dtype, T,
      if (bytes > 32 * 1024) {                  // above the default, with the static part
        cudaError_t err = cudaFuncSetAttribute(compact_prompt_kernel<T>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               (int)bytes);
        if (err != cudaSuccess) return cudaGetErrorString(err);
      }
      compact_prompt_kernel<T><<<(unsigned)p->rows, kCompactThreads, bytes, stream>>>(*p));
  return fe::launch_status();
}

extern "C" const char* fe_buzz_pass(const FeBuzzPass* p, cudaStream_t stream) {
  if (p->n > kBuzzMaxSlots)
    return "flexevict: BUZZ kernel supports at most " FE_STR(FE_BUZZ_MAX_SLOTS) " slots";
  if (p->dim > FE_BUZZ_MAX_DIM)
    return "flexevict: BUZZ kernel supports head_dim <= " FE_STR(FE_BUZZ_MAX_DIM);
  if (p->rows == 0 || p->n == 0) return nullptr;
  const size_t bytes = p->n * (3 * sizeof(int32_t) + 2);
  FE_DISPATCH_DTYPE(p->dtype, T,
      buzz_pass_kernel<T><<<(unsigned)p->rows, kBuzzThreads, bytes, stream>>>(*p));
  return fe::launch_status();
}

extern "C" const char* fe_page_select(const FePageSelect* p, cudaStream_t stream) {
  if (p->n_pages > FE_PAGE_MAX_PAGES)
    return "flexevict: page choice supports at most " FE_STR(FE_PAGE_MAX_PAGES) " pages";
  if (p->dim > FE_PAGE_MAX_DIM) return "flexevict: page choice: head_dim too large";
  if (p->pages > p->n_pages) return "flexevict: more pages asked for than there are";
  if (p->rows == 0 || p->pages == 0) return nullptr;
  const size_t bytes = pow2_at_least(p->n_pages) * sizeof(uint64_t) + 2 * p->dim * sizeof(float);
  FE_DISPATCH_DTYPE(p->dtype, T,
      page_select_kernel<T><<<(unsigned)p->rows, kPageThreads, bytes, stream>>>(*p));
  return fe::launch_status();
}
