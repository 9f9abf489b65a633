"""`triattention` (policies/triattention.py): a hand-worked score, the score against a float64
computation of the paper's formula as written (RoPE inverted, every offset), the prompt and
decode selections, independence of attention weights and of batch-mates with a real
calibration, the calibration command's statistics, the shipped SmolLM2 calibration, bad input.
Bit-identity with `full` at a whole-sequence budget: tests/test_policy_matrix.py."""
import math
import os

import pytest
import torch

from flexevict.core.kv import KVBuffer
from flexevict.core.model import apply_rope, rope_cos_sin
from flexevict.errors import UserError
from flexevict.policies import get_policy
from flexevict.policies import triattention as T
from flexevict.runtime.engine import Engine
from flexevict.runtime.generation import Sampling, generate

from tiny import CONFIGS, kept, model_for, rand_prompts

CFG = CONFIGS["llama-gqa"]            # 2 layers, 4 query heads over 2 kv heads, head dim 16


def random_calibration(config, seed=0) -> T.Calibration:
    g = torch.Generator().manual_seed(seed)
    shape = (config.num_layers, config.num_heads, config.dim_head // 2)
    q_mean = torch.randn(*shape, 2, generator=g)
    q_abs = torch.linalg.vector_norm(q_mean, dim=-1) + torch.rand(*shape, generator=g)
    return T.Calibration(q_mean, q_abs, T.model_inv_freq(config).float(), config.num_kv_heads,
                         config.name, "random", 0)


@pytest.fixture
def stats_file(tmp_path):
    path = str(tmp_path / "t.pt")
    T.save_calibration(path, random_calibration(CFG))
    return path


def bound(path, **args):
    return get_policy("triattention", stats=path, **args).for_model(CFG)


def buffer(policy, s, rows, layer=0, gen=10):
    layout = policy.layout(s, gen)
    return KVBuffer(layout, rows, CFG.dim_head, torch.float32, "cpu", kv_heads=CFG.num_kv_heads,
                    layer=layer, fields=policy.fields(layout))


# ------------------------------------------------------------------ the score

def test_hand_worked_score_without_rope():
    """d = 2 (one frequency), w = 0: S = q_mean . k + (E|q| - |q_mean|) |k|. q_mean = (1, 0),
    E|q| = 2: keys (1,0), (0,1), (-1,0), (0,2) -> 1 + 1, 0 + 1, -1 + 1, 0 + 2."""
    stats = {"q_mean": torch.tensor([[[[1.0, 0.0]]]]), "excess": torch.tensor([[[1.0]]]),
             "inv_freq": torch.zeros(1), "m": T.offset_mean(torch.zeros(1), 65536)}
    k = torch.tensor([[1.0, 0], [0, 1], [-1, 0], [0, 2]]).unsqueeze(1)         # (4, 1, 2)
    got = T.head_scores(k, torch.tensor([4]), stats)
    assert got.flatten().tolist() == [2.0, 1.0, 0.0, 2.0]
    # z-normalised over the valid keys; the max over one head is itself
    z = T.combined(got, torch.ones(4, 1, dtype=torch.bool), True).flatten()
    torch.testing.assert_close(z, (torch.tensor([2.0, 1, 0, 2]) - 1.25) / math.sqrt(0.6875))


def direct_scores(cal, layer, k_rot, pos, t, horizon=65536):
    """The formula as written, in float64, one (row, query head) at a time: RoPE undone at the
    key's position, S_trig(D) = sum_f |q_f||k_f| cos(D w_f + arg q_f - arg k_f) averaged over
    D = t - p + o (o = 1, 2, 4, ..., horizon), plus sum_f (E|q_f| - |q_f|) |k_f| -> (n, R, g)."""
    n, rows, d = k_rot.shape
    f, g = d // 2, CFG.num_heads // CFG.num_kv_heads
    w = cal.inv_freq.double()
    cos, sin = rope_cos_sin(w, pos, torch.float64)
    k = apply_rope(k_rot.double(), cos, -sin)                                 # RoPE undone
    zk = torch.complex(k[..., :f], k[..., f:])
    offsets = [2.0 ** i for i in range(horizon.bit_length())]
    out = torch.zeros(n, rows, g, dtype=torch.float64)
    for r in range(rows):
        for j in range(g):
            h = (r % CFG.num_kv_heads) * g + j
            q = torch.view_as_complex(cal.q_mean[layer, h].double().contiguous())
            amp, phase = q.abs() * zk[:, r].abs(), q.angle() - zk[:, r].angle()   # (n, F)
            trig = sum((amp * torch.cos((t[r] - pos[:, r, None] + o) * w + phase)).sum(-1)
                       for o in offsets) / len(offsets)
            norm = ((cal.q_abs[layer, h].double() - q.abs()) * zk[:, r].abs()).sum(-1)
            out[:, r, j] = trig + norm
    return out


@pytest.mark.parametrize("layer", [0, 1])
def test_score_equals_the_formula_in_float64(stats_file, layer):
    torch.manual_seed(layer)
    policy = bound(stats_file)
    rows, n = 2 * CFG.num_kv_heads, 12                          # two sequences
    buf = buffer(policy, 30, rows, layer)
    pos = torch.randint(0, 3000, (n, rows))
    cos, sin = rope_cos_sin(T.model_inv_freq(CFG), pos, torch.float32)
    k_rot = apply_rope(torch.randn(n, rows, CFG.dim_head), cos, sin)          # cached keys
    t = pos.max(0).values + 1
    want = direct_scores(T.load_calibration(stats_file), layer, k_rot, pos, t)
    got = T.head_scores(k_rot, t, policy.row_stats(buf))
    torch.testing.assert_close(got.double(), want, atol=2e-3, rtol=1e-4)
    valid = torch.ones(n, rows, dtype=torch.bool)
    z = (want - want.mean(0)) / want.std(0, unbiased=False)
    torch.testing.assert_close(policy.scores(buf, k_rot, valid, t).double(), z.amax(-1),
                               atol=1e-3, rtol=1e-4)


def test_a_stack_of_layers_scores_each_row_by_its_layer(stats_file):
    """A stacked buffer (every layer's rows, kv.LayerRows) gives row r layer r // rows-per-layer's
    statistics: the same scores as each layer's own buffer."""
    policy = bound(stats_file)
    rows = CFG.num_kv_heads
    stack = KVBuffer(policy.layout(30, 10), CFG.num_layers * rows, CFG.dim_head, torch.float32,
                     "cpu", kv_heads=CFG.num_kv_heads, layer=None)
    k, t = torch.randn(9, CFG.num_layers * rows, CFG.dim_head), torch.full((4,), 50)
    valid = torch.ones(9, 4, dtype=torch.bool)
    both = policy.scores(stack, k, valid, t)
    for j in range(CFG.num_layers):
        alone = policy.scores(buffer(policy, 30, rows, j), k[:, j * rows:(j + 1) * rows],
                              valid[:, :rows], t[:rows])
        assert torch.equal(both[:, j * rows:(j + 1) * rows], alone)


# ------------------------------------------------------------------ selection

def test_prompt_keeps_the_best_scored_and_the_window(stats_file):
    torch.manual_seed(5)
    s, rows = 40, CFG.num_kv_heads
    for window in (0, 4):
        policy = bound(stats_file, budget_tokens=13, window=window)             # 12 kept
        buf = buffer(policy, s, rows)
        k = torch.randn(s, rows, CFG.dim_head)
        pos = torch.arange(s)[:, None].expand(s, rows).to(torch.int32)
        valid = torch.ones(s, rows, dtype=torch.bool)
        policy.prefill(buf, k, torch.randn_like(k), pos, valid)
        score = policy.scores(buf, k, valid, torch.full((rows,), s))
        for r in range(rows):
            best = score[:s - window, r].topk(12 - window).indices.tolist()
            assert kept(buf, r) == sorted(best + list(range(s - window, s)))


def test_decode_drops_the_lowest_score_and_ignores_attention(stats_file):
    """Two buffers fed the same keys with different attention probabilities keep the same
    tokens; each victim is the lowest-scored key of the full buffer (the new one included)."""
    torch.manual_seed(2)
    rows, s = CFG.num_kv_heads, 10
    policy = bound(stats_file, budget_tokens=11)                              # 10 + scratch
    bufs = [buffer(policy, s, rows) for _ in range(2)]
    k = torch.randn(s, rows, CFG.dim_head)
    pos = torch.arange(s)[:, None].expand(s, rows).to(torch.int32)
    for buf in bufs:
        policy.prefill(buf, k, torch.randn_like(k), pos, torch.ones(s, rows, dtype=torch.bool))
    for p in range(s, s + 8):
        key = torch.randn(rows, CFG.dim_head)
        before = [torch.where(bufs[0].valid, bufs[0].pos, -1).clone()]
        for i, buf in enumerate(bufs):
            slot = buf.incoming_slot()
            buf.write(slot, key, torch.randn(rows, CFG.dim_head), torch.full((rows,), p,
                                                                            dtype=torch.int32))
            n = buf.attended(slot)
            probs = torch.rand(rows, 2, n) if i else torch.full((rows, 2, n), 1.0 / n)
            if i == 0:
                score = policy.scores(buf, buf.k[:n], buf.valid[:n], torch.full((rows,), p + 1))
                before.append(buf.pos[:n].clone())
            policy.after_attention(buf, slot, probs)
        assert all(kept(bufs[0], r) == kept(bufs[1], r) for r in range(rows))
        for r in range(rows):
            gone = set(before[1][:, r].tolist()) - set(kept(bufs[0], r))
            assert gone == {int(before[1][score[:, r].argmin(), r])}


def test_batch_rows_are_independent_with_a_calibration(tmp_path):
    """Through the model with a calibration of the tiny model itself (the command's function):
    a prompt's tokens in a padded batch equal those it decodes alone."""
    model = model_for("llama-gqa")
    from flexevict.calibrate_policy import calibrate_triattention
    cal = calibrate_triattention(Engine.resident(model), rand_prompts([200], seed=9)[0], "random")
    path = str(tmp_path / "cal.pt")
    T.save_calibration(path, cal)
    ps = rand_prompts([50, 37], seed=4)
    make = lambda: get_policy("triattention", budget_tokens=20, stats=path)  # noqa: E731
    together = generate(model, ps, 30, make(), Sampling(), (), 0)
    assert together == [generate(model, [p], 30, make(), Sampling(), (), 0)[0] for p in ps]
    stats_none = generate(model, ps, 30, get_policy("triattention", budget_tokens=20, stats="none"),
                          Sampling(), (), 0)
    assert stats_none != together                       # the statistics change the selection


# ------------------------------------------------------------------ calibration

def test_query_statistics_undo_rope():
    """Queries rotated to their positions give back the statistics of the unrotated ones."""
    torch.manual_seed(1)
    s, rows, g, d = 50, 2, 3, 8
    pre = torch.randn(s, rows, g, d, dtype=torch.float64) + 0.7
    pos = torch.arange(s)[:, None].expand(s, rows)
    valid = torch.ones(s, rows, dtype=torch.bool)
    valid[:5, 1] = False                                            # pads do not count
    inv = 1.0 / 100.0 ** (torch.arange(0, d, 2).double() / d)
    cos, sin = rope_cos_sin(inv, pos, torch.float64)
    mean, mod = T.query_statistics(apply_rope(pre, cos[:, :, None], sin[:, :, None]), pos,
                                   valid, inv)
    z = torch.complex(pre[..., :d // 2], pre[..., d // 2:])
    for r in range(rows):
        zr = z[valid[:, r], r]
        torch.testing.assert_close(torch.view_as_complex(mean[r].contiguous()), zr.mean(0))
        torch.testing.assert_close(mod[r], zr.abs().mean(0))


def test_calibration_of_a_model_fits_it_and_is_refused_by_another(tmp_path):
    model = model_for("llama-gqa")
    from flexevict.calibrate_policy import calibrate_triattention
    cal = calibrate_triattention(Engine.resident(model), list(range(1, 64)), "ids 1..63")
    assert cal.q_mean.shape == (2, 4, 8, 2) and cal.q_abs.shape == (2, 4, 8)
    assert (cal.q_abs >= torch.linalg.vector_norm(cal.q_mean, dim=-1) - 1e-5).all()  # |E q| <= E|q|
    cal.check(CFG)
    with pytest.raises(UserError, match="does not fit"):
        cal.check(CONFIGS["opt"])


def test_auto_finds_the_cache_then_the_shipped_file(tmp_path, monkeypatch, stats_file):
    monkeypatch.setenv("FLEXEVICT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(T, "SHIPPED", str(tmp_path / "shipped"))
    policy = get_policy("triattention", budget=0.5)
    assert "no calibration for model 't'" in policy.for_model(CFG).describe()["calibration"]
    os.makedirs(tmp_path / "shipped")
    T.save_calibration(str(tmp_path / "shipped" / "t.pt"),
                       T.Calibration(**{**vars(random_calibration(CFG)), "text": "shipped"}))
    assert policy.for_model(CFG).describe()["calibration"] == "t: 0 tokens of shipped"
    T.save_calibration(T.cache_path("t"), random_calibration(CFG))
    assert policy.for_model(CFG).describe()["calibration"] == "t: 0 tokens of random"
    from flexevict.planner.calibration import cache_dir
    assert T.cache_path("t") == os.path.join(cache_dir(), "triattention", "t.pt")


def test_shipped_smollm2_calibration(smollm2_path):
    """The packaged SmolLM2-135M ships its calibration: it fits the model's config, names its
    text and tokens, and shows Q concentration (mean resultant length |E q| / E|q| high)."""
    from flexevict.api import resolve_model
    config, _ = resolve_model("smollm2-135m")
    path = os.path.join(T.SHIPPED, "smollm2-135m.pt")
    cal = T.load_calibration(path)
    cal.check(config)
    assert cal.tokens == 8192 and "Macbeth" in cal.text
    assert (torch.linalg.vector_norm(cal.q_mean, dim=-1) / cal.q_abs).median() > 0.5
    policy = get_policy("triattention", budget=0.2).for_model(config)
    assert policy.describe()["calibration"].startswith("smollm2-135m: 8192 tokens of Macbeth")


def test_flags_and_bad_input(stats_file):
    policy = get_policy("triattention", budget=0.5)
    assert policy.graph_safe and policy.stacks and not policy.needs_prompt_scores
    assert not policy.accumulates_attention and policy.fields(policy.layout(40, 10)) == ()
    assert policy.describe()["calibration"].startswith("unbound")
    with pytest.raises(UserError, match="window=-1"):
        get_policy("triattention", budget=0.2, window=-1)
    with pytest.raises(UserError, match="horizon=0"):
        get_policy("triattention", budget=0.2, horizon=0)
    with pytest.raises(UserError, match="stats=nope"):
        get_policy("triattention", budget=0.2, stats="nope")
    with pytest.raises(UserError, match="does not fit"):
        get_policy("triattention", stats=stats_file).for_model(CONFIGS["opt"])


def test_a_model_without_statistics_is_said_on_stderr_unless_chosen(capsys):
    """stats=auto on a model with no calibration runs on the norm term alone and says so, with
    the command that makes one; stats=none is that choice made on purpose: quiet."""
    from flexevict.policies import get_policy
    config = CFG
    get_policy("triattention", budget_tokens=8).for_model(config)
    err = capsys.readouterr().err
    assert "norm term alone" in err and "calibrate_policy triattention --model" in err
    get_policy("triattention", budget_tokens=8, stats="none").for_model(config)
    assert capsys.readouterr().err == ""
