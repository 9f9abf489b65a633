"""CUDA graphs of steady decode steps (runtime/graphs.py): on the CPU through a double that
re-runs the step wherever a graph would replay (so the host-state bookkeeping, the static inputs
and outputs and the refusal of unsafe policies are checked); on a GPU with real graphs."""
import dataclasses

import pytest
import torch
from tiny import CONFIGS, greedy, model_for, rand_prompts

from flexevict.core import kv
from flexevict.core.kv import Field
from flexevict.io.weights import DummyWeights
from flexevict.policies import POLICIES, get_policy
from flexevict.policies.h2o import H2O
from flexevict.runtime.engine import Engine
from flexevict.runtime.generation import generate
from flexevict.runtime.graphs import (DecodeGraphs, host_state, mirrors, restore_mirrors,
                                      set_host_state)
from flexevict.runtime.placement import Placement

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: real CUDA graphs")
GRAPH_SAFE = sorted(n for n, cls in POLICIES.items() if cls.graph_safe)


# one graph per attention span: BUZZ's step whose token waits in the scratch slot (the buffer
# full until that step's pass) attends one slot more than the steps that append
CAPTURES = {"buzz": 2}


def _policy(name: str):
    """A graph-safe policy whose buffer the test prompts overflow (`full` never evicts)."""
    return get_policy(name) if name == "full" else get_policy(name, budget_tokens=24)


class _Rerun:
    """A replay that runs the step again from the host state it was captured at, the host
    mirrors of the device's counters included: a real graph replays what its capture's Python
    launched with the counters' values then, so a step that reads a mirror (say `buf.cursor`
    where `buf.ring_cursor()` belongs) gives wrong tokens here as it would on a GPU."""

    def __init__(self, body, static):
        self.body, self.static, self.first = body, static, True
        self.bufs = self.key = self.captured = self.at_capture = None

    def replay(self):
        if self.first:                     # the capture itself ran the step
            self.first = False
            return
        set_host_state(self.bufs, self.key)
        saved = mirrors(self.bufs)         # the host's counters: the graphs move them after
        restore_mirrors(self.bufs, self.at_capture)
        out = self.body(self.static)
        for dst, src in zip(self.captured.outputs, out):
            dst.copy_(src)
        assert host_state(self.bufs) == self.captured.after, "the step's host state is not " \
                                                             "a function of its key"
        set_host_state(self.bufs, self.key)   # a real replay runs no Python: it stays at key
        restore_mirrors(self.bufs, saved)


class RerunGraphs(DecodeGraphs):
    """CPU double of DecodeGraphs: capture runs the step, and each later replay re-runs it
    from the captured host state (a real graph would replay the captured kernels)."""

    def __init__(self, device):
        self.device, self.graphs, self.static = device, {}, None
        self.captures = self.replays = 0
        self._warm = False

    @staticmethod
    def supports(device):
        return True

    def _eager(self, body, inputs):
        return body(inputs)

    def _record(self, body):
        outputs = body(self.static)
        return _Rerun(body, self.static), outputs

    def capture(self, bufs, key, body):
        at_capture = mirrors(bufs)
        captured = super().capture(bufs, key, body)
        g = captured.graph
        g.bufs, g.key, g.captured, g.at_capture = bufs, key, captured, at_capture
        return captured


def _engine(arch: str, graphs: bool, device="cpu", **flags) -> Engine:
    cfg = CONFIGS[arch]
    p = Placement(cuda_graphs=graphs, **flags)
    return Engine.load(cfg, DummyWeights(cfg, seed=0), p, device, torch.float32)


@pytest.fixture
def short_runs(monkeypatch):
    """Graphs even for runs too short to pay them back (tests run tens of steps)."""
    monkeypatch.setattr(Engine, "GRAPH_REPLAYS", 0)


