// The thin Python binding of the kernels (built as flexevict._C): checks every tensor (device,
// dtype, shape, layout) with a one-line error naming the argument and the fix, then calls the
// launchers of flexevict_kernels.h. It includes no CUDA header: the stream comes from Python as
// an integer (torch.cuda.current_stream().cuda_stream), so it compiles against a CPU torch too.
#include <torch/extension.h>

#include <c10/core/DeviceGuard.h>

#include <string>
#include <tuple>
#include <vector>

#include "flexevict_kernels.h"

namespace {

using at::Tensor;

void check_device(const Tensor& t, const char* name, const Tensor& ref) {
  TORCH_CHECK_VALUE(t.is_cuda(), "flexevict._C: ", name, " must be a CUDA tensor (got ",
                    t.device(), "); move it with .cuda()");
  TORCH_CHECK_VALUE(t.device() == ref.device(), "flexevict._C: ", name, " is on ", t.device(),
                    " but the other inputs are on ", ref.device(), "; move it there");
}

void check_dtype(const Tensor& t, const char* name, at::ScalarType want) {
  TORCH_CHECK_VALUE(t.scalar_type() == want, "flexevict._C: ", name, " must be ", want,
                    " (got ", t.scalar_type(), "); convert it with .to(", want, ")");
}

void check_contiguous(const Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.is_contiguous(), "flexevict._C: ", name,
                    " must be contiguous; pass .contiguous()");
}

void check_shape(const Tensor& t, const char* name, std::vector<int64_t> shape) {
  TORCH_CHECK_VALUE(t.sizes() == at::IntArrayRef(shape), "flexevict._C: ", name,
                    " must have shape ", at::IntArrayRef(shape), " (got ", t.sizes(), ")");
}

void check_last_dim(const Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.size(-1) <= 1 || t.stride(-1) == 1, "flexevict._C: ", name,
                    " must be contiguous in its last dim; pass .contiguous()");
}

int dtype_code(const Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return FE_F32;
    case at::kHalf: return FE_F16;
    case at::kBFloat16: return FE_BF16;
    default:
      TORCH_CHECK_VALUE(false, "flexevict._C: ", name,
                        " must be float32, float16 or bfloat16 (got ", t.scalar_type(), ")");
  }
  return -1;
}

cudaStream_t as_stream(int64_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

void raise_if(const char* err, const char* op) {
  TORCH_CHECK(err == nullptr, "flexevict._C.", op, ": ", err ? err : "");
}

// The KV buffer's tensors: k, v (slots, rows, dim) of one float dtype; score, state fp32,
// pos int32, valid bool (slots, rows); all contiguous on one CUDA device.
struct Buf {
  Tensor k, v, score, state, pos, valid;
  c10::optional<Tensor> cursor_at;    // the ring cursor, where the buffer keeps it on the device

  // The tensors of a flexevict.core.kv.KVBuffer, read by name and checked: a kernel call takes
  // its buffer, not six tensors.
  static Buf of(const pybind11::handle& buffer) {
    auto get = [&](const char* name) { return buffer.attr(name).cast<Tensor>(); };
    Buf buf{get("k"), get("v"), get("score"), get("state"), get("pos"), get("valid"), {}};
    const pybind11::object at = pybind11::getattr(buffer, "cursor_at", pybind11::none());
    if (!at.is_none()) buf.cursor_at = at.cast<Tensor>();
    buf.check();
    return buf;
  }

  void check() const {
    check_device(k, "buffer k", k);
    dtype_code(k, "buffer k");
    TORCH_CHECK_VALUE(k.dim() == 3, "flexevict._C: buffer k must be (slots, rows, dim)");
    const int64_t slots = k.size(0), rows = k.size(1);
    const std::pair<const Tensor*, const char*> all[] = {
        {&k, "buffer k"}, {&v, "buffer v"}, {&score, "buffer score"}, {&state, "buffer state"},
        {&pos, "buffer pos"}, {&valid, "buffer valid"}};
    for (const auto& [t, name] : all) {
      check_device(*t, name, k);
      check_contiguous(*t, name);
    }
    check_dtype(v, "buffer v", k.scalar_type());
    check_shape(v, "buffer v", k.sizes().vec());
    check_dtype(score, "buffer score", at::kFloat);
    check_dtype(state, "buffer state", at::kFloat);
    check_dtype(pos, "buffer pos", at::kInt);
    check_dtype(valid, "buffer valid", at::kBool);
    for (const auto& t : {score, state, pos, valid})
      check_shape(t, "buffer score/state/pos/valid", {slots, rows});
    if (cursor_at) {
      check_device(*cursor_at, "buffer cursor_at", k);
      check_dtype(*cursor_at, "buffer cursor_at", at::kLong);
      TORCH_CHECK_VALUE(cursor_at->numel() == 1, "flexevict._C: buffer cursor_at must hold one "
                        "slot (got ", cursor_at->sizes(), ")");
    }
  }
};

// --------------------------------------------------------------------------------- ops

// -> out (rows, group, dim) in q's dtype, probs (rows, group, n) fp32.
std::tuple<Tensor, Tensor> decode_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                            const Tensor& valid,
                                            const c10::optional<Tensor>& score, double scale,
                                            int64_t stream) {
  check_device(q, "q", q);
  const int dtype = dtype_code(q, "q");
  TORCH_CHECK_VALUE(q.dim() == 3, "flexevict._C: q must be (rows, group, dim) (got ", q.sizes(),
                    ")");
  const int64_t rows = q.size(0), group = q.size(1), dim = q.size(2);
  TORCH_CHECK_VALUE(k.dim() == 3, "flexevict._C: k must be (n, rows, dim) (got ", k.sizes(), ")");
  const int64_t n = k.size(0);
  for (const auto& [t, name] : {std::pair{&k, "k"}, std::pair{&v, "v"}}) {
    check_device(*t, name, q);
    check_dtype(*t, name, q.scalar_type());
    check_shape(*t, name, {n, rows, dim});
    check_last_dim(*t, name);
  }
  check_last_dim(q, "q");
  check_device(valid, "valid", q);
  check_dtype(valid, "valid", at::kBool);
  check_shape(valid, "valid", {n, rows});
  TORCH_CHECK_VALUE(valid.stride(1) == 1, "flexevict._C: valid must be contiguous per slot");
  FeDecodeAttention p{};
  if (score) {
    check_device(*score, "score", q);
    check_dtype(*score, "score", at::kFloat);
    TORCH_CHECK_VALUE(score->dim() == 2 && score->size(0) >= n && score->size(1) == rows &&
                          score->stride(1) == 1,
                      "flexevict._C: score must be (>= n, rows) fp32, contiguous per slot (got ",
                      score->sizes(), ")");
    p.score = score->data_ptr<float>();
    p.score_slot = score->stride(0);
  }
  c10::DeviceGuard guard(q.device());
  Tensor out = at::empty({rows, group, dim}, q.options());
  Tensor probs = at::empty({rows, group, n}, q.options().dtype(at::kFloat));
  p.dtype = dtype;
  p.rows = rows, p.group = group, p.n = n, p.dim = dim;
  p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr();
  p.valid = reinterpret_cast<const uint8_t*>(valid.data_ptr<bool>());
  p.out = out.data_ptr(), p.probs = probs.data_ptr<float>();
  p.q_row = q.stride(0), p.q_head = q.stride(1);
  p.k_slot = k.stride(0), p.k_row = k.stride(1), p.v_slot = v.stride(0), p.v_row = v.stride(1);
  p.valid_slot = valid.stride(0);
  p.scale = (float)scale;
  raise_if(fe_decode_attention(&p, as_stream(stream)), "decode_attention");
  return {out, probs};
}

