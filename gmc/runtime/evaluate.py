"""Evaluation with the protocol stated next to every number (docs/design.md section 6).

Perplexity: the documents of a text source joined with ``"\\n\\n"``, tokenised once, cut into
non-overlapping windows of ``seq_len`` tokens (the tail shorter than a window is dropped); every
token of a window but the first is scored; perplexity is exp of the mean token NLL. With a
``stride`` the windows slide instead: each has ``seq_len`` tokens, ends ``stride`` tokens after the
previous one (the last ends at the last token) and scores only tokens no earlier window scored, so
every token after the first is scored once, with at least ``seq_len - stride`` tokens of context.

Zero-shot: lm-evaluation-harness on the model object (``HFLM(pretrained=model)``), each task
reported with the paper's metric (``PAPER_METRICS``) or, for other tasks, the first metric its
YAML defines; ``zero_shot_mean`` is the mean over the requested tasks.

What is evaluated is a model reference (``gmc.runtime.refs``): a model, a masks artifact on its
base model, or a lowered directory; artifacts that share a base model reuse one loaded copy.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from gmc.config import (
    __version__,
    base_model_option,
    check_at_least,
    check_seq_len,
    device_option,
    dtype_option,
    option,
    output_option,
    overwrite_option,
    trust_remote_code_option,
)
from gmc.errors import GmcError
from gmc.inputs.calib import BUNDLED, HUB, SOURCES_HELP, hub_rows, load_texts
from gmc.inputs.model import device_and_dtype
from gmc.runtime.refs import PreparedModel, prepared_models, resolve_ref

PAPER_METRICS = {
    "arc_challenge": "acc_norm",
    "arc_easy": "acc_norm",
    "boolq": "acc",
    "hellaswag": "acc_norm",
    "piqa": "acc_norm",
    "winogrande": "acc",
}
PAPER_TASKS = tuple(PAPER_METRICS)
TASKS_DIR = Path(__file__).parents[1] / "tasks"  # gmc's own lm-eval tasks, always on the include path
DOCUMENT_JOIN = "\n\n"


@dataclass
class PerplexityConfig:
    source: str = option("wikitext2", f"Perplexity text: {SOURCES_HELP} [default: wikitext2 unless only --tasks is "
                                      f"given].", flag="--ppl", metavar="SOURCE", optional=True)
    # hub sources only; local and bundled texts have one split
    split: str = option("test", "Split of a hub dataset.")
    seq_len: int = option(2048, "Tokens per perplexity window.")
    # None: non-overlapping windows (the paper protocol)
    stride: int | None = option(None, "Slide windows by this many tokens, scoring only new ones [default: "
                                      "non-overlapping].")
    batch_size: int = option(1, "Perplexity windows / lm-eval requests per forward pass.")

    def __post_init__(self):
        check_seq_len(self.seq_len)
        check_at_least("--batch-size", self.batch_size, minimum=1)
        if self.stride is not None:
            check_at_least("--stride", self.stride, minimum=1)
            if self.stride > self.seq_len:
                raise GmcError(f"bad --stride {self.stride}: must be at most --seq-len {self.seq_len}")
        _check_source(self.source, self.split)


@dataclass
class ZeroShotConfig:
    tasks: tuple[str, ...] = option(PAPER_TASKS, f"lm-eval tasks, comma-separated; 'paper' = the paper's six "
                                                 f"({', '.join(PAPER_TASKS)}).", metavar="A,B", optional=True)
    # lm-eval: int = docs per task, float < 1 = fraction
    limit: int | float | None = option(None, "Documents per task (an integer) or a fraction < 1; for quick checks, "
                                             "not for reporting.", metavar="N")
    batch_size: int = 1
    include_path: str | None = option(None, "Directory of local lm-eval task YAMLs.")

    def __post_init__(self):
        if isinstance(self.tasks, str):  # the command line's "a,b,c" or "paper"
            self.tasks = (PAPER_TASKS if self.tasks.strip() == "paper"
                          else tuple(t.strip() for t in self.tasks.split(",")))
        self.tasks = tuple(self.tasks)
        if not self.tasks or any(not task or "," in task for task in self.tasks):
            raise GmcError(f"bad --tasks {','.join(self.tasks)!r}: expected comma-separated task names")
        check_at_least("--batch-size", self.batch_size, minimum=1)
        self.limit = _normalise_limit(self.limit)
        if self.include_path is not None and not Path(self.include_path).expanduser().is_dir():
            raise GmcError(f"bad --include-path {self.include_path}: not a directory of task YAMLs")


@dataclass
class EvalConfig:
    perplexity: PerplexityConfig | None = field(default_factory=PerplexityConfig)
    zero_shot: ZeroShotConfig | None = None
    dtype: str = dtype_option()
    device: str = device_option()
    model: str | None = base_model_option()
    trust_remote_code: bool = trust_remote_code_option()
    # the results JSON (gmc.runtime.results writes it and a markdown table beside it)
    output: str | None = output_option("Results JSON (a markdown table is written next to it, same name .md).")
    overwrite: bool = overwrite_option("results JSON and .md at -o")

    def __post_init__(self):
        if self.perplexity is None and self.zero_shot is None:
            raise GmcError("nothing to evaluate: give a perplexity source (--ppl) and/or --tasks")
        self.device, self.dtype = device_and_dtype(self.device, self.dtype)


@dataclass
class PerplexityResult:
    perplexity: float
    nll: float  # mean token negative log-likelihood (nats)
    protocol: dict


def _normalise_limit(limit):
    if limit is None:
        return None
    if isinstance(limit, str):  # the command line's "200" or "0.1"
        try:
            limit = float(limit) if any(c in limit for c in ".eE") else int(limit)
        except ValueError:
            raise GmcError(f"bad --limit {limit!r}: a positive count of documents or a fraction in (0, 1)") from None
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0:
        raise GmcError(f"bad --limit {limit!r}: a positive count of documents or a fraction in (0, 1)")
    if isinstance(limit, float) and limit >= 1:
        if not limit.is_integer():
            raise GmcError(f"bad --limit {limit!r}: a positive count of documents or a fraction in (0, 1)")
        return int(limit)
    return limit


def _check_source(source: str, split: str) -> None:
    """Fail before any model is loaded if the text source cannot exist."""
    if source in HUB:
        if split not in HUB[source].splits:
            raise GmcError(f"{source} has no split {split!r}: expected one of {', '.join(HUB[source].splits)}")
    elif source not in BUNDLED and not Path(source).expanduser().is_file():
        if Path(source).suffix in (".txt", ".jsonl", ".json") or "/" in source:
            raise GmcError(f"text file not found: {source}")
        raise GmcError(f"unknown text source {source!r}: expected {SOURCES_HELP}")


# --------------------------------------------------------------------------- perplexity


def load_document(source: str, split: str = "test") -> tuple[str, str]:
    """The evaluation text of ``source``: its documents joined with ``"\\n\\n"``, and a description.

    A hub dataset keeps every row of the split, empty ones included, exactly as the GPTQ /
    SparseGPT / Wanda evaluation scripts join WikiText-2; a local or bundled text joins its
    non-empty lines (paragraphs).
    """
    if source in HUB:
        rows, description = hub_rows(source, split, instead="or 'bundled-heldout'")
        description += ", all rows"
    else:
        rows, description = load_texts(source, split)
    return DOCUMENT_JOIN.join(rows), description


def perplexity_windows(n_tokens: int, seq_len: int, stride: int | None = None) -> list[tuple[int, int]]:
    """``(begin, first_scored)`` per window; a window is tokens ``[begin, begin + seq_len)`` and scores
    positions ``[first_scored, begin + seq_len)`` (see the module docstring for the two modes)."""
    if n_tokens < seq_len:
        return []
    if stride is None:
        return [(begin, begin + 1) for begin in range(0, n_tokens - seq_len + 1, seq_len)]
    windows, scored_until, end = [], 0, seq_len
    while True:
        end = min(end, n_tokens)
        begin = end - seq_len
        windows.append((begin, max(scored_until, begin + 1)))
        scored_until = end
        if end == n_tokens:
            return windows
        end += stride


def perplexity(
    model: torch.nn.Module,
    tokenizer,
    source: str = PerplexityConfig.source,
    seq_len: int = PerplexityConfig.seq_len,
    stride: int | None = PerplexityConfig.stride,
    split: str = PerplexityConfig.split,
    batch_size: int = PerplexityConfig.batch_size,
    progress: bool = True,
) -> PerplexityResult:
    """Perplexity of ``model`` on ``source`` under the protocol of the module docstring."""
    config = PerplexityConfig(source, split, seq_len, stride, batch_size)
    return perplexity_of_document(model, tokenizer, load_document(config.source, config.split), config, progress)


def perplexity_of_document(
    model: torch.nn.Module, tokenizer, document: tuple[str, str], config: PerplexityConfig, progress: bool = True
) -> PerplexityResult:
    """``perplexity`` on an already loaded ``(text, description)`` from ``load_document``."""
    text, description = document
    ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.int64)  # [N]
    windows = perplexity_windows(len(ids), config.seq_len, config.stride)
    if not windows:
        raise GmcError(
            f"text too short for perplexity: {config.source} has {len(ids)} tokens, one window needs "
            f"--seq-len {config.seq_len}; use a smaller --seq-len or a longer text"
        )
    nll_sum, scored = _score_windows(model, ids, windows, config, progress)
    nll = nll_sum / scored
    protocol = {
        "dataset": config.source,
        "description": description,
        "split": config.split if config.source in HUB else None,
        "join": DOCUMENT_JOIN,
        "seq_len": config.seq_len,
        "stride": config.stride,
        "tokens": len(ids),
        "tokens_scored": scored,
        "windows": len(windows),
    }
    return PerplexityResult(perplexity=math.exp(nll), nll=nll, protocol=protocol)


def _score_windows(model, ids, windows, config: PerplexityConfig, progress: bool) -> tuple[float, int]:
    """Sum of token NLLs (float64) and the number of scored tokens over all windows."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    total, scored = 0.0, 0
    disable = None if progress else True  # None: tqdm shows the bar only on a terminal
    bar = tqdm(total=len(windows), desc="perplexity", unit="window", disable=disable)
    for start in range(0, len(windows), config.batch_size):
        batch = windows[start: start + config.batch_size]
        nll, count = _batch_nll(model, ids, batch, config.seq_len, device)
        total += nll
        scored += count
        bar.update(len(batch))
    bar.close()
    return total, scored


