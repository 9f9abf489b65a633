"""Blocks: how a window's rows are grouped for the engine, and one block's run.

A block is one engine run of at most gpu_batch_size x num_gpu_batches prompts, formed by
`generation.plan_batches` within a look-ahead window: only prompts whose `policy.batch_key` is
equal share a block, sorted by length. The blocks of a window depend on nothing but the window's
rows and the settings, so a resumed run and every Ray worker form exactly the same blocks.
"""
from __future__ import annotations

import dataclasses
import time

from flexevict.jobs.inputs import Row, read_window
from flexevict.jobs.openai_batch import Choice, response_line
from flexevict.runtime.generation import Watch, plan_batches


def plan_window(rows: list[Row], spec) -> list[list[Row]]:
    """A window's rows (tokenized) -> its blocks, in the order they run. A row's choices run
    side by side in its block (`Request.sequences`); rows asking for different lengths share a
    block only where the policy never evicts (`generation.plan_batches`)."""
    batches = plan_batches([len(r.ids) for r in rows],
                           [r.request.max_new_tokens for r in rows], spec.policy.make(),
                           spec.block_size, [r.request.sequences for r in rows])
    return [[rows[i] for i in batch] for batch in batches]


def window_todo(spec, win, prompter, done) -> list[tuple[int, int, list[Row]]]:
    """A look-ahead window read and blocked, its committed blocks (`done`) left out ->
    [(block, blocks in the window, rows)]: what the local path runs and the Ray path ships.
    Callers take one window at a time and let it go before the next (the rows of at most
    one window are ever held)."""
    blocks = plan_window(read_window(spec.input, win, spec.window_rows, prompter), spec)
    return [(b, len(blocks), rows) for b, rows in enumerate(blocks) if b not in done]


def run_block(llm, spec, rows: list[Row], on_step=None) -> dict:
    """Generate one block -> its commit record: {"rows": [{"line", "prompt_tokens", "tokens",
    "out"}], "resolved": the policy's budget, "seconds": generation time}. `out` is the output
    line: a plain row as written plus "completion" and "tokens"; an OpenAI request's batch
    output line (`openai_batch.response_line`). "tokens": the row's generated tokens.
    on_step(tokens, step, steps): after each decode step (`generation.generate`)."""
    t0 = time.perf_counter()
    seqs = [(r, seed) for r in rows for seed in spec.choice_seeds(r)]
    reqs = [r.request for r, _ in seqs]
    outs, resolved = llm.generate_block(
        [r.ids for r, _ in seqs], [q.max_new_tokens for q in reqs],
        [dataclasses.replace(q.sampling, seed=seed) for q, (_, seed) in zip(reqs, seqs)],
        spec.policy, watch=Watch(_stop_strings(llm, reqs), on_step))
    seconds = time.perf_counter() - t0
    out, at = [], 0
    for r in rows:
        k = r.request.sequences
        choices = [_choice(llm, ids, r.request.stop) for ids in outs[at:at + k]]
        at += k
        choices *= r.request.n // k                  # greedy: n alike choices, run once
        out.append({"line": r.line, "prompt_tokens": len(r.ids),
                    "tokens": sum(c.tokens for c in choices),
                    "out": _output_line(r, choices, llm.config.name, spec.created)})
    return {"resolved": resolved, "seconds": seconds, "rows": out}


def _stop_strings(llm, reqs: list):
    """`generate`'s ends callback where a request has stop strings: its text so far holds
    one (None where no request has any: no host check each step)."""
    if not any(q.stop for q in reqs):
        return None
    return lambda r, ids: any(s in llm.tokenizer.decode(ids) for s in reqs[r].stop)


def _choice(llm, ids: list[int], stop: tuple[str, ...]) -> Choice:
    """A sequence's generated ids -> its text, cut before its first stop string, and why it
    ended (the engine stopped it at the token that completed the stop string)."""
    text = llm.tokenizer.decode(ids)
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    if cuts:
        return Choice(text[:min(cuts)], len(ids), "stop")
    ended = bool(ids) and ids[-1] in llm.config.eos_token_ids
    return Choice(text, len(ids), "stop" if ended else "length")


def _output_line(row: Row, choices: list[Choice], model: str, created: int) -> dict:
    if row.is_batch_request:
        return response_line(row.id, row.kind, choices, len(row.ids), model, created)
    return {**row.raw, "completion": choices[0].text, "tokens": choices[0].tokens}


def rows_to_wire(rows: list[Row]) -> list[dict]:
    """Rows as plain data (a Ray row carries a whole block)."""
    return [{"line": r.line, "id": r.id, "raw": r.raw, "kind": r.kind, "request": r.request,
             "ids": r.ids} for r in rows]


def rows_from_wire(items: list[dict]) -> list[Row]:
    return [Row(d["line"], d["id"], d["raw"], kind=d["kind"], request=d["request"],
                ids=d["ids"]) for d in items]
