"""Benchmark report: `rasd bench ... --report DIR`, or `rasd report results.json --out DIR` (the same as
`python -m rasd.eval.report`) from a saved results.json.

The tables docs/benchmarks.md quotes are printed to stdout as Markdown, from the same files:
`rasd report results.json --table [--focus pld] [--baseline hf]` (speed per category) and
`rasd report answers.jsonl --sources [--method rasd]` (accepted draft tokens by source, from a
`rasd bench --answers` file, .jsonl or .jsonl.gz).

Writes into DIR a `report.md` with PNG plots beside it, and `report.html`: the same content with the plots
embedded (base64), so that one file can be mailed or attached. Everything comes from results.json alone, so
a report can be rebuilt from committed results without running the benchmark again:

1. `speedup.png`: decode speedup vs HF greedy (vs `ar` without HF) per category, one bar per method on every
   answer and a hatched one on the answers that do not loop (`looping`);
2. `accepted_tokens.png`: mean tokens committed per target forward, per category and method;
3. `position_acceptance.png`: of the steps whose verified tree reached draft depth d, the share that
   accepted the token at depth d (results.json `step_stats[method].position_acceptance`);
4. `accepted_by_source.png`: committed tokens by where they came from (context, datastore, draft, ...);
5. `cost_curve.png`: the target's measured verification latency against tree tokens, per context bucket,
   with the tree sizes the cost model chose per step (`cost_curves`, `step_stats[...].tree_tokens_by_bucket`).

Results written before these keys existed (e.g. tests/eval/data/results_before_report.json) still give the table and
plots 1-2; each missing plot is replaced by a note saying what is absent. `--cost-dir` lets the entry point
take the cost curves from a local cost cache (`$RASD_HOME/cost`) when the results do not carry them; the
report says so, since such a curve was not necessarily the one the run used.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import html
import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rasd.eval.looping import format_counts, looping_line

OVERALL = "overall"
SOURCE_ORDER = ("context", "documents", "datastore", "retrieval", "history", "draft", "eagle", "recycling", "grammar",
                "bonus")
SOURCE_COLOURS = {"context": "#4c72b0", "documents": "#55a868", "datastore": "#8172b2", "retrieval": "#64b5cd",
                  "history": "#937860", "grammar": "#8c8c8c", "draft": "#dd8452", "eagle": "#da8bc3",
                  "recycling": "#c44e52", "bonus": "#b0b0b0"}
# The summary table: (results.json key, column title, format). The test parses these back.
TABLE_COLUMNS = (("tokens_per_s", "tok/s", ".2f"), ("e2e_tokens_per_s", "e2e tok/s", ".2f"),
                 ("speedup_vs_hf", "vs hf", ".2f"), ("speedup_vs_hf_not_looping", "vs hf (not looping)", ".2f"),
                 ("median_speedup_vs_hf", "median vs hf", ".2f"), ("speedup_vs_ar", "vs ar", ".2f"),
                 ("speedup_vs_ar_not_looping", "vs ar (not looping)", ".2f"),
                 ("mean_accepted_tokens", "mean acc.", ".2f"), ("greedy_match_rate", "match", ".2f"),
                 ("num_prompts", "n", "d"))
META_FIELDS = (("model", "model"), ("draft_model", "draft model"), ("device", "device"), ("dtype", "dtype"),
               ("torch_threads", "torch threads"), ("dataset", "dataset"), ("task", "task"),
               ("categories", "categories"), ("limit", "limit per category"), ("num_prompts", "prompts"),
               ("max_new_tokens", "max new tokens"), ("temperature", "temperature"),
               ("repetition_window", "stop on repetition (window)"),
               ("greedy_reference", "greedy reference"), ("truncated_prompts", "truncated prompts"),
               ("skipped_prompts", "skipped prompts"), ("gguf", "llamacpp GGUF"),
               ("llamacpp_version", "llama-cpp-python"), ("llamacpp_threads", "llamacpp threads"), ("date", "date"))


# ------------------------------------------------------------------------------------ Markdown tables


def speed_table(results: dict[str, Any], focus: Sequence[str], baseline: str) -> str:
    """One row per category (then overall): every method's decode tok/s, and for each `focus` method its
    speedup over `baseline` (tokens-weighted mean, the same on the answers that do not loop, per-prompt median),
    mean accepted tokens and match; under it, how many answers loop (results that record it)."""
    methods = list(results["methods"])
    head = ["category"] + [f"{m} tok/s" for m in methods]
    for m in focus:
        head += [f"{m} vs {baseline}", f"{m} vs {baseline} (not looping)", f"{m} median", f"{m} mean acc.",
                 f"{m} match"]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for cat in categories_of(results) + [OVERALL]:
        row = [f"**{cat}**" if cat == OVERALL else cat]
        entries = {m: summary_of(results["methods"][m], cat) or {} for m in methods}
        row += [_fmt(entries[m].get("tokens_per_s"), ".1f") for m in methods]
        for m in focus:
            e = entries[m]
            row += [_times(e.get(f"speedup_vs_{baseline}")), _times(e.get(f"speedup_vs_{baseline}_not_looping")),
                    _times(e.get(f"median_speedup_vs_{baseline}")), _fmt(e.get("mean_accepted_tokens"), ".2f"),
                    _fmt(e.get("greedy_match_rate"), ".2f")]
        lines.append("| " + " | ".join(row) + " |")
    if results.get("looping"):
        lines += ["", looping_line(results["looping"])]
    return "\n".join(lines)


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def answers_by_source(path: Path, method: str) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
    """From a `rasd bench --answers` file: (category -> source -> accepted draft tokens, category -> generated
    tokens) for `method`, each also summed under `overall`. Bonus tokens are the target's own, not drafts."""
    by_source: dict[str, dict[str, int]] = {}
    generated: dict[str, int] = {}
    text = gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text(encoding="utf-8")
    for line in text.splitlines():
        row = json.loads(line)
        if row["method"] != method:
            continue
        for cat in (row["category"], OVERALL):
            generated[cat] = generated.get(cat, 0) + int(row["new_tokens"])
            counts = by_source.setdefault(cat, {})
            for source, count in (row.get("accepted_by_source") or {}).items():
                if source not in ("bonus", "prefill"):
                    counts[source] = counts.get(source, 0) + int(count)
    return by_source, generated


