"""A job's durable state, next to its output: `out.jsonl.state/`.

    manifest.json     the input file's identity (size, SHA-256) and the settings the outputs
                      depend on; a rerun with anything else is refused (or --restart)
    lock              flock'ed while a run uses the folder (released by the kernel on kill -9)
    blocks/W-B-of-N.json
                      block B of look-ahead window W (N blocks in that window), committed once
                      generated: written, flushed, fsynced, renamed, directory fsynced

A block file is either complete or absent (its temporary `.tmp` is ignored and removed), so a
run killed at any point loses only the block in flight. When every block is in, the output is
assembled window by window (each window's rows sorted back into input order) into
`out.jsonl.partial`, renamed to `out.jsonl`, and the folder is removed.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import time

from flexevict.errors import UserError

MANIFEST, LOCK, BLOCKS = "manifest.json", "lock", "blocks"
VERSION = 1


def paths_for(output: str) -> dict:
    """The files a job writes beside `output` (out.jsonl -> out.errors.jsonl, ...)."""
    base = output[:-len(".jsonl")] if output.endswith(".jsonl") else output
    return {"state": output + ".state", "errors": base + ".errors.jsonl",
            "summary": base + ".summary.json"}


def write_atomic(path: str, text: str) -> float:
    """Write text to path durably (temp file, flush, fsync, rename, fsync the folder) ->
    seconds spent."""
    t0 = time.perf_counter()
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))
    return time.perf_counter() - t0


def fsync_dir(folder: str):
    fd = os.open(folder or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class JobState:
    """The state folder of one output file, locked for this run."""

    def __init__(self, output: str):
        self.output = output
        self.folder = paths_for(output)["state"]
        self.blocks = os.path.join(self.folder, BLOCKS)
        self._lock = None

    # ------------------------------------------------------------------ open / check
    def open(self, manifest: dict, restart: bool) -> int:
        """Lock the folder and check (or write) its manifest -> rows committed earlier.

        A different input or different settings -> UserError naming what changed."""
        if restart and os.path.isdir(self.folder):
            shutil.rmtree(self.folder)
        try:
            os.makedirs(self.blocks, exist_ok=True)
            self._take_lock()
        except OSError as e:
            raise UserError(f"{self.folder}: cannot create the job's state folder ({e.strerror}); "
                            "give an --output in a writable directory") from None
        path = os.path.join(self.folder, MANIFEST)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                old = json.load(f)
            self._refuse_changes(old, manifest)
        else:
            for name in os.listdir(self.blocks):       # blocks without a manifest: not ours
                os.remove(os.path.join(self.blocks, name))
            write_atomic(path, json.dumps(manifest, indent=1))
        for name in os.listdir(self.blocks):           # a temporary file of a killed run
            if name.endswith(".tmp"):
                os.remove(os.path.join(self.blocks, name))
        return sum(len(self.load(w, b, n)["rows"]) for w, b, n in self._names())

    def _take_lock(self):
        self._lock = open(os.path.join(self.folder, LOCK), "a+")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            self._lock = None
            raise UserError(f"{self.folder} is in use by another run of this job; wait for it "
                            "to finish, or give another --output") from None

    def _refuse_changes(self, old: dict, new: dict):
        how = ("rerun with the same input and settings to continue it, or add --restart to "
               "start over (its committed rows are discarded)")
        if old.get("version") != VERSION:
            raise UserError(f"{self.folder} was written by another version of flexevict; {how}")
        if old["input"] != new["input"]:
            raise UserError(f"{self.output}: the input file changed since this job started "
                            f"(size or SHA-256 differ); {how}")
        changed = [f"{k} {_show(old['settings'].get(k))} -> {_show(v)}"
                   for k, v in new["settings"].items() if old["settings"].get(k) != v]
        if changed:
            raise UserError(f"{self.output}: this job was started with other settings "
                            f"({', '.join(changed)}); {how}")

    def close(self):
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    # ------------------------------------------------------------------ blocks
    def _names(self) -> list[tuple[int, int, int]]:
        """(window, block, blocks in window) of every committed block, sorted."""
        out = []
        for name in os.listdir(self.blocks):
            if name.endswith(".json"):
                w, b, _, n = name[:-len(".json")].split("-")
                out.append((int(w), int(b), int(n)))
        return sorted(out)

    def committed(self) -> dict[int, set[int]]:
        """window -> its committed blocks."""
        done: dict[int, set[int]] = {}
        for w, b, _ in self._names():
            done.setdefault(w, set()).add(b)
        return done

    def complete_windows(self) -> set[int]:
        """Windows whose every block is committed."""
        counts: dict[int, list[int]] = {}
        for w, b, n in self._names():
            counts.setdefault(w, [0, n])[0] += 1
        return {w for w, (have, n) in counts.items() if have == n}

    def _path(self, w: int, b: int, n: int) -> str:
        return os.path.join(self.blocks, f"{w}-{b}-of-{n}.json")

    def commit(self, w: int, b: int, n: int, record: dict) -> float:
        """Make block b (of n) of window w durable -> seconds it took."""
        return write_atomic(self._path(w, b, n), json.dumps(record, ensure_ascii=False))

    def load(self, w: int, b: int, n: int) -> dict:
        with open(self._path(w, b, n), encoding="utf-8") as f:
            return json.load(f)

    # ------------------------------------------------------------------ the end
    def assemble(self, rows: int) -> dict:
        """Write every committed row in input order to the output (via `.partial`, renamed)
        -> totals over all blocks: rows, prompt and generated tokens, seconds, resolved."""
        totals = {"rows": 0, "prompt_tokens": 0, "generated_tokens": 0, "generate_seconds": 0.0,
                  "blocks": 0, "resolved": []}
        by_window: dict[int, list[tuple[int, int]]] = {}
        for w, b, n in self._names():
            by_window.setdefault(w, []).append((b, n))
        tmp = self.output + ".partial"
        try:
            with open(tmp, "w", encoding="utf-8") as out:
                for w in sorted(by_window):
                    window = []
                    for b, n in by_window[w]:
                        record = self.load(w, b, n)
                        _add(totals, record)
                        window.extend(record["rows"])
                    for r in sorted(window, key=lambda r: r["line"]):
                        out.write(json.dumps(r["out"], ensure_ascii=False) + "\n")
                out.flush()
                os.fsync(out.fileno())
            if totals["rows"] != rows:
                raise RuntimeError(f"{self.folder}: {totals['rows']} rows committed, "
                                   f"expected {rows}")
            os.replace(tmp, self.output)
        except OSError as e:
            raise UserError(f"{self.output}: cannot write output ({e.strerror})") from None
        return totals

    def remove(self):
        self.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def _add(totals: dict, record: dict):
    totals["rows"] += len(record["rows"])
    totals["blocks"] += 1
    totals["prompt_tokens"] += sum(r["prompt_tokens"] for r in record["rows"])
    totals["generated_tokens"] += sum(r["out"]["tokens"] for r in record["rows"])
    totals["generate_seconds"] += record["seconds"]
    if record["resolved"] not in totals["resolved"]:
        totals["resolved"].append(record["resolved"])


def _show(v) -> str:
    return "unset" if v is None else json.dumps(v) if not isinstance(v, str) else v