@pytest.fixture
def rerun(monkeypatch, short_runs):
    """The CPU double of the graphs, attending over a filling buffer's spans as a GPU does."""
    monkeypatch.setattr(Engine, "Graphs", RerunGraphs)
    monkeypatch.setattr(kv, "SPAN_DEVICES", ("cuda", "cpu"))


def run(engine, prompts, steps, policy):
    """-> greedy tokens, the run's stats (what `generate` gives without stop ids)."""
    r = engine.run(prompts, steps, policy, greedy)
    return r.tokens.tolist(), r.stats


@pytest.mark.parametrize("arch", CONFIGS)
@pytest.mark.parametrize("name", GRAPH_SAFE)
def test_graphed_steps_give_the_eager_tokens(arch, name, rerun):
    prompts = rand_prompts([30, 25, 40], seed=3)
    policy = _policy(name)
    ref, eager = run(_engine(arch, graphs=False), prompts, 40, policy)
    assert not any(eager.graphed)
    tokens, stats = run(_engine(arch, graphs=True), prompts, 40, policy)
    assert tokens == ref
    # every decode step of a buffer that fills at prefill (or of `full`'s, one span of 80
    # slots) goes through the graphs; the first is the warm-up, then one capture (a ring
    # cursor or a fill count is kept on the device) and replays
    assert stats.graphed == [False] + [True] * 39
    assert stats.graph_captures == CAPTURES.get(name, 1)


@pytest.mark.parametrize("name", GRAPH_SAFE)
def test_graphed_steps_per_layer_give_the_eager_tokens(name, rerun, monkeypatch):
    """The layers' buffers apart, as on a GPU (a CPU stacks them where the policy `stacks`):
    each layer's hooks run their per-layer path (`after_attention` observes and commits)."""
    monkeypatch.setattr(Engine, "stack_layers", False)
    prompts, policy = rand_prompts([30, 25, 40], seed=3), _policy(name)
    ref, _ = run(_engine("llama-gqa", graphs=False), prompts, 40, policy)
    tokens, stats = run(_engine("llama-gqa", graphs=True), prompts, 40, policy)
    assert tokens == ref and stats.graphed == [False] + [True] * 39
    assert stats.graph_captures == CAPTURES.get(name, 1)


@pytest.mark.parametrize("args", [{"window": 6}, {"window": 20}, {"score": "attention",
                                  "window": 6}, {"score": "attention", "window": 0},
                                  {"base": "scissorhands", "window": 6}])
@pytest.mark.parametrize("lengths", [[30, 25, 40], [12, 9]])
def test_graphed_scissorhands_over_its_window(args, lengths, rerun):
    """Scissorhands' history row (its step t mod the window) comes from a step counter kept on
    the device in a graphed run: windows that wrap during the run (bits of several bytes),
    both scores, no window, VATP over it; prompts that overflow the buffer, or fill it first
    (eager steps, the counter on the host) and move the counter at the first graphed step."""
    policy = get_policy("vatp" if "base" in args else "scissorhands", budget_tokens=24, **args)
    prompts = rand_prompts(lengths, seed=5)
    ref, _ = run(_engine("llama-gqa", graphs=False), prompts, 40, policy)
    tokens, stats = run(_engine("llama-gqa", graphs=True), prompts, 40, policy)
    assert tokens == ref and stats.graph_captures == 1
    assert stats.graphed[-20:] == [True] * 20


def recording_engine(arch: str):
    """A graphed engine on the CPU double (`RerunGraphs`) that keeps each run's `Run` (its
    graphs and buffers, to check after the run) -> (engine, the list the runs go into)."""
    runs = []
    engine = _engine(arch, graphs=True)
    engine.Graphs = RerunGraphs
    real = engine._run
    engine._run = lambda run, *a: runs.append(run) or real(run, *a)
    return engine, runs