def source_share_table(by_source: dict[str, dict[str, int]], generated: dict[str, int]) -> str:
    """Per category: each source's share of the accepted draft tokens, and accepted drafts per 100 generated."""
    sources = sorted({s for counts in by_source.values() for s in counts})
    cats = sorted(c for c in generated if c != OVERALL) + [OVERALL]
    lines = ["| category | " + " | ".join(sources) + " | drafted tokens accepted per 100 generated |",
             "|---" + "|---:" * (len(sources) + 1) + "|"]
    for cat in cats:
        counts = by_source.get(cat, {})
        total = sum(counts.values())
        cells = [f"{100 * counts.get(s, 0) / total:.0f}%" if total else "-" for s in sources]
        name = f"**{cat}**" if cat == OVERALL else cat
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {100 * total / max(generated[cat], 1):.0f} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ document model


@dataclass
class Report:
    """The report as a list of blocks, rendered to Markdown and to HTML from the same content."""

    blocks: list[tuple[str, Any]] = field(default_factory=list)

    def heading(self, text: str, level: int = 2) -> None:
        self.blocks.append(("heading", (level, text)))

    def para(self, text: str) -> None:
        self.blocks.append(("para", text))

    def note(self, text: str) -> None:
        self.blocks.append(("note", text))

    def table(self, header: Sequence[str], rows: Sequence[Sequence[str]], right_from: int = 1) -> None:
        self.blocks.append(("table", (list(header), [list(r) for r in rows], right_from)))

    def image(self, filename: str, alt: str) -> None:
        self.blocks.append(("image", (filename, alt)))

    def markdown(self) -> str:
        out: list[str] = []
        for kind, value in self.blocks:
            if kind == "heading":
                out.append("#" * value[0] + " " + value[1])
            elif kind == "para":
                out.append(value)
            elif kind == "note":
                out.append(f"> **Note:** {value}")
            elif kind == "table":
                header, rows, right_from = value
                align = ["---" if i < right_from else "---:" for i in range(len(header))]
                out.append("\n".join("| " + " | ".join(cells) + " |" for cells in [header, align, *rows]))
            elif kind == "image":
                out.append(f"![{value[1]}]({value[0]})")
        return "\n\n".join(out) + "\n"

    def html(self, folder: Path, title: str) -> str:
        body: list[str] = []
        for kind, value in self.blocks:
            if kind == "heading":
                body.append(f"<h{value[0]}>{_inline_html(value[1])}</h{value[0]}>")
            elif kind == "para":
                body.append(f"<p>{_inline_html(value)}</p>")
            elif kind == "note":
                body.append(f'<p class="note"><b>Note:</b> {_inline_html(value)}</p>')
            elif kind == "table":
                header, rows, right_from = value
                cls = [' class="num"' if i >= right_from else "" for i in range(len(header))]
                head = "".join(f"<th{c}>{_inline_html(h)}</th>" for h, c in zip(header, cls, strict=True))
                trs = "".join("<tr>" + "".join(f"<td{c}>{_inline_html(x)}</td>" for x, c in
                                               zip(row, cls, strict=True)) + "</tr>" for row in rows)
                body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{trs}</tbody></table>")
            elif kind == "image":
                data = base64.b64encode((folder / value[0]).read_bytes()).decode("ascii")
                body.append(f'<p><img alt="{html.escape(value[1])}" src="data:image/png;base64,{data}"></p>')
        style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
                 "table{border-collapse:collapse;font-size:0.9em}th,td{border:1px solid #ccc;padding:2px 6px}"
                 "td.num,th.num{text-align:right}img{max-width:100%}.note{color:#7a4b00}"
                 "code{background:#f3f3f3}")
        return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
                f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def _inline_html(text: str) -> str:
    """Escape, then render the two Markdown inline forms the report uses: **bold** and `code`."""
    out = html.escape(text)
    out = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", out)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", out)


