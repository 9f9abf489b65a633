"""What a GPU run of the offloading engine relies on, checked on the CPU where possible:
every tensor of a KV buffer lives in its home tier (not on the compute device), a lane keeps
the order of what it runs, no load of a home starts before the stores into it have landed,
policy timing events do not pile up over a run, and the pinned cpu tier locks what the memory
plan counts. Tests marked "needs CUDA" check the same on a GPU."""
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from tiny import CONFIGS, greedy, model_for, rand_prompts, roomy

import flexevict.runtime.engine as engine_mod
import flexevict.runtime.offload as offload
from flexevict.runtime.engine import Engine, EvictionClock, _like
from flexevict.runtime.generation import generate
from flexevict.core.kernels.quant import Packed4bit
from flexevict.core.kv import KVBuffer, Layout, Memory
from flexevict.runtime.offload import load_into, store_into
from flexevict.runtime.memory import MemoryPlan
from flexevict.runtime.offload import Lane, Tiers, host_bytes, park_bytes, pinned_size
from flexevict.runtime.placement import Placement
from flexevict.policies import POLICIES, get_policy
from flexevict.io.weights import DummyWeights

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: real streams, "
                          "events and cudaHostRegister")
META = torch.device("meta")       # a compute device no home tier is on


def owned_tensors(buf: KVBuffer):
    """(name, tensor) for every tensor the buffer owns: fields, declared policy state, 4-bit
    parts (not the shared constants: they live where they are used)."""
    owned = {**vars(buf), **{f"policy_state.{n}": v for n, v in buf.policy_state.items()}}
    for name, value in owned.items():
        if isinstance(value, torch.Tensor):
            yield name, value
        elif isinstance(value, Packed4bit):
            yield from ((f"{name}.{p}", getattr(value, p)) for p in ("data", "min", "scale"))


def assert_homed(buf: KVBuffer, device) -> None:
    wrong = {n: t.device for n, t in owned_tensors(buf) if t.device != torch.device(device)}
    assert not wrong, f"tensors off the buffer's home {device}: {wrong}"


# ------------------------------------------------------------------------- 1. buffer devices

@pytest.mark.parametrize("tier", ["cpu", "disk", "gpu"])
@pytest.mark.parametrize("compress", [False, True])
def test_a_buffer_lives_entirely_in_its_home_tier(tier, compress, tmp_path):
    """The tier allocator decides the device; the rows index must follow it (it was created on
    the model's device: a CPU home on a GPU run failed at the first eviction or store)."""
    tiers = Tiers(META, str(tmp_path), pin=False)
    model = SimpleNamespace(config=CONFIGS["llama-gqa"], dtype=torch.float32, device=META)
    try:
        for buf in engine_mod.allocate(model, Layout(9), 3, Memory(META, tiers.alloc(tier))):
            if compress:
                put = lambda x: tiers.put(tier, x)  # noqa: E731
                buf.k, buf.v = engine_mod.compressed(buf.k, put), engine_mod.compressed(buf.v, put)
            assert_homed(buf, tiers.device(tier))
            assert buf.device == tiers.device(tier)
    finally:
        tiers.close()


def _prompt(n, rows, d, seed):
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(n, dtype=torch.int32).unsqueeze(1).expand(-1, rows).contiguous()
    return (torch.randn(n, rows, d, generator=g), torch.randn(n, rows, d, generator=g), pos,
            torch.ones(n, rows, dtype=torch.bool), torch.rand(n, rows, generator=g))


def _decode(policy, buf, position, g):
    """One decode step with seeded K, V and attention probabilities (rows, 1 query, n)."""
    rows, d = buf.k.shape[1], buf.head_dim
    slot = buf.incoming_slot()
    buf.write(slot, torch.randn(rows, d, generator=g), torch.randn(rows, d, generator=g),
              torch.full((rows,), position, dtype=torch.int32))
    policy.before_attention(buf, slot, torch.randn(rows, 1, d, generator=g))
    probs = torch.rand(rows, 1, buf.attended(slot), generator=g).softmax(-1)
    policy.after_attention(buf, slot, probs)


