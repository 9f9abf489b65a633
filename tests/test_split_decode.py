"""Split-slot decode attention (`kernels.split_decode_attention`, cuda/split_decode.cu).

CPU: the contract through the reference, the kernel's specification: output and probabilities
(per head, and their mass summed over a kv head's query heads) against a plain softmax in fp64
for every mask a buffer has (empty slots, a filling buffer's span, padding, rows and splits with
no valid slot), GQA groups 1/3/4/8, any split count (one split, uneven, one slot per split,
more splits than slots); the fused score accumulation; the dispatch's choices and checks.
GPU (skipped without one, saying so): the kernel against the reference with poisoned outputs,
on strided buffer views, inside a CUDA graph, without host synchronisation."""
import pytest
import torch

from flexevict.core import kernels
from flexevict.core.kernels import ext
from flexevict.core.kernels import reference as ref
from flexevict.core.kv import KVBuffer, Layout

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (the kernel's tests; the CPU tests "
                         "check its contract through the reference)")
OUT_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
MASKS = ["all valid", "random", "empty slots", "fill span", "padding", "dead row", "one slot",
         "dead split"]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b| (0 when both are empty or zero)."""
    if not b.numel():
        return 0.0
    scale = b.double().abs().max().clamp_min(1e-30)
    return float((a.double() - b.double()).abs().max() / scale)


def plain_softmax(q, k, v, valid, scale, round_to=None):
    """fp64, row by row and head by head, a softmax over the valid slots only; logits rounded to
    `round_to` (the dtype the contract rounds them to) first. -> out (R, g, d), p (R, g, n)."""
    rows, g, d = q.shape
    n = k.shape[0]
    out = torch.zeros(rows, g, d, dtype=torch.float64)
    p = torch.zeros(rows, g, n, dtype=torch.float64)
    for r in range(rows):
        live = valid[:, r].nonzero().flatten()
        if live.numel() == 0:
            continue
        logits = q[r].double() @ k[live, r].double().t() * scale
        if round_to is not None:
            logits = logits.to(round_to).double()
        pr = torch.softmax(logits, dim=-1)
        p[r][:, live] = pr
        out[r] = pr @ v[live, r].double()
    return out, p


def make_valid(kind: str, n: int, rows: int, gen, splits: int = 4) -> torch.Tensor:
    """(n, rows) masks as a buffer has them."""
    valid = torch.ones(n, rows, dtype=torch.bool)
    if kind == "random":
        valid = torch.rand(n, rows, generator=gen) > 0.3
        valid[n - 1] = True
    elif kind == "empty slots":                      # evicted / never filled slots in between
        valid[torch.randperm(n, generator=gen)[: n // 3]] = False
        valid[n - 1] = True
    elif kind == "fill span":                        # a filling buffer's bucket past the token
        valid[max(1, n - 13):] = False
    elif kind == "padding":                          # left padding of shorter prompts
        for r in range(rows):
            valid[: min(n - 1, 3 * r), r] = False
    elif kind == "dead row":
        valid[:, rows // 2] = False
    elif kind == "one slot":
        valid[:] = False
        valid[torch.randint(n, (rows,), generator=gen), torch.arange(rows)] = True
    elif kind == "dead split":                       # a whole split of the kernel's has no slot
        chunk = -(-n // splits)
        valid[chunk: 2 * chunk] = False
    return valid


def inputs(rows, g, n, d, dtype, seed, kind="random"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, g, d, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(n, rows, d, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(n, rows, d, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, v, make_valid(kind, n, rows, gen)


def split_counts(n: int) -> list:
    """None (unsplit), one split, uneven ones, one slot per split, more splits than slots."""
    return [None, 1, 2, 3, 7, max(1, n), n + 5]


# ==================================================================== the contract (CPU)

@pytest.mark.parametrize("g", [1, 3, 4, 8])
@pytest.mark.parametrize("kind", MASKS)
def test_reference_is_a_softmax_in_fp64_for_any_split(g, kind):
    rows, n, d = 5, 29, 8
    q, k, v, valid = inputs(rows, g, n, d, torch.float64, 10 * g + MASKS.index(kind), kind)
    scale = d ** -0.5
    want_out, want_p = plain_softmax(q, k, v, valid, scale)
    for splits in split_counts(n):
        tol = 1e-6 if splits is None else 1e-12        # unsplit: torch's fp32 softmax
        out, p = ref.split_decode_attention(q, k, v, valid, scale, None, True, splits)
        assert out.shape == (rows, g, d) and p.shape == (rows, g, n), splits
        assert rel_err(out, want_out) <= tol, (splits, rel_err(out, want_out))
        assert (p.double() - want_p).abs().max() <= tol, splits
        _, mass = ref.split_decode_attention(q, k, v, valid, scale, None, False, splits)
        assert mass.shape == (rows, 1, n)
        assert (mass.double() - want_p.sum(1, keepdim=True)).abs().max() <= 4 * tol, splits
        assert not p.transpose(1, 2)[~valid.t()].any(), "a masked slot got probability"
        dead = ~valid.any(0)
        assert not out[dead].any() and not p[dead].any(), "a row with no valid slot"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("g,d", [(1, 64), (3, 96), (4, 128), (8, 256)])
def test_reference_in_each_dtype_against_fp64(dtype, g, d):
    """16-bit inputs: the logits are rounded to the dtype (the contract), the rest is fp32; the
    output comes back in the dtype."""
    rows, n = 3, 70
    q, k, v, valid = inputs(rows, g, n, d, dtype, d + g, "random")
    scale = d ** -0.5
    want_out, want_p = plain_softmax(q, k, v, valid, scale, round_to=dtype)
    for splits in (None, 1, 4, n + 2):
        out, p = ref.split_decode_attention(q, k, v, valid, scale, None, True, splits)
        assert out.dtype == dtype and p.dtype == torch.float32
        tol = OUT_TOL[dtype] if splits is not None else {torch.float32: 1e-5,
                                                         torch.float16: 2e-3,
                                                         torch.bfloat16: 2e-2}[dtype]
        assert rel_err(out, want_out) <= tol, (splits, rel_err(out, want_out))
        # unsplit: decode_attention's p is exact; split: fp32 exponentials and sums
        assert (p.double() - want_p).abs().max() <= 1e-5, splits


def test_split_boundaries_by_hand():
    """n = 10 slots: 4 splits of 3, 3, 3, 1 slots; 6 splits of 2 (the last one empty); 10 of
    one slot; a split holding only masked slots; and every output the same softmax."""
    q = torch.tensor([[[1.0, -1.0]]], dtype=torch.float64)          # R = 1, g = 1, d = 2
    k = torch.arange(20, dtype=torch.float64).view(10, 1, 2).sin()
    v = torch.arange(20, dtype=torch.float64).view(10, 1, 2).cos()
    valid = torch.ones(10, 1, dtype=torch.bool)
    valid[3:6] = False                                              # split 1 of 4: all masked
    logits = (q[0] @ k[:, 0].t())[0]
    p = torch.where(valid[:, 0], torch.exp(logits - logits[valid[:, 0]].max()), 0.0)
    p = p / p.sum()
    for splits in (1, 4, 6, 10, 11):
        out, probs = ref.split_decode_attention(q, k, v, valid, 1.0, None, True, splits)
        assert torch.allclose(probs[0, 0], p, rtol=0, atol=1e-14), splits
        assert torch.allclose(out[0, 0], p @ v[:, 0], rtol=0, atol=1e-14), splits


def test_one_head_per_kv_head_probs_are_the_mass_and_kv_head_probs_agree():
    q, k, v, valid = inputs(4, 3, 40, 16, torch.float32, 7)
    for splits in (None, 5):
        _, p = ref.split_decode_attention(q, k, v, valid, 0.25, None, True, splits)
        _, mass = ref.split_decode_attention(q, k, v, valid, 0.25, None, False, splits)
        assert torch.allclose(kernels.kv_head_probs(p), kernels.kv_head_probs(mass), atol=1e-6)
    q1 = q[:, :1]
    _, p1 = ref.split_decode_attention(q1, k, v, valid, 0.25, None, True, 5)
    _, m1 = ref.split_decode_attention(q1, k, v, valid, 0.25, None, False, 5)
    assert torch.equal(p1, m1)


@pytest.mark.parametrize("splits", [None, 1, 3, 45])
def test_fused_score_adds_the_mass_to_the_first_n_slots(splits):
    rows, g, n = 4, 4, 40
    q, k, v, valid = inputs(rows, g, n, 8, torch.float32, 3, "padding")
    score = torch.rand(n + 3, rows)
    before = score.clone()
    _, mass = ref.split_decode_attention(q, k, v, valid, 0.3, score, False, splits)
    assert torch.allclose(score[:n], before[:n] + mass[:, 0].t(), atol=1e-6)
    assert torch.equal(score[n:], before[n:])
    assert torch.equal(score[:n][~valid], before[:n][~valid])


def test_dispatch_on_a_cpu_is_todays_decode_attention_bit_for_bit():
    """Without a GPU (or kernel) and without splits, the dispatch is `decode_attention`: a CPU
    run does not change by calling it."""
    q, k, v, valid = inputs(6, 4, 50, 16, torch.float32, 11, "empty slots")
    s1 = torch.rand(52, 6)
    s2 = s1.clone()
    out1, p1 = kernels.split_decode_attention(q, k, v, valid, 0.25, s1)
    out2, p2 = kernels.decode_attention(q, k, v, valid, 0.25, s2)
    assert torch.equal(out1, out2) and torch.equal(p1, p2) and torch.equal(s1, s2)
    _, mass = kernels.split_decode_attention(q, k, v, valid, 0.25, heads=False)
    assert torch.equal(mass, p2.sum(1, keepdim=True))


def test_dispatch_checks_its_arguments_in_one_line():
    q, k = torch.zeros(2, 1, 8), torch.zeros(4, 2, 8)
    valid = torch.ones(4, 2, dtype=torch.bool)
    cases = [(lambda: kernels.split_decode_attention(q, k, k, valid, 1.0, splits=0), "splits"),
             (lambda: kernels.split_decode_attention(q, k, k.half(), valid, 1.0), "v"),
             (lambda: kernels.split_decode_attention(q, k, k, valid.float(), 1.0), "valid"),
             (lambda: kernels.split_decode_attention(q, k, k, valid, 1.0, torch.zeros(3, 2)),
              "score")]
    for call, name in cases:
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert "split_decode_attention" in message and name in message, message
        assert "\n" not in message


class _Fake:
    """The compiled module's stand-in: the header's limits; records the calls it gets."""

    def __init__(self, old: bool = False):
        self.called = []
        self.old = old                               # built before the kernel existed

    def limits(self):
        return {} if self.old else {"split_decode_max_dim": 256, "split_decode_dim_multiple": 8,
                                    "split_decode_max_group": 8}

    def split_decode_attention(self, *args):
        self.called.append(args)
        raise RuntimeError("fake split_decode_attention")


@pytest.mark.parametrize("case,kernel", [
    ("buffer", True), ("layer rows view", True), ("fp32 d=72", True), ("head dim 12", False),
    ("head dim 264", False), ("group 9", False), ("misaligned k", False),
    ("score strided per row", False), ("q strided", True), ("an older build", False)])
def test_dispatch_takes_the_kernel_where_it_applies(monkeypatch, case, kernel):
    fake = _Fake(old=case == "an older build")
    monkeypatch.setattr(ext, "module_for", lambda t: fake)
    monkeypatch.setattr(ext, "limits", lambda m: m.limits())
    monkeypatch.setattr(ext, "stream", lambda t: 0)
    rows, g, d, n, dtype = 4, 2, 64, 30, torch.float16
    if case == "fp32 d=72":
        d, dtype = 72, torch.float32
    elif case == "head dim 12":
        d = 12
    elif case == "head dim 264":
        d = 264
    elif case == "group 9":
        g = 9
    buf = KVBuffer(Layout(n + 1), rows * 2, d, dtype, "cpu")
    if case == "layer rows view":                   # kv.LayerRows: every tensor a row slice
        view = buf.layers(2)[1]
        k, v, valid, score = view.k[:n], view.v[:n], view.valid[:n], view.score
    else:
        k, v, valid, score = buf.k[:n, :rows], buf.v[:n, :rows], buf.valid[:n, :rows], \
            buf.score[:, :rows]
    if case == "misaligned k":
        k = torch.zeros(n * rows * d + 4, dtype=dtype)[4:].view(n, rows, d)
    if case == "score strided per row":
        score = torch.zeros(rows, n + 1).t()
    q = torch.zeros(rows, g + 3, d, dtype=dtype)[:, 1:1 + g] if case == "q strided" else \
        torch.zeros(rows, g, d, dtype=dtype)
    if kernel:
        with pytest.raises(RuntimeError, match="fake split_decode_attention"):
            kernels.split_decode_attention(q, k, v, valid, 0.1, score, heads=False)
        args = fake.called[0]
        assert args[6:8] == (0, False)                # splits 0 (the kernel's), heads False
    else:
        out, p = kernels.split_decode_attention(q, k, v, valid, 0.1, score, heads=False)
        assert out.shape == (rows, g, d) and p.shape == (rows, 1, n) and fake.called == []


# ==================================================================== the kernel (GPU)

@pytest.fixture(scope="module")
def built():
    module = ext.load()
    assert module is not None, "the CUDA kernels did not build (see the warning above)"
    return module


def poison():
    """Freed CUDA blocks filled with 0xFF (NaN in every float dtype): torch.empty reuses them,
    so an output element the kernel forgot cannot pass by luck."""
    blocks = [torch.empty(n, dtype=torch.uint8, device="cuda")
              for n in [64 << 20] + [1 << 19] * 32 + [1 << 12] * 128]
    for b in blocks:
        b.fill_(0xFF)
    del blocks


GPU_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
GPU_SHAPES = [(1, 1, 1, 64), (3, 1, 37, 96), (5, 3, 129, 64), (8, 4, 513, 128),
              (2, 8, 2049, 128), (4, 2, 300, 256), (3, 1, 4100, 128), (2, 5, 77, 8)]


def cuda_inputs(rows, g, n, d, dtype, seed, kind):
    q, k, v, valid = inputs(rows, g, n, d, torch.float32, seed, kind)
    qkv = torch.randn(rows, g + 3, d, generator=torch.Generator().manual_seed(seed))
    qkv[:, 1:1 + g] = q
    q = qkv.to("cuda", dtype)[:, 1:1 + g]                         # strided, as in the model
    return q, k.to("cuda", dtype), v.to("cuda", dtype), valid.cuda()


def check_against_reference(q, k, v, valid, scale, splits, heads, dtype, with_score=True):
    rows, n = q.shape[0], k.shape[0]
    score = torch.rand(n + 2, rows, device="cuda") if with_score else None
    want_score = None if score is None else score.clone()
    with ext.use_kernels(False):
        want_out, want_p = kernels.split_decode_attention(q, k, v, valid, scale, want_score,
                                                          heads, splits)
    poison()
    out, p = kernels.split_decode_attention(q, k, v, valid, scale, score, heads, splits)
    assert out.shape == want_out.shape and p.shape == want_p.shape and p.dtype == torch.float32
    assert not out.isnan().any() and not p.isnan().any()
    assert rel_err(out, want_out) <= GPU_TOL[dtype], rel_err(out, want_out)
    assert rel_err(p, want_p) <= GPU_TOL[dtype], rel_err(p, want_p)
    if score is not None:
        assert rel_err(score, want_score) <= max(GPU_TOL[dtype], 1e-5)
        assert torch.equal(score[n:], want_score[n:])               # past n: untouched
    dead = ~valid.any(0)
    assert not out[dead].any() and not p[dead].any()
    return out, p


@gpu
@pytest.mark.parametrize("dtype", list(GPU_TOL))
@pytest.mark.parametrize("rows,g,n,d", GPU_SHAPES)
@pytest.mark.parametrize("splits", [None, 1, 3, "one per slot", "more than slots"])
def test_kernel_against_reference(built, dtype, rows, g, n, d, splits):
    splits = {"one per slot": n, "more than slots": n + 3}.get(splits, splits)
    for kind in ("random", "dead row", "fill span", "padding"):
        q, k, v, valid = cuda_inputs(rows, g, n, d, dtype, rows * 7 + n, kind)
        for heads in (True, False):
            # the unsplit reference, and the same splits (the kernel's own math)
            check_against_reference(q, k, v, valid, d ** -0.5, splits, heads, dtype)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", MASKS)
def test_kernel_masks_and_splits_against_the_split_reference(built, dtype, kind):
    rows, g, n, d = 6, 4, 700, 128
    q, k, v, valid = cuda_inputs(rows, g, n, d, dtype, 5, kind)
    for splits in (4, 7, 64):
        with ext.use_kernels(False):
            want_out, want_p = kernels.split_decode_attention(q, k, v, valid, 0.1, None, True,
                                                              splits)
        poison()
        out, p = kernels.split_decode_attention(q, k, v, valid, 0.1, None, True, splits)
        assert rel_err(out, want_out) <= GPU_TOL[dtype] and rel_err(p, want_p) <= GPU_TOL[dtype]


@gpu
def test_kernel_on_a_layer_of_a_stacked_buffer(built):
    """A kv.LayerRows view (strided rows, score and valid) and the fused score, as the model
    would pass them."""
    rows, g, d, n = 6, 4, 128, 300
    stack = KVBuffer(Layout(n + 1), 3 * rows, d, torch.float16, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    stack.k.copy_(torch.randn(stack.k.shape, generator=gen, device="cuda"))
    stack.v.copy_(torch.randn(stack.v.shape, generator=gen, device="cuda"))
    stack.valid.copy_(torch.rand(stack.valid.shape, generator=gen, device="cuda") > 0.2)
    layer = stack.layers(3)[1]
    q = torch.randn(rows, g, d, generator=gen, device="cuda").half()
    want = layer.score.clone()
    with ext.use_kernels(False):
        want_out, want_p = kernels.split_decode_attention(q, layer.k[:n], layer.v[:n],
                                                          layer.valid[:n], 0.1, want, False)
    others = stack.score[:, :rows].clone(), stack.score[:, 2 * rows:].clone()
    out, p = kernels.split_decode_attention(q, layer.k[:n], layer.v[:n], layer.valid[:n], 0.1,
                                            layer.score, False)
    assert rel_err(out, want_out) <= 2e-3 and rel_err(p, want_p) <= 2e-3
    assert rel_err(layer.score, want) <= 1e-5
    assert torch.equal(stack.score[:, :rows], others[0])            # other layers untouched
    assert torch.equal(stack.score[:, 2 * rows:], others[1])


@gpu
def test_kernel_never_synchronises_and_replays_in_a_cuda_graph(built):
    rows, g, n, d = 8, 4, 1000, 128
    q, k, v, valid = cuda_inputs(rows, g, n, d, torch.float16, 1, "random")
    score = torch.zeros(n, rows, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager_out, eager_p = kernels.split_decode_attention(q, k, v, valid, 0.1, score, False)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    score.zero_()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):                                 # warm up off the default
        kernels.split_decode_attention(q, k, v, valid, 0.1, score, False)
    torch.cuda.current_stream().wait_stream(stream)
    score.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, p = kernels.split_decode_attention(q, k, v, valid, 0.1, score, False)
    q.copy_(q * 0.5)                                                # new inputs, same buffers
    graph.replay()
    torch.cuda.synchronize()
    want_out, want_p = kernels.split_decode_attention(q, k, v, valid, 0.1, None, False)
    assert torch.equal(out, want_out) and torch.equal(p, want_p)
    assert torch.allclose(score, p[:, 0].t() * valid, atol=1e-6)
    assert not torch.equal(out, eager_out) and eager_p.shape == p.shape


@gpu
def test_kernel_against_todays_torch_decode_attention_at_opt_shape(built):
    """The model's decode attention today (torch ops) and the kernel, at OPT-6.7B's kv heads."""
    rows, g, n, d = 2 * 32, 1, 2048, 128
    q, k, v, valid = cuda_inputs(rows, g, n, d, torch.float16, 2, "fill span")
    s1, s2 = torch.zeros(n, rows, device="cuda"), torch.zeros(n, rows, device="cuda")
    out1, p1 = kernels.decode_attention(q, k, v, valid, d ** -0.5, s1)
    out2, p2 = kernels.split_decode_attention(q, k, v, valid, d ** -0.5, s2)
    assert rel_err(out2, out1) <= 2e-3 and rel_err(p2, p1) <= 2e-3 and rel_err(s2, s1) <= 2e-3


@gpu
def test_splits_follow_the_sizes_alone(built):
    assert built.split_decode_splits(768, 2048) == built.split_decode_splits(768, 2048)
    for rows, n in [(1, 1), (8, 32768), (768, 819), (1344, 32768), (4, 0)]:
        s = built.split_decode_splits(rows, n)
        assert 1 <= s <= max(1, n)


def test_the_kernel_benchmark_times_decode_attention_alone(tmp_path):
    """`python -m flexevict.bench.kernels --only attention`: the kernel (on a GPU) against
    torch's decode attention with the score pass; on a CPU the references at a tiny shape."""
    import json

    from flexevict.bench import kernels as bench
    out = tmp_path / "attention.json"
    assert bench.main(["--device", "cpu", "--only", "attention", "--launches", "1", "--loops",
                       "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["phases"] == ["attention"] and {row["phase"] for row in r["results"]} == {"attention"}
    assert [row["op"] for row in r["results"]] == ["split decode attention + scores",
                                                   "split decode attention + scores, mass"]
    assert all(row["kernel_ms"] is None and row["reference_ms"] > 0 for row in r["results"])
    assert [s.model for s in bench.ATTENTION_SHAPES[:6]] == ["opt-6.7b"] * 3 + ["opt-30b"] * 3
    assert [s.slots for s in bench.ATTENTION_SHAPES[:3]] == [2048, 8192, 32768]
    assert {(s.heads, s.head_dim) for s in bench.ATTENTION_SHAPES[:6]} == {(32, 128), (56, 128)}
