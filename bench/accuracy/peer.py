"""flexevict vs kvpress on the same prompts: export the sweep's inputs, then score the peer.

    python bench/accuracy/peer.py export --out /tmp/peer_inputs.json
    KVPRESS_VENV/bin/python bench/accuracy/kvpress_peer.py --inputs /tmp/peer_inputs.json \\
        --out bench/results/accuracy/kvpress_peer.json
    python bench/accuracy/peer.py compare --inputs /tmp/peer_inputs.json \\
        --peer bench/results/accuracy/kvpress_peer.json \\
        --sweep bench/results/accuracy/results.json \\
        --out bench/results/accuracy/kvpress_comparison.md

The inputs are the sweep's own `passkey` and `agreement` prompts (default sizes, packaged texts),
as token ids, with the slot count flexevict resolves for each budget; kvpress keeps that many
prompt tokens. The inputs file holds corpus text, so it stays outside the repository. Scoring
uses the sweep's functions (`tasks.score_passkey`, `tasks.compare`), so both engines are judged
by one piece of code.
"""
import argparse
import json
import sys
from types import SimpleNamespace

from flexevict.io.packaged import smollm2_gguf
from flexevict.policies import PolicySpec
from flexevict.evaluation.tasks import Agreement, Passkey, compare, passkey_answer, score_passkey
from flexevict.io.tokenizer import load_tokenizer

BUDGETS = (0.05, 0.1, 0.2, 0.4, 0.6)
# kvpress press -> the flexevict policy it is compared with (and why, in the README)
PAIRS = {"streaming": "streaming", "streaming-rerotate": "streaming",
         "observed-attention": "h2o", "tova": "tova", "snapkv": "scissorhands"}


def export(out: str) -> None:
    gguf = smollm2_gguf()
    llm = SimpleNamespace(tokenizer=load_tokenizer(gguf))   # the tasks only tokenize
    tasks = {}
    # the committed comparison's inputs: the sweep's sizes when it was run (5 depths, 8 prompts)
    for task in (Passkey(llm, depths=(0.1, 0.3, 0.5, 0.7, 0.9), repeats=1),
                 Agreement(llm, prompts=8)):
        slots = {}
        for b in BUDGETS:
            slots[str(b)] = PolicySpec("h2o", budget=b).make().layout(*task.lengths).slots
        tasks[task.name] = {"prompts": [llm.tokenizer.encode(p) for p in task.prompts],
                            "new_tokens": task.lengths[1], "slots": slots,
                            "settings": task.settings, "keys": getattr(task, "keys", None)}
    with open(out, "w") as f:
        json.dump({"gguf": gguf, "tasks": tasks}, f)


def score(tok, task: str, inputs: dict, outputs: list, ref: list) -> dict:
    """Peer outputs (token ids per prompt) -> the sweep's metrics for that task."""
    outs = [{"ids": ids, "completion": tok.decode(ids)} for ids in outputs]
    if task == "passkey":
        per = [score_passkey(o["completion"], k) for o, k in zip(outs, inputs["keys"])]
        return {"accuracy": sum(p["exact"] for p in per) / len(per),
                "digit_accuracy": sum(p["digits"] for p in per) / len(per),
                "answers": [p["answer"] for p in per]}
    refs = [{"ids": ids, "completion": tok.decode(ids)} for ids in ref]
    r = compare(outs, refs)
    return {"rouge_l": r["rouge_l"], "token_agreement": r["token_agreement"],
            "completions": [o["completion"] for o in outs]}


def sweep_cells(path: str, task: str, settings: dict) -> dict:
    with open(path) as f:
        cells = json.load(f)["cells"].values()
    return {(c["policy"], c["budget"]): c["metrics"] for c in cells
            if c["task"] == task and c["settings"] == settings and "skipped" not in c["metrics"]}