def _cpu_home(layout, rows, d, fields=()):
    """A home as the engine makes it on a GPU run: compute device passed, CPU memory given."""
    cpu = lambda shape, dtype, device: torch.zeros(shape, dtype=dtype)  # noqa: E731
    return KVBuffer(layout, rows, d, torch.float32, Memory(META, cpu), fields=fields)


@pytest.mark.parametrize("name", sorted(n for n in POLICIES if n != "full"))
def test_evicting_policy_round_trips_through_a_cpu_home(name):
    """Every registered policy: prefill and decode steps (with evictions) on a working buffer,
    stored into and loaded back from a home that lives on another device than the one the
    engine asked for: the home holds exactly the state of a buffer that never moved (its
    declared policy state included), and stays on its device."""
    rows, d, prompt, steps = 3, 4, 24, 10
    ref_policy, policy = (get_policy(name, **roomy(name, budget_tokens=18)) for _ in range(2))
    ref_layout = ref_policy.layout(prompt, steps)
    layout = policy.layout(prompt, steps)
    assert ref_layout.evicts
    ref = KVBuffer(ref_layout, rows, d, torch.float32, "cpu", fields=ref_policy.fields(ref_layout))
    home = _cpu_home(layout, rows, d, policy.fields(layout))
    work = _like(home, "cpu")
    ref_policy.prefill(ref, *_prompt(prompt, rows, d, 0))
    policy.prefill(work, *_prompt(prompt, rows, d, 0))
    store_into(home, work)
    g_ref, g = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for i in range(steps):
        _decode(ref_policy, ref, prompt + i, g_ref)
        work = _like(home, "cpu")                 # as a pool buffer last used by another layer
        load_into(work, home)
        _decode(policy, work, prompt + i, g)
        store_into(home, work)                    # only the changed K/V slots
        assert_homed(home, "cpu")
    mine = dict(owned_tensors(home))
    for field, value in owned_tensors(ref):
        if field in ("k", "v"):      # an empty slot's K/V mean nothing (recall's dropped pages)
            value, mine[field] = value[ref.valid], mine[field][ref.valid]
        assert torch.equal(mine[field], value), field
    assert (home.used, home.cursor, home.ring_start) == (ref.used, ref.cursor, ref.ring_start)
    hosts = lambda b: {n: v for n, v in b.policy_state.items() if not isinstance(v, torch.Tensor)}  # noqa: E731
    assert hosts(home) == hosts(ref)


def test_a_load_counts_the_declared_state_it_reads():
    """load_into reports the bytes it read: the core tensors and every declared field (the
    engine's traffic counts them), not only K, V and the per-slot rows."""
    policy = get_policy("scissorhands", budget_tokens=18)
    layout = policy.layout(24, 10)
    home = _cpu_home(layout, 3, 4, policy.fields(layout))
    declared = sum(t.numel() * t.element_size() for t in home.policy_state.values()
                   if isinstance(t, torch.Tensor))
    assert declared > 0
    assert load_into(_like(home, "cpu"), home) == home.nbytes() + declared


def test_evicting_policy_runs_on_a_cpu_home_directly():
    """--cpu-cache-compute: eviction runs on the home itself (its rows index included)."""
    rows, d, prompt = 2, 4, 12
    policy = get_policy("h2o", budget_tokens=7)
    home = _cpu_home(policy.layout(prompt, 8), rows, d)
    policy.prefill(home, *_prompt(prompt, rows, d, 0))
    g = torch.Generator().manual_seed(1)
    for i in range(8):
        _decode(policy, home, prompt + i, g)
    assert_homed(home, "cpu")
    assert home.valid[:home.capacity].all() and home.pos.max() == prompt + 7


# ------------------------------------------------------------------------- 2. order of copies