// Split-slot decode attention (FeSplitDecode): q (rows, group, dim); k, v (n, rows, dim), rows
// 16-byte aligned; valid (n, rows); score (>= n, rows) fp32 or None; splits 0: the launcher's
// choice -> out (rows, group, dim) in q's dtype and probs fp32: (rows, group, n) per query head
// when `heads`, else (rows, 1, n), each slot's probability summed over the group.
std::tuple<Tensor, Tensor> split_decode_attention(const Tensor& q, const Tensor& k,
                                                  const Tensor& v, const Tensor& valid,
                                                  const c10::optional<Tensor>& score,
                                                  double scale, int64_t splits, bool heads,
                                                  int64_t stream) {
  check_device(q, "q", q);
  const int dtype = dtype_code(q, "q");
  TORCH_CHECK_VALUE(q.dim() == 3, "flexevict._C: q must be (rows, group, dim) (got ", q.sizes(),
                    ")");
  const int64_t rows = q.size(0), group = q.size(1), dim = q.size(2);
  TORCH_CHECK_VALUE(k.dim() == 3, "flexevict._C: k must be (n, rows, dim) (got ", k.sizes(), ")");
  const int64_t n = k.size(0);
  for (const auto& [t, name] : {std::pair{&k, "k"}, std::pair{&v, "v"}}) {
    check_device(*t, name, q);
    check_dtype(*t, name, q.scalar_type());
    check_shape(*t, name, {n, rows, dim});
    check_last_dim(*t, name);
    TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0 &&
                          t->stride(0) % FE_SPLIT_DECODE_DIM_MULTIPLE == 0 &&
                          t->stride(1) % FE_SPLIT_DECODE_DIM_MULTIPLE == 0,
                      "flexevict._C: ", name, " must have 16-byte aligned rows (strides ",
                      t->strides(), "); pass .contiguous()");
  }
  check_last_dim(q, "q");
  TORCH_CHECK_VALUE(dim > 0 && dim <= FE_SPLIT_DECODE_MAX_DIM &&
                        dim % FE_SPLIT_DECODE_DIM_MULTIPLE == 0,
                    "flexevict._C: split decode attention needs head_dim a multiple of ",
                    FE_SPLIT_DECODE_DIM_MULTIPLE, " up to ", FE_SPLIT_DECODE_MAX_DIM, " (got ",
                    dim, ")");
  TORCH_CHECK_VALUE(group >= 1 && group <= FE_SPLIT_DECODE_MAX_GROUP, "flexevict._C: split "
                    "decode attention takes 1 to ", FE_SPLIT_DECODE_MAX_GROUP,
                    " query heads per kv head (got ", group, ")");
  check_device(valid, "valid", q);
  check_dtype(valid, "valid", at::kBool);
  check_shape(valid, "valid", {n, rows});
  TORCH_CHECK_VALUE(valid.stride(1) == 1 || rows <= 1,
                    "flexevict._C: valid must be contiguous per slot");
  TORCH_CHECK_VALUE(splits >= 0, "flexevict._C: splits must be >= 0 (0: automatic; got ", splits,
                    ")");
  FeSplitDecode p{};
  if (score) {
    check_device(*score, "score", q);
    check_dtype(*score, "score", at::kFloat);
    TORCH_CHECK_VALUE(score->dim() == 2 && score->size(0) >= n && score->size(1) == rows &&
                          (score->stride(1) == 1 || rows <= 1),
                      "flexevict._C: score must be (>= n, rows) fp32, contiguous per slot (got ",
                      score->sizes(), ")");
    p.score = score->data_ptr<float>();
    p.score_slot = score->stride(0);
  }
  if (splits == 0) splits = fe_split_decode_splits(rows, n);
  c10::DeviceGuard guard(q.device());
  const auto f32 = q.options().dtype(at::kFloat);
  Tensor out = at::empty({rows, group, dim}, q.options());
  Tensor logits = at::empty({rows, group, n}, f32);       // probabilities in place (heads)
  Tensor part = at::empty({rows, splits, group, dim + 2}, f32);
  const bool per_head = heads || group == 1;             // one head: its probabilities are the sum
  Tensor mass = per_head ? logits : at::empty({rows, 1, n}, f32);
  p.dtype = dtype;
  p.rows = rows, p.group = group, p.n = n, p.dim = dim, p.splits = splits;
  p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr();
  p.valid = reinterpret_cast<const uint8_t*>(valid.data_ptr<bool>());
  p.logits = logits.data_ptr<float>(), p.part = part.data_ptr<float>();
  p.out = out.data_ptr(), p.mass = per_head ? nullptr : mass.data_ptr<float>();
  p.q_row = q.stride(0), p.q_head = q.stride(1);
  p.k_slot = k.stride(0), p.k_row = k.stride(1), p.v_slot = v.stride(0), p.v_row = v.stride(1);
  p.valid_slot = valid.stride(0);
  p.heads = per_head;
  p.scale = (float)scale;
  raise_if(fe_split_decode(&p, as_stream(stream)), "split_decode_attention");
  return {out, mass};
}

