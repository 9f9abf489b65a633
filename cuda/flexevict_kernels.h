// Launchers of the flexevict CUDA kernels (one per op), shared by the .cu files and the C++
// binding. Every launcher takes raw pointers, sizes and strides (in elements) in a plain struct,
// plus the stream to launch on, and returns nullptr on success or a one-line error message.
// Nothing here needs a CUDA or torch header, so binding.cpp compiles against a CPU-only torch.
#pragma once
#include <stdint.h>

// The CUDA runtime's own definition (driver_types.h); repeating an identical typedef is legal C++.
typedef struct CUstream_st* cudaStream_t;

enum FeDtype { FE_F32 = 0, FE_F16 = 1, FE_BF16 = 2 };

// What each kernel accepts (the one place these numbers live): the launchers check them, their
// error messages quote them, and the binding exports them as flexevict._C.limits(), from which
// flexevict.core.kernels decides what a kernel takes and what goes to the PyTorch reference.
#define FE_SHARED_BYTES (48 * 1024)          // a block's shared memory without opting in to more
#define FE_DECODE_MAX_DIM 256                // decode attention: head_dim
#define FE_PREFILL_MAX_DIM 128               // prefill attention: head_dim
#define FE_PREFILL_MAX_BATCH_HEADS 65535     // prefill attention: batch * heads (grid y)
#define FE_COMPACT_MAX_SEQ 4096              // prompt compaction: prompt tokens
#define FE_BUZZ_MAX_SLOTS 3072               // BUZZ pass: buffer slots
#define FE_BUZZ_MAX_DIM 256                  // BUZZ pass: head_dim
#define FE_LSH_MAX_BITS 1024                 // SimHash: bits (one warp per 32-bit word)
#define FE_LSH_MAX_DIM (FE_SHARED_BYTES / 4) // SimHash: head_dim (an fp32 row in shared memory)
#define FE_CASCADE_MAX_LEVELS 16             // Cascade: sub-caches
#define FE_CASCADE_MAX_KV_HEADS 128          // Cascade: kv heads per sequence
#define FE_PAGE_MAX_PAGES 4096               // recall's page choice: pages per row
#define FE_PAGE_MAX_DIM 256                  // recall's page choice: head_dim
#define FE_SPLIT_DECODE_MAX_DIM 256          // split-slot decode attention: head_dim ...
#define FE_SPLIT_DECODE_DIM_MULTIPLE 8       // ... a multiple of this (16-byte loads)
#define FE_SPLIT_DECODE_MAX_GROUP 8          // ... and query heads per kv head
#define FE_STR_(x) #x
#define FE_STR(x) FE_STR_(x)                 // a limit's digits, for an error message

// Decode attention of one query token per buffer row over slots [0, n), masked by `valid`.
// q (rows, group, dim); k, v (n, rows, dim); valid (n, rows); out (rows, group, dim) contiguous;
// probs (rows, group, n) fp32 contiguous; score (>= n, rows) fp32 or null: += probs summed over
// the group, for valid slots only. Rows with no valid slot get zero output and probabilities.
struct FeDecodeAttention {
  int dtype;
  int64_t rows, group, n, dim;
  const void* q;
  const void* k;
  const void* v;
  const uint8_t* valid;
  void* out;
  float* probs;
  float* score;
  int64_t q_row, q_head;            // strides of q
  int64_t k_slot, k_row, v_slot, v_row;
  int64_t valid_slot, score_slot;   // slot strides (row stride 1)
  float scale;
};

// Causal prefill attention that also sums, per key, the attention probability it receives from
// the valid queries of every query head of its kv head, without forming the S x S matrix.
// q (B, H, S, d); k, v (B, Hk, S, d); mask (B, 1, S, S) (nonzero = may attend); valid (B, S);
// out (B, H, S, d) contiguous; row_max, row_sum (B, H, S) fp32 scratch; colsum (B, Hk, S) fp32.
struct FePrefillAttention {
  int dtype;
  int64_t batch, heads, kv_heads, seq, dim;
  const void* q;
  const void* k;
  const void* v;
  const uint8_t* mask;
  const uint8_t* valid;
  void* out;
  float* row_max;
  float* row_sum;
  float* colsum;
  int64_t q_b, q_h, q_s, k_b, k_h, k_s, v_b, v_h, v_s;   // strides (last dim contiguous)
  int64_t m_b, m_q, m_k;                                  // mask strides
  int64_t valid_b;                                        // valid (B, S) batch stride
  float scale;
};