def harness_check(tok, task: str, ref: list, cells: dict) -> str:
    """Does kvpress without a press give flexevict's full-cache greedy output? (Same model,
    same prompts: any difference here is a harness or numerics difference, not eviction.)"""
    full = cells.get(("full", 1.0))
    if full is None:
        return "flexevict full cell missing"
    theirs = [tok.decode(ids) for ids in ref]
    if task == "passkey":
        ours, theirs = [p["answer"] for p in full["per_trial"]], map(passkey_answer, theirs)
    else:
        ours = full["completions"]
    same = sum(a == b for a, b in zip(ours, list(theirs)))
    return f"{same}/{len(ours)} prompts give identical {'answers' if task == 'passkey' else 'text'}"


def comparison(inputs: dict, peer: dict, sweep: str) -> tuple[list, dict]:
    tok = load_tokenizer(inputs["gguf"])
    rows, harness = [], {}
    for task, spec in inputs["tasks"].items():
        cells = sweep_cells(sweep, task, spec["settings"])
        runs = peer["tasks"][task]
        ref = next(r for r in runs if r["press"] == "none")["outputs"]
        harness[task] = harness_check(tok, task, ref, cells)
        metric = "accuracy" if task == "passkey" else "rouge_l"
        for r in runs:
            if r["press"] == "none":
                continue
            cell = cells.get((PAIRS[r["press"]], r["budget"]), {})
            theirs = score(tok, task, spec, r["outputs"], ref)
            same = None
            if task == "passkey" and cell:           # answer by answer, not just the rate
                same = sum(a == p["answer"] for a, p in zip(theirs["answers"], cell["per_trial"]))
            rows.append({"task": task, "metric": metric, "budget": r["budget"],
                         "slots": r["slots"], "press": r["press"], "kvpress": theirs[metric],
                         "policy": PAIRS[r["press"]], "flexevict": cell.get(metric),
                         "same_answers": same})
    return rows, harness


def same(row: dict) -> str:
    return "" if row["same_answers"] is None else f" ({row['same_answers']} same)"


def markdown(rows: list, harness: dict, peer: dict) -> str:
    lines = [f"kvpress {peer['kvpress']} (transformers {peer['transformers']}, torch "
             f"{peer['torch']}) vs flexevict, SmolLM2-135M fp32 CPU, same token ids; each cell "
             "`kvpress / flexevict`. kvpress compresses the prompt once at prefill and keeps "
             "every generated token; flexevict keeps `slots` tokens through decode too.", ""]
    lines += [f"- harness check, no press vs flexevict `full`, {t}: {h}"
              for t, h in harness.items()]
    presses = list(dict.fromkeys(r["press"] for r in rows))
    for task in dict.fromkeys(r["task"] for r in rows):
        sub = [r for r in rows if r["task"] == task]
        lines += ["", f"**{task}** ({sub[0]['metric']}; higher is better"
                  f"{'; (k same): answers identical to flexevict' if task == 'passkey' else ''})",
                  "",
                  "| budget (slots) | " + " | ".join(f"{p} / `{PAIRS[p]}`" for p in presses) + " |",
                  "|---|" + "---|" * len(presses)]
        for b in sorted({r["budget"] for r in sub}):
            cell = {r["press"]: r for r in sub if r["budget"] == b}
            fmt = lambda v: "–" if v is None else f"{v:.2f}"           # noqa: E731
            lines.append(f"| {b:.0%} ({next(iter(cell.values()))['slots']}) | " + " | ".join(
                f"{fmt(cell[p]['kvpress'])} / {fmt(cell[p]['flexevict'])}" + same(cell[p])
                if p in cell else "–" for p in presses) + " |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("--out", required=True)
    c = sub.add_parser("compare")
    for name in ("--inputs", "--peer", "--sweep", "--out"):
        c.add_argument(name, required=True)
    args = p.parse_args()
    if args.cmd == "export":
        return export(args.out)
    with open(args.inputs) as f:
        inputs = json.load(f)
    with open(args.peer) as f:
        peer = json.load(f)
    rows, harness = comparison(inputs, peer, args.sweep)
    with open(args.out, "w") as f:
        f.write(markdown(rows, harness, peer))
    with open(args.out.rsplit(".", 1)[0] + ".json", "w") as f:
        json.dump({"rows": rows, "harness": harness}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
