// Eviction bookkeeping kernels: victim selection fused with the commit of the scratch token,
// SimHash codes for HashEvict, and Cascade's sub-cache update. One launch per op, no host sync.
#include <limits.h>
#include <math.h>

#include "common.cuh"

namespace {

using fe::kWarp;

// ------------------------------------------------------------------------------ buffer moves

// A buffer's tensors (slots, rows[, dim]); `at(slot, row)` indexes the per-slot scalars.
template <typename T>
struct Buffer {
  T* k;
  T* v;
  float* score;
  float* state;
  int32_t* pos;
  uint8_t* valid;
  int64_t rows, dim;
  __device__ int64_t at(int64_t slot, int64_t row) const { return slot * rows + row; }
};

// Copy one row's token from slot src to slot dst: K and V by the lanes of a warp, the scalars
// by lane 0 (callers order moves of the same row with __syncwarp).
template <typename T>
__device__ void move_token(const Buffer<T>& b, int64_t src, int64_t dst, int64_t row, int lane) {
  if (src == dst) return;
  const int64_t s = b.at(src, row), t = b.at(dst, row);
  for (int64_t e = lane; e < b.dim; e += kWarp) {
    b.k[t * b.dim + e] = b.k[s * b.dim + e];
    b.v[t * b.dim + e] = b.v[s * b.dim + e];
  }
  if (lane == 0) {
    b.score[t] = b.score[s];
    b.state[t] = b.state[s];
    b.pos[t] = b.pos[s];
    b.valid[t] = b.valid[s];
  }
}

// ------------------------------------------------------------------------------ selection

// Candidate order of policies/base.py `lowest`: the lowest key (empty slots are -inf), then
// the oldest position, then the first candidate.
struct Pick {
  float key;
  int32_t pos;
  int32_t cand;
};

__device__ __forceinline__ bool before(const Pick& a, const Pick& b) {
  if (a.key != b.key) return a.key < b.key;
  if (a.pos != b.pos) return a.pos < b.pos;
  return a.cand < b.cand;
}

__device__ __forceinline__ float hamming_value(const FeSelectCommit& p, int64_t slot, int64_t row) {
  int dist = 0;
  for (int64_t w = 0; w < p.words; ++w) {
    const int64_t code = p.codes != nullptr
        ? p.codes[(slot * p.rows + row) * p.words + w]
        : (int64_t)p.state[slot * p.rows + row];
    for (int64_t j = 0; j < p.query_group; ++j) {
      const int64_t query = p.query_codes[(row * p.query_group + j) * p.words + w];
      dist += __popcll((unsigned long long)(query ^ code));
    }
  }
  return -(float)dist;                              // the farthest key is the lowest value
}

__device__ Pick pick_victim(const FeSelectCommit& p, int64_t extra, int64_t row, int lane) {
  const int64_t ncand = p.n_range + (extra >= 0 ? 1 : 0);
  Pick best{INFINITY, INT_MAX, INT_MAX};
  for (int64_t c = lane; c < ncand; c += kWarp) {
    const int64_t slot = c < p.n_range ? c : extra;
    const int64_t at = slot * p.rows + row;
    float key;
    if (!p.valid[at]) key = -INFINITY;
    else if (c < p.protect) key = INFINITY;
    else if (p.source == FE_VALUE_SCORE) key = p.score[at];
    else if (p.source == FE_VALUE_TENSOR) key = p.value[c * p.rows + row];
    else key = hamming_value(p, slot, row);
    if (isnan(key)) key = -INFINITY;                // a NaN value goes first, as in `lowest`
    const Pick mine{key, p.pos[at], (int32_t)c};
    if (before(mine, best)) best = mine;
  }
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) {
    const Pick other{__shfl_xor_sync(fe::kFull, best.key, o),
                     __shfl_xor_sync(fe::kFull, best.pos, o),
                     __shfl_xor_sync(fe::kFull, best.cand, o)};
    if (before(other, best)) best = other;
  }
  return best;
}