// Split-slot decode attention (flash-decoding) of one query token per buffer row (one kv head of
// one sequence) over slots [0, n), masked by `valid`. Pass 1, one block per (row, split): the
// split's slots [s * chunk, min((s + 1) * chunk, n)), every query head of the row's group read
// against one load of each K and V row: logits (rounded to the dtype) into `logits`, and per
// head the split's max, sum of exponentials and unnormalised output into `part`. Pass 2, one
// block per (row, split): the merged max M and sum L of each head, this block's share of the
// output elements sum_s exp(m_s - M) o_s / L, and the probabilities exp(logit - M) / L of the
// split's slots: written over the logits when `heads`, summed over the group into `mass` (when
// not null) and added to `score` at valid slots (when not null). Rows with no valid slot get
// zero output and probabilities.
// q (rows, group, dim); k, v (n, rows, dim), dim a multiple of 8, 16-byte aligned rows (slot and
// row strides multiples of 8); valid (n, rows) (row stride 1); logits (rows, group, n) fp32;
// part (rows, splits, group, dim + 2) fp32 scratch; out (rows, group, dim) contiguous; mass
// (rows, n) fp32 or null; score (>= n, rows) fp32 (row stride 1) or null.
struct FeSplitDecode {
  int dtype;
  int64_t rows, group, n, dim;
  int64_t splits;                   // blocks per row; the launcher sets chunk = ceil(n / splits)
  const void* q;
  const void* k;
  const void* v;
  const uint8_t* valid;
  float* logits;
  float* part;
  void* out;
  float* mass;
  float* score;
  int64_t q_row, q_head;            // strides of q
  int64_t k_slot, k_row, v_slot, v_row;
  int64_t valid_slot, score_slot;   // slot strides (row stride 1)
  int heads;                        // write each head's probabilities over `logits`
  float scale;
};

enum FeValueSource { FE_VALUE_SCORE = 0, FE_VALUE_TENSOR = 1, FE_VALUE_HAMMING = 2 };
enum FeCommit { FE_COMMIT_NONE = 0, FE_COMMIT_MASK = 1, FE_COMMIT_REPLACE = 2, FE_COMMIT_RING = 3 };

// Per buffer row: the victim among candidate slots [0, n_range) + {extra} (lowest value; empty
// slots first; ties -> smallest pos, then first candidate), then the commit of the scratch slot
// (slots - 1). Buffer tensors (slots, rows[, dim]) are contiguous.
struct FeSelectCommit {
  int dtype;
  int64_t rows, dim, slots;
  void* k;
  void* v;
  float* score;
  float* state;
  int32_t* pos;
  uint8_t* valid;
  int64_t n_range, extra;          // candidates; extra < 0: none
  int source;                      // FeValueSource
  const float* value;              // FE_VALUE_TENSOR: (candidates, rows)
  int64_t protect;                 // the first `protect` candidates are +inf while valid
  const int64_t* query_codes;      // FE_VALUE_HAMMING: (rows, query_group, words)
  int64_t query_group, words;
  const int64_t* codes;            // (slots, rows, words), or null: the code is `state` (words 1)
  int commit;                      // FeCommit
  int64_t cursor;                  // FE_COMMIT_RING: the oldest recent slot
  const int64_t* cursor_at;        // or null: the cursor read from device memory instead (a
                                   // CUDA graph's replays then take the current one)
  int extra_is_cursor;             // with cursor_at: the extra candidate is that cursor
  const int64_t* victims_in;       // (rows,) given victims (no selection), or null
  int64_t* victims_out;            // (rows,)
};

// Per buffer row (RingPolicy prefill of a prompt longer than the buffer): left-align the real
// tokens, keep the `prefix` best by rank among those older than the last `ring`, in position
// order, then the last `ring`; write them into buffer slots [0, prefix + ring).
// k, v (S, rows, dim); pos, valid, scores, rank (S, rows) contiguous (scores may be null).
struct FeCompactPrompt {
  int dtype;
  int64_t seq, rows, dim, prefix, ring;
  const void* k;
  const void* v;
  const int32_t* pos;
  const uint8_t* valid;
  const float* scores;
  const float* rank;
  int64_t k_slot, k_row, v_slot, v_row;
  void* out_k;
  void* out_v;
  float* out_score;
  float* out_state;
  int32_t* out_pos;
  uint8_t* out_valid;
};

// One BUZZ pass over buffer slots [0, n) of every row, compacting kept slots to the front.
// kept (rows,) int32 receives each row's kept count.
struct FeBuzzPass {
  int dtype;
  int64_t rows, dim, n;
  int64_t sinks, window, threshold, stride;
  void* k;
  void* v;
  float* score;
  float* state;
  int32_t* pos;
  uint8_t* valid;
  int32_t* kept;
};

enum FeReduce { FE_REDUCE_MEAN = 0, FE_REDUCE_MAX = 1, FE_REDUCE_MEDIAN = 2 };