// -> out (B, H, S, d) in q's dtype, colsum (B, Hk, S) fp32.
std::tuple<Tensor, Tensor> prefill_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const Tensor& mask, const Tensor& valid,
                                             double scale, int64_t stream) {
  check_device(q, "q", q);
  const int dtype = dtype_code(q, "q");
  TORCH_CHECK_VALUE(q.dim() == 4 && k.dim() == 4, "flexevict._C: q, k, v must be (B, H, S, d)");
  const int64_t b = q.size(0), h = q.size(1), s = q.size(2), d = q.size(3), hk = k.size(1);
  TORCH_CHECK_VALUE(hk > 0 && h % hk == 0, "flexevict._C: query heads (", h,
                    ") must be a multiple of kv heads (", hk, ")");
  check_last_dim(q, "q");
  for (const auto& [t, name] : {std::pair{&k, "k"}, std::pair{&v, "v"}}) {
    check_device(*t, name, q);
    check_dtype(*t, name, q.scalar_type());
    check_shape(*t, name, {b, hk, s, d});
    check_last_dim(*t, name);
  }
  check_device(mask, "mask", q);
  check_dtype(mask, "mask", at::kBool);
  TORCH_CHECK_VALUE(mask.dim() == 4 && mask.size(0) == b && mask.size(1) == 1 &&
                        mask.size(2) == s && mask.size(3) == s,
                    "flexevict._C: mask must be (B, 1, S, S) (got ", mask.sizes(), ")");
  check_device(valid, "valid", q);
  check_dtype(valid, "valid", at::kBool);
  check_shape(valid, "valid", {b, s});
  TORCH_CHECK_VALUE(valid.stride(1) == 1, "flexevict._C: valid must be contiguous per row");
  c10::DeviceGuard guard(q.device());
  const auto f32 = q.options().dtype(at::kFloat);
  Tensor out = at::empty({b, h, s, d}, q.options());
  Tensor row_max = at::empty({b, h, s}, f32), row_sum = at::empty({b, h, s}, f32);
  Tensor colsum = at::empty({b, hk, s}, f32);
  FePrefillAttention p{};
  p.dtype = dtype;
  p.batch = b, p.heads = h, p.kv_heads = hk, p.seq = s, p.dim = d;
  p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr();
  p.mask = reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>());
  p.valid = reinterpret_cast<const uint8_t*>(valid.data_ptr<bool>());
  p.out = out.data_ptr(), p.row_max = row_max.data_ptr<float>();
  p.row_sum = row_sum.data_ptr<float>(), p.colsum = colsum.data_ptr<float>();
  p.q_b = q.stride(0), p.q_h = q.stride(1), p.q_s = q.stride(2);
  p.k_b = k.stride(0), p.k_h = k.stride(1), p.k_s = k.stride(2);
  p.v_b = v.stride(0), p.v_h = v.stride(1), p.v_s = v.stride(2);
  p.m_b = mask.stride(0), p.m_q = mask.stride(2), p.m_k = mask.stride(3);
  p.valid_b = valid.stride(0);
  p.scale = (float)scale;
  raise_if(fe_prefill_attention(&p, as_stream(stream)), "prefill_attention");
  return {out, colsum};
}

