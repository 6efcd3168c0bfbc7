"""``gmc bench``: prompt-processing and token-generation speed of model refs, after llama.cpp's ``llama-bench``.

For each ref and each thread count, two tests on random token ids (seeded), greedy::

    pp<P>  one prefill of P tokens into an empty cache              t/s = P / seconds of that step
    tg<N>  a 1-token prompt, then N decode steps of one token each  t/s = N / seconds of the N steps

Each test runs ``--warmup`` untimed times per ref, then ``-r`` timed repetitions interleaved across
refs (repetition 1 of every ref, then repetition 2, ...), so a drift of the host (clock boost, a
neighbour's job) spreads over every ref instead of landing on one; a row is the mean ± sample
standard deviation of its repetitions' t/s. The timing is ``gmc.runtime.generate.generate``'s (wall
clock around each step call, CUDA synchronised, token choice outside) over the steps ``gmc
generate`` runs (``gmc.runtime.steps``): eager dense, masks folded into the base, lowered, or a
lowered directory's compiled packages. tg starts from one token as llama-bench's does (its BOS), so
the cache grows from 1 to N + 1 positions while it is timed.

An ONNX model directory (``gmc lower --backend onnx``, or onnxruntime-genai's own model builder) runs
in onnxruntime-genai, as it is deployed: its generator keeps the KV cache, the same step timing wraps
each ``append_tokens``. Its form reads ``onnxruntime-genai`` (``(gmc op)`` with gmc's op library); its
size is its ``model.onnx*`` files'.
"""
from __future__ import annotations

import contextlib
import csv
import io
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from gmc.config import (
    __version__,
    base_model_option,
    check_at_least,
    device_option,
    dtype_option,
    option,
    output_option,
    overwrite_option,
    trust_remote_code_option,
)
from gmc.errors import GmcError
from gmc.graph.decode import KVCache

FORMATS = ("md", "json", "csv")
TG_PROMPT = 1  # tokens before the timed decode steps, as llama-bench's tg
ONNX_FORM = "onnxruntime-genai"
# the columns of --format csv, in order; --format json has them too, with "host" as one object
FIELDS = ("ref", "form", "size_mib", "device", "dtype", "threads", "test", "tokens", "tokens_per_s",
          "tokens_per_s_std", "repetitions", "warmup", "samples_tokens_per_s", "gmc_version")


@dataclass
class BenchConfig:
    """What ``gmc bench`` measures: which refs, which tests, on how many threads, and where it writes."""

    refs: tuple
    n_prompt: int = option(256, "pp: tokens of the one timed prefill.", short="-p", flag="--n-prompt")
    n_gen: int = option(64, "tg: timed one-token decode steps after a 1-token prompt.", short="-n", flag="--n-gen")
    repetitions: int = option(5, "Timed repetitions of each test, interleaved across refs.", short="-r")
    threads: Optional[tuple] = option(None, "CPU thread counts, comma-separated [default: torch's].", short="-t",
                                      metavar="N,M", optional=True)
    warmup: int = option(1, "Untimed runs of each test per ref before the timed ones.")
    format: str = option("md", "md: a llama-bench table; json: a list of records with every field and the "
                               "host; csv: one row per record.", choices=FORMATS)
    output: Optional[str] = output_option("Write the table or records to FILE instead of stdout.")
    overwrite: bool = overwrite_option("results file at -o")
    device: str = device_option()
    dtype: str = dtype_option()
    model: Optional[str] = base_model_option()
    trust_remote_code: bool = trust_remote_code_option()

    def __post_init__(self):
        from gmc.inputs.model import device_and_dtype

        self.refs = tuple(self.refs)
        if not self.refs:
            raise GmcError("nothing to bench: give at least one REF")
        check_at_least("-p/--n-prompt", self.n_prompt, 1)
        check_at_least("-n/--n-gen", self.n_gen, 1)
        check_at_least("-r/--repetitions", self.repetitions, 1)
        check_at_least("--warmup", self.warmup, 0)
        self.threads = parse_threads(self.threads)
        if self.format not in FORMATS:
            raise GmcError(f"bad --format {self.format!r}: expected one of {', '.join(FORMATS)}")
        self.device, self.dtype = device_and_dtype(self.device, self.dtype)
        for ref in self.refs:  # before any model loads: a bad ref fails in a second
            _check_ref(ref, self.model)
        if self.output is not None:
            self.output = str(check_bench_path(self.output, self.overwrite, inputs=[*self.refs, self.model]))


