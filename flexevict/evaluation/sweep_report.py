"""Tables, plots and the papers' claims from a sweep's cells.

`sel` everywhere is `sweep.select(...)`: {(task, policy, budget): metrics}; `full` sits at 1.0.
"""
from __future__ import annotations

import os

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
    """'20% (102)': the slot count of a ring policy's cell (BUZZ reports its peak)."""
    for p in ("local", "h2o", *POLICIES):
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


def tables(sel: dict, tasks: list, settings_note: str) -> str:
    parts = [f"# Accuracy sweep\n\n{settings_note}\n\n`–`: not run; `below min`: the "
             "budget gives fewer slots than the policy's minimum (its sinks + window).\n"]
    for t in tasks:
        for metric, (label, _) in t.metrics.items():
            parts.append(table(sel, t, metric, label))
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

def at_least(tm: tuple, a, b) -> bool:
    """a is as good as b or better on this metric."""
    return a <= b if tm[1] in LOWER_IS_BETTER else a >= b


def head_to_head(sel: dict, tm: tuple, a: str, b: str, budgets=None) -> list[tuple]:
    """[(budget, value a, value b, a at least as good)] over evicting budgets both ran."""
    rows = []
    for bud in budgets if budgets is not None else budgets_of(sel, tm[0]):
        va, vb = value(sel, tm, a, bud), value(sel, tm, b, bud)
        if bud < 1 and va is not None and vb is not None:
            rows.append((bud, va, vb, at_least(tm, va, vb)))
    return rows


NAMES = {PPL: "ppl", ROUGE: "agreement ROUGE-L", TOKENS: "agreement tokens",
         PASSKEY: "passkey accuracy", ATTN: "attention error"}


def describe(rows: list[tuple], tm: tuple, a: str, b: str) -> str:
    """'ppl h2o vs local: 5/5 (5% 20.1 vs 45.2, ...)': budgets where a is at least as good."""
    wins = sum(r[3] for r in rows)
    pairs = ", ".join(f"{bud:.0%} {fmt(tm[1], va)} vs {fmt(tm[1], vb)}" for bud, va, vb, _ in rows)
    return f"{NAMES[tm]} {a} vs {b}: {wins}/{len(rows)} ({pairs})"


def tally(rows: list[tuple], tm: tuple) -> tuple[int, int, int]:
    """(better, equal, worse) of the first policy over head_to_head rows."""
    better = sum(r[1] != r[2] and r[3] for r in rows)
    equal = sum(r[1] == r[2] for r in rows)
    return better, equal, len(rows) - better - equal


def verdict(ok: list[bool]) -> str:
    """Over the cells a claim covers: holds in all, in some (partly, k/n), or in none."""
    if not ok:
        return "not measured"
    k = sum(ok)
    return "holds" if k == len(ok) else ("does not hold" if k == 0 else f"partly ({k}/{len(ok)})")


def claim_h2o(sel: dict) -> list[dict]:
    rows = {tm: head_to_head(sel, tm, "h2o", "local") for tm in (PPL, ROUGE, PASSKEY)}
    first = {"paper": "H2O", "claim": "H2O >= local at every budget (ppl and agreement)",
             "measured": "; ".join(describe(r, tm, "h2o", "local") for tm, r in rows.items() if r),
             "verdict": verdict([r[3] for r in rows[PPL] + rows[ROUGE]])}
    full = value(sel, PPL, "full", 1.0)
    near = [(b, value(sel, PPL, "h2o", b) / full - 1) for b in budgets_of(sel, "ppl")
            if 0.2 <= b < 1 and full and value(sel, PPL, "h2o", b) is not None]
    rouge = [f"{b:.0%} {fmt('rouge_l', value(sel, ROUGE, 'h2o', b))}"
             for b in budgets_of(sel, "agreement")
             if 0.2 <= b < 1 and value(sel, ROUGE, "h2o", b) is not None]
    text = ", ".join(f"{b:.0%} {d:+.1%}" for b, d in near)
    second = {"paper": "H2O", "claim": "H2O ≈ full at >= 20% (ppl within 5% of full)",
              "measured": f"ppl vs full {fmt('ppl', full)}: {text}; ROUGE-L vs full "
                          f"output (1.0 = identical): {', '.join(rouge) or '–'}",
              "verdict": verdict([d <= 0.05 for _, d in near])}
    return [first, second]