// Candidate slots [0, n_range) + {extra} (extra < 0: none) of `buffer`, the commit mode
// (FeCommit) and the ring's cursor: what every selection shares.
FeSelectCommit selection(const Buf& buf, int64_t n_range, int64_t extra, int64_t commit,
                         int64_t cursor) {
  const int64_t slots = buf.k.size(0);
  TORCH_CHECK_VALUE(n_range >= 0 && n_range <= slots && extra < slots && cursor < slots,
                    "flexevict._C: candidate slots out of range (", n_range, ", ", extra,
                    ", cursor ", cursor, ") for ", slots, " slots");
  TORCH_CHECK_VALUE(commit >= FE_COMMIT_NONE && commit <= FE_COMMIT_RING,
                    "flexevict._C: unknown commit mode ", commit);
  TORCH_CHECK_VALUE(commit != FE_COMMIT_RING || cursor >= 0,
                    "flexevict._C: ring commit needs a cursor");
  FeSelectCommit p{};
  p.source = FE_VALUE_SCORE;
  p.n_range = n_range, p.extra = extra, p.commit = (int)commit, p.cursor = cursor;
  if (buf.cursor_at) {
    // the host's cursor and an extra candidate equal to it (the ring's oldest slot, as every
    // caller passes it) are read from the device when the kernel runs: a graph replays them
    p.cursor_at = buf.cursor_at->data_ptr<int64_t>();
    p.extra_is_cursor = extra >= 0 && extra == cursor;
  }
  return p;
}

// Launch a filled-in selection on the buffer -> victims (rows,) int64.
Tensor launch_selection(const Buf& buf, FeSelectCommit& p, int64_t stream) {
  const int64_t rows = buf.k.size(1);
  TORCH_CHECK_VALUE(p.victims_in || p.n_range + (p.extra >= 0 ? 1 : 0) > 0,
                    "flexevict._C: no candidate slot to choose a victim from");
  Tensor victims = at::empty({rows}, buf.k.options().dtype(at::kLong));
  c10::DeviceGuard guard(buf.k.device());
  p.dtype = dtype_code(buf.k, "buffer k");
  p.rows = rows, p.dim = buf.k.size(2), p.slots = buf.k.size(0);
  p.k = buf.k.data_ptr(), p.v = buf.v.data_ptr();
  p.score = buf.score.data_ptr<float>(), p.state = buf.state.data_ptr<float>();
  p.pos = buf.pos.data_ptr<int32_t>();
  p.valid = reinterpret_cast<uint8_t*>(buf.valid.data_ptr<bool>());
  p.victims_out = victims.data_ptr<int64_t>();
  raise_if(fe_select_commit(&p, as_stream(stream)), "select_commit");
  return victims;
}

// The lowest of the buffer's score (or of `value` (candidates, rows) fp32) among the candidate
// slots, or the given `victims` (rows,) int64, then the commit -> victims.
Tensor select_commit(const pybind11::handle& buffer, int64_t n_range, int64_t extra,
                     const c10::optional<Tensor>& value, int64_t commit, int64_t cursor,
                     const c10::optional<Tensor>& victims, int64_t stream) {
  const Buf buf = Buf::of(buffer);
  FeSelectCommit p = selection(buf, n_range, extra, commit, cursor);
  if (value) {
    check_device(*value, "value", buf.k);
    check_dtype(*value, "value", at::kFloat);
    check_shape(*value, "value", {n_range + (extra >= 0 ? 1 : 0), buf.k.size(1)});
    check_contiguous(*value, "value");
    p.source = FE_VALUE_TENSOR;
    p.value = value->data_ptr<float>();
  }
  if (victims) {
    check_device(*victims, "victims", buf.k);
    check_dtype(*victims, "victims", at::kLong);
    check_shape(*victims, "victims", {buf.k.size(1)});
    check_contiguous(*victims, "victims");
    p.victims_in = victims->data_ptr<int64_t>();
  }
  return launch_selection(buf, p, stream);
}

// HashEvict: per row, the candidate (slots [0, n_range) + {extra}, the first `protect` kept)
// whose key codes are farthest in Hamming distance from the query codes (rows, group, words)
// int64, masked out for this step -> victims. codes (slots, rows, words), or None when each
// slot's one-word code is kept in the buffer's state.
Tensor hash_select(const pybind11::handle& buffer, int64_t n_range, int64_t extra,
                   int64_t protect, const Tensor& query_codes,
                   const c10::optional<Tensor>& codes, int64_t stream) {
  const Buf buf = Buf::of(buffer);
  FeSelectCommit p = selection(buf, n_range, extra, FE_COMMIT_MASK, extra);
  check_device(query_codes, "query_codes", buf.k);
  check_dtype(query_codes, "query_codes", at::kLong);
  check_contiguous(query_codes, "query_codes");
  TORCH_CHECK_VALUE(query_codes.dim() == 3 && query_codes.size(0) == buf.k.size(1),
                    "flexevict._C: query_codes must be (rows, group, words) (got ",
                    query_codes.sizes(), ")");
  p.source = FE_VALUE_HAMMING, p.protect = protect;
  p.query_codes = query_codes.data_ptr<int64_t>();
  p.query_group = query_codes.size(1), p.words = query_codes.size(2);
  if (codes) {
    check_device(*codes, "codes", buf.k);
    check_dtype(*codes, "codes", at::kLong);
    check_contiguous(*codes, "codes");
    check_shape(*codes, "codes", {buf.k.size(0), buf.k.size(1), p.words});
    p.codes = codes->data_ptr<int64_t>();
  } else {
    TORCH_CHECK_VALUE(p.words == 1, "flexevict._C: codes kept in state hold one word; pass codes");
  }
  return launch_selection(buf, p, stream);
}