def parse_threads(threads) -> tuple[int, ...]:
    """``"1,2"`` (the command line), a sequence of ints, or None (torch's count now) -> ``(1, 2)``."""
    if threads is None:
        return (torch.get_num_threads(),)
    items = threads.split(",") if isinstance(threads, str) else list(threads)
    counts = []
    for item in items:
        text = str(item).strip()
        if not text.isdigit() or int(text) < 1:
            raise GmcError(f"bad -t/--threads {threads if isinstance(threads, str) else ','.join(map(str, items))!r}: "
                           f"expected comma-separated positive integers, e.g. 1,2")
        counts.append(int(text))
    return tuple(counts)


def _check_ref(ref: str, model: Optional[str]) -> None:
    from gmc.runtime.refs import resolve_ref

    if _is_onnx(ref):
        from gmc.formats.onnx import check_onnx_dir

        check_onnx_dir(Path(ref).expanduser())
        return
    resolve_ref(ref, model)


def _is_onnx(ref: str) -> bool:
    from gmc.formats.onnx import is_onnx_dir

    return is_onnx_dir(Path(ref).expanduser())


def check_bench_path(path, overwrite: bool = False, inputs=()) -> Path:
    """``gmc bench -o``: may replace only results ``gmc bench`` wrote, with ``overwrite``, and no input
    (``gmc.formats.outputs``, kind ``bench``)."""
    from gmc.formats.outputs import check_output

    return check_output(path, "bench", overwrite=overwrite, inputs=inputs)


def write_bench(path, text: str, overwrite: bool = False) -> Path:
    """Atomically write rendered results (checked again: the bench may have run for minutes)."""
    from gmc.formats.atomic import atomic_write_bytes

    path = check_bench_path(path, overwrite)
    atomic_write_bytes(path, text.encode())
    return path


# ------------------------------------------------------------------------------ what is timed


@dataclass
class _Subject:
    """One ref ready to time: its steps over a cache, what it is, and how to move it to a thread count."""

    ref: str
    form: str
    weight_bytes: int
    vocab: int
    device: str
    dtype: str
    steps: dict
    cache: KVCache
    set_threads: Callable[[int], None] = lambda threads: None  # torch's count is set for every subject


class GenaiStep:
    """An ONNX model directory run by onnxruntime-genai as a ``generate`` step: a call at position 0
    starts a generator (its own KV cache), every call appends its tokens and returns the last logits.
    One model per thread count (onnxruntime fixes its threads when a session opens), opened at the
    first call on that count (``bench/bench_genai.py`` times its rows with this step too)."""

    def __init__(self, path: Path, max_len: int, threads: Optional[int] = None):
        self.path, self.max_len = path, max_len
        self.threads = threads or torch.get_num_threads()
        self.models: dict[int, object] = {}
        self.generator = None

    def set_threads(self, threads: int) -> None:
        self.threads = threads

    def __call__(self, tokens: torch.Tensor, position: torch.Tensor, keys=None, values=None) -> torch.Tensor:
        import numpy as np
        import onnxruntime_genai as og

        if int(position) == 0:
            if self.threads not in self.models:
                from gmc.formats.onnx import genai_model

                self.models[self.threads] = genai_model(self.path, self.threads)
            params = og.GeneratorParams(self.models[self.threads])
            params.set_search_options(max_length=self.max_len, do_sample=False)
            self.generator = og.Generator(self.models[self.threads], params)
        self.generator.append_tokens(tokens.cpu().numpy().astype(np.int32))
        return torch.from_numpy(self.generator.get_logits()[:, -1])  # [1, V]


def _onnx_subject(ref: str, max_len: int) -> _Subject:
    from gmc.formats.onnx import check_onnx_dir

    path = Path(ref).expanduser()
    config = check_onnx_dir(path)
    step = GenaiStep(path, max_len)
    size = sum(p.stat().st_size for p in path.iterdir() if p.name.startswith("model.onnx"))
    empty = torch.empty(1, 0, max_len, 0)  # [1, 0, M, 0]: the positions generate checks, no storage
    form = ONNX_FORM + (" (gmc op)" if "gmc_library" in config else "")
    return _Subject(ref, form, size, int(config["model"]["vocab_size"]), "cpu", "float32",
                    {"prefill": step, "decode": step}, KVCache([empty], [empty]), step.set_threads)