# ------------------------------------------------------------------------------------------- helpers


def _fmt(value: Any, pattern: str) -> str:
    if value is None:
        return "-"
    return format(value, pattern)


def categories_of(results: dict[str, Any]) -> list[str]:
    """Every category of any method, sorted (the overall group is not included)."""
    return sorted({c for e in results.get("methods", {}).values() for c in e.get("per_category", {})})


def summary_of(entry: dict[str, Any], category: str) -> dict[str, Any] | None:
    return entry if category == OVERALL else entry.get("per_category", {}).get(category)


def speedup_base(results: dict[str, Any]) -> str | None:
    methods = results.get("methods", {})
    return next((b for b in ("hf", "ar") if b in methods), None)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)


def _title(results: dict[str, Any]) -> str:
    threads = results.get("torch_threads")
    return (f"{results.get('model')} on {results.get('device')} ({results.get('dtype')}, "
            f"{threads} thread{'' if threads == 1 else 's'})")


# --------------------------------------------------------------------------------------------- plots
# Each plot function writes its PNG and returns None, or returns a note saying why there is no plot.


def plot_per_category(results: dict[str, Any], path: Path, key: str, ylabel: str, skip: Sequence[str] = (),
                      reference: float | None = 1.0) -> str | None:
    """Grouped bars: `key` per category (and overall), one bar per method that has a value."""
    methods = {n: e for n, e in results.get("methods", {}).items() if n not in skip}
    categories = [*categories_of(results), OVERALL]
    names = [n for n, e in methods.items() if any((summary_of(e, c) or {}).get(key) is not None
                                                  for c in categories)]
    if not names:
        return f"no method has `{key}` in these results"
    plt = _pyplot()
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(categories) + 2.5), 4.5))
    for i, name in enumerate(names):
        values = [(summary_of(methods[name], c) or {}).get(key) for c in categories]
        offset = (i - (len(names) - 1) / 2) * width
        bars = ax.bar([x + offset for x in range(len(categories))], [v or 0.0 for v in values], width,
                      label=name)
        ax.bar_label(bars, labels=[_fmt(v, ".2f") for v in values], fontsize=6, rotation=90, padding=2)
    if reference is not None:
        ax.axhline(reference, color="black", linewidth=1, linestyle="--")
    ax.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.12)
    ax.set_title(_title(results), fontsize=10)
    ax.legend(fontsize=8, ncol=min(len(names), 6))
    _save(fig, path)
    return None


