"""Batch jobs (`flexevict.generate --input`): block commits survive kill -9, Ctrl-C and SIGTERM
and a rerun finishes byte for byte like an uninterrupted run; changed settings are refused;
--on-error skip; OpenAI batch lines; --chat; bounded memory for any input size."""
import json
import os
import subprocess
import sys
import weakref

import pytest

from flexevict.errors import UserError
from flexevict.jobs import inputs, state as job_state
from flexevict.runtime.generation import Sampling
from test_cli import assert_user_error, run, tiny_dir  # noqa: F401 (fixture)

ROWS = [{"id": i, "prompt": "abcdefghij"[: 1 + i % 7] * (1 + i % 4), "n": i} for i in range(40)]
BLOCKS = ["--gpu-batch-size", "3", "--num-gpu-batches", "2", "--window", "12"]   # 6-row blocks


def write_rows(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def job(tmp_path, model, *extra, out="out.jsonl", inp="in.jsonl", fault=None):
    """Run the job -> CompletedProcess: `generate`'s main in this process (test_cli.run), or
    with a fault (signal, where, k) a subprocess that gets that signal before or after its k-th
    block commit (tests/fault_job.py)."""
    argv = ["--model", model, "--input", str(tmp_path / inp), "--output", str(tmp_path / out),
            "--max-new-tokens", "6", "--threads", "1", *BLOCKS, *extra]
    if fault is None:
        return run("generate", *argv)
    return subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "fault_job.py"),
                           *map(str, fault), *argv], capture_output=True, text=True,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"), timeout=300)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_dir):  # noqa: F811
    """Uninterrupted outputs (greedy full, h2o, and sampled) of the same 40 rows."""
    d = tmp_path_factory.mktemp("ref")
    write_rows(d / "in.jsonl", ROWS)
    out = {}
    for name, flags in RUNS.items():
        proc = job(d, tiny_dir, *flags, out=f"{name}.jsonl")
        assert proc.returncode == 0, proc.stderr
        out[name] = (d / f"{name}.jsonl").read_bytes()
    return out


RUNS = {"greedy": [], "h2o": ["--policy", "h2o", "--budget", "0.5"],
        "sampled": ["--temperature", "1.5", "--seed", "4"]}


def killed_after_commit(tmp_path, model, k: int):
    """The 40 rows' job, killed (-9) right after its k-th block commit."""
    write_rows(tmp_path / "in.jsonl", ROWS)
    proc = job(tmp_path, model, fault=("KILL", "after-commit", k))
    assert proc.returncode == -9, proc.stderr


def committed_blocks(out):
    folder = str(out) + ".state/blocks"
    return sorted(n for n in os.listdir(folder) if n.endswith(".json"))


# ------------------------------------------------------------------ stop, rerun, same bytes

@pytest.mark.parametrize("run_name,sig,where,k,code", [
    ("greedy", "KILL", "after-commit", 1, -9),         # right after the first commit
    ("greedy", "KILL", "after-commit", 5, -9),         # later, in the second window
    ("h2o", "KILL", "before-commit", 3, -9),           # mid-block: block 3 generated, not saved
    ("sampled", "KILL", "before-commit", 2, -9),
    ("greedy", "INT", "before-commit", 2, 130),        # Ctrl-C mid-block
    ("h2o", "TERM", "after-commit", 2, 143),           # SIGTERM from a scheduler
])
@pytest.mark.slow
def test_stopped_job_reruns_to_the_same_bytes(tmp_path, tiny_dir, reference,  # noqa: F811
                                              run_name, sig, where, k, code):
    write_rows(tmp_path / "in.jsonl", ROWS)
    flags = RUNS[run_name]
    proc = job(tmp_path, tiny_dir, *flags, fault=(sig, where, k))
    assert proc.returncode == code, proc.stderr
    saved = k if where == "after-commit" else k - 1
    blocks = committed_blocks(tmp_path / "out.jsonl")
    assert len(blocks) == saved
    rows = sum(len(json.loads((tmp_path / "out.jsonl.state/blocks" / b).read_text())["rows"])
               for b in blocks)
    assert not (tmp_path / "out.jsonl").exists()
    if sig != "KILL":                                  # a clean exit says how to continue
        assert "rerun the same command to continue" in proc.stderr
    proc = job(tmp_path, tiny_dir, *flags)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out.jsonl").read_bytes() == reference[run_name]
    assert not (tmp_path / "out.jsonl.state").exists()
    summary = json.loads((tmp_path / "out.summary.json").read_text())
    assert rows > 0 and summary["rows_resumed"] == rows      # committed rows were not redone
    assert summary["this_run"]["rows"] == len(ROWS) - rows
    assert f"resuming {tmp_path / 'out.jsonl'}: {rows} of 40 rows" in proc.stderr
    ids = [json.loads(line)["id"] for line in reference[run_name].splitlines()]
    assert ids == [r["id"] for r in ROWS]                  # every id once, in input order