@pytest.mark.parametrize("args", [{}, {"w": 8, "T": 20}])
@pytest.mark.parametrize("span", [16, 256])
@pytest.mark.parametrize("lengths", [[30, 25, 40], [12, 9, 17]])
def test_graphed_buzz_passes(args, span, lengths, short_runs, monkeypatch):
    """BUZZ's counts move every step by its rules alone: a graphed run keeps the fill count on
    the device (a pass sets it from the kept counts) and moves the host's counts and fill
    count after each replay (`Buzz.replay_host`); one graph per attention span. Ragged rows
    (each its own counts), prompts that overflow the buffer or fill it first, spans of 16
    slots (several graphs) or 256, and a threshold below the buffer (a pass at every step
    whose span exceeds k + w + T, not only in the scratch slot)."""
    monkeypatch.setattr(kv, "FILL_SPAN", span)
    monkeypatch.setattr(kv, "SPAN_DEVICES", ("cuda", "cpu"))       # as on a GPU
    policy, prompts = get_policy("buzz", budget_tokens=48, **args), rand_prompts(lengths, seed=6)
    engine, runs = recording_engine("llama-gqa")
    tokens, stats = run(engine, prompts, 60, policy)
    assert tokens == run(_engine("llama-gqa", graphs=False), prompts, 60, policy)[0]
    assert all(stats.graphed[1:]) and stats.graph_captures <= 4
    for b in (b for batch in runs[0].cache for b in batch):
        live, old = b.valid.sum(0), (b.valid & (b.state > 0.5)).sum(0)
        assert int(b.used_at) == b.used == int(live.max())
        assert set(b.policy_state["counts"]) == set(zip(live.tolist(), old.tolist()))


def test_the_cpu_double_replays_the_counters_of_its_capture(rerun, monkeypatch):
    """A step that indexes by the host mirror of the ring cursor (not `ring_cursor()`) would
    replay its capture's slot on a GPU: the double re-runs it with that value too, so the
    tokens differ from the eager ones."""
    monkeypatch.setattr(kv.KVBuffer, "ring_cursor", lambda self: self.cursor)
    prompts, policy = rand_prompts([30, 25, 40], seed=3), H2O(budget_tokens=24)
    ref, _ = run(_engine("opt", graphs=False), prompts, 40, policy)
    tokens, stats = run(_engine("opt", graphs=True), prompts, 40, policy)
    assert all(stats.graphed[1:]) and tokens != ref


@pytest.mark.parametrize("arch", CONFIGS)
def test_graphed_hashevict_with_codes_beside_the_buffer(arch, rerun):
    """HashEvict's codes of more than 24 bits live in their own field, moved with the ring's
    commit at the cursor kept on the device."""
    prompts, policy = rand_prompts([30, 25], seed=4), get_policy("hashevict", budget_tokens=24,
                                                                 hash_bits=40)
    ref, _ = run(_engine(arch, graphs=False), prompts, 30, policy)
    tokens, stats = run(_engine(arch, graphs=True), prompts, 30, policy)
    assert tokens == ref and stats.graph_captures == 1 and all(stats.graphed[1:])


@pytest.mark.parametrize("stack_layers", [False, True])
def test_one_graph_serves_every_ring_position(short_runs, monkeypatch, stack_layers):
    """h2o at 12 slots: 11 committed, half heavy, so the ring cycles through 6 cursors; the
    cursor lives on the device in a graphed run (advanced there by the commit, mirrored on the
    host), so one capture serves all 6, laps after laps, stacked layers or not."""
    monkeypatch.setattr(Engine, "stack_layers", stack_layers)
    prompts, policy = rand_prompts([30], seed=1), H2O(budget_tokens=12)
    engine, runs = recording_engine("opt")
    tokens = generate(engine, prompts, 40, policy)
    g, bufs = runs[0].graphs, [b for batch in runs[0].cache for b in batch]
    assert g.captures == 1 and g.replays == 38          # 39 decode steps, one warm-up
    assert all(int(b.cursor_at) == b.cursor for b in bufs)
    assert len({b.cursor for b in bufs}) == 1 and bufs[0].cursor != bufs[0].ring_start
    assert tokens == generate(_engine("opt", graphs=False), prompts, 40, policy)