def plot_speedup_split(results: dict[str, Any], path: Path, base: str) -> str | None:
    """Grouped bars per category (and overall): each method's speedup vs `base`, solid on every answer and hatched
    beside it on the answers that do not loop (where the results record it)."""
    key, split = f"speedup_vs_{base}", f"speedup_vs_{base}_not_looping"
    methods = {n: e for n, e in results.get("methods", {}).items() if n != base}
    categories = [*categories_of(results), OVERALL]
    names = [n for n, e in methods.items() if any((summary_of(e, c) or {}).get(key) is not None for c in categories)]
    if not names:
        return f"no method has `{key}` in these results"
    keys = [key] + ([split] if any((summary_of(methods[n], c) or {}).get(split) is not None
                                   for n in names for c in categories) else [])
    plt = _pyplot()
    bars = len(names) * len(keys)
    width = 0.8 / bars
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * bars * len(categories) + 2.5), 4.5))
    for i, name in enumerate(names):
        for j, k in enumerate(keys):
            values = [(summary_of(methods[name], c) or {}).get(k) for c in categories]
            offset = (i * len(keys) + j - (bars - 1) / 2) * width
            drawn = ax.bar([x + offset for x in range(len(categories))], [v or 0.0 for v in values], width,
                           color=f"C{i}", alpha=0.5 if j else 1.0, hatch="//" if j else None,
                           label=f"{name}, not looping" if j else name)
            ax.bar_label(drawn, labels=[_fmt(v, ".2f") for v in values], fontsize=6, rotation=90, padding=2)
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
    ax.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
    ax.set_ylabel(f"decode speedup vs {base}")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.12)
    loops = (results.get("looping") or {}).get("overall")
    ax.set_title(_title(results) + (f"\nlooping answers: {format_counts(loops)}" if loops else ""), fontsize=10)
    ax.legend(fontsize=8, ncol=min(bars, 6))
    _save(fig, path)
    return None


def plot_position_acceptance(results: dict[str, Any], path: Path) -> str | None:
    """Acceptance rate per draft depth, one line per method with per-step tree depths."""
    stats = results.get("step_stats") or {}
    series = {n: s["position_acceptance"] for n, s in stats.items() if s.get("position_acceptance")}
    if not series:
        if any(s.get("position_acceptance") is not None for s in stats.values()):
            return "no verified tree held a draft token, so there is no draft position to rate"
        return ("these results have no per-step tree depths (`step_stats[method].position_acceptance`; "
                "recorded by `rasd bench` since the report was added, for our engine's methods)")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name, rows in series.items():
        rows = [r for r in rows if r["reached"] > 0]
        ax.plot([r["depth"] for r in rows], [r["accepted"] / r["reached"] for r in rows], "o-", label=name,
                markersize=4)
    ax.set_xlabel("draft depth d (1 = first token after the last committed one)")
    ax.set_ylabel("accepted at depth d / steps whose tree reached d")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.set_title(_title(results), fontsize=10)
    ax.legend(fontsize=8)
    _save(fig, path)
    return None


def source_counts(results: dict[str, Any]) -> dict[str, dict[str, int]]:
    """{method: {source: accepted tokens}} for the methods that recorded sources."""
    stats = results.get("step_stats") or {}
    return {n: s["accepted_by_source"] for n, s in stats.items() if s.get("accepted_by_source")}


def ordered_sources(counts: dict[str, dict[str, int]]) -> list[str]:
    seen = {src for c in counts.values() for src in c}
    known = [s for s in SOURCE_ORDER if s in seen and s != "bonus"]
    other = sorted(seen - set(SOURCE_ORDER))
    return known + other + (["bonus"] if "bonus" in seen else [])


def plot_sources(results: dict[str, Any], path: Path) -> str | None:
    """Stacked bars per method: committed decode-phase tokens by source (bonus = the target's own token)."""
    counts = source_counts(results)
    if not counts:
        return ("these results have no accepted-token sources (`step_stats[method].accepted_by_source`; "
                "recorded by `rasd bench` since the report was added, for our engine's methods)")
    plt = _pyplot()
    names, sources = list(counts), ordered_sources(counts)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(names) + 3), 4.5))
    bottom = [0.0] * len(names)
    for src in sources:
        values = [float(counts[n].get(src, 0)) for n in names]
        ax.bar(names, values, 0.6, bottom=bottom, label=src, color=SOURCE_COLOURS.get(src))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("tokens committed after the first (all prompts)")
    ax.set_title(_title(results), fontsize=10)
    ax.legend(fontsize=8, bbox_to_anchor=(1.01, 1), loc="upper left")
    _save(fig, path)
    return None