void lsh_hash(const Tensor& x, const Tensor& proj, Tensor& codes, int64_t stream) {
  check_device(x, "x", x);
  const int dtype = dtype_code(x, "x");
  TORCH_CHECK_VALUE(x.dim() == 2, "flexevict._C: x must be (n, dim) (got ", x.sizes(), ")");
  check_last_dim(x, "x");
  check_device(proj, "proj", x);
  check_dtype(proj, "proj", at::kFloat);
  check_contiguous(proj, "proj");
  TORCH_CHECK_VALUE(proj.dim() == 2 && proj.size(1) == x.size(1),
                    "flexevict._C: proj must be (bits, ", x.size(1), ") (got ", proj.sizes(), ")");
  const int64_t words = (proj.size(0) + 31) / 32;
  check_device(codes, "codes", x);
  check_dtype(codes, "codes", at::kLong);
  check_shape(codes, "codes", {x.size(0), words});
  check_contiguous(codes, "codes");
  c10::DeviceGuard guard(x.device());
  raise_if(fe_lsh_hash(dtype, x.data_ptr(), x.size(0), x.size(1), x.stride(0),
                       proj.data_ptr<float>(), proj.size(0), codes.data_ptr<int64_t>(),
                       as_stream(stream)),
           "lsh_hash");
}

// The prompt k, v (S, rows, dim), pos, valid, scores, rank (S, rows) into `buffer`'s prefix and
// ring (its layout's regions).
void compact_prompt(const Tensor& k, const Tensor& v, const Tensor& pos, const Tensor& valid,
                    const c10::optional<Tensor>& scores, const Tensor& rank,
                    const pybind11::handle& buffer, int64_t stream) {
  const Buf buf = Buf::of(buffer);
  const Tensor &out_k = buf.k, &out_v = buf.v;
  const pybind11::object layout = buffer.attr("layout");
  const auto prefix = layout.attr("prefix").cast<int64_t>();
  const auto ring = layout.attr("ring").cast<int64_t>();
  TORCH_CHECK_VALUE(k.dim() == 3, "flexevict._C: k must be (S, rows, dim) (got ", k.sizes(), ")");
  const int64_t s = k.size(0), rows = out_k.size(1), dim = out_k.size(2);
  TORCH_CHECK_VALUE(prefix >= 0 && ring >= 0 && prefix + ring <= out_k.size(0) && prefix + ring < s,
                    "flexevict._C: prefix + ring (", prefix + ring, ") must be below the prompt (",
                    s, ") and fit the buffer (", out_k.size(0), ")");
  for (const auto& [t, name] : {std::pair{&k, "k"}, std::pair{&v, "v"}}) {
    check_device(*t, name, out_k);
    check_dtype(*t, name, out_k.scalar_type());
    check_shape(*t, name, {s, rows, dim});
    check_last_dim(*t, name);
  }
  for (const auto& [t, name, dt] : {std::tuple{&pos, "pos", at::kInt},
                                    std::tuple{&valid, "valid", at::kBool},
                                    std::tuple{&rank, "rank", at::kFloat}}) {
    check_device(*t, name, out_k);
    check_dtype(*t, name, dt);
    check_shape(*t, name, {s, rows});
    check_contiguous(*t, name);
  }
  FeCompactPrompt p{};
  if (scores) {
    check_device(*scores, "scores", out_k);
    check_dtype(*scores, "scores", at::kFloat);
    check_shape(*scores, "scores", {s, rows});
    check_contiguous(*scores, "scores");
    p.scores = scores->data_ptr<float>();
  }
  c10::DeviceGuard guard(k.device());
  p.dtype = dtype_code(k, "k");
  p.seq = s, p.rows = rows, p.dim = dim, p.prefix = prefix, p.ring = ring;
  p.k = k.data_ptr(), p.v = v.data_ptr();
  p.pos = pos.data_ptr<int32_t>();
  p.valid = reinterpret_cast<const uint8_t*>(valid.data_ptr<bool>());
  p.rank = rank.data_ptr<float>();
  p.k_slot = k.stride(0), p.k_row = k.stride(1), p.v_slot = v.stride(0), p.v_row = v.stride(1);
  p.out_k = out_k.data_ptr(), p.out_v = out_v.data_ptr();
  p.out_score = buf.score.data_ptr<float>(), p.out_state = buf.state.data_ptr<float>();
  p.out_pos = buf.pos.data_ptr<int32_t>();
  p.out_valid = reinterpret_cast<uint8_t*>(buf.valid.data_ptr<bool>());
  raise_if(fe_compact_prompt(&p, as_stream(stream)), "compact_prompt");
}