@pytest.mark.parametrize("span", [16, 256])
def test_one_graph_per_span_of_a_filling_buffer(short_runs, monkeypatch, span):
    """`full`'s buffer fills for the whole run: its fill count lives on the device in a
    graphed run (written at and counted there, mirrored on the host), and a step attends over
    the fill rounded up to FILL_SPAN slots (masked past the new token), so one capture serves
    each span: at 16, spans 48, 64 and 80 (capacity 80) after the warm-up at 41 slots."""
    monkeypatch.setattr(kv, "FILL_SPAN", span)
    monkeypatch.setattr(kv, "SPAN_DEVICES", ("cuda", "cpu"))    # as on a GPU
    prompts, policy = rand_prompts([30, 25, 40], seed=3), get_policy("full")
    engine, runs = recording_engine("llama-gqa")
    tokens, stats = run(engine, prompts, 40, policy)
    ref, _ = run(_engine("llama-gqa", graphs=False), prompts, 40, policy)
    assert tokens == ref and all(stats.graphed[1:])
    g, bufs = runs[0].graphs, [b for batch in runs[0].cache for b in batch]
    assert g.captures == (3 if span == 16 else 1) and g.replays == 38
    assert all(int(b.used_at) == b.used == 40 + 39 for b in bufs)


def test_a_policy_that_reassigns_buffer_state_is_refused(rerun):
    @dataclasses.dataclass(frozen=True)
    class Reassigning(H2O):
        def fields(self, layout):
            return (Field("seen", ("rows",), torch.float32),)

        def observe(self, buf, slot, probs, scored=False):
            super().observe(buf, slot, probs, scored)
            buf.policy_state["seen"] = buf.policy_state["seen"] + 1    # a new tensor
    with pytest.raises(RuntimeError, match="not graph_safe"):
        generate(_engine("opt", graphs=True), rand_prompts([30], seed=1), 10,
                 Reassigning(budget_tokens=12))


def test_a_step_that_cannot_be_captured_runs_eagerly(monkeypatch, capsys, short_runs):
    """A capture refused mid-step (say an op that synchronises) ran no kernel: the host state
    is put back, the step and the rest of the run go eagerly, with one line saying so."""
    class Refusing(RerunGraphs):
        bufs = None

        def capture(self, bufs, key, body):
            Refusing.bufs = bufs
            return super().capture(bufs, key, body)

        def _record(self, body):
            for b in Refusing.bufs:              # the Python of the step got this far
                b.cursor = b.ring_start
            raise RuntimeError("operation not permitted when stream is capturing\nmore")
    prompts, policy = rand_prompts([30, 40], seed=2), get_policy("h2o", budget_tokens=12)
    ref, _ = run(_engine("opt", graphs=False), prompts, 20, policy)
    monkeypatch.setattr(Engine, "Graphs", Refusing)
    tokens, stats = run(_engine("opt", graphs=True), prompts, 20, policy)
    assert tokens == ref
    assert stats.graphed == [False, True] + [False] * 18      # the warm-up, then eager
    err = capsys.readouterr().err
    assert err.count("CUDA graphs are off for this run") == 1 and "not permitted" in err


@dataclasses.dataclass(frozen=True)
class _Unsafe(H2O):
    """h2o's hooks declared not graph_safe."""
    graph_safe = False


@pytest.mark.parametrize("case", ["flag off", "not graph_safe", "weights on cpu",
                                  "cache on cpu", "budget holds all"])
