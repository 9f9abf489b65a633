"""The README must be true: no links outside the repository, every file it lists exists, the
quick start installs torch's CPU build, and every flag it names exists on its command. The long
sections live in the README of the folder they describe; the checks follow them there."""
import json
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()

# Every folder README (README.md links each one).
FOLDERS = ("policies", "cuda", "bench", "bench/results", "bench/results/accuracy",
           "flexevict/planner", "flexevict/jobs", "flexevict/runtime")


def folder_readme(folder: str) -> str:
    return open(os.path.join(ROOT, folder, "README.md"), encoding="utf-8").read()


def test_no_reference_outside_the_repository():
    docs = [README] + [folder_readme(d) for d in FOLDERS]
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
    from test_cli import run                     # generate's main, in this process
    helptext = run("generate", "--help").stdout
    span = README.split("### Generate", 1)[1].split("### Evaluate", 1)[0]   # + Batch jobs
    for section in (span, folder_readme("flexevict/jobs")):   # Batch jobs' full text is there
        section = "\n".join(ln for ln in section.splitlines() if not ln.startswith("ray start"))
        section = re.sub(r"`python (bench/|-m flexevict\.bench)[^`]*`", "", section)   # other tools
        for flag in set(re.findall(r"(--[a-z][a-z-]+)", section)):
            assert flag in helptext, flag


# ------------------------------------------------------------------ README's commands run

# Commands that cannot run here as written, by what they need: a GPU, a Ray cluster, a
# GPU-sized model, or many minutes of measuring (the calibration and the accuracy sweep have
# tests of their own); the rest run as written.
NEEDS_ELSEWHERE = ("--device cuda", "--ray ", "opt-6.7b", "opt-30b", "opt-175b", "eval sweep")


def needs_elsewhere(cmd: str) -> bool:
    return any(need in cmd for need in NEEDS_ELSEWHERE) or cmd == "python -m flexevict.calibrate"


# README.md, then the folder READMEs its long sections moved to (their commands, too, run from
# the repository root). cuda/README.md's block is a synopsis with [optional] arguments.
COMMAND_DOCS = ("README.md", "policies/README.md", "flexevict/jobs/README.md",
                "flexevict/runtime/README.md", "flexevict/planner/README.md", "bench/README.md")


def readme_commands() -> list[str]:
    """Every distinct `python -m flexevict...` command of the bash blocks of COMMAND_DOCS,
    continuation lines joined and trailing comments dropped, in order."""
    commands = []
    for doc in COMMAND_DOCS:
        text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
        for block in re.findall(r"```bash\n(.*?)```", text, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"\s+#.*$", "", line).strip()
                if line.startswith("python -m flexevict.") and line not in commands:
                    commands.append(line)
    return commands


def stated_outputs() -> dict[str, dict]:
    """{command: the JSON a bash block states it prints} for the commands of COMMAND_DOCS whose
    next line is `# {...}`."""
    stated = {}
    for doc in COMMAND_DOCS:
        text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
        for block in re.findall(r"```bash\n(.*?)```", text, re.S):
            lines = block.replace("\\\n", " ").splitlines()
            for cmd, out in zip(lines, lines[1:]):
                cmd = re.sub(r"\s+#.*$", "", cmd).strip()
                if cmd.startswith("python -m flexevict.") and out.startswith("# {"):
                    stated[cmd] = json.loads(out[2:])
    return stated


def matches_stated(got: dict, stated: dict) -> bool:
    """Every stated key printed with the stated value; a stated float to its stated digits."""
    def same(a, b):
        if isinstance(b, float):
            digits = len(repr(b).split(".")[1])
            return isinstance(a, float) and round(a, digits) == b
        return a == b
    return all(k in got and same(got[k], v) for k, v in stated.items())


def readme_batch_example() -> list[dict]:
    """The OpenAI batch output lines README.md shows (the second json block of its section)."""
    section = README.split("### OpenAI batch files", 1)[1].split("\n### ", 1)[0]
    block = re.findall(r"```json\n(.*?)```", section, re.S)[1]
    return [json.loads(ln) for ln in block.splitlines()]


def test_the_stated_outputs_are_found():
    stated = stated_outputs()
    assert any("eval ppl" in c for c in stated) and all(stated.values())
    assert matches_stated({"a": 3.40946, "b": "x"}, {"a": 3.4095, "b": "x"})
    assert not matches_stated({"a": 3.40946}, {"a": 3.42})          # 3.42 != round(a, 2)
    assert len(readme_batch_example()) == 2


def test_readme_commands_are_found_and_use_shipped_files():
    commands = readme_commands()
    assert len(commands) > 15
    for cmd in commands:
        for path in re.findall(r"--(?:input|text) (\S+)", cmd):
            assert os.path.isfile(os.path.join(ROOT, path)), (cmd, path)
        assert "[" not in cmd and "..." not in cmd.replace('"..."', ""), cmd


@pytest.mark.slow
def test_readme_commands_run_as_written(tmp_path, monkeypatch):
    """Each quick README command (README.md's, then the folder READMEs') runs as written after
    the Quick start, in order, from a folder where `bench/` is the repository's (outputs land
    there, not in the checkout). Each runs its CLI's main in this process (`test_cli.run`,
    which saves a fresh interpreter's 3 s of importing torch per command), except a command
    whose --cpu-mem-limit counts its own process's memory: that one gets a fresh interpreter,
    as a user's would be."""
    import shlex

    from test_cli import run, run_process
    (tmp_path / "bench").symlink_to(os.path.join(ROOT, "bench"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLEXEVICT_PROGRESS_SECONDS", "600")
    ran, stated = [], stated_outputs()
    for cmd in readme_commands():
        if needs_elsewhere(cmd):
            continue
        _, _, module, *args = shlex.split(cmd)          # python -m flexevict.<module> args
        fresh = run_process if "--cpu-mem-limit" in args else run
        proc = fresh(module.removeprefix("flexevict."), *args)
        assert proc.returncode == 0, (cmd, proc.stderr[-2000:])
        ran.append(cmd)
        if cmd in stated:                  # the output the README shows is the one printed
            assert matches_stated(json.loads(proc.stdout), stated[cmd]), (cmd, proc.stdout)
    assert len(ran) >= 10
    for out in ("auto.jsonl", "chat-out.jsonl", "offloaded.jsonl", "out.jsonl", "sampled.jsonl"):
        rows = [json.loads(ln) for ln in (tmp_path / out).read_text().splitlines()]
        assert rows and all("completion" in r for r in rows), out
    printed = {r["custom_id"]: r for r in map(json.loads, open(tmp_path / "batch-out.jsonl"))}
    for line in readme_batch_example():    # all but `created`: the input file's mtime
        got = printed[line["custom_id"]]
        got["response"]["body"]["created"] = line["response"]["body"]["created"]
        assert got == line