Tensor buzz_pass(const pybind11::handle& buffer, int64_t n, int64_t sinks, int64_t window,
                 int64_t threshold, int64_t stride, int64_t stream) {
  const Buf buf = Buf::of(buffer);
  const Tensor &k = buf.k, &v = buf.v, &score = buf.score, &state = buf.state, &pos = buf.pos,
               &valid = buf.valid;
  TORCH_CHECK_VALUE(n >= 0 && n <= k.size(0), "flexevict._C: n (", n, ") exceeds the buffer's ",
                    k.size(0), " slots");
  TORCH_CHECK_VALUE(stride >= 1 && sinks >= 0 && window >= 0,
                    "flexevict._C: BUZZ needs stride >= 1, sinks >= 0, window >= 0");
  Tensor kept = at::empty({k.size(1)}, k.options().dtype(at::kInt));
  c10::DeviceGuard guard(k.device());
  FeBuzzPass p{};
  p.dtype = dtype_code(k, "buffer k");
  p.rows = k.size(1), p.dim = k.size(2), p.n = n;
  p.sinks = sinks, p.window = window, p.threshold = threshold, p.stride = stride;
  p.k = k.data_ptr(), p.v = v.data_ptr();
  p.score = score.data_ptr<float>(), p.state = state.data_ptr<float>();
  p.pos = pos.data_ptr<int32_t>(), p.valid = reinterpret_cast<uint8_t*>(valid.data_ptr<bool>());
  p.kept = kept.data_ptr<int32_t>();
  raise_if(fe_buzz_pass(&p, as_stream(stream)), "buzz_pass");
  return kept;
}

// Cascade's step on `buffer` (its kv_heads per sequence) with the sub-caches' start, count
// (levels, rows) and sizes (levels,) int64, under `rule` (flexevict.core.kernels.CascadeRule:
// sinks, gamma, reduce, tie_replace, eager_fill) -> each move's destination slot
// (levels + 1, rows), for the buffer's dirty tracking.
Tensor cascade_update(const pybind11::handle& buffer, const Tensor& probs, const Tensor& start,
                      const Tensor& count, const Tensor& sizes, const pybind11::handle& rule,
                      int64_t stream) {
  const Buf buf = Buf::of(buffer);
  const Tensor &k = buf.k, &v = buf.v, &score = buf.score, &state = buf.state, &pos = buf.pos,
               &valid = buf.valid;
  const auto kv_heads = buffer.attr("kv_heads").cast<int64_t>();
  const auto sinks = rule.attr("sinks").cast<int64_t>();
  const auto gamma = rule.attr("gamma").cast<double>();
  const auto reduction = rule.attr("reduce").cast<std::string>();
  const int reduce = reduction == "mean" ? FE_REDUCE_MEAN : reduction == "max" ? FE_REDUCE_MAX
                     : reduction == "median" ? FE_REDUCE_MEDIAN : -1;
  const int64_t slots = k.size(0), rows = k.size(1);
  check_device(probs, "probs", k);
  check_dtype(probs, "probs", at::kFloat);
  check_contiguous(probs, "probs");
  TORCH_CHECK_VALUE(probs.dim() == 3 && probs.size(0) == rows && probs.size(2) <= slots,
                    "flexevict._C: probs must be (rows, group, n <= slots) (got ", probs.sizes(),
                    ")");
  const int64_t levels = sizes.numel();
  for (const auto& [t, name, shape] :
       {std::tuple{&start, "start", std::vector<int64_t>{levels, rows}},
        std::tuple{&count, "count", std::vector<int64_t>{levels, rows}},
        std::tuple{&sizes, "sizes", std::vector<int64_t>{levels}}}) {
    check_device(*t, name, k);
    check_dtype(*t, name, at::kLong);
    check_shape(*t, name, shape);
    check_contiguous(*t, name);
  }
  TORCH_CHECK_VALUE(kv_heads >= 1 && rows % kv_heads == 0, "flexevict._C: rows (", rows,
                    ") must be a multiple of kv_heads (", kv_heads, ")");
  TORCH_CHECK_VALUE(reduce >= 0, "flexevict._C: unknown reduction ", reduction);
  Tensor done = at::zeros({rows / kv_heads}, k.options().dtype(at::kInt));
  Tensor moved_to = at::empty({levels + 1, rows}, k.options().dtype(at::kLong));
  c10::DeviceGuard guard(k.device());
  FeCascadeUpdate p{};
  p.dtype = dtype_code(k, "buffer k");
  p.rows = rows, p.dim = k.size(2), p.slots = slots, p.n = probs.size(2);
  p.group = probs.size(1), p.kv_heads = kv_heads, p.levels = levels, p.sinks = sinks;
  p.k = k.data_ptr(), p.v = v.data_ptr();
  p.score = score.data_ptr<float>(), p.state = state.data_ptr<float>();
  p.pos = pos.data_ptr<int32_t>(), p.valid = reinterpret_cast<uint8_t*>(valid.data_ptr<bool>());
  p.probs = probs.data_ptr<float>();
  p.start = start.data_ptr<int64_t>(), p.count = count.data_ptr<int64_t>();
  p.sizes = sizes.data_ptr<int64_t>(), p.done = done.data_ptr<int32_t>();
  p.moved_to = moved_to.data_ptr<int64_t>();
  p.gamma = (float)gamma, p.rate = (float)(1.0 - gamma);
  p.reduce = reduce;
  p.tie_replace = rule.attr("tie_replace").cast<bool>();
  p.eager_fill = rule.attr("eager_fill").cast<bool>();
  raise_if(fe_cascade_update(&p, as_stream(stream)), "cascade_update");
  return moved_to;
}