def test_graphs_only_where_a_step_can_be_replayed(case, rerun, tmp_path):
    flags, policy = {}, get_policy("h2o", budget_tokens=12)
    if case == "flag off":
        flags = {"cuda_graphs": False}
    elif case == "not graph_safe":
        policy = _Unsafe(budget_tokens=12)
    elif case == "weights on cpu":
        flags = {"w_gpu": 0, "w_cpu": 100}
    elif case == "cache on cpu":
        flags = {"cache_gpu": 0, "cache_cpu": 100}
    elif case == "budget holds all":
        policy = get_policy("h2o", budget=1.0)
    cfg = CONFIGS["opt"]
    p = Placement(**{"cuda_graphs": True, "offload_dir": str(tmp_path), **flags})
    e = Engine.load(cfg, DummyWeights(cfg, seed=0), p, "cpu", torch.float32)
    try:
        _, stats = run(e, rand_prompts([30], seed=1), 8, policy)
    finally:
        e.close()
    assert not any(stats.graphed)


@pytest.mark.parametrize("steps,graphed", [(4, False), (5, True)])
def test_graphs_only_for_runs_long_enough_to_pay_them_back(steps, graphed, monkeypatch):
    """A capture pays back after GRAPH_REPLAYS (5) replays: 4 decode steps run eagerly, 5
    take the graph."""
    monkeypatch.setattr(Engine, "Graphs", RerunGraphs)
    assert Engine.GRAPH_REPLAYS == 5
    _, stats = run(_engine("opt", graphs=True), rand_prompts([30], seed=1), steps + 1,
                   H2O(budget_tokens=12))
    assert any(stats.graphed) == graphed


def test_the_cli_flag_reaches_the_placement():
    from flexevict.bench.throughput import parse_args
    from flexevict.cli import placement_from_args
    assert placement_from_args(parse_args(["--model", "opt-125m"])).cuda_graphs
    off = parse_args(["--model", "opt-125m", "--cuda-graphs", "false"])
    assert not placement_from_args(off).cuda_graphs


@CUDA
@pytest.mark.parametrize("arch", CONFIGS)
@pytest.mark.parametrize("name", GRAPH_SAFE)
def test_real_graphs_give_the_eager_tokens_on_a_gpu(arch, name, short_runs):
    prompts = rand_prompts([30, 25, 40], seed=3)
    policy = _policy(name)
    ref, _ = run(_engine(arch, graphs=False, device="cuda"), prompts, 60, policy)
    tokens, stats = run(_engine(arch, graphs=True, device="cuda"), prompts, 60, policy)
    assert tokens == ref
    assert sum(stats.graphed) == 59                                   # for every ring position
    assert stats.graph_captures == CAPTURES.get(name, 1)


@CUDA
def test_real_graphs_of_hashevict_with_codes_beside_the_buffer(short_runs):
    prompts = rand_prompts([30, 25], seed=4)
    policy = get_policy("hashevict", budget_tokens=24, hash_bits=40)
    ref, _ = run(_engine("llama-gqa", graphs=False, device="cuda"), prompts, 40, policy)
    tokens, stats = run(_engine("llama-gqa", graphs=True, device="cuda"), prompts, 40, policy)
    assert tokens == ref and sum(stats.graphed) == 39 and stats.graph_captures == 1


@CUDA
def test_real_graphs_on_the_resident_model_path(short_runs):
    """generate() with a loaded Transformer (Engine.resident) takes the graphs too."""
    cfg = CONFIGS["llama-gqa"]
    model = model_for("llama-gqa").load(cfg, DummyWeights(cfg, seed=0), device="cuda")
    prompts = rand_prompts([30, 25], seed=4)
    policy = get_policy("h2o", budget_tokens=12)
    eager = Engine.resident(model)
    eager.placement = dataclasses.replace(eager.placement, cuda_graphs=False)
    assert generate(Engine.resident(model), prompts, 30, policy) == \
        generate(eager, prompts, 30, policy)
    tokens, stats = run(Engine.resident(model), prompts, 30, policy)
    assert sum(stats.graphed) == 29 and tokens == run(eager, prompts, 30, policy)[0]