def test_references_are_not_degenerate(reference):
    """Equal bytes would prove little if every completion were the same."""
    greedy = [json.loads(x)["completion"] for x in reference["greedy"].splitlines()]
    sampled = [json.loads(x)["completion"] for x in reference["sampled"].splitlines()]
    assert len(set(greedy)) > 3 and sampled != greedy


def test_outputs_do_not_depend_on_the_blocks(tmp_path, tiny_dir, reference):  # noqa: F811
    """Other block sizes and windows give the same bytes, sampled too: each row's sampler is
    seeded from (--seed, its id), not from its place in a block."""
    write_rows(tmp_path / "in.jsonl", ROWS)
    for name in ("greedy", "sampled"):
        e = dict(os.environ, HF_HUB_OFFLINE="1")
        proc = subprocess.run([sys.executable, "-m", "flexevict.generate", "--model", tiny_dir,
                               "--input", str(tmp_path / "in.jsonl"), "--output",
                               str(tmp_path / f"{name}.jsonl"), "--max-new-tokens", "6",
                               "--threads", "1", "--gpu-batch-size", "5", "--window", "35",
                               *RUNS[name]], capture_output=True, text=True, env=e)
        assert proc.returncode == 0, proc.stderr
        assert (tmp_path / f"{name}.jsonl").read_bytes() == reference[name], name


def test_row_seeded_sampling_is_batch_invariant():
    """generate() with one Sampling per prompt: a prompt samples the same tokens alone as in a
    batch, and with other settings beside it (greedy, another temperature, top-p)."""
    import dataclasses
    from flexevict.runtime.generation import Sampling, generate
    from flexevict.policies import get_policy
    from tiny import model_for, rand_prompts
    m, ps = model_for("opt"), rand_prompts([5, 9, 7], seed=2)
    hot = Sampling(greedy=False, temperature=1.5)
    rows = [dataclasses.replace(hot, seed=seed) for seed in (11, 12, 13)]
    together = generate(m, ps, 10, get_policy("full"), rows)
    alone = [generate(m, [p], 10, get_policy("full"), [s])[0] for p, s in zip(ps, rows)]
    assert together == alone
    mixed = [Sampling(), rows[1], Sampling(greedy=False, temperature=0.7, top_p=0.8, seed=5)]
    assert generate(m, ps, 10, get_policy("full"), mixed)[1] == alone[1]
    other = rows[:2] + [dataclasses.replace(hot, seed=14)]
    assert generate(m, ps, 10, get_policy("full"), other)[2] != alone[2]


# ------------------------------------------------------------------ refused reruns, --restart