def test_a_lane_runs_jobs_in_submission_order():
    """Two threads: a fast second job must not overtake a slow first one."""
    lane, log = Lane("t", torch.device("cpu"), threads=2), []
    release, second_ran = threading.Event(), threading.Event()
    try:
        lane.submit(lambda: (release.wait(5), log.append(1)))
        lane.submit(lambda: (log.append(2), second_ran.set()))
        overtook = second_ran.wait(0.5)          # it may not start while the first is blocked
        release.set()
        lane.drain()
    finally:
        release.set()
        lane.close()
    assert not overtook and log == [1, 2]


def test_jobs_with_different_keys_overlap_and_one_key_keeps_order():
    lane, log = Lane("t", torch.device("cpu"), threads=2), []
    b_ran = threading.Event()
    try:
        a = lane.submit(lambda: b_ran.wait(5), key="a")      # needs b to run meanwhile
        b = lane.submit(lambda: b_ran.set() or "b", key="b")
        a2 = lane.submit(lambda: log.append("a2"), key="a")
        assert a.wait() is True and b.wait() == "b"
        a2.wait()
        assert log == ["a2"]
    finally:
        b_ran.set()
        lane.close()


def test_one_ticket_can_be_waited_from_several_threads():
    lane = Lane("t", torch.device("cpu"))
    try:
        t = lane.submit(lambda: 42)
        out = []
        threads = [threading.Thread(target=lambda: out.append(t.wait())) for _ in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert out == [42] * 4 and t.wait() == 42
    finally:
        lane.close()


def _engine(arch, percent, tmp, device="cpu", dtype=torch.float32, **flags):
    cfg = CONFIGS[arch]
    p = Placement.from_percent(percent, offload_dir=str(tmp), **flags)
    return Engine.load(cfg, DummyWeights(cfg, seed=0), p, device, dtype)


@pytest.mark.parametrize("cpu_compute", [False, True])
def test_a_slow_prefill_store_is_waited_for_before_the_home_is_read(cpu_compute, tmp_path,
                                                                     monkeypatch):
    """Batches of 2 and 1 sequences, cache on the CPU: the prefill store into (batch 1, layer 0)
    is slowed down. Its ticket shares a pool slot with a later store of the step; before, that
    slot's ticket was replaced unwaited and the next step read a half-written home. No load
    (or direct use) of a home may start while a store into it runs."""
    prompts = rand_prompts([30, 25, 40], seed=3)
    ref = generate(model_for("opt"), prompts, 6, get_policy("h2o", budget=0.4))
    real_store, real_load = engine_mod.store_into, engine_mod.load_into
    real_attention = type(model_for("opt")).attention_half
    storing, overlaps, slowed = set(), [], []      # homes being stored into; violations
    rows_1 = CONFIGS["opt"].num_kv_heads            # batch 1: one sequence

    def slow_store(home, work):
        storing.add(id(home))
        try:
            if work.dirty is None and home.layer == 0 and home.valid.shape[1] == rows_1 \
                    and not slowed:
                slowed.append(1)
                time.sleep(0.5)
            return real_store(home, work)
        finally:
            storing.discard(id(home))

    def checked_load(work, home):
        if id(home) in storing:
            overlaps.append(home.layer)
        return real_load(work, home)

    def checked_attention(self, w, h, inp, buf, policy, clock):   # the direct (cpu compute) path
        if buf is not None and id(buf) in storing:
            overlaps.append(buf.layer)
        return real_attention(self, w, h, inp, buf, policy, clock)
    monkeypatch.setattr(engine_mod, "store_into", slow_store)
    monkeypatch.setattr(engine_mod, "load_into", checked_load)
    monkeypatch.setattr(type(model_for("opt")), "attention_half", checked_attention)
    e = _engine("opt", (100, 0, 0, 100, 100, 0), tmp_path, gpu_batch_size=2, num_gpu_batches=2,
                cpu_cache_compute=cpu_compute)
    try:
        out = generate(e, prompts, 6, get_policy("h2o", budget=0.4))
    finally:
        e.close()
    assert slowed and not overlaps
    assert out == ref


class _FakeEvent:
    """A CUDA event stand-in: records a tick; done once the test says so."""
    clock, done_upto = 0, 0

    def __init__(self):
        self.t = None

    def record(self, stream=None):
        _FakeEvent.clock += 1
        self.t = _FakeEvent.clock

    def query(self):
        return self.t <= _FakeEvent.done_upto

    def elapsed_time(self, end):
        return float(end.t - self.t)                    # ms


class _FakeTimed(EvictionClock):
    drained: list = []

    def __init__(self, device, enabled=True):
        super().__init__(torch.device("cuda"), enabled)   # the event path, with fake events

    _event = staticmethod(_FakeEvent)

    def drain(self):
        _FakeEvent.done_upto = _FakeEvent.clock          # the engine drains after a sync
        before = len(self._events)
        super().drain()
        _FakeTimed.drained.append((before, len(self._events)))


def test_timing_events_are_read_and_dropped_once_complete():
    timed = EvictionClock(torch.device("cuda"))
    timed._event = _FakeEvent
    for _ in range(3):
        with timed:                                     # as the model times a policy hook
            pass
    _FakeEvent.done_upto = timed._events[1][1].t      # the first two pairs have completed
    timed.drain()
    assert len(timed._events) == 1 and timed._spent == pytest.approx(2 / 1e3)
    _FakeEvent.done_upto = _FakeEvent.clock
    timed.drain()
    assert timed._events == [] and timed.seconds() == pytest.approx(3 / 1e3)


def test_the_engine_drains_timing_events_every_step(monkeypatch):
    monkeypatch.setattr(engine_mod, "EvictionClock", _FakeTimed)
    _FakeTimed.drained = []
    generate(model_for("llama-gqa"), rand_prompts([20, 17], seed=1), 12,
             get_policy("h2o", budget=0.5))
    per_step = [before for before, _ in _FakeTimed.drained]
    assert len(per_step) == 12 and all(after == 0 for _, after in _FakeTimed.drained)
    assert max(per_step[1:]) == min(per_step[1:]) > 0   # one step's hooks, not the run's


# ------------------------------------------------------------------------- 3. pinned memory

class _FakeCuda:
    """cudaHostRegister / Unregister stand-ins that check what a driver would refuse."""

    def __init__(self):
        self.live, self.registrations = {}, 0

    def register(self, ptr, size):
        assert ptr % offload.PAGE == 0 and size % offload.PAGE == 0, (ptr, size)
        assert all(ptr + size <= p or p + s <= ptr for p, s in self.live.items()), "overlap"
        self.live[ptr] = size
        self.registrations += 1

    def unregister(self, ptr):
        assert self.live.pop(ptr, None) is not None, "not registered"

    @property
    def nbytes(self):
        return sum(self.live.values())


@pytest.fixture
def fake_cuda(monkeypatch):
    """Pinning on a CPU-only machine: the tier registers through the fake."""
    fake = _FakeCuda()
    monkeypatch.setattr(offload, "can_pin", lambda device: True)
    monkeypatch.setattr(offload, "_register", fake.register)
    monkeypatch.setattr(offload, "_unregister", fake.unregister)
    return fake


ODD = [((1,), torch.uint8), ((4095,), torch.uint8), ((4097,), torch.uint8),
       ((3, 333, 7), torch.float16), ((1000, 1001), torch.float32), (((5 << 20) + 3,), torch.bool)]


def test_pinned_tier_locks_whole_pages_not_powers_of_two(fake_cuda, tmp_path):
    tiers = Tiers(torch.device("cpu"), str(tmp_path), pin=True)
    sizes = [torch.Size(s).numel() * torch.empty((), dtype=dt).element_size() for s, dt in ODD]
    try:
        ts = [tiers.zeros("cpu", s, dt) for s, dt in ODD]
        for t, (s, dt) in zip(ts, ODD):
            assert t.shape == s and t.dtype == dt and not t.any()
            t.fill_(1)                                     # each its own memory
        assert all(t.all() for t in ts)
        assert tiers.pinned.nbytes == fake_cuda.nbytes == host_bytes(sizes, True)
        assert host_bytes(sizes, True) < sum(park_bytes(n, True) for n in sizes)
        assert pinned_size(4097) == 2 * offload.PAGE and park_bytes(4097, True) == 8192
    finally:
        tiers.close()
    assert fake_cuda.live == {} and tiers.pinned.nbytes == 0
    assert all(t.all() for t in ts)                        # still usable, unpinned


def test_a_run_scope_recycles_its_pinned_memory(fake_cuda, tmp_path):
    tiers = Tiers(torch.device("cpu"), str(tmp_path), pin=True)
    size = lambda *elems: sum(pinned_size(4 * n) for n in elems)  # noqa: E731  fp32 tensors
    try:
        kept = tiers.zeros("cpu", (100,), torch.float32)         # outside a scope: kept
        with tiers.run_scope():
            for _ in range(2):
                tiers.zeros("cpu", (5000,), torch.float32).fill_(7)
        n = fake_cuda.registrations
        with tiers.run_scope():                                  # same size: reused, zeroed
            b = tiers.zeros("cpu", (5000,), torch.float32)
            assert fake_cuda.registrations == n and not b.any()
        assert fake_cuda.nbytes == tiers.pinned.nbytes == size(100, 5000)   # the unused one went
        with tiers.run_scope():                                  # another size: free list emptied
            tiers.zeros("cpu", (9000,), torch.float32)
            assert fake_cuda.nbytes == size(100, 9000)
        assert kept.data_ptr() in fake_cuda.live
    finally:
        tiers.close()
    assert fake_cuda.live == {}


@pytest.mark.parametrize("compress", [False, True])
def test_the_memory_plan_counts_what_the_pinned_tier_holds(compress, fake_cuda, tmp_path,
                                                          monkeypatch):
    """Weights and cache on the (pinned) CPU tier: during a run the tier locks exactly what
    MemoryPlan.needs counts for it; a second run of the same shape registers nothing more."""
    prompts, steps = rand_prompts([30, 25, 40], seed=3), 5
    flags = {"compress_weight": compress, "compress_cache": compress}
    e = _engine("opt", (0, 100, 0, 100, 100, 0), tmp_path, **flags)
    seen = _spy_steps(monkeypatch, lambda: fake_cuda.nbytes)
    try:
        out = generate(e, prompts, steps, get_policy("h2o", budget=0.5))
        n = fake_cuda.registrations
        assert generate(e, prompts, steps, get_policy("h2o", budget=0.5)) == out
        assert fake_cuda.registrations == n
    finally:
        e.close()
    assert set(seen) == {_plan(e, prompts, steps, torch.float32).needs()["cpu"]}
    assert fake_cuda.live == {}
    if not compress:
        assert out == generate(model_for("opt"), prompts, steps, get_policy("h2o", budget=0.5))


def _spy_steps(monkeypatch, read) -> list:
    """read() at the start of every token step of every run -> the list it fills."""
    seen, real = [], Engine._step

    def step(self, *args):
        seen.append(read())
        return real(self, *args)
    monkeypatch.setattr(Engine, "_step", step)
    return seen


def _plan(e, prompts, steps, dtype) -> MemoryPlan:
    longest = max(len(p) for p in prompts)
    slots = get_policy("h2o", budget=0.5).layout(longest, steps).capacity + 1
    return MemoryPlan(e.config, e.placement, dtype, len(prompts), longest, steps, slots)


def test_parked_activations_are_counted_at_the_pinned_allocators_rounding():
    c = CONFIGS["opt"]
    p = Placement.from_percent((100, 0, 100, 0, 0, 100), num_gpu_batches=2)
    plan = MemoryPlan(c, p, torch.float16, 6, 37, 4, 41)
    parked = 3 * 37 * c.hidden_size * 2
    assert plan.needs("cuda")["cpu"] == 3 * park_bytes(parked, True) > 3 * parked
    assert plan.needs("cpu")["cpu"] == 3 * parked


# ------------------------------------------------------------------------- on a GPU

@CUDA
def test_pinned_bytes_of_odd_sizes_match_the_count(tmp_path):
    tiers = Tiers(torch.device("cuda"), str(tmp_path), pin=True)
    sizes = [torch.Size(s).numel() * torch.empty((), dtype=dt).element_size() for s, dt in ODD]
    host = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    try:
        ts = [tiers.zeros("cpu", s, dt) for s, dt in ODD]
        assert all(t.is_pinned() for t in ts)
        assert tiers.pinned.nbytes == host_bytes(sizes, True)
        assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == host
        for t in ts:                                          # asynchronous copies work
            assert torch.equal(t.to("cuda", non_blocking=True).cpu(), t)
    finally:
        tiers.close()
    assert not any(t.is_pinned() for t in ts)


@CUDA
def test_gpu_run_pins_what_the_plan_counts(tmp_path, monkeypatch):
    prompts, steps = rand_prompts([30, 25, 40], seed=3), 5
    e = _engine("opt", (0, 100, 0, 100, 100, 0), tmp_path, "cuda", torch.float16)
    seen = _spy_steps(monkeypatch, lambda: e.tiers.pinned.nbytes)
    try:
        out = generate(e, prompts, steps, get_policy("h2o", budget=0.5))
        weights = [h.data for hs in e.homes for h in hs.values() if h.tier == "cpu"]
        assert weights and all(t.is_pinned() for t in weights)
    finally:
        e.close()
    assert set(seen) == {_plan(e, prompts, steps, torch.float16).needs("cuda")["cpu"]}
    assert [len(o) for o in out] == [steps] * 3


@CUDA
@pytest.mark.parametrize("policy", [("h2o", 0.3), ("recall", 0.5)])
@pytest.mark.parametrize("percent, flags", [
    ((100, 0, 0, 100, 100, 0), {}), ((100, 0, 0, 0, 100, 0), {}),
    ((100, 0, 0, 100, 100, 0), {"cpu_cache_compute": True}),
    ((100, 0, 50, 50, 100, 0), {"num_gpu_batches": 2}),
])
def test_offloaded_cache_with_eviction_runs_on_a_gpu(percent, flags, policy, tmp_path):
    """Homes on the CPU or disk with an evicting ring policy, and recall (its history in
    pinned CPU memory read by the page-gather kernel, or in a disk file): tokens of the
    resident GPU run split into the same GPU batches (attention on the CPU with
    --cpu-cache-compute may round differently: length only)."""
    name, budget = policy
    prompts = rand_prompts([30, 25, 40, 33], seed=3)
    split = {k: v for k, v in flags.items() if k == "num_gpu_batches"}
    resident = _engine("llama-gqa", (100, 0, 100, 0, 100, 0), tmp_path, "cuda", **split)
    e = _engine("llama-gqa", percent, tmp_path, "cuda", **flags)
    try:
        ref = generate(resident, prompts, 14, get_policy(name, budget=budget))
        out = generate(e, prompts, 14, get_policy(name, budget=budget))
    finally:
        resident.close()
        e.close()
    if flags.get("cpu_cache_compute"):
        assert [len(o) for o in out] == [14] * 4
    else:
        assert out == ref


@CUDA
def test_timing_events_do_not_grow_with_steps(monkeypatch, tmp_path):
    seen = []
    real = EvictionClock.drain

    def spy(self):
        real(self)
        seen.append(len(self._events))
    monkeypatch.setattr(EvictionClock, "drain", spy)
    e = _engine("llama-gqa", (100, 0, 100, 0, 100, 0), tmp_path, "cuda",
                cuda_graphs=False)                   # graphed steps run the hooks untimed
    try:
        run = e.run(rand_prompts([20, 17], seed=1), 16, get_policy("h2o", budget=0.5), greedy)
        assert run.stats.eviction_seconds > 0
    finally:
        e.close()
    assert len(seen) == 16 and seen == [0] * 16