// One warp per buffer row: pick the victim (or take the given one), then commit.
template <typename T>
__global__ void select_commit_kernel(FeSelectCommit p) {
  const int lane = threadIdx.x % kWarp;
  const int64_t row = (int64_t)blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  if (row >= p.rows) return;                        // the whole warp leaves together
  const Buffer<T> b{static_cast<T*>(p.k), static_cast<T*>(p.v), p.score, p.state, p.pos,
                    p.valid, p.rows, p.dim};
  const int64_t scratch = p.slots - 1;
  const int64_t cursor = p.cursor_at != nullptr ? *p.cursor_at : p.cursor;
  const int64_t extra = p.extra_is_cursor ? cursor : p.extra;
  int64_t victim;
  if (p.victims_in != nullptr) {
    victim = p.victims_in[row];
  } else {
    const Pick best = pick_victim(p, extra, row, lane);
    victim = best.cand < p.n_range ? best.cand : extra;
  }
  if (lane == 0 && p.victims_out != nullptr) p.victims_out[row] = victim;
  // every lane's reads of the row (the selection) before any lane's writes (the commit): the
  // shuffles above converge the warp but do not order memory
  __syncwarp();
  switch (p.commit) {
    case FE_COMMIT_MASK:                            // HashEvict: hide the victim from attention
      if (lane == 0) p.valid[b.at(victim, row)] = 0;
      break;
    case FE_COMMIT_REPLACE:                         // KVBuffer.replace
      move_token(b, scratch, victim, row, lane);
      __syncwarp();
      if (lane == 0) p.valid[b.at(scratch, row)] = 0;
      break;
    case FE_COMMIT_RING:                            // KVBuffer.ring_commit
      move_token(b, cursor, victim, row, lane);     // the oldest recent token survives
      __syncwarp();
      move_token(b, scratch, cursor, row, lane);
      __syncwarp();
      if (lane == 0) p.valid[b.at(scratch, row)] = 0;
      break;
    default:
      break;
  }
}

// ------------------------------------------------------------------------------ SimHash

// One block per vector, one thread per hash bit: warp w's ballot is code word w.
template <typename T>
__global__ void lsh_hash_kernel(const T* x, int64_t dim, int64_t x_row, const float* proj,
                                int64_t bits, int64_t* codes, int64_t words) {
  extern __shared__ float xs[];
  const int64_t i = blockIdx.x;
  for (int64_t e = threadIdx.x; e < dim; e += blockDim.x) xs[e] = fe::to_f(x[i * x_row + e]);
  __syncthreads();
  const int64_t bit = threadIdx.x;
  bool set = false;
  if (bit < bits) {
    const float* row = proj + bit * dim;
    float dot = 0.f;
    for (int64_t e = 0; e < dim; ++e) dot = fmaf(xs[e], row[e], dot);
    set = dot >= 0.f;                               // the paper's Heaviside: 0 maps to 1
  }
  const unsigned word = __ballot_sync(fe::kFull, set);
  if (threadIdx.x % kWarp == 0) codes[i * words + threadIdx.x / kWarp] = (int64_t)word;
}

// ------------------------------------------------------------------------------ Cascade

// ------------------------------------------------------------------------------ HashEvict's replay

constexpr int kReplayThreads = 256;

