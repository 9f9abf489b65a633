"""Tiny random-weight models and prompts shared by the policy tests (imported as `tiny`), and
the prefill mask the kernel tests hand to the reference kernels."""
import torch

from flexevict.core.config import ModelConfig
from flexevict.core.model import Transformer
from flexevict.io.weights import DummyWeights

CONFIGS = {
    "llama-gqa": ModelConfig(arch="llama", name="t", vocab_size=128, hidden_size=64, num_layers=2,
                             num_heads=4, num_kv_heads=2, ffn_size=128, max_positions=512,
                             tie_embeddings=False),
    "opt": ModelConfig(arch="opt", name="t-opt", vocab_size=128, hidden_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=4, ffn_size=128, max_positions=512,
                       tie_embeddings=False),
}
# families run by the policy matrix's family tests only (test_policy_matrix.py): the tests over
# CONFIGS cover the attention and cache paths, which every family shares
FAMILY_CONFIGS = {
    "qwen3": ModelConfig(arch="qwen3", name="t-qwen3", vocab_size=128, hidden_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, ffn_size=128,
                         max_positions=512, norm_eps=1e-6),
    # a window (16) shorter than the policy tests' runs (40 + 16): the sliding layers keep a
    # ring, the policy runs on the global one
    "gemma3": ModelConfig(arch="gemma3", name="t-gemma3", vocab_size=128, hidden_size=64,
                          num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32, ffn_size=128,
                          max_positions=512, norm_eps=1e-6, sliding_window=16,
                          layer_types=("sliding", "global", "sliding"), rope_theta=1e6,
                          rope_local_theta=1e4, query_pre_attn_scalar=24,
                          final_logit_softcap=30.0),
}
_MODELS = {}


def model_for(key: str) -> Transformer:
    """A cached dummy-weight (seed 0) model for a CONFIGS key."""
    if key not in _MODELS:
        cfg = CONFIGS.get(key) or FAMILY_CONFIGS[key]
        _MODELS[key] = Transformer.load(cfg, DummyWeights(cfg, seed=0))
    return _MODELS[key]


def roomy(name: str, budget_tokens: int | None = None, budget: float | None = None) -> dict:
    """The budget arguments a generic test gives policy `name`: recall keeps one key summary
    per page of the run in its budget (policies/recall.py), so the tiny runs' smallest
    budgets get it a few more slots (30, or half the run)."""
    if name == "recall":
        budget_tokens = None if budget_tokens is None else max(budget_tokens, 30)
        budget = None if budget is None else max(budget, 0.5)
    return {k: v for k, v in (("budget_tokens", budget_tokens), ("budget", budget))
            if v is not None}


def rand_prompts(lengths, seed, vocab=128):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def greedy(i, k, h, head):
    """The plainest `Consumer`: each step's greedy tokens (the last position at the prefill)."""
    return head(h[:, -1] if h.dim() == 3 else h).argmax(-1)


def kept(buf, row=0):
    """Sorted positions of the committed tokens of one buffer row."""
    return sorted(buf.pos[:buf.capacity, row][buf.valid[:buf.capacity, row]].tolist())


def decode_step(policy, buf, pos, probs):
    """One decode step on a bare buffer with hand-made probabilities (rows, group, attended)."""
    rows = buf.k.shape[1]
    slot = buf.incoming_slot()
    buf.write(slot, torch.randn(rows, 2), torch.randn(rows, 2),
              torch.tensor(pos, dtype=torch.int32))
    policy.before_attention(buf, slot, torch.randn(rows, probs.shape[1], 2))
    assert probs.shape[-1] == buf.attended(slot)
    policy.after_attention(buf, slot, probs)


@torch.inference_mode()
def engine_logits(model, prompts, feed, policy):
    """Logits through the path users run (`Engine.run`, of an Engine or a resident model),
    teacher-forced:
    the prompts' prefill logits (B, S, V), then one (B, V) per token of `feed` (a list of (B,)
    token tensors or lists fed one step each, left padding as `left_pad` makes it)."""
    from flexevict.runtime.generation import as_engine
    engine = as_engine(model)
    out: dict = {}

    def consume(i, k, h, head):
        out.setdefault(i, {})[k] = head(h)
        if i < len(feed):
            return torch.as_tensor(feed[i], device=h.device)[_rows(engine, prompts, k)]
        return head(h).argmax(-1)

    engine.run(prompts, len(feed) + 1, policy, consume)
    logits = [torch.cat([step[k] for k in sorted(step)]) for _, step in sorted(out.items())]
    return logits[0], logits[1:]


def _rows(engine, prompts, k: int) -> slice:
    return engine.placement.batch_rows(len(prompts))[k]


def prefill_mask(valid: torch.Tensor) -> torch.Tensor:
    """Causal mask that also hides pad keys; pad queries see themselves (no all-masked row).
    (B, S) -> (B, 1, S, S) bool, for kernels that take any mask (the model needs none)."""
    s = valid.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=valid.device).tril()
    eye = torch.eye(s, dtype=torch.bool, device=valid.device)
    return ((causal & valid[:, None, :]) | eye).unsqueeze(1)