@pytest.mark.slow
def test_changed_settings_or_input_are_refused_then_restart(tmp_path, tiny_dir,  # noqa: F811
                                                            reference):
    killed_after_commit(tmp_path, tiny_dir, 2)
    proc = job(tmp_path, tiny_dir, "--policy", "h2o", "--budget", "0.5")
    assert_user_error(proc, "--policy full -> h2o", "--budget unset -> 0.5", "--restart")
    proc = job(tmp_path, tiny_dir, "--gpu-batch-size", "4")
    assert_user_error(proc, "--gpu-batch-size 3 -> 4", "--restart")
    write_rows(tmp_path / "in.jsonl", ROWS + [{"id": "new", "prompt": "xyz"}])
    proc = job(tmp_path, tiny_dir)
    assert_user_error(proc, "input file changed", "--restart")
    write_rows(tmp_path / "in.jsonl", ROWS)
    proc = job(tmp_path, tiny_dir, "--percent", "0", "100", "0", "100", "100", "0")
    assert proc.returncode == 0, proc.stderr       # where weights live changes no output
    assert (tmp_path / "out.jsonl").read_bytes() == reference["greedy"]
    proc = job(tmp_path, tiny_dir, fault=("KILL", "after-commit", 1))
    assert proc.returncode == 0 and "nothing to do" in proc.stderr     # already complete
    proc = job(tmp_path, tiny_dir, "--restart", *RUNS["h2o"])
    assert proc.returncode == 0, proc.stderr
    assert "resuming" not in proc.stderr
    assert (tmp_path / "out.jsonl").read_bytes() == reference["h2o"]


def test_batch_size_is_an_alias_of_gpu_batch_size(tmp_path, tiny_dir):  # noqa: F811
    write_rows(tmp_path / "in.jsonl", ROWS[:8])
    args = ["generate", "--model", tiny_dir, "--input", str(tmp_path / "in.jsonl"),
            "--max-new-tokens", "3"]
    proc = run(*args, "--output", str(tmp_path / "a.jsonl"), "--batch-size", "3")
    assert proc.returncode == 0 and "deprecated; use --gpu-batch-size 3" in proc.stderr
    summary = json.loads((tmp_path / "a.summary.json").read_text())
    assert summary["placement"]["gpu_batch_size"] == 3 and summary["blocks"] == 3
    proc = run(*args, "--output", str(tmp_path / "b.jsonl"), "--batch-size", "3",
               "--num-gpu-batches", "2")
    assert_user_error(proc, "--batch-size is the old name of --gpu-batch-size")


# ------------------------------------------------------------------ bad rows

BAD = [{"id": "a", "prompt": "fine"},
       '{"id": "b", "prompt": ',                                    # 2: malformed
       {"id": "c", "text": "no prompt"},                             # 3
       {"id": "d", "prompt": "   "},                                 # 4
       {"id": "e", "prompt": "x" * 80},                              # 5: 80 + 6 > 64 positions
       {"id": "a", "prompt": "again"},                               # 6: duplicate
       {"id": "f", "messages": [{"role": "user", "content": "hi"}]},  # 7: needs --chat
       {"id": "g", "prompt": "also fine"}]


def test_on_error_fail_names_the_first_bad_row(tmp_path, tiny_dir):  # noqa: F811
    write_rows(tmp_path / "in.jsonl", BAD)
    proc = job(tmp_path, tiny_dir)
    assert_user_error(proc, "in.jsonl:2", "malformed JSON")
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "out.jsonl.state").exists()