// One block per row, the steps in order (each step's pool is the last one's after its
// eviction): threads over the members find the largest key (ties -> the first member), then one
// thread decides and writes.
__global__ void __launch_bounds__(kReplayThreads) hash_replay_kernel(FeHashReplay p) {
  __shared__ float warp_best[kReplayThreads / kWarp];
  __shared__ int32_t warp_member[kReplayThreads / kWarp];
  const int64_t r = blockIdx.x;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  int64_t* pool = p.pool + r * (p.members + 1);
  for (int64_t i = 0; i < p.steps; ++i) {
    const int64_t t = p.first + i, a = t - p.ring;
    const float* kt = p.keys + (i * p.rows + r) * p.n;
    float best = -INFINITY;
    int32_t member = INT_MAX;
    for (int64_t m = threadIdx.x; m < p.members; m += blockDim.x) {
      const int64_t x = pool[m];
      const float key = x < 0 ? kt[0] + 1.f : kt[x];
      if (key > best) best = key, member = (int32_t)m;      // m rises: the first maximum
    }
#pragma unroll
    for (int o = kWarp / 2; o > 0; o >>= 1) {
      const float b = __shfl_xor_sync(fe::kFull, best, o);
      const int32_t m = __shfl_xor_sync(fe::kFull, member, o);
      if (b > best || (b == best && m < member)) best = b, member = m;
    }
    if (lane == 0) warp_best[warp] = best, warp_member[warp] = member;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < (int)(blockDim.x / kWarp); ++w)
        if (warp_best[w] > best || (warp_best[w] == best && warp_member[w] < member))
          best = warp_best[w], member = warp_member[w];
      bool evict = best > kt[a];                            // else the arrival goes
      if (t >= p.all_live) evict = evict && t < p.live[r];
      pool[evict ? member : p.members] = a;
    }
    __syncthreads();                                        // the pool before the next step
  }
}

constexpr int kCascadeThreads = 128;
constexpr int kMaxLevels = FE_CASCADE_MAX_LEVELS;
constexpr int kMaxKvHeads = FE_CASCADE_MAX_KV_HEADS;

// rho over a sequence's kv heads of one slot's attention (each summed over its query heads).
__device__ float reduce_heads(const FeCascadeUpdate& p, int64_t row0, int64_t slot) {
  float vals[kMaxKvHeads];
  const int64_t kv = p.kv_heads, n = p.n, g = p.group;
  float sum = 0.f, mx = -INFINITY;
  for (int64_t h = 0; h < kv; ++h) {
    float s = 0.f;
    for (int64_t j = 0; j < g; ++j) s += p.probs[((row0 + h) * g + j) * n + slot];
    if (p.reduce == FE_REDUCE_MEDIAN) vals[h] = s;
    sum += s;
    mx = fmaxf(mx, s);
  }
  if (p.reduce == FE_REDUCE_MEAN) return sum / (float)kv;
  if (p.reduce == FE_REDUCE_MAX) return mx;
  for (int64_t a = 1; a < kv; ++a) {                // insertion sort; torch.median is the lower
    const float x = vals[a];
    int64_t c = a - 1;
    for (; c >= 0 && vals[c] > x; --c) vals[c + 1] = vals[c];
    vals[c + 1] = x;
  }
  return vals[(kv - 1) / 2];
}

__device__ __forceinline__ int64_t wrap(int64_t x, int64_t m) { return ((x % m) + m) % m; }

// Algorithm 1 for one row (policies/cascade.py `_plan`): the simultaneous moves (src[i], dst[i]),
// i <= levels, that insert the scratch token, with the row's start/count updated.
__device__ void cascade_plan(const FeCascadeUpdate& p, int64_t row, int32_t* src, int32_t* dst) {
  const int64_t R = p.rows, scratch = p.slots - 1;
  const int64_t t = p.pos[scratch * R + row];
  const bool sink = t < p.sinks;
  int64_t window = 0, held = 0;
  for (int64_t i = 0; i < p.levels; ++i) {
    window += p.sizes[i];
    held += p.count[i * R + row];
  }
  src[0] = (int32_t)scratch;
  dst[0] = (int32_t)(sink ? t : scratch);
  bool reached = !sink;
  int64_t carry = scratch, base = p.sinks;
  for (int64_t i = 0; i < p.levels; ++i) {
    const int64_t size = p.sizes[i];
    int64_t& start = p.start[i * R + row];
    int64_t& count = p.count[i * R + row];
    bool accepting = wrap(t - p.sinks, (int64_t)1 << i) == 0;
    if (p.eager_fill) accepting = accepting || held < window;
    const bool full = count == size, empty = count == 0, push = accepting && full;
    const int64_t oldest = base + start;
    const int64_t newest = base + wrap(start + count - 1, size);
    const int64_t tail = base + wrap(start + count, size);
    const float mu_in = __ldcg(&p.state[carry * R + row]);   // written by other blocks
    const float mu_new = __ldcg(&p.state[newest * R + row]);
    const bool win = p.tie_replace ? mu_in >= mu_new : mu_in > mu_new;
    const bool do_push = reached && push;
    const bool do_append = reached && !push && (accepting || empty);
    const bool do_win = reached && !accepting && !empty && win;
    const bool moved = do_push || do_append || do_win;
    src[i + 1] = (int32_t)(moved ? carry : scratch);
    dst[i + 1] = (int32_t)(moved ? (do_push ? oldest : do_append ? tail : newest) : scratch);
    if (do_push) start = wrap(start + 1, size);
    if (do_append) count += 1;
    reached = reached && push;                      // the evicted oldest goes one level down
    carry = oldest;
    base += size;
  }
}