def plot_cost_curve(results: dict[str, Any], curves: list[dict[str, Any]], path: Path) -> str | None:
    """Latency vs tree tokens per context bucket, with the share of steps at each chosen tree size."""
    chosen = chosen_sizes(results, curves)
    buckets = sorted({int(c["context_len"]) for c in curves} | {int(b) for h in chosen.values() for b in h})
    if not curves:
        return ("these results carry no measured cost curve (`cost_curves`; recorded by `rasd bench` since "
                "the report was added, or taken from `--cost-dir`)")
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(buckets), figsize=(5.2 * len(buckets), 4.3), squeeze=False)
    for ax, bucket in zip(axes[0], buckets, strict=True):
        curve = next((c for c in curves if int(c["context_len"]) == bucket), None)
        if curve is not None:
            ax.plot(curve["sizes"], [1000 * t for t in curve["latency_s"]], "k-o", markersize=4,
                    label="measured latency")
        ax.set_xscale("log", base=2)
        ticks = sorted({int(s) for c in curves for s in c["sizes"]})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("tree tokens per forward (root included)")
        ax.set_ylabel("latency (ms)")
        ax.set_title(f"context bucket {bucket}", fontsize=10)
        ax.grid(alpha=0.3)
        if not chosen:
            ax.legend(fontsize=8, loc="upper left")
            continue
        twin = ax.twinx()
        for i, (name, hists) in enumerate(chosen.items()):
            hist = {int(k): v for k, v in hists.get(str(bucket), {}).items()}
            total = sum(hist.values())
            if not total:
                continue
            xs = sorted(hist)
            shift = 2 ** ((i - (len(chosen) - 1) / 2) * 0.08)     # side by side on the log axis
            twin.vlines([x * shift for x in xs], 0, [hist[x] / total for x in xs], colors=f"C{i}",
                        linewidth=3, alpha=0.7, label=f"{name}: chosen ({total} steps)")
        twin.set_ylim(0, 1.05)
        twin.set_ylabel("share of steps at this size")
        lines, labels = ax.get_legend_handles_labels()
        lines2, labels2 = twin.get_legend_handles_labels()
        ax.legend(lines + lines2, labels + labels2, fontsize=7, loc="upper left")
    fig.suptitle(_title(results), fontsize=10)
    _save(fig, path)
    return None


# --------------------------------------------------------------------------------------- cost curves


