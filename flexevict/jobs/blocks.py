"""Blocks: how a window's rows are grouped for the engine, and one block's run.

A block is one engine run of at most gpu_batch_size x num_gpu_batches prompts, formed by
`generation.plan_batches` within a look-ahead window: only prompts whose `policy.batch_key` is
equal share a block, sorted by length. The blocks of a window depend on nothing but the window's
rows and the settings, so a resumed run and every Ray worker form exactly the same blocks.
"""
from __future__ import annotations

import time

from flexevict.runtime.generation import plan_batches
from flexevict.jobs.inputs import Row, read_window


def plan_window(rows: list[Row], spec) -> list[list[Row]]:
    """A window's rows (tokenized) -> its blocks, in the order they run."""
    batches = plan_batches([len(r.ids) for r in rows], spec.max_new_tokens, spec.policy.make(),
                           spec.block_size)
    return [[rows[i] for i in batch] for batch in batches]


def window_todo(spec, win, prompter, done) -> list[tuple[int, int, list[Row]]]:
    """A look-ahead window read and blocked, its committed blocks (`done`) left out ->
    [(block, blocks in the window, rows)]: what the local path runs and the Ray path ships.
    Callers take one window at a time and let it go before the next (the rows of at most
    one window are ever held)."""
    blocks = plan_window(read_window(spec.input, win, spec.window_rows, prompter, spec.chat),
                         spec)
    return [(b, len(blocks), rows) for b, rows in enumerate(blocks) if b not in done]


def run_block(llm, spec, rows: list[Row]) -> dict:
    """Generate one block -> its commit record: {"rows": [{"line", "prompt_tokens", "out"}],
    "resolved": the policy's budget, "seconds": generation time}. `out` is the output row: the
    input row as written plus "completion" and "tokens"."""
    t0 = time.perf_counter()
    outs, resolved = llm.generate_block([r.ids for r in rows], spec.max_new_tokens,
                                        spec.sampling, spec.policy,
                                        row_seeds=[spec.row_seed(r.id) for r in rows])
    seconds = time.perf_counter() - t0
    return {"resolved": resolved, "seconds": seconds, "rows": [
        {"line": r.line, "prompt_tokens": len(r.ids),
         "out": {**r.raw, "completion": llm.tokenizer.decode(ids), "tokens": len(ids)}}
        for r, ids in zip(rows, outs)]}


def rows_to_wire(rows: list[Row]) -> list[dict]:
    """Rows as plain data (a Ray row carries a whole block)."""
    return [{"line": r.line, "id": r.id, "raw": r.raw, "ids": r.ids} for r in rows]


def rows_from_wire(items: list[dict]) -> list[Row]:
    return [Row(d["line"], d["id"], d["raw"], ids=d["ids"]) for d in items]
