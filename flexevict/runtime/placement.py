"""Where weights, KV cache and activations live: FlexGen's placement policy.

Six percents (weights, cache, activations on the GPU and on the CPU; the rest of each on disk),
a block of `gpu_batch_size * num_gpu_batches` sequences, and the switches of FlexGen's `Policy`.
"GPU" is the compute device's memory: on a machine without CUDA the same placement runs with the
CPU as the compute device, so every tier and the schedule are exercised without a GPU.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from flexevict.errors import UserError, setting

# where disk-tier files go unless --offload-dir says otherwise (every default of it is this)
DEFAULT_OFFLOAD_DIR = "~/flexevict_offload_dir"


@dataclass(frozen=True)
class Placement:
    w_gpu: int = 100
    w_cpu: int = 0
    cache_gpu: int = 100
    cache_cpu: int = 0
    act_gpu: int = 100
    act_cpu: int = 0
    gpu_batch_size: int = 0          # 0: the whole batch in one GPU batch
    num_gpu_batches: int = 1
    overlap: bool = True
    sep_layer: bool = True
    pin_weight: bool = True
    cpu_cache_compute: bool = False
    compress_weight: bool = False
    compress_cache: bool = False
    offload_dir: str = DEFAULT_OFFLOAD_DIR
    cuda_graphs: bool = True         # replay steady decode steps as CUDA graphs (graphs.py)
    weight_cache: bool = True        # keep disk-tier dummy weights for the next run
                                     # (weight_cache.py)

    @classmethod
    def from_percent(cls, percent, **flags) -> "Placement":
        if len(percent) != 6:
            raise UserError(f"{setting('percent')} takes six integers (weights, cache, activations "
                            f"on GPU and CPU), got {len(percent)}")
        return cls(*percent, **flags).checked()

    def checked(self) -> "Placement":
        for what, gpu, cpu in self.pairs():
            if min(gpu, cpu) < 0 or gpu + cpu > 100:
                raise UserError(f"{setting('percent')} for {what}: GPU {gpu} + CPU {cpu} must be "
                                "two non-negative integers summing to at most 100 (the rest is "
                                "disk)")
        if self.act_gpu not in (0, 100) and self.act_cpu not in (0, 100):
            raise UserError("activations must be 100% on one tier (FlexGen's rule); use "
                            f"{setting('percent')} ... 100 0 or ... 0 100")
        if self.act_gpu + self.act_cpu != 100:
            raise UserError("activations on disk are not supported; put them on the GPU or CPU "
                            f"(last two {setting('percent')} values 100 0 or 0 100)")
        if self.gpu_batch_size < 0 or self.num_gpu_batches < 1:
            raise UserError(f"{setting('gpu_batch_size')} must be >= 1 and "
                            f"{setting('num_gpu_batches')} >= 1 (got {self.gpu_batch_size} and "
                            f"{self.num_gpu_batches})")
        if (self.compress_cache and self.cache_gpu not in (0, 100)
                and self.cache_cpu not in (0, 100)):
            raise UserError(f"{setting('compress_cache')} needs the cache 100% on one tier "
                            "(FlexGen's rule)")
        return self

    def pairs(self):
        return (("weights", self.w_gpu, self.w_cpu), ("cache", self.cache_gpu, self.cache_cpu),
                ("activations", self.act_gpu, self.act_cpu))

    @property
    def percent(self) -> tuple:
        return (self.w_gpu, self.w_cpu, self.cache_gpu, self.cache_cpu, self.act_gpu, self.act_cpu)

    @property
    def uses_disk(self) -> bool:
        """Some weights or cache live under offload_dir."""
        return self.w_gpu + self.w_cpu < 100 or self.cache_gpu + self.cache_cpu < 100

    @property
    def act_tier(self) -> str:
        return "gpu" if self.act_gpu == 100 else "cpu"

    def describe(self) -> dict:
        return {**asdict(self), "percent": list(self.percent)}

    def batch_split(self, n: int) -> list[int]:
        """Sizes of the GPU batches for n sequences: gpu_batch_size each (the last one may be
        short), or, without --gpu-batch-size, n split as evenly as possible over at most
        num_gpu_batches batches."""
        nb, gbs = self.num_gpu_batches, self.gpu_batch_size
        if gbs and n > gbs * nb:
            raise UserError(f"{n} prompts exceed one block of {setting('num_gpu_batches')} {nb} x "
                            f"{setting('gpu_batch_size')} {gbs}; raise either or give fewer "
                            "prompts")
        gbs = gbs or -(-n // nb)
        return [min(gbs, n - a) for a in range(0, n, gbs)]

    def batch_rows(self, n: int) -> list[slice]:
        """The rows of each GPU batch among n sequences (`batch_split`'s sizes, in order)."""
        rows, at = [], 0
        for size in self.batch_split(n):
            rows.append(slice(at, at + size))
            at += size
        return rows

    def weight_tiers(self, sizes: list[int]) -> list[str]:
        """Tier of each of a layer's weight tensors, given their sizes in declaration order.

        FlexGen's rule: a tensor goes where the midpoint of its cumulative-size interval falls
        on the [disk | cpu | gpu] scale, so every layer gets the same split."""
        return [_tier_at(mid, self.w_gpu, self.w_cpu) for mid in _midpoints(sizes)]

    def tensor_tiers(self, weights: dict) -> list[str]:
        """`weight_tiers` of a schedule layer's weights by name (None: an absent bias, size 0)."""
        return self.weight_tiers([0 if t is None else t.numel() for t in weights.values()])

    def cache_tiers(self, num_gpu_batches: int) -> list[str]:
        """Tier of each GPU batch's cache. A mixed percent splits along whole GPU batches (each
        one a set of whole sequences), by the same midpoint rule as weights."""
        return [_tier_at(mid, self.cache_gpu, self.cache_cpu)
                for mid in _midpoints([1] * num_gpu_batches)]

    def work_tier(self, tier: str) -> str:
        """Where attention (and eviction) over a cache home of `tier` runs: in the CPU's memory
        with --cpu-cache-compute for a cpu or disk home, else on the compute device."""
        return "cpu" if self.cpu_cache_compute and tier in ("cpu", "disk") else "gpu"

    def in_place(self, tier: str) -> bool:
        """Whether decode computes on a cache home of `tier` itself, never a working copy: on
        the compute device, or with --cpu-cache-compute on the CPU; never a compressed one."""
        return self.work_tier(tier) == tier and not self.compress_cache


def _midpoints(sizes: list[int]) -> list[float]:
    total, acc, out = sum(sizes) or 1, 0, []
    for s in sizes:
        out.append(100.0 * (acc + s / 2) / total)
        acc += s
    return out


def _tier_at(percent_point: float, gpu: int, cpu: int) -> str:
    disk = 100 - gpu - cpu
    if percent_point < disk:
        return "disk"
    return "cpu" if percent_point < disk + cpu else "gpu"