def claim_buzz(sel: dict) -> list[dict]:
    rows = head_to_head(sel, ROUGE, "buzz", "h2o", [0.1])
    tokens = head_to_head(sel, TOKENS, "buzz", "h2o", [0.1])
    every = head_to_head(sel, ROUGE, "buzz", "h2o")
    measured = "; ".join(describe(r, tm, "buzz", "h2o") for r, tm in
                         ((rows, ROUGE), (tokens, TOKENS), (every, ROUGE)) if r)
    return [{"paper": "BUZZ", "claim": "BUZZ >= H2O on agreement with the full cache's "
             "output at 10% (ROUGE-L)", "measured": measured, "verdict": verdict([r[3] for r in rows])}]


def claim_cascade(sel: dict) -> list[dict]:
    rows = head_to_head(sel, PPL, "cascade", "streaming")
    return [{"paper": "Cascade", "claim": "Cascade < StreamingLLM streaming ppl at equal cache",
             "measured": describe(rows, PPL, "cascade", "streaming"),
             "verdict": verdict([r[1] < r[2] for r in rows])}]


def claim_hashevict(sel: dict) -> list[dict]:
    """Three checks: ppl within 5% and ROUGE-L within 5 points of h2o at 50% (else the nearest
    budget measured), and below local's ppl at every budget."""
    near = [b for b in (0.5, 0.4, 0.6) if value(sel, PPL, "hashevict", b) is not None]
    measured, ok = [], []
    if near:
        b = near[0]
        dp = value(sel, PPL, "hashevict", b) / value(sel, PPL, "h2o", b) - 1
        dr = (value(sel, ROUGE, "hashevict", b) or 0) - (value(sel, ROUGE, "h2o", b) or 0)
        measured.append(f"at {b:.0%}: ppl {dp:+.1%} vs h2o, ROUGE-L {dr * 100:+.1f} points")
        ok += [abs(dp) <= 0.05, abs(dr) <= 0.05]
    local = head_to_head(sel, PPL, "hashevict", "local")
    measured.append(describe(local, PPL, "hashevict", "local"))
    ok += [all(r[3] for r in local)] if local else []
    return [{"paper": "HashEvict", "claim": "HashEvict within a few points of H2O at 50% "
             "(ppl within 5%; ROUGE-L within 5 points) and better than local (ppl)",
             "measured": "; ".join(measured), "verdict": verdict(ok)}]


def claim_vatp(sel: dict) -> list[dict]:
    out = []
    for a, b, claim in (("vatp", "h2o", "VATP >= its base (h2o) on most tasks and budgets"),
                        ("vatp-pin", "h2o", "pinning only (vatp-pin) vs h2o: the sink effect"),
                        ("vatp", "vatp-pin", "value norm on top of pinning (vatp vs vatp-pin)")):
        rows = {tm: head_to_head(sel, tm, a, b) for tm in (PPL, ROUGE, PASSKEY, ATTN)}
        better, equal, worse = (sum(x) for x in zip(*(tally(r, tm) for tm, r in rows.items())))
        measured = f"{a} vs {b} over (task, budget) cells: {better} better, {equal} equal, " \
            f"{worse} worse; " + "; ".join(describe(r, tm, a, b) for tm, r in rows.items() if r)
        # an equal cell is no evidence either way (e.g. when the 20 pinned tokens fill the
        # cache); "most" = more cells better than worse
        result = "not measured" if not better + worse + equal else \
            "holds" if better > worse else "no net effect" if better == worse else "does not hold"
        out.append({"paper": "VATP", "claim": claim, "measured": measured, "verdict": result})
    return out


def claims(sel: dict) -> list[dict]:
    return [*claim_h2o(sel), *claim_buzz(sel), *claim_cascade(sel), *claim_hashevict(sel),
            *claim_vatp(sel)]


def claims_markdown(rows: list[dict]) -> str:
    lines = ["| paper | claim | verdict | measured |", "|---|---|---|---|"]
    lines += [f"| {r['paper']} | {r['claim']} | **{r['verdict']}** | {r['measured']} |"
              for r in rows]
    return "\n".join(lines) + "\n"
