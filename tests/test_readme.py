"""The README must be true: no links outside the repository, every file it lists exists, the
quick start installs torch's CPU build, and every flag it names exists on its command."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


def test_no_reference_outside_the_repository():
    docs = [README] + [open(os.path.join(ROOT, d, "README.md"), encoding="utf-8").read()
                       for d in ("bench", "cuda")]
    for text in docs:
        assert "../shared" not in text and "shared/research" not in text


def test_every_listed_module_exists():
    layout = README.split("## How it is built", 1)[1].split("```")[1]
    paths = re.findall(r"^((?:flexevict|policies|cuda|bench|tests)/\S*)", layout, re.M)
    assert len(paths) > 10
    for path in paths:
        assert os.path.exists(os.path.join(ROOT, path)), path


def test_quick_start_installs_the_cpu_build_of_torch():
    quick = README.split("## Quick start", 1)[1].split("```")[1]
    assert "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in quick


def test_flags_named_for_generate_exist():
    helptext = subprocess.run([sys.executable, "-m", "flexevict.generate", "--help"],
                              capture_output=True, text=True).stdout
    section = README.split("### Generate", 1)[1].split("### Evaluate", 1)[0]   # + Batch jobs
    section = "\n".join(ln for ln in section.splitlines() if not ln.startswith("ray start"))
    section = re.sub(r"`python (bench/|-m flexevict\.bench)[^`]*`", "", section)   # other tools
    for flag in set(re.findall(r"(--[a-z][a-z-]+)", section)):
        assert flag in helptext, flag