// Cascade's decode step for every sequence: EMA of the attention (slots [sinks, n)), reduced
// over a sequence's kv heads, then Algorithm 1's insertion of the scratch token.
// probs (rows, group, n) fp32; start, count (levels, rows) int64; sizes (levels,) int64;
// done: a zeroed int32 counter per sequence, left zeroed again by the kernel.
struct FeCascadeUpdate {
  int dtype;
  int64_t rows, dim, slots, n, group, kv_heads, levels, sinks;
  void* k;
  void* v;
  float* score;
  float* state;
  int32_t* pos;
  uint8_t* valid;
  const float* probs;
  int64_t* start;
  int64_t* count;
  const int64_t* sizes;
  int32_t* done;                   // (rows / kv_heads,) zeros: blocks finished per sequence
  int64_t* moved_to;               // (levels + 1, rows): each move's destination (dirty slots)
  float gamma, rate;               // mu <- mu * gamma + rate * s (rate = 1 - gamma, as fp32)
  int reduce;                      // FeReduce
  int tie_replace, eager_fill;
};

// Recall (Quest's page bound) per buffer row: the `pages` pages of highest bound
// sum_e s+_e max_e + s-_e min_e in fp32, s+ and s- the positive and negative parts of the row's
// query heads summed (rounded to the dtype), among the candidates: a page whose first token is
// below limit[row] and that holds a token past the first `sinks`; ties and too few candidates
// go to the lower page. q (rows, group, dim) and summary (rows, 2, dim, n_pages) [max; min]
// contiguous in one dtype; limit (rows,) int64; out (rows, pages) int64.
struct FePageSelect {
  int dtype;
  int64_t rows, group, dim, n_pages, page, sinks, pages;
  const void* q;
  const void* summary;
  const int64_t* limit;
  int64_t* out;
};

// HashEvict's prompt replay over one chunk of steps t = first .. first + steps - 1 (Algorithm 1
// on token indices), per buffer row: the pool member (pool[:members]; -1 empty, competing as
// token 0 plus one) or the token leaving the ring, a = t - ring, with the largest key goes, and
// a takes its place (a row evicting its arrival writes the spare entry pool[members]); a row
// takes part while t < live[row] (every row below all_live). keys (steps, rows, n) fp32
// contiguous, keys[i][row][x] = token x's key at step first + i; pool (rows, members + 1)
// int64, changed in place; live (rows,) int64.
struct FeHashReplay {
  const float* keys;
  int64_t* pool;
  const int64_t* live;
  int64_t steps, rows, n, members, first, ring, all_live;
};

#ifdef __cplusplus
extern "C" {
#endif

const char* fe_decode_attention(const FeDecodeAttention* p, cudaStream_t stream);
// Bytes of shared memory decode attention needs for `group` query heads of `dim` (a launch
// takes at most FE_SHARED_BYTES).
int64_t fe_decode_attention_shared_bytes(int64_t group, int64_t dim);
const char* fe_prefill_attention(const FePrefillAttention* p, cudaStream_t stream);
// Two launches on `stream`, no host synchronisation, no allocation: capturable in a CUDA graph.
const char* fe_split_decode(const FeSplitDecode* p, cudaStream_t stream);
// The split count the launcher picks for `rows` rows of `n` slots (splits 0 asks the binding
// for it): fixed by the sizes alone, so one CUDA graph replays it.
int64_t fe_split_decode_splits(int64_t rows, int64_t n);
const char* fe_select_commit(const FeSelectCommit* p, cudaStream_t stream);
const char* fe_compact_prompt(const FeCompactPrompt* p, cudaStream_t stream);
const char* fe_buzz_pass(const FeBuzzPass* p, cudaStream_t stream);
const char* fe_cascade_update(const FeCascadeUpdate* p, cudaStream_t stream);
const char* fe_page_select(const FePageSelect* p, cudaStream_t stream);
const char* fe_hash_replay(const FeHashReplay* p, cudaStream_t stream);

// SimHash codes: x (n, dim) with row stride x_row; proj (bits, dim) fp32 contiguous;
// codes (n, ceil(bits / 32)) int64, bit j in bit j % 32 of word j / 32.
const char* fe_lsh_hash(int dtype, const void* x, int64_t n, int64_t dim, int64_t x_row,
                        const float* proj, int64_t bits, int64_t* codes, cudaStream_t stream);

// 4-bit asymmetric group quantisation of x viewed as (outer, length, inner), grouped along
// length: packed (outer, padded / 2, inner) uint8 (element 2i in the low nibble), mins and
// scales (outer, groups, inner) in x's dtype; x ~= code * scale + min.
const char* fe_quantize_4bit(int dtype, const void* x, int64_t outer, int64_t length,
                             int64_t inner, int64_t group, uint8_t* packed, void* mins,
                             void* scales, cudaStream_t stream);
const char* fe_dequantize_4bit(int dtype, const uint8_t* packed, const void* mins,
                               const void* scales, int64_t outer, int64_t length, int64_t inner,
                               int64_t group, void* out, cudaStream_t stream);

// Rows of row_bytes bytes between a table of table_rows rows (device memory, or pinned host
// memory the GPU reaches directly) and `rows` (n rows, device memory), index (n,) int64 on the
// device: gather rows[i] = table[index[i]], scatter table[index[i]] = rows[i].
const char* fe_copy_rows(void* table, int64_t table_rows, void* rows, const int64_t* index,
                         int64_t n, int64_t row_bytes, bool scatter, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