// x viewed as (outer, length, inner), grouped along length -> packed (outer, padded / 2, inner)
// uint8, mins and scales (outer, groups, inner) in x's dtype.
std::tuple<Tensor, Tensor, Tensor> quantize_4bit(const Tensor& x, int64_t outer, int64_t length,
                                                 int64_t inner, int64_t group, int64_t stream) {
  check_device(x, "x", x);
  const int dtype = dtype_code(x, "x");
  check_contiguous(x, "x");
  TORCH_CHECK_VALUE(x.numel() == outer * length * inner, "flexevict._C: x has ", x.numel(),
                    " elements, not outer * length * inner = ", outer * length * inner);
  TORCH_CHECK_VALUE(group >= 2 && group % 2 == 0, "flexevict._C: group must be even (got ", group,
                    ")");
  const int64_t groups = (length + group - 1) / group;
  c10::DeviceGuard guard(x.device());
  Tensor packed = at::empty({outer, groups * group / 2, inner}, x.options().dtype(at::kByte));
  Tensor mins = at::empty({outer, groups, inner}, x.options());
  Tensor scales = at::empty({outer, groups, inner}, x.options());
  raise_if(fe_quantize_4bit(dtype, x.data_ptr(), outer, length, inner, group,
                            packed.data_ptr<uint8_t>(), mins.data_ptr(), scales.data_ptr(),
                            as_stream(stream)),
           "quantize_4bit");
  return {packed, mins, scales};
}

// -> (outer, length, inner) in the dtype of mins and scales.
Tensor dequantize_4bit(const Tensor& packed, const Tensor& mins, const Tensor& scales,
                       int64_t outer, int64_t length, int64_t inner, int64_t group,
                       int64_t stream) {
  check_device(mins, "mins", mins);
  const int dtype = dtype_code(mins, "mins");
  TORCH_CHECK_VALUE(group >= 2 && group % 2 == 0, "flexevict._C: group must be even (got ", group,
                    ")");
  const int64_t groups = (length + group - 1) / group;
  check_device(packed, "packed", mins);
  check_dtype(packed, "packed", at::kByte);
  check_contiguous(packed, "packed");
  TORCH_CHECK_VALUE(packed.numel() == outer * groups * group / 2 * inner,
                    "flexevict._C: packed has the wrong size");
  for (const auto& [t, name] : {std::pair{&mins, "mins"}, std::pair{&scales, "scales"}}) {
    check_device(*t, name, mins);
    check_dtype(*t, name, mins.scalar_type());
    check_contiguous(*t, name);
    TORCH_CHECK_VALUE(t->numel() == outer * groups * inner, "flexevict._C: ", name,
                      " has the wrong size");
  }
  c10::DeviceGuard guard(mins.device());
  Tensor out = at::empty({outer, length, inner}, mins.options());
  raise_if(fe_dequantize_4bit(dtype, packed.data_ptr<uint8_t>(), mins.data_ptr(), scales.data_ptr(),
                              outer, length, inner, group, out.data_ptr(), as_stream(stream)),
           "dequantize_4bit");
  return out;
}

// table (N, ...) on the GPU or in pinned host memory; rows (n, ...) on the GPU with table's row
// shape and dtype; index (n,) int64 on rows' GPU, entries below N (the caller checks); a
// gather leaves the rows of negative entries as they are.
void copy_rows(Tensor& table, Tensor& rows, const Tensor& index, bool scatter, int64_t stream) {
  check_device(rows, "rows", rows);
  check_device(index, "index", rows);
  check_dtype(index, "index", at::kLong);
  check_contiguous(index, "index");
  check_dtype(table, "table", rows.scalar_type());
  check_contiguous(table, "table");
  check_contiguous(rows, "rows");
  TORCH_CHECK_VALUE(table.is_cuda() ? table.device() == rows.device() : table.is_pinned(),
                    "flexevict._C: table must be on rows' GPU or in pinned host memory");
  TORCH_CHECK_VALUE(table.dim() >= 1 && rows.dim() == table.dim() &&
                    rows.sizes().slice(1) == table.sizes().slice(1),
                    "flexevict._C: rows must have the table's row shape");
  TORCH_CHECK_VALUE(index.dim() == 1 && index.size(0) == rows.size(0),
                    "flexevict._C: index must have one entry per row of rows");
  c10::DeviceGuard guard(rows.device());
  const int64_t row_bytes = table.size(0) ? table.numel() / table.size(0) * table.element_size() : 0;
  raise_if(fe_copy_rows(table.data_ptr(), table.size(0), rows.data_ptr(),
                        index.data_ptr<int64_t>(), index.size(0), row_bytes, scatter,
                        as_stream(stream)),
           "copy_rows");
}

// Recall's page choice (FePageSelect): q (rows, group, dim), summary (rows, 2, dim, n_pages) of
// one dtype, limit (rows,) int64 -> (rows, pages) int64.
Tensor page_select(const Tensor& q, const Tensor& summary, const Tensor& limit, int64_t page,
                   int64_t sinks, int64_t pages, int64_t stream) {
  check_device(q, "q", q);
  const int dtype = dtype_code(q, "q");
  TORCH_CHECK_VALUE(q.dim() == 3, "flexevict._C: q must be (rows, group, dim) (got ", q.sizes(),
                    ")");
  check_contiguous(q, "q");
  const int64_t rows = q.size(0), dim = q.size(2);
  check_device(summary, "summary", q);
  check_dtype(summary, "summary", q.scalar_type());
  check_contiguous(summary, "summary");
  TORCH_CHECK_VALUE(summary.dim() == 4 && summary.size(0) == rows && summary.size(1) == 2 &&
                        summary.size(2) == dim,
                    "flexevict._C: summary must be (", rows, ", 2, ", dim, ", pages) (got ",
                    summary.sizes(), ")");
  check_device(limit, "limit", q);
  check_dtype(limit, "limit", at::kLong);
  check_shape(limit, "limit", {rows});
  check_contiguous(limit, "limit");
  TORCH_CHECK_VALUE(page >= 1 && sinks >= 0 && pages >= 0 && pages <= summary.size(3),
                    "flexevict._C: page choice needs page >= 1, sinks >= 0 and 0 <= pages <= ",
                    summary.size(3), " (got ", page, ", ", sinks, ", ", pages, ")");
  Tensor out = at::empty({rows, pages}, limit.options());
  FePageSelect p{};
  p.dtype = dtype;
  p.rows = rows, p.group = q.size(1), p.dim = dim, p.n_pages = summary.size(3);
  p.page = page, p.sinks = sinks, p.pages = pages;
  p.q = q.data_ptr(), p.summary = summary.data_ptr();
  p.limit = limit.data_ptr<int64_t>(), p.out = out.data_ptr<int64_t>();
  c10::DeviceGuard guard(q.device());
  raise_if(fe_page_select(&p, as_stream(stream)), "page_select");
  return out;
}

