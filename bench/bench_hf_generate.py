"""Speed where the user is: HF eager ``model.generate`` of a packed checkpoint vs the dense model.

Both models are loaded with ``AutoModelForCausalLM.from_pretrained`` from checkpoints written in
this run: the dense SmolLM2-135M (``gmc.inputs.model.load_model("smollm2-135m")``) and its packed
checkpoint (``gmc.formats.lowered.save_lowered``: 1x256 groups, random masks at 50% unless
``--artifact`` gives learned ones). Per thread count: batch-1 greedy decode of ``--new-tokens``
tokens, packed and dense interleaved (one generate of each in turn), median tokens/s and the
packed/dense ratio. Memory at load: each checkpoint is loaded in a fresh subprocess that, after its
imports, resets the kernel's peak-RSS mark (``/proc/self/clear_refs``) and reports how far the peak
(``VmHWM``) grows through ``from_pretrained`` and one forward pass (safetensors are memory-mapped: a
dense weight is resident only once a forward reads it). It does so twice: the first load also pays
the process's one-time costs (modeling code, kernels, allocator arenas, ~170 MiB for either model),
the second, after the first model is freed, is what the model itself costs; the ratio is of those.
Held-out perplexity (``--ppl``): the packed checkpoint against the same masks folded into the dense
model (``gmc.graph.pipeline.fold``), the bundled held-out text, 512-token windows. Host: CPU model,
cores, and a memory-copy bandwidth (``copy_`` of 256 MiB, bytes read + written over time) measured
in the same run.

    python bench/bench_hf_generate.py                          # writes bench/results/hf_generate.json
    python bench/bench_hf_generate.py --repeats 2 --new-tokens 4 --out /tmp/hf.json   # a smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from host import copy_bandwidth_gbs, host

RSS_AT_LOAD = """
import gc, sys
import torch
import gmc
from transformers import AutoModelForCausalLM
def status(key):  # kB
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key + ":"))
def load_and_run():  # safetensors are mapped: a weight is resident once a forward has read it
    open("/proc/self/clear_refs", "w").write("5")  # the peak-RSS mark restarts from the current RSS
    before = status("VmRSS")
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
    with torch.no_grad():
        model(torch.ones(1, 8, dtype=torch.long))
    return before, status("VmHWM")
first = load_and_run()  # pays the process's one-time costs too (modeling code, kernels, allocator)
gc.collect()
print(*first, *load_and_run())
"""


def load_rss_mib(directory: Path) -> dict:
    """Peak-RSS growth (MiB) of ``from_pretrained`` + one forward: the process's first load, and a
    second load of the same checkpoint after the first was freed (what the model itself costs)."""
    result = subprocess.run([sys.executable, "-c", RSS_AT_LOAD, str(directory)], capture_output=True, text=True,
                            check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    first_before, first_peak, before, peak = (int(n) / 1024 for n in result.stdout.strip().splitlines()[-1].split())
    return {"first_load_peak_growth": first_peak - first_before, "model_peak_growth": peak - before}


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
    return dense_dir, packed_dir, source, (masks, spec, weights)


def heldout_ppl(model, tokenizer) -> float:
    from gmc.runtime.evaluate import perplexity

    return perplexity(model, tokenizer, "bundled-heldout", seq_len=512, progress=False).perplexity


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
    parser.add_argument("--ppl", action="store_true", help="held-out perplexity, packed vs the folded dense model")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "hf_generate.json"))
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import gmc.formats.hf_checkpoint  # noqa: F401

    with tempfile.TemporaryDirectory(prefix="gmc-hf-bench-") as scratch:
        dense_dir, packed_dir, masks, (chosen, spec, weights) = write_checkpoints(Path(scratch), args.artifact,
                                                                                  args.sparsity)
        rss = {"dense": load_rss_mib(dense_dir), "packed": load_rss_mib(packed_dir)}
        models = {"dense": AutoModelForCausalLM.from_pretrained(dense_dir).eval(),
                  "packed": AutoModelForCausalLM.from_pretrained(packed_dir).eval()}
        tokenizer = AutoTokenizer.from_pretrained(dense_dir)
        ppl = None
        if args.ppl:
            from gmc.graph.pipeline import fold

            torch.set_num_threads(max(args.threads))
            folded = AutoModelForCausalLM.from_pretrained(dense_dir).eval()
            fold(folded, chosen, spec, weights)
            ppl = {"folded": heldout_ppl(folded, tokenizer), "packed": heldout_ppl(models["packed"], tokenizer)}
            ppl["relative_difference"] = abs(ppl["packed"] - ppl["folded"]) / ppl["folded"]
            print(f"held-out ppl: folded {ppl['folded']:.4f}, packed {ppl['packed']:.4f} "
                  f"(relative difference {ppl['relative_difference']:.1e})")
            del folded
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
    ratio = rss["packed"]["model_peak_growth"] / rss["dense"]["model_peak_growth"]
    first = rss["packed"]["first_load_peak_growth"] / rss["dense"]["first_load_peak_growth"]
    notes = [f"Masks: {masks}. Memory at load (`from_pretrained` + one forward, peak-RSS growth): dense "
             f"{rss['dense']['model_peak_growth']:.0f} MiB, packed {rss['packed']['model_peak_growth']:.0f} MiB "
             f"(x{ratio:.2f}); the process's first load, one-time costs included: "
             f"{rss['dense']['first_load_peak_growth']:.0f} / {rss['packed']['first_load_peak_growth']:.0f} MiB "
             f"(x{first:.2f})."]
    if ppl:
        notes.append(f"Held-out perplexity (bundled text, 512-token windows): packed {ppl['packed']:.6g}, the same "
                     f"masks folded into the dense model {ppl['folded']:.6g} (relative difference "
                     f"{ppl['relative_difference']:.1e}).")
    title = "SmolLM2-135M packed checkpoint vs dense: HF eager generate, batch 1"
    record = {"name": "smollm2-hf-eager", "title": title,
              "bench": "bench/bench_hf_generate.py", "command": " ".join(["python", *sys.argv]),
              "host": {**host(), "copy_gbps": [row["copy_gbs"] for row in rows]},
              "columns": [{"key": "threads", "title": "threads", "format": "{:.0f}"},
                          {"key": "dense_tokens_per_s", "title": "dense tok/s", "format": "{:.1f}"},
                          {"key": "packed_tokens_per_s", "title": "packed tok/s", "format": "{:.1f}"},
                          {"key": "speedup", "title": "packed x dense", "format": "{:.2f}x"}],
              "rows": rows, "notes": notes, "masks": masks, "new_tokens": args.new_tokens, "repeats": args.repeats,
              "heldout_ppl": ppl, "load_rss_mib": rss}
    for note in notes:
        print(note)
    result = [record]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