// The per-slot scalars of one row's simultaneous moves, then the scratch slot is emptied.
__device__ void move_scalars(const FeCascadeUpdate& p, int64_t row, const int32_t* src,
                             const int32_t* dst) {
  const int64_t R = p.rows, moves = p.levels + 1;
  float score[kMaxLevels + 1], state[kMaxLevels + 1];
  int32_t pos[kMaxLevels + 1];
  uint8_t valid[kMaxLevels + 1];
  for (int64_t m = 0; m < moves; ++m) {
    score[m] = p.score[src[m] * R + row];
    state[m] = __ldcg(&p.state[src[m] * R + row]);
    pos[m] = p.pos[src[m] * R + row];
    valid[m] = p.valid[src[m] * R + row];
  }
  for (int64_t m = 0; m < moves; ++m) {
    p.score[dst[m] * R + row] = score[m];
    p.state[dst[m] * R + row] = state[m];
    p.pos[dst[m] * R + row] = pos[m];
    p.valid[dst[m] * R + row] = valid[m];
  }
  p.valid[(p.slots - 1) * R + row] = 0;
}

// Grid (sequences, slot chunks): each block updates the EMA of its slots; the last block of
// a sequence to finish (counted in `done`) then plans and moves for the sequence's kv_heads
// rows, which decide alike. Moves read all of their sources before writing any destination.
template <typename T>
__global__ void __launch_bounds__(kCascadeThreads) cascade_kernel(FeCascadeUpdate p) {
  __shared__ int32_t src[kMaxKvHeads][kMaxLevels + 1];
  __shared__ int32_t dst[kMaxKvHeads][kMaxLevels + 1];
  __shared__ bool last;
  const int64_t seq = blockIdx.x, row0 = seq * p.kv_heads, R = p.rows, moves = p.levels + 1;
  const int64_t i = p.sinks + (int64_t)blockIdx.y * blockDim.x + threadIdx.x;
  if (i < p.n) {
    const float s = reduce_heads(p, row0, i);
    for (int64_t h = 0; h < p.kv_heads; ++h) {
      float& mu = p.state[i * R + row0 + h];
      mu = fmaf(p.rate, s, mu * p.gamma);
    }
  }
  __threadfence();                                  // EMA visible before the block counts in
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&p.done[seq], 1) == (int)gridDim.y - 1;
  __syncthreads();
  if (!last) return;
  if (threadIdx.x == 0) p.done[seq] = 0;            // ready for the next step
  if (threadIdx.x < p.kv_heads)
    cascade_plan(p, row0 + threadIdx.x, src[threadIdx.x], dst[threadIdx.x]);
  __syncthreads();
  T* k = static_cast<T*>(p.k);
  T* v = static_cast<T*>(p.v);
  for (int64_t h = 0; h < p.kv_heads; ++h) {
    const int64_t row = row0 + h;
    for (int64_t e = threadIdx.x; e < p.dim; e += blockDim.x) {
      T kx[kMaxLevels + 1], vx[kMaxLevels + 1];
#pragma unroll
      for (int m = 0; m <= kMaxLevels; ++m)
        if (m < moves) {
          kx[m] = k[(src[h][m] * R + row) * p.dim + e];
          vx[m] = v[(src[h][m] * R + row) * p.dim + e];
        }
#pragma unroll
      for (int m = 0; m <= kMaxLevels; ++m)
        if (m < moves) {
          k[(dst[h][m] * R + row) * p.dim + e] = kx[m];
          v[(dst[h][m] * R + row) * p.dim + e] = vx[m];
        }
    }
  }
  if (threadIdx.x < p.kv_heads) {
    const int64_t row = row0 + threadIdx.x;
    move_scalars(p, row, src[threadIdx.x], dst[threadIdx.x]);
    for (int64_t m = 0; m < moves; ++m) p.moved_to[m * R + row] = dst[threadIdx.x][m];
  }
}

}  // namespace

