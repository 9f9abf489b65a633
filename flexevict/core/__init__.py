"""The model and its cache: `config` (ModelConfig), `model` (white-box OPT/LLaMA math over
explicit weights), `kv` (KVBuffer, the fixed-budget per-layer cache) and `kernels` (the decode
hot path: CUDA kernels and their PyTorch reference). Eviction policies are `flexevict.policies`."""
