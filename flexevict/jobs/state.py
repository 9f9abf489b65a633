"""A job's durable state, next to its output: `out.jsonl.state/`.

    manifest.json     the input file's identity (size, SHA-256) and the settings the outputs
                      depend on, with the SHA-256 of both; a rerun with anything else is
                      refused (or --restart), and so is an edited manifest
    lock              flock'ed while a run uses the folder (released by the kernel on kill -9);
                      --restart takes it before it clears anything
    blocks/W-B-of-N.json
                      block B of look-ahead window W (N blocks in that window), committed once
                      generated: written, flushed, fsynced, renamed, directory fsynced; it holds
                      the SHA-256 of its place and rows, checked on every resume
    damaged/          blocks that failed that check (torn, emptied, edited, renamed), set
                      aside with a warning and generated again; never deleted by the job

A block file is either complete or absent (its temporary `.tmp` is ignored and removed), so a
run killed at any point loses only the block in flight. When every block is in, the output is
assembled window by window (each window's rows sorted back into input order) into
`out.jsonl.partial`, renamed to `out.jsonl`, and the folder is removed. A full disk (or quota,
or file size limit, or read-only filesystem) is one error line naming the path; no temporary
file stays behind and the committed blocks are kept.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import time

from flexevict.errors import FLAGS, UserError, setting

MANIFEST, LOCK, BLOCKS, DAMAGED = "manifest.json", "lock", "blocks", "damaged"
VERSION = 4                   # 2: blocks carry their SHA-256; 3: the manifest too; 4: a
                              # row's generated tokens beside its output (OpenAI lines)
BLOCK_NAME = re.compile(r"(\d+)-(\d+)-of-(\d+)\.json")
# what a full or read-only disk raises: an error line, not a traceback
DISK_FULL = {errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded",
             errno.EFBIG: "file too large for the filesystem or its size limit",
             errno.EROFS: "read-only filesystem"}


def paths_for(output: str) -> dict:
    """The files a job writes beside `output` (out.jsonl -> out.errors.jsonl, ...)."""
    base = output[:-len(".jsonl")] if output.endswith(".jsonl") else output
    return {"state": output + ".state", "errors": base + ".errors.jsonl",
            "summary": base + ".summary.json"}


def write_atomic(path: str, text: str) -> float:
    """Write text to path durably (temp file, flush, fsync, rename, fsync the folder) ->
    seconds spent. A full disk: UserError, and the temp file is gone."""
    t0 = time.perf_counter()
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path))
    except OSError as e:
        _remove_quietly(tmp)
        raise disk_error(path, e, len(text.encode("utf-8"))) from None
    return time.perf_counter() - t0


def disk_error(path: str, e: OSError, nbytes: int) -> Exception:
    """A full or read-only disk as a UserError naming the path and the room needed (the
    committed blocks stay: rerunning once there is room continues the job); another OSError
    as itself."""
    if e.errno not in DISK_FULL:
        return e
    return UserError(f"{path}: {DISK_FULL[e.errno]} (writing about {_size(nbytes)}); free "
                     "space there and rerun the same command: the committed blocks are kept")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes} bytes"


def _remove_quietly(path: str):
    try:
        os.remove(path)
    except OSError:
        pass


def free_path(path: str) -> str:
    """path, or the first of path.1, path.2, ... that does not exist (nothing is overwritten)."""
    k, free = 1, path
    while os.path.exists(free):
        free, k = f"{path}.{k}", k + 1
    return free


def manifest_digest(manifest: dict) -> str:
    """SHA-256 of a manifest's content (its keys sorted), the `sha256` field aside."""
    text = json.dumps(manifest, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def block_digest(w: int, b: int, n: int, rows: list) -> str:
    """SHA-256 of a block's place (window, block, blocks in the window) and rows: a block that
    is torn, edited, short or renamed fails it."""
    text = json.dumps({"window": w, "block": b, "of": n, "rows": rows}, sort_keys=True,
                      ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def warn(message: str):
    print(f"flexevict.generate: warning: {message}", file=sys.stderr)


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
        """Lock the folder (--restart: then clear it), check (or write) its manifest and every
        committed block -> rows committed earlier.

        A different input or different settings with committed blocks -> UserError naming what
        changed; a missing or unreadable manifest with blocks -> UserError (the two ways on).
        Damaged blocks are set aside (`damaged/`) and stray files left alone, with a warning."""
        try:
            os.makedirs(self.folder, exist_ok=True)
            self._take_lock()
            if restart:
                self._clear()
            os.makedirs(self.blocks, exist_ok=True)
        except OSError as e:
            raise UserError(f"{self.folder}: cannot create the job's state folder ({e.strerror}); "
                            f"give an {setting('output')} in a writable directory") from None
        for name in os.listdir(self.blocks):           # a temporary file of a killed run
            if name.endswith(".tmp"):
                os.remove(os.path.join(self.blocks, name))
        old = self._read_manifest()
        if old is not None and self._names():
            self._refuse_changes(old, manifest)
        elif old != manifest:            # nothing committed yet: the new settings simply win
            write_atomic(os.path.join(self.folder, MANIFEST),
                         json.dumps({**manifest, "sha256": manifest_digest(manifest)}, indent=1))
        return self._check_blocks()

    def _clear(self):
        """--restart: everything in the folder but the lock (held by this run)."""
        for name in os.listdir(self.folder):
            if name != LOCK:
                path = os.path.join(self.folder, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)

    def _read_manifest(self) -> dict | None:
        """The manifest, None when absent (and no block is there either)."""
        path = os.path.join(self.folder, MANIFEST)
        ways = (f"add {setting('restart')} to start over (its committed rows are discarded), or "
                f"put back the job's {MANIFEST}")
        if not os.path.exists(path):
            if self._names():
                raise UserError(f"{self.folder} holds committed blocks but no {MANIFEST}; {ways}")
            return None
        try:
            with open(path, encoding="utf-8") as f:
                old = json.load(f)
            if not isinstance(old, dict) or "input" not in old or "settings" not in old:
                raise ValueError("not a manifest")
        except (OSError, ValueError) as e:
            raise UserError(f"{path} is unreadable ({type(e).__name__}); {ways}") from None
        digest = old.pop("sha256", None)
        older = digest is None and old.get("version", 0) < VERSION    # refused as a change
        if not older and digest != manifest_digest(old):
            raise UserError(f"{path} does not match its checksum (edited or damaged); {ways}")
        return old

    def _check_blocks(self) -> int:
        """Every committed block verified (`_verify`): damaged ones moved to damaged/, files
        that are no block of a job left where they are, each with one warning line -> the
        rows of the sound blocks."""
        for name in sorted(os.listdir(self.blocks)):
            if not BLOCK_NAME.fullmatch(name):
                warn(f"{os.path.join(self.blocks, name)} is not a block of this job; ignored")
        rows = 0
        for w, b, n in self._names():
            record, why = self._verify(w, b, n)
            if why is None:
                rows += len(record["rows"])
                continue
            os.makedirs(os.path.join(self.folder, DAMAGED), exist_ok=True)
            path = self._path(w, b, n)
            aside = free_path(os.path.join(self.folder, DAMAGED, os.path.basename(path)))
            os.replace(path, aside)
            warn(f"{path} is damaged ({why}); moved to {aside}, its rows are generated again")
        return rows

    def _verify(self, w: int, b: int, n: int) -> tuple[dict | None, str | None]:
        """-> (the block's record, None) for a sound block, else (None, what is wrong)."""
        try:
            with open(self._path(w, b, n), encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError) as e:           # ValueError: JSON and UTF-8 decoding
            return None, f"unreadable: {type(e).__name__}"
        if not isinstance(record, dict) or not isinstance(record.get("rows"), list):
            return None, "not a block record"
        if record.get("sha256") != block_digest(w, b, n, record["rows"]):
            return None, "its SHA-256 does not match its rows"
        return record, None

    def _take_lock(self):
        self._lock = open(os.path.join(self.folder, LOCK), "a+")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            self._lock = None
            raise UserError(f"{self.folder} is in use by another run of this job; wait for it "
                            f"to finish, or give another {setting('output')}") from None

    def _refuse_changes(self, old: dict, new: dict):
        how = ("rerun with the same input and settings to continue it, or add "
               f"{setting('restart')} to start over (its committed rows are discarded)")
        if old.get("version") != VERSION:
            raise UserError(f"{self.folder} was written by another version of flexevict; {how}")
        if old["input"] != new["input"]:
            raise UserError(f"{self.output}: the input file changed since this job started "
                            f"(size or SHA-256 differ); {how}")
        changed = [f"{_setting_of(k)} {_show(old['settings'].get(k))} -> {_show(v)}"
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
            m = BLOCK_NAME.fullmatch(name)
            if m:
                out.append(tuple(int(x) for x in m.groups()))
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
        record = {**record, "sha256": block_digest(w, b, n, record["rows"])}
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
                raise UserError(f"{self.folder}: {totals['rows']} rows committed, expected "
                                f"{rows}; add {setting('restart')} to generate the job again")
            os.replace(tmp, self.output)
        except OSError as e:
            raise disk_error(self.output, e, os.path.getsize(tmp) if os.path.exists(tmp)
                             else 0) if e.errno in DISK_FULL else \
                UserError(f"{self.output}: cannot write output ({e.strerror})") from None
        finally:
            _remove_quietly(tmp)                     # renamed already, or not to be kept
        return totals

    def remove(self):
        """The job is done: the folder goes, except the blocks set aside as damaged, which
        move beside the output (`out.jsonl.damaged/`) for the user to look at."""
        damaged = os.path.join(self.folder, DAMAGED)
        if os.path.isdir(damaged):
            keep = free_path(self.output + ".damaged")
            os.replace(damaged, keep)
            warn(f"the damaged blocks set aside during this job are kept in {keep}")
        self.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def _add(totals: dict, record: dict):
    totals["rows"] += len(record["rows"])
    totals["blocks"] += 1
    totals["prompt_tokens"] += sum(r["prompt_tokens"] for r in record["rows"])
    totals["generated_tokens"] += sum(r["tokens"] for r in record["rows"])
    totals["generate_seconds"] += record["seconds"]
    if record["resolved"] not in totals["resolved"]:
        totals["resolved"].append(record["resolved"])


def _setting_of(key: str) -> str:
    """A settings key of the manifest (a flag, `JobSpec.settings`) as `setting` names it."""
    name = {flag: name for name, flag in FLAGS.items()}.get(key, key[2:].replace("-", "_"))
    return setting(name)


def _show(v) -> str:
    return "unset" if v is None else json.dumps(v) if not isinstance(v, str) else v
