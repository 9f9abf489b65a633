"""Tables, plots and the papers' claims from a sweep's cells.

`sel` everywhere is `sweep.select(...)`: {(task, policy, budget): metrics}; `full` sits at 1.0.
"""
from __future__ import annotations

import math
import os

from flexevict.evaluation.paired import FAILS, HOLDS, UNCLEAR, paired_difference
from flexevict.policies import POLICIES

LOWER_IS_BETTER = {"ppl", "attn_error"}
PPL, ROUGE, TOKENS, PASSKEY, ATTN = (("ppl", "ppl"), ("agreement", "rouge_l"),
                                     ("agreement", "token_agreement"), ("passkey", "accuracy"),
                                     ("attention-loss", "attn_error"))


def policy_order(sel: dict) -> list[str]:
    present = {p for _, p, _ in sel}
    return [p for p in POLICIES if p in present] + sorted(present - set(POLICIES))


def budgets_of(sel: dict, task: str) -> list[float]:
    return sorted({b for t, _, b in sel if t == task})


def value(sel: dict, tm: tuple, policy: str, budget: float):
    return sel.get((tm[0], policy, budget), {}).get(tm[1])


def fmt(metric: str, v) -> str:
    if v is None:
        return "–"
    return f"{v:.2f}" if metric == "ppl" else f"{v:.3f}"


# ------------------------------------------------------------------------------ tables

def slots_label(sel: dict, task: str, budget: float) -> str:
    """'20% (102)': the slot count of a ring policy's cell (BUZZ reports its peak; `recall`'s
    count leaves out its page summaries, so it never labels a column)."""
    for p in ("local", "h2o", *(p for p in POLICIES if p != "recall")):
        m = sel.get((task, p, budget))
        if m and m.get("slots"):
            return f"{budget:.0%} ({m['slots']})"
    return f"{budget:.0%}"