// HashEvict's prompt replay over a chunk of steps (FeHashReplay): keys (steps, rows, n) fp32,
// pool (rows, members + 1) int64 changed in place, live (rows,) int64.
void hash_replay(const Tensor& keys, Tensor& pool, const Tensor& live, int64_t first,
                 int64_t ring, int64_t all_live, int64_t stream) {
  check_device(keys, "keys", keys);
  check_dtype(keys, "keys", at::kFloat);
  check_contiguous(keys, "keys");
  TORCH_CHECK_VALUE(keys.dim() == 3, "flexevict._C: keys must be (steps, rows, tokens) (got ",
                    keys.sizes(), ")");
  const int64_t rows = keys.size(1);
  check_device(pool, "pool", keys);
  check_dtype(pool, "pool", at::kLong);
  check_contiguous(pool, "pool");
  TORCH_CHECK_VALUE(pool.dim() == 2 && pool.size(0) == rows && pool.size(1) >= 2,
                    "flexevict._C: pool must be (", rows, ", members + 1) (got ", pool.sizes(),
                    ")");
  check_device(live, "live", keys);
  check_dtype(live, "live", at::kLong);
  check_shape(live, "live", {rows});
  check_contiguous(live, "live");
  FeHashReplay p{};
  p.keys = keys.data_ptr<float>(), p.pool = pool.data_ptr<int64_t>();
  p.live = live.data_ptr<int64_t>();
  p.steps = keys.size(0), p.rows = rows, p.n = keys.size(2), p.members = pool.size(1) - 1;
  p.first = first, p.ring = ring, p.all_live = all_live;
  c10::DeviceGuard guard(keys.device());
  raise_if(fe_hash_replay(&p, as_stream(stream)), "hash_replay");
}

// The kernels' limits (flexevict_kernels.h) by name: Python reads them from here, so that the
// header stays the only place they are written down.
pybind11::dict limits() {
  pybind11::dict out;
  out["shared_bytes"] = FE_SHARED_BYTES;
  out["decode_max_dim"] = FE_DECODE_MAX_DIM;
  out["prefill_max_dim"] = FE_PREFILL_MAX_DIM;
  out["prefill_max_batch_heads"] = FE_PREFILL_MAX_BATCH_HEADS;
  out["compact_max_seq"] = FE_COMPACT_MAX_SEQ;
  out["buzz_max_slots"] = FE_BUZZ_MAX_SLOTS;
  out["buzz_max_dim"] = FE_BUZZ_MAX_DIM;
  out["lsh_max_bits"] = FE_LSH_MAX_BITS;
  out["lsh_max_dim"] = FE_LSH_MAX_DIM;
  out["cascade_max_levels"] = FE_CASCADE_MAX_LEVELS;
  out["cascade_max_kv_heads"] = FE_CASCADE_MAX_KV_HEADS;
  out["page_max_pages"] = FE_PAGE_MAX_PAGES;
  out["page_max_dim"] = FE_PAGE_MAX_DIM;
  out["split_decode_max_dim"] = FE_SPLIT_DECODE_MAX_DIM;
  out["split_decode_dim_multiple"] = FE_SPLIT_DECODE_DIM_MULTIPLE;
  out["split_decode_max_group"] = FE_SPLIT_DECODE_MAX_GROUP;
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flexevict CUDA kernels (see cuda/README.md); use them through flexevict.core.kernels";
  m.def("decode_attention", &decode_attention);
  m.def("split_decode_attention", &split_decode_attention);
  m.def("split_decode_splits", &fe_split_decode_splits,
        "the split count split_decode_attention picks for (rows, n) when given splits 0");
  m.def("prefill_attention", &prefill_attention);
  m.def("select_commit", &select_commit);
  m.def("hash_select", &hash_select);
  m.def("lsh_hash", &lsh_hash);
  m.def("compact_prompt", &compact_prompt);
  m.def("buzz_pass", &buzz_pass);
  m.def("cascade_update", &cascade_update);
  m.def("page_select", &page_select);
  m.def("hash_replay", &hash_replay);
  m.def("quantize_4bit", &quantize_4bit);
  m.def("copy_rows", &copy_rows);
  m.def("dequantize_4bit", &dequantize_4bit);
  m.def("limits", &limits, "what each kernel accepts (cuda/flexevict_kernels.h), by name");
  m.def("decode_attention_shared_bytes", &fe_decode_attention_shared_bytes,
        "shared memory bytes decode attention needs for (group, dim); at most shared_bytes");
}