def _subject(ref: str, config: BenchConfig, max_len: int, stack: contextlib.ExitStack) -> _Subject:
    """Load ``ref`` and enter its steps for the whole run (``stack`` closes them)."""
    if _is_onnx(ref):
        return _onnx_subject(ref, max_len)
    from gmc.runtime.steps import load_runnable

    runnable = load_runnable(ref, config.dtype, config.device, config.model, config.trust_remote_code)
    run = stack.enter_context(runnable.steps(max_len))
    if run.cache.max_len < max_len:
        raise GmcError(f"{ref}: its compiled programs hold {run.cache.max_len} positions and -p/-n need {max_len}: "
                       f"lower -p/-n, or lower again with --max-len {max_len}")
    text = runnable.config.get_text_config() if hasattr(runnable.config, "get_text_config") else runnable.config
    dtype = str(run.cache.keys[0].dtype).removeprefix("torch.")
    return _Subject(ref, run.how, runnable.weight_bytes, int(text.vocab_size), str(run.cache.keys[0].device), dtype,
                    run.steps, run.cache)


def _pp(subject: _Subject, ids: torch.Tensor) -> float:
    """t/s of one prefill of ``ids [1, P]``."""
    from gmc.runtime.generate import SampleConfig, generate

    done = generate(subject.steps, subject.cache, ids, SampleConfig(max_new_tokens=1))
    return ids.shape[1] / done.prefill_s


def _tg(subject: _Subject, ids: torch.Tensor, n_gen: int) -> float:
    """t/s of ``n_gen`` one-token decode steps after the prompt ``ids [1, TG_PROMPT]``."""
    from gmc.runtime.generate import SampleConfig, generate

    done = generate(subject.steps, subject.cache, ids, SampleConfig(max_new_tokens=n_gen + 1))
    return len(done.decode_s) / sum(done.decode_s)


def run_bench(config: BenchConfig) -> list[dict]:
    """Time pp and tg of every ref on every thread count; one record per ref x thread count x test,
    in the order of the refs. torch's thread count is restored afterwards."""
    from gmc.runtime.host import copy_bandwidth_gbs, host

    max_len = max(config.n_prompt, TG_PROMPT + config.n_gen) + 1  # generate's check: prompt + new tokens
    before = torch.get_num_threads()
    with contextlib.ExitStack() as stack:
        subjects = [_subject(ref, config, max_len, stack) for ref in config.refs]
        machine = {**host(), "copy_gbs": {str(t): round(copy_bandwidth_gbs(t), 1) for t in config.threads}}
        gpus = sorted({torch.cuda.get_device_name(s.device) for s in subjects if s.device.startswith("cuda")})
        if gpus:
            machine["gpu"] = ", ".join(gpus)
        generator = torch.Generator().manual_seed(0)
        records = []
        try:
            for threads in config.threads:
                torch.set_num_threads(threads)
                for subject in subjects:
                    subject.set_threads(threads)
                for test, tokens, measure in _tests(config, subjects, generator):
                    for _ in range(config.warmup):
                        for subject in subjects:
                            measure(subject)
                    samples = [[] for _ in subjects]
                    for _ in range(config.repetitions):
                        for subject, kept in zip(subjects, samples):
                            kept.append(measure(subject))
                    records += [_record(subject, config, threads, test, tokens, kept, machine)
                                for subject, kept in zip(subjects, samples)]
        finally:
            torch.set_num_threads(before)
    order = {ref: i for i, ref in enumerate(config.refs)}
    return sorted(records, key=lambda r: (order[r["ref"]], config.threads.index(r["threads"]), r["test"][:2] != "pp"))