def chosen_sizes(results: dict[str, Any], curves: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{method: {bucket: {tree tokens: steps}}}, for the methods whose sizer used a cost curve.

    Curves recorded with the run name the methods that used them (`ar` and fixed sizers use none); without
    that information every method with per-step tree sizes is shown.
    """
    stats = results.get("step_stats") or {}
    chosen = {n: s["tree_tokens_by_bucket"] for n, s in stats.items() if s.get("tree_tokens_by_bucket")}
    users = {m for c in curves for m in c.get("methods") or ()}
    return {n: h for n, h in chosen.items() if n in users} if users else chosen


def curves_from_cache(results: dict[str, Any], cost_dir: str | Path) -> list[dict[str, Any]]:
    """Cached cost curves that match the run's model name, device, dtype and threads (newest version).

    The file names follow `rasd.decoding.sizing.cost.curve_key`: `<name>-<config hash>-<device>-<dtype>-t<threads>
    -ctx<bucket>-v<version>.json`, the name made file-safe and cut to its last 40 characters.
    """
    folder = Path(cost_dir).expanduser()
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(results.get("model")))[-40:]
    device = str(results.get("device")).replace(":", "")
    pattern = re.compile(re.escape(name) + r"-[0-9a-f]+-" + re.escape(device) + "-"
                         + re.escape(str(results.get("dtype"))) + f"-t{results.get('torch_threads')}"
                         + r"-ctx(\d+)-v(\d+)\.json$")
    best: dict[int, tuple[int, float, Path]] = {}
    for path in folder.glob("*.json") if folder.is_dir() else []:
        match = pattern.fullmatch(path.name)
        if not match:
            continue
        bucket, version = int(match.group(1)), int(match.group(2))
        rank = (version, path.stat().st_mtime, path)
        if bucket not in best or rank[:2] > best[bucket][:2]:
            best[bucket] = rank
    curves = []
    for bucket in sorted(best):
        try:
            data = json.loads(best[bucket][2].read_text())
            curves.append({"key": data["key"], "context_len": int(data["context_len"]),
                           "sizes": list(data["sizes"]), "latency_s": list(data["latency_s"]),
                           "methods": [], "from_cache": str(best[bucket][2])})
        except (ValueError, KeyError, TypeError):
            continue
    return curves


# ------------------------------------------------------------------------------------------ sections


def _metadata(report: Report, results: dict[str, Any], source: str | None) -> None:
    rows = [[label, "`" + str(results[key]) + "`" if key == "dataset" else str(results[key])]
            for key, label in META_FIELDS if results.get(key) is not None]
    if results.get("date") is None:
        rows.append(["date", "not recorded in these results"])
    rows.append(["methods", ", ".join(results.get("methods", {}))])
    if source:
        rows.append(["results file", f"`{source}`"])
    report.heading("Run", 2)
    report.table(["field", "value"], rows, right_from=2)


def summary_rows(results: dict[str, Any]) -> list[list[str]]:
    """One row per (category, method), the overall rows last: the numbers of results.json, rounded."""
    rows = []
    for cat in [*categories_of(results), OVERALL]:
        for name, entry in results.get("methods", {}).items():
            s = summary_of(entry, cat)
            if s is None:
                continue
            label = f"**{cat}**" if cat == OVERALL else cat
            rows.append([label, name, *(_fmt(s.get(key), pattern) for key, _, pattern in TABLE_COLUMNS)])
    return rows


def _summary(report: Report, results: dict[str, Any]) -> None:
    report.heading("Summary", 2)
    report.para("Decode-phase tokens per second (prefill excluded) and ratios of sums over each group's prompts; "
                "`median vs hf` is the median of per-prompt ratios; `mean acc.` is tokens committed per target "
                "forward (bonus token included, plain decoding = 1.00); `match` is the share of prompts whose "
                f"tokens equal `{results.get('greedy_reference') or '-'}` token for token; `(not looping)` is the "
                "same speedup on the prompts whose reference answer does not loop.")
    report.table(["category", "method", *(title for _, title, _ in TABLE_COLUMNS)], summary_rows(results),
                 right_from=2)
    if results.get("looping"):
        report.para(looping_line(results["looping"]) + ".")
    else:
        report.note("these results do not record which answers loop (written before `looping` existed).")
    if results.get("llamacpp_first_difference"):
        from rasd.eval.llamacpp import format_first_differences

        report.para(format_first_differences(results["llamacpp_first_difference"], results["greedy_reference"])
                    + " (llama.cpp runs its own kernels, the activations of its products quantized to 8 bits: "
                    "its greedy output can leave the reference's where two logits are close).")


def _quality(report: Report, results: dict[str, Any]) -> None:
    """Answer quality per category on the reference's answers (LongBench rows), with its notes."""
    section = results.get("quality")
    if not section:
        return
    from rasd.eval.quality import HEADER, notes, table_rows

    report.heading("Answer quality", 2)
    report.para(f"`{section['reference']}`'s answers scored with LongBench v1's metric of each row's dataset (the "
                "best over the gold answers; mean per category over the scored rows); evidence recall: the share "
                "of rows whose retrieved chunks contain a gold answer (normalized; in brackets the rows with "
                "retrieved chunks).")
    report.table(list(HEADER), [[f"**{r[0]}**" if r[0] == OVERALL else r[0], *r[1:]] for r in table_rows(section)])
    for line in notes(section):
        report.note(line + ".")


def _position_table(report: Report, results: dict[str, Any], max_depth: int = 8) -> None:
    series = {n: s["position_acceptance"] for n, s in (results.get("step_stats") or {}).items()
              if s.get("position_acceptance")}
    if not series:
        return
    depth = min(max_depth, max(len(rows) for rows in series.values()))
    rows = []
    for name, data in series.items():
        by_depth = {r["depth"]: r for r in data}
        cells = []
        for d in range(1, depth + 1):
            r = by_depth.get(d)
            cells.append(f"{r['accepted'] / r['reached']:.2f} ({r['reached']})" if r and r["reached"] else "-")
        rows.append([name, *cells])
    report.para("Acceptance rate at each draft depth (in brackets: steps whose tree reached that depth):")
    report.table(["method", *(f"d={d}" for d in range(1, depth + 1))], rows)


def _source_table(report: Report, results: dict[str, Any]) -> None:
    counts = source_counts(results)
    if not counts:
        return
    sources = ordered_sources(counts)
    rows = []
    for name, c in counts.items():
        total = sum(c.values()) or 1
        rows.append([name, *(f"{c.get(s, 0)} ({100 * c.get(s, 0) / total:.0f}%)" for s in sources),
                     str(sum(c.values()))])
    report.table(["method", *sources, "total"], rows)


def _cost_section(report: Report, results: dict[str, Any], curves: list[dict[str, Any]]) -> None:
    if curves and any(c.get("from_cache") for c in curves):
        report.note("these results do not carry their cost curves; the curves shown are the local cache's "
                    "curves for the same model name, device, dtype and thread count (" +
                    ", ".join(f"`{Path(c['from_cache']).name}`" for c in curves) +
                    "), not necessarily the ones this run measured.")
    if curves:
        sizes = sorted({s for c in curves for s in c["sizes"]})
        rows = [[str(c["context_len"]), *(_fmt(_latency_at(c, s), ".1f") for s in sizes)] for c in curves]
        report.para("Measured verification latency (ms) by tree tokens, per context bucket:")
        report.table(["context bucket", *(str(s) for s in sizes)], rows)
    chosen = chosen_sizes(results, curves)
    if not chosen:
        report.note("no per-step tree sizes in these results, so the sizes the cost model chose are not shown.")
        return
    rows = []
    for name, hists in chosen.items():
        merged: dict[int, int] = {}
        for hist in hists.values():
            for k, v in hist.items():
                merged[int(k)] = merged.get(int(k), 0) + v
        steps = sum(merged.values())
        spec = sum(v for k, v in merged.items() if k > 1)
        mean = sum(k * v for k, v in merged.items()) / steps if steps else 0.0
        rows.append([name, str(steps), f"{100 * spec / steps:.0f}%" if steps else "-", f"{mean:.2f}",
                     str(max(merged) if merged else "-")])
    report.para("Tree sizes chosen per step (tokens per verification forward, root included; 1 = no speculation):")
    report.table(["method", "steps", "steps with a draft", "mean tree tokens", "largest"], rows)


def _latency_at(curve: dict[str, Any], size: int) -> float | None:
    if size not in curve["sizes"]:
        return None
    return 1000 * curve["latency_s"][curve["sizes"].index(size)]


# ---------------------------------------------------------------------------------------------- main


def write_report(results: dict[str, Any], out_dir: str | Path, source: str | None = None,
                 cost_dir: str | Path | None = None, html_file: bool = True) -> Path:
    """Write report.md (+ report.html) and the PNG plots into `out_dir`; return report.md's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    curves = list(results.get("cost_curves") or [])
    if not curves and cost_dir is not None:
        curves = curves_from_cache(results, cost_dir)
    base = speedup_base(results)
    report = Report()
    title = f"Benchmark report: {results.get('model')} on {results.get('device')}"
    report.heading(title, 1)
    _metadata(report, results, source)
    _summary(report, results)
    _quality(report, results)

    def section(heading: str, filename: str, text: str, draw: Callable[[Path], str | None],
                after: Callable[[], None] | None = None) -> None:
        report.heading(heading, 2)
        report.para(text)
        path = out / filename
        note = draw(path)
        if note is None:
            report.image(filename, heading)
        else:
            path.unlink(missing_ok=True)       # never leave a stale plot from an earlier report
            report.note(f"no plot: {note}.")
        if after is not None:
            after()

    if base is None:
        report.heading("Speedup", 2)
        report.note("no plot: neither `hf` nor `ar` was run, so there is no baseline to compare with.")
    else:
        section(f"Speedup vs {base}", "speedup.png",
                f"Decode tokens per second over `{base}`'s on the same prompts (dashed line: 1x); hatched: on the "
                "prompts whose reference answer does not loop.",
                lambda p: plot_speedup_split(results, p, base))
    section("Mean accepted tokens", "accepted_tokens.png",
            "Tokens committed per target forward, bonus token included (plain decoding = 1).",
            lambda p: plot_per_category(results, p, "mean_accepted_tokens", "tokens per target forward"))
    section("Acceptance rate per draft position", "position_acceptance.png",
            "Of the verification steps whose tree reached draft depth d, the share that accepted the token "
            "at depth d (acceptance stops at the first rejected depth, so later depths need every earlier "
            "one accepted).",
            lambda p: plot_position_acceptance(results, p), lambda: _position_table(report, results))
    section("Accepted tokens by source", "accepted_by_source.png",
            "Decode-phase tokens by where the accepted draft came from; `bonus` is the target's own token "
            "after the accepted draft (every step has one).",
            lambda p: plot_sources(results, p), lambda: _source_table(report, results))
    section("Cost curve and chosen tree sizes", "cost_curve.png",
            "The target's measured verification latency against tree tokens per context bucket (black), and "
            "per method the share of steps at each tree size the cost model chose (bars, right axis).",
            lambda p: plot_cost_curve(results, curves, p), lambda: _cost_section(report, results, curves))

    md_path = out / "report.md"
    md_path.write_text(report.markdown(), encoding="utf-8")
    if html_file:
        (out / "report.html").write_text(report.html(out, title), encoding="utf-8")
    return md_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `rasd report` and `python -m rasd.eval.report` (one list for both)."""
    parser.add_argument("results", help="results.json written by `rasd bench --out` (with --sources: the "
                                        "answers file written by `rasd bench --answers`)")
    parser.add_argument("--out", default=None, help="folder for report.md, report.html and the plots")
    parser.add_argument("--cost-dir", default=None,
                        help="take cost curves from this cache (e.g. ~/.cache/rasd/cost) when the results lack them")
    parser.add_argument("--no-html", action="store_true", help="write report.md and the plots only")
    tables = parser.add_mutually_exclusive_group()
    tables.add_argument("--table", action="store_true",
                        help="print the speed table per category (Markdown) instead of writing a report")
    tables.add_argument("--sources", action="store_true",
                        help="RESULTS is an answers .jsonl[.gz]: print accepted draft tokens by source per category")
    parser.add_argument("--focus", action="append", default=None, metavar="METHOD",
                        help="with --table: a method to give speedup, acceptance and match columns (repeatable; "
                             "default pld)")
    parser.add_argument("--baseline", default="hf", choices=("hf", "ar"), help="with --table: the speedups' base")
    parser.add_argument("--method", default="rasd", help="with --sources: the method whose answers are counted")


DESCRIPTION = "Write a benchmark report from a `rasd bench` results.json, or print its tables as Markdown."


def register(subparsers: Any) -> argparse.ArgumentParser:
    """`rasd report`."""
    p = subparsers.add_parser("report", help="rebuild a benchmark report, or print its tables as Markdown",
                              description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m rasd.eval.report results.json --out DIR`, the same as `rasd report`."""
    parser = argparse.ArgumentParser(prog="python -m rasd.eval.report", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Rebuild a report from saved results; `--table` and `--sources` print the Markdown tables
    docs/benchmarks.md quotes instead."""
    if args.sources:
        try:
            print(source_share_table(*answers_by_source(Path(args.results), args.method)))
        except (OSError, ValueError, KeyError) as exc:
            print(f"report: error: cannot read {args.results} as a `rasd bench --answers` file: {exc}",
                  file=sys.stderr)
            return 2
        return 0
    if not args.table and args.out is None:
        print("report: error: --out is required to write a report (or print a table: --table, --sources)",
              file=sys.stderr)
        return 2
    try:
        results = json.loads(Path(args.results).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        print(f"report: error: cannot read {args.results}: {exc}", file=sys.stderr)
        return 2
    if not isinstance(results, dict) or not isinstance(results.get("methods"), dict):
        print(f"report: error: {args.results} is not a `rasd bench` results file (no `methods`)", file=sys.stderr)
        return 2
    if args.table:
        focus = args.focus or ["pld"]
        unknown = [m for m in focus if m not in results["methods"]]
        if unknown:
            print(f"report: error: {', '.join(unknown)} not in {args.results} (it has "
                  f"{', '.join(results['methods'])})", file=sys.stderr)
            return 2
        print(speed_table(results, focus, args.baseline))
        return 0
    path = write_report(results, args.out, source=args.results, cost_dir=args.cost_dir,
                        html_file=not args.no_html)
    print(f"report: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