@torch.no_grad()
def _batch_nll(model, ids, batch, seq_len: int, device) -> tuple[float, int]:
    inputs = torch.stack([ids[begin: begin + seq_len] for begin, _ in batch]).to(device)  # [B, L]
    logits = model(input_ids=inputs, use_cache=False).logits  # [B, L, V]
    nll = F.cross_entropy(  # [B, L-1]; column j is the NLL of position j + 1
        logits[:, :-1].float().transpose(1, 2), inputs[:, 1:], reduction="none"
    )
    first = torch.tensor([first - begin for begin, first in batch], device=device)  # [B], >= 1
    keep = torch.arange(1, seq_len, device=device)[None, :] >= first[:, None]  # [B, L-1]
    return float(nll[keep].double().sum()), int(keep.sum())


# --------------------------------------------------------------------------- zero-shot


def zero_shot(
    model: torch.nn.Module,
    tokenizer,
    tasks=ZeroShotConfig.tasks,
    limit: int | float | None = ZeroShotConfig.limit,
    batch_size: int = ZeroShotConfig.batch_size,
    include_path: str | None = ZeroShotConfig.include_path,
) -> dict:
    """lm-eval zero-shot scores: ``{"tasks": {task: {metric, value, stderr, samples}},
    "zero_shot_mean": float, "protocol": {...}}``."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    config = ZeroShotConfig(tuple(tasks), limit, batch_size, include_path)
    manager = _task_manager(config.tasks, config.include_path)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=config.batch_size)
    output = lm_eval.simple_evaluate(
        model=lm, tasks=list(config.tasks), task_manager=manager, limit=config.limit,
        log_samples=False, bootstrap_iters=1000,
    )
    scores = {task: _task_score(output, task) for task in config.tasks}
    protocol = {
        "harness": f"lm-eval {lm_eval.__version__}",
        "num_fewshot": 0,
        "limit": config.limit,
        "batch_size": config.batch_size,
        "include_path": config.include_path,
        "metrics": "paper table (docs/design.md section 6); other tasks: first metric of their YAML",
    }
    mean = sum(score["value"] for score in scores.values()) / len(scores)
    return {"tasks": scores, "zero_shot_mean": mean, "protocol": protocol}


def _task_manager(tasks: tuple[str, ...], include_path: str | None):
    """A TaskManager that knows ``tasks``; indexing only local YAMLs when they suffice, since
    indexing lm-eval's own few thousand task files takes seconds."""
    from lm_eval.tasks import TaskManager

    paths = [str(TASKS_DIR)] + ([str(Path(include_path).expanduser())] if include_path else [])
    manager = TaskManager(include_path=paths, include_defaults=False)
    if not set(tasks) <= set(manager.all_tasks):
        manager = TaskManager(include_path=paths)
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        raise GmcError(
            f"unknown task {unknown[0]!r}: not an lm-eval task, not in gmc/tasks"
            + (f" nor in {include_path}" if include_path else "; pass --include-path for local YAMLs")
        )
    return manager


