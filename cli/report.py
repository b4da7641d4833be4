"""`redteam-grpo report`: one self-contained HTML file per run — metric plots (inline SVG) and the top
adversarial examples, behind a content warning."""

from __future__ import annotations

import html
import io
import math
from pathlib import Path

import pandas as pd

from redteam_grpo.core.metrics.registry import REPORT, shown_in
from redteam_grpo.storage.atomic import write_atomic
from redteam_grpo.storage.modes import mode_of
from redteam_grpo.storage.query import adversarial_examples, query
from redteam_grpo.storage.rundir import RunDir

PLOTS = [(m.name, m.name.replace("_", " ")) for m in shown_in(REPORT, with_iteration=False)]  # (column, title)


def _svg_plot(metrics: pd.DataFrame, column: str, title: str) -> str:
    import matplotlib

    matplotlib.use("Agg")  # no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.2, 2.6), dpi=100)
    values = metrics[column].astype(float)
    if values.notna().any():
        ax.plot(metrics["iteration"], values, marker="o", markersize=3)
    else:
        ax.text(0.5, 0.5, "not computed in this run", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(title)
    ax.set_xlabel("iteration")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    plt.close(fig)
    svg = buf.getvalue()
    return svg[svg.index("<svg") :]  # drop the XML prolog: the SVG is inlined


def _fmt(x) -> str:
    if isinstance(x, float):
        return "" if math.isnan(x) else f"{x:.3f}"
    if isinstance(x, list | tuple) or hasattr(x, "tolist"):
        return ", ".join(map(str, list(x)))
    return str(x)


def evaluation_html(run: RunDir) -> str:
    """The newest evaluation's summary (`redteam-grpo evaluate`), metrics as rows and policies side by side."""
    summaries = sorted((run.root / "eval").glob("summary-*.parquet"), key=lambda p: p.stat().st_mtime)
    if not summaries:
        return '<p id="evaluation">No evaluation yet: <code>redteam-grpo evaluate RUN</code> writes one.</p>'
    frame = pd.read_parquet(str(summaries[-1]))  # a URL (a run on object storage) is read through fsspec
    frame["metric"] = [m if pd.isna(t) else f"{m} @ τ={t:g}" for m, t in zip(frame.metric, frame.tau, strict=True)]
    if "judge" in frame.columns:  # every attack-success and refusal figure beside the judge whose verdict it counts
        frame["metric"] = [
            m if j is None or pd.isna(j) else f"{m} (judge: {j})"
            for m, j in zip(frame.metric, frame.judge, strict=True)
        ]
    table = frame.pivot_table(index="metric", columns="policy", values="value", sort=False, dropna=False)
    header = "".join(f"<th>{html.escape(str(c))}</th>" for c in table.columns)
    body = "\n".join(
        f"<tr><th>{html.escape(str(metric))}</th>" + "".join(f"<td>{_fmt(float(v))}</td>" for v in row) + "</tr>"
        for metric, row in table.iterrows()
    )
    name = html.escape(summaries[-1].name.removeprefix("summary-"))
    return f'<p>{name}</p><table id="evaluation"><tr><th>metric</th>{header}</tr>\n{body}</table>'


def dialogue_html(messages, answer_scores=None) -> str:
    """A dialogue turn by turn: who said what, in order; with `answer_scores` (scores.parquet: turn_harm), each
    answer's harm score in the conversation up to it."""
    known = answer_scores is not None and not isinstance(answer_scores, float)  # a null cell may read as NaN
    scores = iter(list(answer_scores) if known else [])
    turns = []
    for m in messages:
        score = next(scores, None) if m["role"] == "assistant" else None
        shown = f' <span class="score">({_fmt(float(score))})</span>' if score is not None else ""
        role = html.escape(m["role"])
        turns.append(f'<li class="{role}"><b>{role}</b>: {html.escape(m["content"])}{shown}</li>')
    return f'<ol class="dialogue">{"".join(turns)}</ol>'


def render_report(run: RunDir, top_k: int = 20) -> str:
    metrics = query(run, "select * from metrics order by iteration")
    examples = adversarial_examples(run, limit=top_k)
    manifest = run.identity_and_status()
    config = run.stored_config()
    plots = "\n".join(
        f'<figure class="plot" id="plot-{col}" data-metric="{col}">{_svg_plot(metrics, col, title)}</figure>'
        for col, title in PLOTS
    )
    # dialogues (dialogue.turns > 1) are shown turn by turn in one cell; a single turn as prompt and completion
    dialogues = any(len(m) > 2 for m in examples.get("messages", []))
    texts = ["dialogue"] if dialogues else ["prompt", "completion"]
    header = ["iteration", "checkpoint", "harm", "reward", "refusal", "categories", *texts]

    def cell(row, column: str) -> str:
        if column == "dialogue":
            return dialogue_html(row["messages"], row.get("turn_harm"))
        return html.escape(_fmt(row[column]))

    rows = "\n".join(
        "<tr>" + "".join(f"<td>{cell(row, c)}</td>" for c in header) + "</tr>" for _, row in examples.iterrows()
    )
    facts = {
        "run": run.run_id,
        "status": manifest.get("status"),
        "iterations completed": len(run.completed_iterations()),
        "policy": config.model.policy,
        "scorer": config.reward.scorer,
        "lineage": manifest.get("lineage") or "",
        "parent run": manifest.get("parent_run") or "",
    }
    facts_html = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in facts.items())
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>redteam-grpo report: {html.escape(run.run_id)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; }} .plots {{ display: flex; flex-wrap: wrap; gap: 1em; }}
figure {{ margin: 0; }} table {{ border-collapse: collapse; }} td, th {{ border: 1px solid #ccc; padding: 4px;
vertical-align: top; text-align: left; }} .warning {{ background: #fff3cd; padding: 1em; border: 1px solid #e0c36b; }}
</style></head><body>
<h1>{mode_of(config).title} {html.escape(run.run_id)}</h1>
<table class="facts">{facts_html}</table>
<h2>Per iteration</h2>
<div class="plots">{plots}</div>
<h2>Evaluation against the base model</h2>
{evaluation_html(run)}
<h2>Top {len(examples)} adversarial examples by harm</h2>
<p class="warning" id="content-warning"><strong>Content warning:</strong> the examples below were produced to be
harmful or offensive. They are research data; do not publish them without care.</p>
<table id="examples"><tr>{"".join(f"<th>{h}</th>" for h in header)}</tr>
{rows}
</table>
</body></html>
"""


def write_report(run: RunDir, out: Path | None = None, top_k: int = 20) -> Path:
    out = out or run.root / "report.html"
    text = render_report(run, top_k)
    write_atomic(out, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return out