def _tests(config: BenchConfig, subjects: list[_Subject], generator: torch.Generator):
    """``(name, timed tokens, measure(subject) -> t/s)`` of pp and tg; each subject gets ids of its vocabulary."""
    prompts = {id(s): torch.randint(0, s.vocab, (1, config.n_prompt), generator=generator) for s in subjects}
    return [(f"pp{config.n_prompt}", config.n_prompt, lambda s: _pp(s, prompts[id(s)])),
            (f"tg{config.n_gen}", config.n_gen, lambda s: _tg(s, prompts[id(s)][:, :TG_PROMPT], config.n_gen))]


def _record(subject: _Subject, config: BenchConfig, threads: int, test: str, tokens: int, samples: list[float],
            machine: dict) -> dict:
    return {
        "ref": subject.ref, "form": subject.form, "size_mib": round(subject.weight_bytes / 2**20, 2),
        "device": subject.device, "dtype": subject.dtype, "threads": threads, "test": test, "tokens": tokens,
        "tokens_per_s": statistics.fmean(samples),
        "tokens_per_s_std": statistics.stdev(samples) if len(samples) > 1 else 0.0,
        "repetitions": config.repetitions, "warmup": config.warmup, "samples_tokens_per_s": samples,
        "gmc_version": __version__, "host": machine,
    }


# ------------------------------------------------------------------------------ how the numbers read


def render(records: list[dict], format: str) -> str:
    """``records`` as ``format``: md (a llama-bench table, a host line, the protocol line), json, csv."""
    if format == "json":
        return json.dumps(records, indent=2) + "\n"
    if format == "csv":
        return _csv(records)
    if format == "md":
        return _markdown(records)
    raise GmcError(f"bad --format {format!r}: expected one of {', '.join(FORMATS)}")


def _csv(records: list[dict]) -> str:
    """One row per record: ``FIELDS``, then the host as ``host_*`` columns (lists space-separated)."""
    out = io.StringIO()
    host_keys = list(dict.fromkeys(key for record in records for key in record["host"]))
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([*FIELDS, *(f"host_{key}" for key in host_keys)])
    for record in records:
        row = [_cell(record[name]) for name in FIELDS]
        writer.writerow(row + [_cell(record["host"].get(key, "")) for key in host_keys])
    return out.getvalue()


def _cell(value) -> str:
    if isinstance(value, list):
        return " ".join(_cell(item) for item in value)
    if isinstance(value, dict):
        return " ".join(f"{key}:{item}" for key, item in value.items())
    return str(value)


def _markdown(records: list[dict]) -> str:
    header = ["model", "form", "size (MiB)", "threads", "test", "t/s"]
    right = [False, False, True, True, True, True]
    rows = [[r["ref"], r["form"], f"{r['size_mib']:.2f}", str(r["threads"]), r["test"],
             f"{r['tokens_per_s']:.2f} ± {r['tokens_per_s_std']:.2f}"] for r in records]
    widths = [max(len(cells[i]) for cells in [header, *rows]) for i in range(len(header))]

    def line(cells):
        return "| " + " | ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)) + " |"

    rule = "| " + " | ".join("-" * (w - 1) + ":" if r else "-" * w for w, r in zip(widths, right)) + " |"
    lines = [line(header), rule, *map(line, rows), ""]
    if records:
        lines.append(host_line(records[0]["host"]))
        first = records[0]
        lines.append(f"gmc bench {__version__}: pp = one prefill of the test's tokens; tg = one-token decode steps "
                     f"after a {TG_PROMPT}-token prompt; mean ± std of {first['repetitions']} repetitions after "
                     f"{first['warmup']} warm-up, interleaved across refs")
    return "\n".join(lines) + "\n"


def host_line(machine: dict) -> str:
    """``Intel(R) Xeon(R) Processor, AVX2 AVX-512 AMX (torch AVX512), 2 cores, copy 13.2 / 20.3 GB/s on 1 / 2
    threads``, and the GPU where one was used."""
    copy = machine.get("copy_gbs", {})
    isa = " ".join(machine["isa"]) or "no AVX2"
    text = (f"host: {machine['cpu']}, {isa} (torch {machine['torch_cpu_capability']}), {machine['cores']} cores, "
            f"copy {' / '.join(str(v) for v in copy.values())} GB/s on {' / '.join(copy)} "
            f"thread{'s' if list(copy) != ['1'] else ''}")
    return text + (f", GPU {machine['gpu']}" if "gpu" in machine else "")