def _task_score(output: dict, task: str) -> dict:
    values = output["results"].get(task, {})
    metric = PAPER_METRICS.get(task) or _defined_metric(output, task)
    key = next((k for k in values if k.split(",")[0] == metric), None)
    if key is None:
        raise GmcError(f"lm-eval returned no {metric!r} for task {task!r} (it returned {sorted(values)})")
    stderr = values.get(key.replace(metric, f"{metric}_stderr", 1))
    samples = output.get("n-samples", {}).get(task, {}).get("effective")
    return {
        "metric": metric,
        "value": float(values[key]),
        "stderr": stderr if isinstance(stderr, float) else None,
        "samples": samples,
    }


def _defined_metric(output: dict, task: str) -> str:
    """The first metric of the task's YAML ``metric_list`` (else the first it reported)."""
    metric_list = output.get("configs", {}).get(task, {}).get("metric_list") or []
    if metric_list:
        return metric_list[0]["metric"]
    higher = output.get("higher_is_better", {}).get(task) or {}
    if higher:
        return next(iter(higher))
    raise GmcError(f"task {task!r} defines no metric")


# --------------------------------------------------------------------------- orchestration


def evaluate_refs(refs: list[str], config: EvalConfig) -> list[dict]:
    """One result entry per ref (see ``evaluate_loaded``), base models shared between refs."""
    if not refs:
        raise GmcError("no model to evaluate: give at least one model or artifact")
    for ref in refs:
        resolve_ref(ref, config.model)  # fail on a bad ref before reading a corpus
    ppl = config.perplexity
    document = None if ppl is None else load_document(ppl.source, ppl.split)  # before any model loads
    models = prepared_models(list(refs), config.dtype, config.device, config.model, config.trust_remote_code)
    return [evaluate_loaded(prepared, config, document) for prepared in models]