def table(sel: dict, task, metric: str, label: str) -> str:
    budgets = budgets_of(sel, task.name)
    lines = [f"**{task.name}: {label}** ({'lower' if metric in LOWER_IS_BETTER else 'higher'} "
             f"is better; columns: budget (slots))", "",
             "| policy | " + " | ".join(slots_label(sel, task.name, b) for b in budgets) + " |",
             "|---|" + "---|" * len(budgets)]
    for p in policy_order(sel):
        row = [cell_text(sel, task.name, metric, p, b) for b in budgets]
        if any(r != "–" for r in row):
            lines.append(f"| `{p}` | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def cell_text(sel: dict, task: str, metric: str, policy: str, budget: float) -> str:
    m = sel.get((task, policy, budget))
    if m is not None and "skipped" in m:
        return "below min"                 # the budget's slots are under the policy's minimum
    return fmt(metric, None if m is None else m.get(metric))


def breakdown_table(sel: dict, task: str, key: str, label: str) -> str:
    """One row per (policy, budget) with its `key` scores ({column: score}; a nested
    {column: {...: score}} is averaged), `full` first: what the model itself can do in each
    column beside what each policy keeps of it. Columns are strings, as JSON stores them."""
    rows = []
    for p in dict.fromkeys(["full", *policy_order(sel)]):
        for b in budgets_of(sel, task):
            scores = sel.get((task, p, b), {}).get(key)
            if scores is not None:
                rows.append((p, b, {str(c): v if isinstance(v, (int, float))
                                    else sum(v.values()) / len(v) for c, v in scores.items()}))
    if not rows:
        return ""
    columns = list(dict.fromkeys(c for _, _, r in rows for c in r))
    lines = [f"**{task}: {label}** (higher is better)", "",
             "| policy | budget | " + " | ".join(columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    lines += [f"| `{p}` | {b:.0%} | " + " | ".join(fmt(key, r.get(c)) for c in columns) + " |"
              for p, b, r in rows]
    return "\n".join(lines) + "\n"


def tables(sel: dict, tasks: list, settings_note: str) -> str:
    parts = [f"# Accuracy sweep\n\n{settings_note}\n\n`–`: not run; `below min`: the "
             "budget gives fewer slots than the policy's minimum (its sinks + window).\n"]
    for t in tasks:
        for metric, (label, _) in t.metrics.items():
            parts.append(table(sel, t, metric, label))
        parts += [x for key, label in t.breakdowns.items()
                  if (x := breakdown_table(sel, t.name, key, label))]
    return "\n".join(parts)


# ------------------------------------------------------------------------------ plots

# tab10, then three more far from it: 12 evicting policies + `full` (black, dashed)
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf", "#000080", "#808000", "#00ced1")
MARKERS = "os^vD<>pP*Xhd"


def draw_lines(ax, sel: dict, task: str, metric: str, log: bool = False) -> None:
    """One line per policy of `metric` against budget on a log x axis; `full` dashed. With a
    log y axis, zeros (no eviction: no error) are left out."""
    for i, p in enumerate(policy_order(sel)):
        pts = sorted((b, m[metric]) for (t, q, b), m in sel.items()
                     if t == task and q == p and m.get(metric) is not None
                     and (m[metric] > 0 or not log))
        if p == "full" and pts:
            ax.axhline(pts[0][1], color="black", ls="--", lw=1, label="full")
        elif pts:
            ax.plot(*zip(*pts), marker=MARKERS[i % len(MARKERS)], ms=4, lw=1.3,
                    color=PALETTE[i % len(PALETTE)], label=p)
    budgets = budgets_of(sel, task)
    ax.set_xscale("log")
    ax.set_xticks(budgets, [f"{b:.0%}" for b in budgets])
    ax.minorticks_off()
    ax.set_xlabel("KV budget (fraction of prompt + generated tokens)")
    ax.grid(alpha=0.3)


def plot_metric(sel: dict, task: str, metric: str, label: str, title: str, path: str) -> None:
    """`metric` against budget, one line per policy. Perplexity gets a log-scale panel and a
    zoom on the band within 50% of `full`, where all but the weakest policies sit."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    full = value(sel, (task, metric), "full", 1.0)
    zoom = metric == "ppl" and full is not None
    log = metric in LOWER_IS_BETTER           # ppl and errors span orders of magnitude
    fig, axes = plt.subplots(1, 2 if zoom else 1, figsize=(13 if zoom else 7.5, 4.8),
                             squeeze=False)
    for ax in axes[0]:
        draw_lines(ax, sel, task, metric, log=log)
        ax.set_ylabel(label)
    if log:
        axes[0][0].set_yscale("log")
    if zoom:
        axes[0][1].set_ylim(full * 0.98, full * 1.5)
        axes[0][1].set_title("zoom: within 50% of full", fontsize=9)
    axes[0][0].set_title(title, fontsize=10)
    if axes[0][-1].get_legend_handles_labels()[0]:      # none while too few cells are done
        axes[0][-1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_layers(sel: dict, budget: float, title: str, path: str) -> None:
    """Attention output error per layer at one budget, one line per policy (HashEvict Fig.)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for i, p in enumerate(policy_order(sel)):
        m = sel.get(("attention-loss", p, budget))
        if m and m.get("decode_steps"):
            ax.plot(m["per_layer"], lw=1.3, color=PALETTE[i % len(PALETTE)],
                    marker=MARKERS[i % len(MARKERS)], ms=3, label=p)
    ax.set_xlabel("layer")
    ax.set_ylabel("||O - Ô|| / ||O||, mean over decode steps")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plots(sel: dict, tasks: list, model: str, out: str) -> list[str]:
    paths = []
    for t in tasks:
        for metric, (label, _) in t.metrics.items():
            path = os.path.join(out, f"{t.name}_{metric}.png")
            plot_metric(sel, t.name, metric, label, f"{model}: {t.name}", path)
            paths.append(path)
    layer_budgets = [b for b in budgets_of(sel, "attention-loss") if b < 1]
    if layer_budgets:
        b = min(layer_budgets, key=lambda x: abs(x - 0.2))
        path = os.path.join(out, "attention-loss_per_layer.png")
        plot_layers(sel, b, f"{model}: attention output error per layer at {b:.0%}", path)
        paths.append(path)
    return paths


# ------------------------------------------------------------------------------ claims
#
# Every claim is checked by paired comparisons (`paired.paired_difference`) of per-item scores
# (`items` in a cell: a document stretch's NLL, a prompt's ROUGE-L, a passkey trial), one per
# budget. A claim over budgets holds when it holds at every budget, does not hold when it fails
# at any, and is otherwise not distinguishable at this sample size.

RETRIEVAL = ("retrieval", "accuracy")
ITEM = {PPL: "nll", ROUGE: "rouge_l", TOKENS: "token_agreement", PASSKEY: "accuracy",
        ATTN: "attn_error", RETRIEVAL: "accuracy"}
NAMES = {PPL: "ppl", ROUGE: "agreement ROUGE-L", TOKENS: "agreement tokens",
         PASSKEY: "passkey accuracy", ATTN: "attention error", RETRIEVAL: "retrieval accuracy"}
PPL_5_PERCENT = math.log(1.05)        # ppl within 5% = mean NLL within log 1.05


def replicas(sel: dict, task: str, label: str, budget: float) -> list[dict]:
    """The cells of `label`, and of its seed replicas `label@seed...` (HashEvict's projection
    seeds), at one budget."""
    return [m for (t, p, b), m in sel.items() if t == task and b == budget and "skipped" not in m
            and (p == label or p.startswith(label + "@seed"))]


def items(sel: dict, tm: tuple, label: str, budget: float) -> list[float] | None:
    """Per-item scores, averaged item by item over seed replicas; None if not measured."""
    lists = [m.get("items", {}).get(ITEM[tm]) for m in replicas(sel, tm[0], label, budget)]
    lists = [x for x in lists if x]
    if not lists or len({len(x) for x in lists}) > 1:
        return None
    return [sum(v) / len(v) for v in zip(*lists)]


def mean_value(sel: dict, tm: tuple, label: str, budget: float):
    vals = [m[tm[1]] for m in replicas(sel, tm[0], label, budget) if m.get(tm[1]) is not None]
    return sum(vals) / len(vals) if vals else None


def paired(sel: dict, tm: tuple, a: str, b: str, budget: float, margin: float = 0.0,
           b_budget: float | None = None) -> dict | None:
    """a at `budget` vs b at `b_budget` (default the same) on task-metric tm -> the difference
    (positive: a better), its 95% interval and verdict; None where either was not measured."""
    b_budget = budget if b_budget is None else b_budget
    xa, xb = items(sel, tm, a, budget), items(sel, tm, b, b_budget)
    if xa is None or xb is None or len(xa) != len(xb):
        return None
    d = paired_difference(xa, xb, higher_is_better=tm[1] not in LOWER_IS_BETTER)
    return {"tm": tm, "budget": budget, "a": mean_value(sel, tm, a, budget),
            "b": mean_value(sel, tm, b, b_budget), "diff": d, "verdict": d.verdict(margin)}


def stat_text(r: dict) -> str:
    """'10% 19.85 vs 21.36, +0.071 [+0.032, +0.110] n=32: holds'."""
    d, tm = r["diff"], r["tm"]
    unit = "NLL" if tm[1] == "ppl" else ""
    return (f"{r['budget']:.0%} {fmt(tm[1], r['a'])} vs {fmt(tm[1], r['b'])}, {unit}"
            f"{d.mean:+.3f} [{d.low:+.3f}, {d.high:+.3f}] n={d.n}: {r['verdict']}")


def overall(results: list[dict]) -> str:
    if not results:
        return "not measured"
    verdicts = [r["verdict"] for r in results]
    if all(v == HOLDS for v in verdicts):
        return HOLDS
    if any(v == FAILS for v in verdicts):
        return FAILS
    return UNCLEAR


# What each paper measured for its claim (model, task, budget; table), beside our setting.
PAPER_SETTING = {
    "H2O": "OPT-13B/30B, 5-shot COPA, OpenBookQA, PiQA, Winogrande at a 20% budget "
           "(Tables 1, 2, 9)",
    "H2O full": "OPT-30B at 20%: within 1.2 accuracy points of the full cache on 4 tasks "
                "(Table 2)",
    "BUZZ": "Llama-2-7B; XSUM ROUGE at 10-60% of the full cache's average size (Table 2); "
            "Wikitext perplexity at caches of 50 and 100 tokens (Table 3)",
    "Cascade": "LLaMA2-7B/13B, Qwen1.5-7B/14B; PG19 streaming perplexity, 2048 or 4096 slots, "
               "4 sub-caches, 4 sinks (Table 1)",
    "HashEvict": "Llama-3-8B-Instruct; GSM8K free response at 10-90% budgets, ROUGE-L 0.393 vs "
                 "H2O's 0.398 at 50% (Table 4); its weaker baseline is the key-norm rule (L2)",
    "VATP": "LLaMA2-7B-chat (3.5k tokens) and Vicuna (7.5k); 16 LongBench tasks at a 50% "
            "budget: H2O + VATP better on 12 of 16 (Table 1)",
    "Recall": "Quest (Tang et al. 2024): near the full cache on passkey and LongBench at token "
              "budgets of 256-4096 (Sec. 5); the goals set for `recall` on SmolLM2",
    "SnapKV": "16 LongBench datasets: comparable to the full cache; Needle-in-a-Haystack to 380k "
              "tokens with a negligible drop (abstract); the prompt selected once, at prefill",
    "KeyDiff": "Llama-3.1-8B and Llama-3.2-3B, LongBench: within 0.04% of the full cache at an "
               "8k-token budget (about 23% of the cache evicted; abstract), prompt block-wise",
    "TriAttention": "AIME25 with 32k generated tokens: the full cache's accuracy at 10.7x less KV "
                    "memory, where attention-score baselines reach about half (abstract)",
}


def claim(paper: str, text: str, setting: str, results: list, verdict: str | None = None,
          paper_setting: str | None = None) -> dict:
    results = [r for r in results if r is not None]
    by_metric: dict = {}
    for r in results:
        by_metric.setdefault(NAMES[r["tm"]], []).append(stat_text(r))
    statistic = "; ".join(f"{m}: " + ", ".join(v) for m, v in by_metric.items())
    return {"paper": paper, "claim": text, "theirs": paper_setting or PAPER_SETTING[paper],
            "ours": setting, "statistic": statistic or "–",
            "verdict": verdict or overall(results), "results": results}


def evicting(sel: dict, task: str, lo: float = 0.0) -> list[float]:
    return [b for b in budgets_of(sel, task) if lo <= b < 1]


def claim_h2o(sel: dict) -> list[dict]:
    vs_local = [paired(sel, tm, "h2o", "local", b) for tm in (PPL, ROUGE)
                for b in evicting(sel, tm[0])]
    near_full = [paired(sel, PPL, "h2o", "full", b, margin=PPL_5_PERCENT, b_budget=1.0)
                 for b in evicting(sel, "ppl", 0.2)]
    return [claim("H2O", "H2O better than local (recent window) at every budget",
                  "ppl and agreement, every budget", vs_local),
            claim("H2O", "H2O ≈ full at >= 20% (ppl no more than 5% above full's)",
                  "ppl, budgets >= 20%; margin: mean NLL within log 1.05", near_full,
                  paper_setting=PAPER_SETTING["H2O full"])]


def claim_buzz(sel: dict) -> list[dict]:
    out = []
    for a, b, setting in (
            ("buzz", "h2o", "equal peak slots, H2O half heavy / half recent (our protocol)"),
            ("buzz", "h2o@T+w", "equal peak slots, H2O of T heavy + w recent (authors' code)"),
            ("buzz@avg", "h2o", "equal average cache (Sec. 4.2.1), H2O half / half"),
            ("buzz@avg", "h2o@T+w", "equal average cache, H2O of T heavy + w recent "
                                    "(the paper's protocol)")):
        rows = [paired(sel, tm, a, b, bud) for tm in (PPL, ROUGE) for bud in evicting(sel, tm[0])]
        out.append(claim("BUZZ", f"{a} better than {b} (ppl, Table 3; agreement, Table 2)",
                         setting, rows))
    return out


def claim_cascade(sel: dict) -> list[dict]:
    return [claim("Cascade", f"{a} lower streaming ppl than StreamingLLM at equal cache",
                  setting, [paired(sel, PPL, a, "streaming", b) for b in evicting(sel, "ppl")])
            for a, setting in (("cascade", "every budget, default fill"),
                               ("cascade@eager", "every budget, eager_fill=true"))]


def claim_hashevict(sel: dict) -> list[dict]:
    """Non-inferior to H2O at 50% (else the nearest budget): ppl within 5%, ROUGE-L within 5
    points, with our prefill and with the authors' (`hashevict@rg`); better than local on ppl
    at every budget. Seeds averaged item by item."""
    out = []
    for label, prefill in (("hashevict", "prefill replays Algorithm 1 over the prompt"),
                           ("hashevict@rg", "the authors' prefill: first 4 and last C - 4 "
                            "prompt tokens, hash eviction while decoding (prompt_pool="
                            "recent_global)")):
        near = [b for b in (0.5, 0.4, 0.6) if items(sel, PPL, label, b) is not None][:1]
        close = [paired(sel, PPL, label, "h2o", b, margin=PPL_5_PERCENT) for b in near] + \
            [paired(sel, ROUGE, label, "h2o", b, margin=0.05) for b in near]
        seeds = len(replicas(sel, "ppl", label, near[0])) if near else 0
        out.append(claim("HashEvict", f"{label} within a few points of H2O at 50% (ppl within "
                         "5%; ROUGE-L within 0.05)", f"{near[0]:.0%} budget, {seeds} projection "
                         f"seed(s) averaged; {prefill}" if near else "–", close))
    return [*out, claim("HashEvict", "HashEvict better than local (ppl)", "every budget",
                        [paired(sel, PPL, "hashevict", "local", b) for b in evicting(sel, "ppl")])]


def tally(rows: list[dict]) -> tuple[str, str]:
    """Over (task, budget) cells -> (verdict, counts): holds when more than half of them hold
    ("most tasks"), does not hold when more fail than hold, else not distinguishable."""
    n = {v: sum(r["verdict"] == v for r in rows) for v in (HOLDS, FAILS, UNCLEAR)}
    verdict = "not measured" if not rows else HOLDS if 2 * n[HOLDS] > len(rows) else \
        FAILS if n[FAILS] > n[HOLDS] else UNCLEAR
    return verdict, (f"{len(rows)} (task, budget) cells: {n[HOLDS]} better, {n[FAILS]} worse, "
                     f"{n[UNCLEAR]} not distinguishable")


def claim_vatp(sel: dict) -> list[dict]:
    """VATP better than h2o on most (task, budget) cells, as the paper's 12 of 16 (`tally`)."""
    out = []
    for a, b, text in (("vatp", "h2o", "VATP better than its base (h2o) on most tasks and budgets"),
                       ("vatp@F20", "h2o", "the same with the paper's F = 20 pinned tokens "
                                           "(vatp@F20: sinks=20)"),
                       ("vatp-pin", "h2o", "pinning only (vatp-pin) vs h2o: the sink effect"),
                       ("vatp", "vatp-pin", "value norm on top of pinning (vatp vs vatp-pin)")):
        rows = [r for tm in (PPL, ROUGE, PASSKEY, ATTN) for bud in evicting(sel, tm[0])
                if (r := paired(sel, tm, a, b, bud)) is not None]
        verdict, counts = tally(rows)
        out.append(claim("VATP", text, counts, rows, verdict))
    return out


def near_full(sel: dict, label: str, metrics: tuple) -> list[dict]:
    """`label` against the full cache at every budget it ran, on metrics of PPL, RETRIEVAL and
    PASSKEY: perplexity within 5%, retrieval within 10% of full's mean score, passkey within
    0.05 (agreement is left out: it scores the full cache's own text, 1.0 by definition)."""
    out = []
    for tm in metrics:
        ref = mean_value(sel, tm, "full", 1.0)
        margin = {PPL: PPL_5_PERCENT, RETRIEVAL: 0.1 * (ref or 0), PASSKEY: 0.05}[tm]
        out += [paired(sel, tm, label, "full", b, margin=margin, b_budget=1.0)
                for b in evicting(sel, tm[0])]
    return out


def claim_2026(sel: dict) -> list[dict]:
    """The 2026 methods' headline claims (each paper's abstract): near the full cache; and
    TriAttention's, better than an attention-score method at the same budget (`snapkv` here,
    over (task, budget) cells, `tally`)."""
    every = (PPL, RETRIEVAL, PASSKEY)
    margins = "ppl within 5%, retrieval within 10% of full's score, passkey within 0.05"
    rows = [r for tm in (PPL, ROUGE, PASSKEY, RETRIEVAL) for b in evicting(sel, tm[0])
            if (r := paired(sel, tm, "triattention", "snapkv", b)) is not None]
    verdict, counts = tally(rows)
    return [claim("SnapKV", "SnapKV ≈ full on long-prompt tasks (retrieval, passkey)",
                  margins + "; every budget", near_full(sel, "snapkv", (RETRIEVAL, PASSKEY))),
            claim("KeyDiff", "KeyDiff ≈ full", margins + "; every budget (the paper's 77% is "
                  "not run)", near_full(sel, "keydiff", every)),
            claim("TriAttention", "TriAttention ≈ full", margins + "; every budget",
                  near_full(sel, "triattention", every)),
            claim("TriAttention", "TriAttention better than an attention-score method "
                  "(snapkv) at the same budget on most tasks", counts, rows, verdict)]


def claim_recall(sel: dict) -> list[dict]:
    """recall, which keeps the whole history and attends to the pages each step needs, against
    the full cache (retrieval within 10% of its score; passkey within 0.05; perplexity within
    1% at 10%) and against the eviction policy that retrieves best at the same budget."""
    near = near_full(sel, "recall", (RETRIEVAL,))
    best = [paired(sel, RETRIEVAL, "recall", p, b) for b in evicting(sel, "retrieval")
            if (p := best_evicting(sel, RETRIEVAL, b)) is not None]
    passkey = near_full(sel, "recall", (PASSKEY,))
    ppl = [paired(sel, PPL, "recall", "full", b, margin=math.log(1.01), b_budget=1.0)
           for b in evicting(sel, "ppl") if b == 0.1]
    return [claim("Recall", "recall >= 0.9x the full cache's retrieval accuracy",
                  "every budget; margin: 10% of full's mean score", near),
            claim("Recall", "recall better than the best eviction policy (retrieval)",
                  "every budget; the evicting policy of highest mean score there", best),
            claim("Recall", "recall's passkey accuracy equal to the full cache's",
                  "every budget; margin 0.05", passkey),
            claim("Recall", "recall's perplexity within 1% of the full cache's at 10%",
                  "10%; margin: mean NLL within log 1.01", ppl)]


def best_evicting(sel: dict, tm: tuple, budget: float) -> str | None:
    """The measured policy other than recall and full (and their variants, `recall@...`) with
    the highest mean at `budget`."""
    scores = {p: v for t, p, b in sel if t == tm[0] and b == budget and p.split("@")[0] not in
              ("recall", "full") and (v := mean_value(sel, tm, p, budget)) is not None}
    return max(scores, key=scores.get) if scores else None


def claims(sel: dict) -> list[dict]:
    return [*claim_h2o(sel), *claim_buzz(sel), *claim_cascade(sel), *claim_hashevict(sel),
            *claim_vatp(sel), *claim_recall(sel), *claim_2026(sel)]


def claims_markdown(rows: list[dict]) -> str:
    lines = ["Each statistic: budget, the two policies' values, the mean per-item difference "
             "(positive: the first policy better; NLL for ppl) with its 95% bootstrap interval "
             "and n items, and the verdict at that budget. Our model and task sizes are in "
             "results.md.", "",
             "| paper | claim | paper's setting | our setting | verdict | statistic |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['paper']} | {r['claim']} | {r['theirs']} | {r['ours']} | "
              f"**{r['verdict']}** | {r['statistic']} |" for r in rows]
    lines += ["", "Why a verdict differs from the paper's is a reading of the results, not a "
              "computation: for SmolLM2-135M it is in the repository's "
              "bench/results/accuracy/README.md, per paper."]
    return "\n".join(lines) + "\n"
