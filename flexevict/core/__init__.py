"""The model and its cache: `config` (ModelConfig), `model` (white-box OPT/LLaMA math over
explicit weights), `kv` (KVBuffer, the fixed-budget per-layer cache) and `kernels` (the decode
hot path: CUDA kernels and their PyTorch reference). Eviction policies are `flexevict.policies`.

May import only `flexevict.errors` (and the compiled `flexevict._C`): everything else builds on
it (tests/test_architecture.py checks every package's imports)."""