extern "C" const char* fe_select_commit(const FeSelectCommit* p, cudaStream_t stream) {
  if (p->rows == 0) return nullptr;
  if (p->victims_in == nullptr && p->n_range + (p->extra >= 0 ? 1 : 0) == 0)
    return "flexevict: victim selection needs at least one candidate slot";
  constexpr int warps = 4;
  const unsigned blocks = (unsigned)((p->rows + warps - 1) / warps);
  FE_DISPATCH_DTYPE(p->dtype, T, select_commit_kernel<T><<<blocks, warps * kWarp, 0, stream>>>(*p));
  return fe::launch_status();
}

extern "C" const char* fe_lsh_hash(int dtype, const void* x, int64_t n, int64_t dim, int64_t x_row,
                                   const float* proj, int64_t bits, int64_t* codes,
                                   cudaStream_t stream) {
  const int64_t words = (bits + kWarp - 1) / kWarp;
  if (bits > FE_LSH_MAX_BITS)
    return "flexevict: SimHash supports at most " FE_STR(FE_LSH_MAX_BITS) " bits";
  if (dim > FE_LSH_MAX_DIM) return "flexevict: SimHash: head_dim too large";
  if (n == 0) return nullptr;
  const size_t bytes = dim * sizeof(float);
  FE_DISPATCH_DTYPE(dtype, T,
      lsh_hash_kernel<T><<<(unsigned)n, (unsigned)(words * kWarp), bytes, stream>>>(
          static_cast<const T*>(x), dim, x_row, proj, bits, codes, words));
  return fe::launch_status();
}

extern "C" const char* fe_cascade_update(const FeCascadeUpdate* p, cudaStream_t stream) {
  if (p->levels > kMaxLevels)
    return "flexevict: Cascade kernel supports at most " FE_STR(FE_CASCADE_MAX_LEVELS)
           " sub-caches";
  if (p->kv_heads > kMaxKvHeads)
    return "flexevict: Cascade kernel supports at most " FE_STR(FE_CASCADE_MAX_KV_HEADS)
           " kv heads";
  if (p->kv_heads < 1 || p->rows % p->kv_heads) return "flexevict: rows must be batch * kv_heads";
  if (p->rows == 0) return nullptr;
  const int64_t ema_slots = p->n > p->sinks ? p->n - p->sinks : 0;
  const int64_t chunks = (ema_slots + kCascadeThreads - 1) / kCascadeThreads;
  const dim3 grid((unsigned)(p->rows / p->kv_heads), (unsigned)(chunks > 0 ? chunks : 1));
  FE_DISPATCH_DTYPE(p->dtype, T, cascade_kernel<T><<<grid, kCascadeThreads, 0, stream>>>(*p));
  return fe::launch_status();
}

extern "C" const char* fe_hash_replay(const FeHashReplay* p, cudaStream_t stream) {
  if (p->members < 1) return "flexevict: HashEvict's replay needs a pool";
  if (p->first < p->ring || p->first + p->steps - 1 - p->ring >= p->n)
    return "flexevict: HashEvict's replay: the arriving tokens must lie within the keys";
  if (p->rows == 0 || p->steps == 0) return nullptr;
  hash_replay_kernel<<<(unsigned)p->rows, kReplayThreads, 0, stream>>>(*p);
  return fe::launch_status();
}
