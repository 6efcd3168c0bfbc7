"""Results of ``gmc eval`` as files and tables: the JSON of every entry ``evaluate_refs`` returns and
the side-by-side comparison, in the terminal and as markdown next to the JSON.

Kept apart from ``gmc.runtime.evaluate`` so that measuring a model and presenting the numbers change
independently; the table always carries the protocol lines, so a number is never shown without how
it was measured.
"""
from __future__ import annotations

import json
from pathlib import Path

from gmc.config import __version__
from gmc.errors import GmcError


def check_results_path(path: str | Path, overwrite: bool = False, inputs=()) -> Path:
    """``gmc eval -o``: the results JSON and the ``.md`` next to it may replace only a results pair gmc
    wrote, with ``overwrite``, and neither may be an input (``gmc.formats.outputs``)."""
    from gmc.formats.outputs import check_output

    path = check_output(path, "eval", overwrite=overwrite, inputs=inputs)
    markdown = path.with_suffix(".md")
    if path.suffix == ".md":
        raise GmcError(f"-o {path}: name the results .json file; the markdown table goes next to it as .md")
    if (markdown.exists() or markdown.is_symlink()) and not path.exists():
        raise GmcError(f"-o {path}: {markdown} already exists and gmc did not write it with {path.name}; "
                       f"choose another path or move it away")
    return path


def write_results(path: str | Path, entries: list[dict], overwrite: bool = False) -> Path:
    """Atomically write the results JSON, and the comparison table as markdown next to it."""
    from gmc.formats.atomic import atomic_write_bytes

    path = check_results_path(path, overwrite)
    document = {"gmc_version": __version__, "models": entries}
    atomic_write_bytes(path, (json.dumps(document, indent=2) + "\n").encode())
    atomic_write_bytes(path.with_suffix(".md"), results_markdown(entries).encode())
    return path


def comparison_rows(entries: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the side-by-side table; the first entry is the baseline of the deltas."""
    tasks = list(dict.fromkeys(task for entry in entries for task in entry["tasks"]))
    header = ["model", "sparsity"]
    if any(entry["perplexity"] is not None for entry in entries):
        header.append("ppl")
    header += [f"{task} {_task_metric(entries, task)}" for task in tasks]
    if tasks:
        header.append("mean")
    base = entries[0]
    rows = []
    for entry in entries:
        row = [entry["ref"], f"{_sparsity(entry):.1%}"]
        if "ppl" in header:
            row.append(_with_delta(entry["perplexity"], base["perplexity"], "{:.2f}", entry is base))
        for task in tasks:
            row.append(_with_delta(_task_value(entry, task), _task_value(base, task), "{:.3f}", entry is base))
        if tasks:
            row.append(_with_delta(entry["zero_shot_mean"], base["zero_shot_mean"], "{:.3f}", entry is base))
        rows.append(row)
    return header, rows


def _task_metric(entries, task) -> str:
    return next(entry["tasks"][task]["metric"] for entry in entries if task in entry["tasks"])


def _task_value(entry, task):
    return entry["tasks"][task]["value"] if task in entry["tasks"] else None


def _sparsity(entry: dict) -> float:
    info = entry.get("model_info") or {}
    value = info.get("global_sparsity")
    return value if value is not None else info.get("zero_fraction") or 0.0


def _with_delta(value, base, fmt: str, is_base: bool) -> str:
    if value is None:
        return "-"
    text = fmt.format(value)
    if is_base or base is None:
        return text
    return f"{text} ({'+' if value >= base else '-'}{fmt.format(abs(value - base))})"


def protocol_lines(entries: list[dict]) -> list[str]:
    """One line per distinct protocol, for the table's caption."""
    lines = []
    for entry in entries:
        ppl, shot = entry["protocol"]["perplexity"], entry["protocol"]["zero_shot"]
        if ppl:
            stride = "non-overlapping windows" if ppl["stride"] is None else f"stride {ppl['stride']}"
            split = f" {ppl['split']}" if ppl["split"] else ""
            lines.append(
                f"perplexity: {ppl['dataset']}{split}, documents joined with \\n\\n, seq_len {ppl['seq_len']}, "
                f"{stride}, {ppl['windows']} windows, {ppl['tokens_scored']} tokens scored"
            )
        if shot:
            limit = f", limit {shot['limit']}" if shot["limit"] is not None else ""
            lines.append(f"zero-shot: {shot['harness']}, 0-shot{limit}")
        lines.append(f"dtype: {entry['protocol']['dtype']}")
    return list(dict.fromkeys(lines))


def results_markdown(entries: list[dict]) -> str:
    """The comparison table with its protocol lines, as written next to the results JSON."""
    header, rows = comparison_rows(entries)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += [""] + [f"- {line}" for line in protocol_lines(entries)]
    lines.append(f"- first row is the baseline of the deltas in parentheses; gmc {__version__}")
    return "\n".join(lines) + "\n"