def test_on_error_skip_writes_the_errors_file(tmp_path, tiny_dir):  # noqa: F811
    write_rows(tmp_path / "in.jsonl", BAD)
    proc = job(tmp_path, tiny_dir, "--on-error", "skip")
    assert proc.returncode == 0, proc.stderr
    got = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [g["id"] for g in got] == ["a", "g"] and got[0]["prompt"] == "fine"
    errors = [json.loads(x) for x in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert [(e["id"], e["line"]) for e in errors] == [
        (None, 2), ("c", 3), ("d", 4), ("e", 5), ("a", 6), ("f", 7)]
    reasons = [e["error"] for e in errors]
    assert "malformed JSON" in reasons[0] and '"prompt"' in reasons[1]
    assert "whitespace-only prompt" in reasons[2]
    assert "maximum of 64 positions" in reasons[3]
    assert "duplicate id, first used on line 1" in reasons[4] and "--chat" in reasons[5]
    summary = json.loads((tmp_path / "out.summary.json").read_text())
    assert summary["failed_rows"] == 6 and summary["completed_rows"] == 2
    assert "2 completions" in proc.stderr and "6 failed rows" in proc.stderr


def test_openai_batch_lines(tmp_path, tiny_dir, reference):  # noqa: F811
    """custom_id + body.prompt lines: the same completions as {"id", "prompt"} lines, as
    batch output lines (their format: tests/test_openai_batch.py)."""
    rows = [{"custom_id": f"req-{r['id']}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "tiny", "prompt": r["prompt"], "max_tokens": 6}} for r in ROWS]
    write_rows(tmp_path / "in.jsonl", rows)
    proc = job(tmp_path, tiny_dir)
    assert proc.returncode == 0, proc.stderr
    got = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    ref = [json.loads(x) for x in reference["greedy"].splitlines()]
    assert [g["custom_id"] for g in got] == [r["custom_id"] for r in rows]
    assert [g["response"]["body"]["choices"][0]["text"] for g in got] == \
        [r["completion"] for r in ref]
    assert [g["response"]["body"]["usage"]["completion_tokens"] for g in got] == \
        [r["tokens"] for r in ref]
    write_rows(tmp_path / "in.jsonl", [{"method": "POST", "body": {"prompt": "x"}}])
    assert_user_error(job(tmp_path, tiny_dir, out="o2.jsonl"), "in.jsonl:1", '"custom_id"')


# ------------------------------------------------------------------ --chat

@pytest.mark.slow
def test_chat_template_renders_like_transformers(smollm2_path, hf_smollm2_tokenizer,
                                                 engine_smollm2_tokenizer):
    from flexevict.jobs.chat import load_chat_template
    from flexevict.jobs.inputs import Prompter, Request, Row
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    template = load_chat_template(smollm2_path, "smollm2-135m")
    want = hf_smollm2_tokenizer.apply_chat_template(chat, tokenize=False,
                                                    add_generation_prompt=True)
    assert template.render(chat) == want
    assert want.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nWhat is" in want
    prompter = Prompter(engine_smollm2_tokenizer, 2048, Request(8, Sampling()), chat=True,
                        template=lambda: template)
    by_prompt = prompter.encode(Row(1, 1, {}, prompt=chat[0]["content"]))
    assert by_prompt == prompter.encode(Row(1, 1, {}, messages=chat))
    assert by_prompt == hf_smollm2_tokenizer.apply_chat_template(
        chat, tokenize=True, add_generation_prompt=True, return_dict=False)


@pytest.mark.slow
def test_chat_job_on_smollm2(tmp_path, smollm2_path):
    """A prompt row and the same chat as messages give the same completion."""
    write_rows(tmp_path / "in.jsonl", [
        {"id": 1, "prompt": "Name a colour."},
        {"id": 2, "messages": [{"role": "user", "content": "Name a colour."}]}])
    proc = job(tmp_path, "smollm2-135m", "--chat", "--max-new-tokens", "4")
    assert proc.returncode == 0, proc.stderr
    got = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert got[0]["completion"] == got[1]["completion"] and got[0]["tokens"] == 4


def test_chat_without_a_template_is_refused_up_front(tmp_path, tiny_dir):  # noqa: F811
    write_rows(tmp_path / "in.jsonl", ROWS[:2])
    assert_user_error(job(tmp_path, tiny_dir, "--chat"), "no chat template", "drop --chat")


# ------------------------------------------------------------------ bounded memory

@pytest.mark.slow
def test_a_100k_line_input_is_never_held_at_once(tmp_path, tiny_dir, monkeypatch):  # noqa: F811
    """The pre-pass holds one row at a time (and the ids seen); the job holds at most one
    look-ahead window of rows, whatever the input size. Rows alive are counted by weakref."""
    from flexevict.generate import main
    n, window = 100_000, 2048
    with open(tmp_path / "in.jsonl", "w") as f:
        for i in range(n):
            f.write(f'{{"id": {i}, "prompt": "p{i % 97}"}}\n')
    alive, peak = [0], [0]
    real_parse = inputs.parse_line

    def counted(*a, **k):
        row = real_parse(*a, **k)
        alive[0] += 1
        peak[0] = max(peak[0], alive[0])
        weakref.finalize(row, lambda: alive.__setitem__(0, alive[0] - 1))
        return row
    monkeypatch.setattr(inputs, "parse_line", counted)

    class FakeLLM:                      # the engine is not what this test is about
        tokenizer = type("T", (), {"decode": staticmethod(lambda ids: "z")})
        config = type("C", (), {"name": "fake", "eos_token_ids": ()})

        def generate_block(self, encoded, *a, **k):
            return [[1] for _ in encoded], {"policy": "full"}

        def close(self):
            pass
    monkeypatch.setattr("flexevict.jobs.spec.JobSpec.llm", lambda self, progress=False: FakeLLM())
    main(["--model", tiny_dir, "--input", str(tmp_path / "in.jsonl"), "--output",
          str(tmp_path / "out.jsonl"), "--max-new-tokens", "2", "--gpu-batch-size", "512",
          "--num-gpu-batches", "2", "--window", str(window)])
    assert 0 < peak[0] <= window
    with open(tmp_path / "out.jsonl") as f:
        assert sum(1 for _ in f) == n


# ------------------------------------------------------------------ the state folder

MANIFEST = {"version": job_state.VERSION, "input": {"size": 1, "sha256": "x"},
            "settings": {"--seed": 0}}
ROW = {"line": 1, "prompt_tokens": 1, "tokens": 1, "out": {"id": 1, "tokens": 1}}


def state_with_blocks(tmp_path, blocks=((0, 0, 2), (0, 1, 2))):
    """A closed state folder with a manifest and committed one-row blocks."""
    s = job_state.JobState(str(tmp_path / "out.jsonl"))
    assert s.open(MANIFEST, restart=False) == 0
    for line, (w, b, n) in enumerate(blocks, 1):
        s.commit(w, b, n, {"rows": [{**ROW, "line": line}], "resolved": {}, "seconds": 0.0})
    s.close()
    return s


def reopen(tmp_path, manifest=MANIFEST, restart=False):
    s = job_state.JobState(str(tmp_path / "out.jsonl"))
    return s, s.open(manifest, restart=restart)


def test_torn_block_files_are_ignored_and_the_folder_is_locked(tmp_path):
    s = state_with_blocks(tmp_path, [(0, 0, 2)])
    torn = os.path.join(s.blocks, "0-1-of-2.json.tmp")
    open(torn, "w").write('{"rows": [{"li')                   # kill -9 mid-write
    held, rows = reopen(tmp_path)
    assert rows == 1 and not os.path.exists(torn)             # the committed block only
    with pytest.raises(UserError, match="in use by another run"):
        reopen(tmp_path)
    with pytest.raises(UserError, match="in use by another run"):   # --restart waits its turn
        reopen(tmp_path, restart=True)
    assert held.committed() == {0: {0}} and held.complete_windows() == set()
    held.close()


@pytest.mark.parametrize("damage", ["truncated", "emptied", "random bytes", "rows dropped",
                                    "a completion edited", "renamed"])
def test_a_damaged_block_is_set_aside_and_generated_again(tmp_path, damage, capsys):
    s = state_with_blocks(tmp_path, [(0, 0, 2), (0, 1, 2)])
    path = os.path.join(s.blocks, "0-1-of-2.json")
    text = open(path, encoding="utf-8").read()
    record = json.loads(text)
    if damage == "truncated":
        open(path, "w").write(text[:len(text) // 2])
    elif damage == "emptied":
        open(path, "w").close()
    elif damage == "random bytes":
        open(path, "wb").write(os.urandom(200))
    elif damage == "rows dropped":
        open(path, "w").write(json.dumps({**record, "rows": []}))
    elif damage == "a completion edited":
        record["rows"][0]["out"]["completion"] = "edited"
        open(path, "w").write(json.dumps(record))
    else:                                                     # another block's name
        os.replace(path, os.path.join(s.blocks, "1-0-of-2.json"))
        path = os.path.join(s.blocks, "1-0-of-2.json")
    again, rows = reopen(tmp_path)
    assert rows == 1 and again.committed() == {0: {0}}        # block 0 only: 1 is regenerated
    aside = os.path.join(s.folder, "damaged", os.path.basename(path))
    assert os.path.exists(aside) and not os.path.exists(path)      # set aside, never deleted
    err = capsys.readouterr().err
    assert f"{path} is damaged" in err and "generated again" in err and err.count("\n") == 1
    again.close()


def test_a_stray_file_is_ignored_with_a_warning(tmp_path, capsys):
    s = state_with_blocks(tmp_path)
    open(os.path.join(s.blocks, "notes.json"), "w").write("{}")
    again, rows = reopen(tmp_path)
    assert rows == 2 and "notes.json is not a block of this job; ignored" in \
        capsys.readouterr().err
    again.close()


@pytest.mark.parametrize("damage", ["deleted", "truncated", "edited"])
def test_a_lost_manifest_with_blocks_is_one_clear_error(tmp_path, damage):
    s = state_with_blocks(tmp_path)
    path = os.path.join(s.folder, "manifest.json")
    if damage == "deleted":
        os.remove(path)
    elif damage == "truncated":
        open(path, "w").write(open(path).read()[:10])
    else:               # settings edited to pass for another command's: blocks were not made so
        edited = json.load(open(path))
        edited["settings"]["--seed"] = 1
        open(path, "w").write(json.dumps(edited))
    with pytest.raises(UserError, match="add restart to start over .* or put back the job's "
                                        "manifest.json"):
        reopen(tmp_path)
    assert len(os.listdir(s.blocks)) == 2                     # nothing discarded
    again, rows = reopen(tmp_path, restart=True)              # the way on that discards
    assert rows == 0 and os.listdir(again.blocks) == []
    again.close()


def test_new_settings_without_committed_blocks_are_taken(tmp_path):
    """A state folder whose run committed nothing never makes a corrected command refuse."""
    s = job_state.JobState(str(tmp_path / "out.jsonl"))
    s.open(MANIFEST, restart=False)
    s.close()
    other = {**MANIFEST, "settings": {"--seed": 1}}
    again, rows = reopen(tmp_path, other)
    assert rows == 0
    again.close()
    state_with_blocks(tmp_path / "b")
    with pytest.raises(UserError, match="other settings"):
        reopen(tmp_path / "b", other)


def test_a_full_disk_is_one_error_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    import errno
    s = state_with_blocks(tmp_path, [(0, 0, 2)])
    s2, _ = reopen(tmp_path)
    real = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(UserError, match="no space left .*committed blocks are kept"):
        s2.commit(0, 1, 2, {"rows": [{**ROW, "line": 2}], "resolved": {}, "seconds": 0.0})
    assert sorted(os.listdir(s.blocks)) == ["0-0-of-2.json"]      # no .tmp, block 0 kept
    with pytest.raises(UserError, match="no space left"):
        s2.assemble(1)
    assert not os.path.exists(str(tmp_path / "out.jsonl.partial"))
    monkeypatch.setattr(os, "fsync", real)
    assert s2.assemble(1)["rows"] == 1                            # once there is room
    s2.close()


@pytest.mark.parametrize("case", ["same file", "through a symlink", "a hard link",
                                  "a directory", "input is a directory", "input is a FIFO"])
def test_outputs_that_would_destroy_inputs_are_refused(tmp_path, case):
    from flexevict.jobs.runner import check_paths
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "a"}\n')
    out = str(inp)
    if case == "through a symlink":
        os.symlink(inp, tmp_path / "link.jsonl")
        out = str(tmp_path / "link.jsonl")
    elif case == "a hard link":
        os.link(inp, tmp_path / "hard.jsonl")
        out = str(tmp_path / "hard.jsonl")
    elif case == "a directory":
        out = str(tmp_path)
    elif case == "input is a directory":
        inp, out = tmp_path, str(tmp_path / "o.jsonl")
    elif case == "input is a FIFO":
        inp = tmp_path / "fifo"
        os.mkfifo(inp)
        out = str(tmp_path / "o.jsonl")
    want = {"a directory": ": output is a directory", "input is a directory":
            ": input is a directory", "input is a FIFO": "not a regular file"}.get(
                case, "is the input file itself")
    with pytest.raises(UserError, match=want):
        check_paths(str(inp), out)
    check_paths(str(tmp_path / "in.jsonl"), str(tmp_path / "fine.jsonl"))   # no complaint


def test_flags_found_late_are_refused_before_the_model_loads(tmp_path, tiny_dir):  # noqa: F811
    write_rows(tmp_path / "in.jsonl", ROWS[:3])
    proc = job(tmp_path, tiny_dir, "--budget", "0.5")             # the default policy is full
    assert_user_error(proc, "policy 'full' keeps every token")
    assert not (tmp_path / "out.jsonl.state").exists()
    proc = job(tmp_path, tiny_dir, "--gpu-batch-size", "0")       # after BLOCKS' 3: it wins
    assert_user_error(proc, "--gpu-batch-size must be >= 1 (got 0)")
    proc = job(tmp_path, tiny_dir, out="in.jsonl")
    assert_user_error(proc, "is the input file itself")
    assert (tmp_path / "in.jsonl").read_text().count("\n") == 3  # untouched


@pytest.mark.slow
def test_a_job_with_a_damaged_block_finishes_byte_identical(tmp_path, tiny_dir,  # noqa: F811
                                                           reference):
    killed_after_commit(tmp_path, tiny_dir, 3)
    blocks = tmp_path / "out.jsonl.state" / "blocks"
    first = sorted(os.listdir(blocks))[0]
    record = json.loads((blocks / first).read_text())
    record["rows"][0]["out"]["completion"] = "edited by hand"
    (blocks / first).write_text(json.dumps(record))
    (blocks / "notes.json").write_text("{}")
    proc = job(tmp_path, tiny_dir)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out.jsonl").read_bytes() == reference["greedy"]
    assert f"{blocks / first} is damaged" in proc.stderr
    assert (tmp_path / "out.jsonl.damaged" / first).exists()     # kept for the user, not lost


def test_a_line_too_long_by_its_bytes_is_refused_without_tokenizing():
    """A 50 MB line once tokenized for minutes before its length error."""
    class Refuses:
        max_token_bytes = 16

        def encode(self, text, special=True):
            raise AssertionError("tokenized")
    p = inputs.Prompter(Refuses(), max_positions=2048, defaults=inputs.Request(32, Sampling()))
    row = inputs.Row(7, "big", {}, prompt="x" * (16 * 2048))     # at least 2048 tokens
    with pytest.raises(inputs.RowError, match="32768 bytes .* exceeds the model's maximum"):
        p.encode(row)
    with pytest.raises(inputs.RowError, match="tokenized"):      # a line that may fit is
        p.encode(inputs.Row(8, "small", {}, prompt="x" * 1000))  # tokenized as before