def evaluate_loaded(prepared: PreparedModel, config: EvalConfig, document: tuple[str, str] | None = None) -> dict:
    """The result entry of one model: numbers plus everything needed to reproduce them.
    ``document``: the perplexity text from ``load_document``, if already loaded."""
    started = time.perf_counter()
    entry = {
        "ref": prepared.target.ref,
        "kind": prepared.target.kind,
        "gmc_version": __version__,
        "model_fingerprint": prepared.fingerprint,
        "model_info": prepared.info,
        "perplexity": None,
        "tasks": {},
        "zero_shot_mean": None,
        "protocol": {"dtype": config.dtype, "device": config.device, "perplexity": None, "zero_shot": None},
    }
    if config.perplexity is not None:
        ppl = config.perplexity
        document = document or load_document(ppl.source, ppl.split)
        result = perplexity_of_document(prepared.model, prepared.tokenizer, document, ppl)
        entry["perplexity"] = result.perplexity
        entry["protocol"]["perplexity"] = result.protocol
    if config.zero_shot is not None:
        shot = config.zero_shot
        scores = zero_shot(prepared.model, prepared.tokenizer, shot.tasks, shot.limit, shot.batch_size,
                           shot.include_path)
        entry["tasks"] = scores["tasks"]
        entry["zero_shot_mean"] = scores["zero_shot_mean"]
        entry["protocol"]["zero_shot"] = scores["protocol"]
    entry["seconds"] = round(time.perf_counter() - started, 1)
    return entry
