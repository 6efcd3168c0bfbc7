"""Speed where the user is: HF eager ``model.generate`` of a packed checkpoint vs the dense model.

Both models are loaded with ``AutoModelForCausalLM.from_pretrained`` from checkpoints written in
this run: the dense SmolLM2-135M (``gmc.inputs.model.load_model("smollm2-135m")``) and its packed
checkpoint (``gmc.formats.lowered.save_lowered``: 1x256 groups, random masks at 50% unless
``--artifact`` gives learned ones). Per thread count: batch-1 greedy decode of ``--new-tokens``
tokens, packed and dense interleaved (one generate of each in turn), median tokens/s and the
packed/dense ratio. Peak RSS at load: each checkpoint is loaded in a fresh subprocess that reports
``ru_maxrss`` after ``from_pretrained``. Host: CPU model, cores, and a memory-copy bandwidth
(``copy_`` of 256 MiB, bytes read + written over time) measured in the same run.

    python bench/bench_hf_generate.py                          # writes bench/results/hf_generate.json
    python bench/bench_hf_generate.py --repeats 2 --new-tokens 4 --out /tmp/hf.json   # a smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

RSS_AT_LOAD = """
import resource, sys
import gmc.formats.hf_checkpoint
from transformers import AutoModelForCausalLM
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
AutoModelForCausalLM.from_pretrained(sys.argv[1])
print(before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def host() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__}


def copy_bandwidth_gbs(threads: int, repeats: int = 5) -> float:
    torch.set_num_threads(threads)
    src = torch.ones(256 * 2**20 // 4)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * 4 / statistics.median(times) / 1e9


def peak_rss_mib(directory: Path) -> dict:
    """Peak RSS after the imports and after ``from_pretrained`` (MiB; ru_maxrss is KiB on Linux)."""
    result = subprocess.run([sys.executable, "-c", RSS_AT_LOAD, str(directory)], capture_output=True, text=True,
                            check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    before, after = (int(n) / 1024 for n in result.stdout.strip().splitlines()[-1].split())
    return {"after_imports": before, "after_load": after}


def write_checkpoints(root: Path, artifact: str | None, sparsity: float) -> tuple[Path, Path, str]:
    from gmc.formats.lowered import save_lowered
    from gmc.graph.pipeline import pack_targets
    from gmc.graph.targets import eager_targets
    from gmc.groups import parse_pattern
    from gmc.inputs.model import load_model

    loaded = load_model("smollm2-135m")
    dense_dir, packed_dir = root / "dense", root / "packed"
    loaded.model.save_pretrained(dense_dir)
    loaded.tokenizer.save_pretrained(dense_dir)
    if artifact:
        from gmc.formats.artifact import load_artifact

        art = load_artifact(artifact)
        masks, spec, weights, source = art.masks, art.pattern, art.weights, f"learned masks from {artifact}"
    else:
        spec, generator = parse_pattern("1x256"), torch.Generator().manual_seed(0)
        modules = dict(loaded.model.named_modules())
        masks = {name: torch.rand(spec.grid(tuple(modules[name].weight.shape)), generator=generator) >= sparsity
                 for name in (target.name for target in eager_targets(loaded.model))}
        weights, source = None, f"random 1x256 masks at {sparsity:.0%} sparsity (not learned)"
    packed = pack_targets(loaded.model, masks, spec, weights)
    save_lowered(packed_dir, loaded.model, loaded.tokenizer, packed, {"model": "smollm2-135m", "group": str(spec)})
    return dense_dir, packed_dir, source


def decode_tokens_per_s(model, ids: torch.Tensor, new_tokens: int) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             use_cache=True)
    elapsed = time.perf_counter() - start
    return (out.shape[1] - ids.shape[1]) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--artifact", default=None, help="learned masks artifact (default: random 1x256 at 50%%)")
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "hf_generate.json"))
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import gmc.formats.hf_checkpoint  # noqa: F401

    with tempfile.TemporaryDirectory(prefix="gmc-hf-bench-") as scratch:
        dense_dir, packed_dir, masks = write_checkpoints(Path(scratch), args.artifact, args.sparsity)
        rss = {"dense": peak_rss_mib(dense_dir), "packed": peak_rss_mib(packed_dir)}
        models = {"dense": AutoModelForCausalLM.from_pretrained(dense_dir).eval(),
                  "packed": AutoModelForCausalLM.from_pretrained(packed_dir).eval()}
        tokenizer = AutoTokenizer.from_pretrained(dense_dir)
        ids = torch.tensor([tokenizer("The history of sparse neural networks")["input_ids"]])
        rows = []
        for threads in args.threads:
            torch.set_num_threads(threads)
            for model in models.values():  # warm-up
                decode_tokens_per_s(model, ids, 4)
            speeds = {name: [] for name in models}
            for _ in range(args.repeats):
                for name, model in models.items():
                    speeds[name].append(decode_tokens_per_s(model, ids, args.new_tokens))
            medians = {name: statistics.median(values) for name, values in speeds.items()}
            rows.append({"threads": threads, "dense_tokens_per_s": medians["dense"],
                         "packed_tokens_per_s": medians["packed"], "speedup": medians["packed"] / medians["dense"],
                         "copy_gbs": copy_bandwidth_gbs(threads)})
            print(f"threads={threads}: dense {medians['dense']:.1f} tok/s, packed {medians['packed']:.1f} tok/s, "
                  f"x{rows[-1]['speedup']:.2f}")
    result = {"bench": "hf_generate", "command": " ".join(["python", *sys.argv]), "host": host(), "masks": masks,
              "baseline": "HF eager dense generate (same run)", "new_tokens": args.new_tokens,
              "repeats": args.repeats, "rows": rows,
              "peak_rss_mib": {**rss, "ratio_after_load": rss["packed"]["after_load"] / rss["dense"]["after_load"]}}
    print(f"peak RSS: {rss} (packed/dense after load x{result['peak_rss_mib']['ratio_after_load']:.2f})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
