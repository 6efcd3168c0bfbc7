"""Shared builders, as plain functions (``from conftest import ...``) and the fixtures built on them:
tiny random causal LMs from configs (no download), tokenizers, masks and artifacts, packed layers,
texts and lm-eval tasks, report manifests, and ``gmc`` runners.

Heavy libraries (transformers, gmc's) are imported inside the builders. The Triton kernels run on
the CPU through the interpreter, so ``TRITON_INTERPRET`` is set here, before any test module (in
whatever folder is collected first) imports triton."""
from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Under pytest-xdist (pyproject's addopts run two workers) each worker's torch, and every child
# process a test starts, runs on one thread: two workers of two threads on a 2-core machine leave
# OpenMP's spinning threads fighting for the cores. Tests of the kernels' two-thread paths set
# their threads themselves.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# ------------------------------------------------------------------------------ tiny models

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=320, max_position_embeddings=256)
SMOL_VOCAB = 49152  # SmolLM2's vocabulary, so its tokenizer drives the tiny model


def tiny_model(arch: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random ``*ForCausalLM`` of ``arch`` (llama, qwen3, qwen2, mistral) in eval mode."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    extra = {"head_dim": 16} if arch == "qwen3" else {}
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**TINY, **extra, **overrides})).eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model


def tiny_smol_model(seed: int = 0) -> torch.nn.Module:
    """A 1-layer random Llama with SmolLM2's vocabulary (about 3M parameters)."""
    return tiny_model("llama", seed=seed, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, vocab_size=SMOL_VOCAB)


def save_tiny_smol(path: Path, seed: int = 0) -> Path:
    """``tiny_smol_model`` saved with the SmolLM2 tokenizer as an HF model directory."""
    tiny_smol_model(seed).save_pretrained(path)
    smol_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def tiny_llama():
    return tiny_model("llama")


@pytest.fixture(scope="session")
def smollm2():
    """The bundled SmolLM2-135M (slow tests only)."""
    from gmc.inputs.model import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama with a real tokenizer saved as an HF directory (for CLI tests).

    hidden 128 and intermediate 320 make 1x256 groups ragged (320 = 256 + 64)."""
    path = tmp_path_factory.mktemp("tiny") / "llama"
    tiny_model("llama", hidden_size=128, intermediate_size=320).save_pretrained(path)
    byte_bpe_tokenizer().save_pretrained(path)
    return path


# ------------------------------------------------------------------------------ tokenizers


class CharTokenizer:
    """A stand-in HF tokenizer for tiny models: bytes -> ids, BOS = 1."""

    bos_token_id = 1
    eos_token_id = 2
    pad_token_id = 0

    def __call__(self, text, add_special_tokens=True, **_):
        ids = [3 + b for b in text.encode("utf-8")][:10_000]
        return {"input_ids": ([self.bos_token_id] if add_special_tokens else []) + ids}


def letters_tokenizer():
    """A real HF fast tokenizer with one id per lowercase letter and space (saved with tiny models)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, " ": 2, **{chr(97 + i): 3 + i for i in range(26)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>")


def byte_bpe_tokenizer(vocab_size: int = 300):
    """A real HF fast tokenizer trained offline on the bundled calibration text."""
    import tokenizers
    import transformers

    from gmc.inputs.calib import BUNDLED

    lines = BUNDLED["bundled"].read_text().splitlines()[:300]
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(lines, vocab_size=vocab_size, min_frequency=2,
                            special_tokens=["<s>", "</s>", "<pad>"], show_progress=False)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


@functools.lru_cache(maxsize=1)
def smol_tokenizer():
    """The bundled SmolLM2 tokenizer (offline); skips the test if the model is not installed."""
    from transformers import AutoTokenizer

    from gmc.errors import GmcError
    from gmc.inputs.model import _smollm2_hf_dir

    try:
        return AutoTokenizer.from_pretrained(str(_smollm2_hf_dir()))
    except GmcError as error:
        pytest.skip(f"bundled SmolLM2 unavailable: {error}")


# ------------------------------------------------------------------------------ masks and artifacts


def x_quantized(expected: torch.Tensor) -> dict:
    """assert_close tolerance of int8 / int4 packed layers against their dequantized dense model:
    the CPU kernel quantizes x to int8 per 32 numbers for its integer dot products (int4 always,
    int8 past 4 tokens; tests/kernels/test_cpu_low_precision.py bounds that layer by layer)."""
    return dict(atol=0.02 * max(1.0, expected.abs().max().item()), rtol=0)


def random_masks(model, pattern, sparsity: float = 0.5, seed: int = 0) -> dict[str, torch.Tensor]:
    """Boolean selectors over every target of ``model``, each group kept with probability ``1 - sparsity``."""
    from gmc.graph.targets import eager_targets

    gen = torch.Generator().manual_seed(seed)
    return {t.name: torch.rand(pattern.grid(t.shape), generator=gen) >= sparsity for t in eager_targets(model)}


def set_selectors(gm, selectors: dict) -> None:
    """Give each GroupSelector of graph ``gm`` its selectors (float 0/1, may carry autograd history;
    None: dense again), by target name."""
    from gmc.graph.selector import selector_modules

    modules = selector_modules(gm)
    unknown = set(selectors) - set(modules)
    if unknown:
        raise KeyError(f"no selector node for {sorted(unknown)[:3]}")
    for name, value in selectors.items():
        modules[name].selectors = value


def masked_copy(model, masks, pattern) -> torch.nn.Module:
    """A copy of ``model`` with each masked weight multiplied by its expanded mask (the dense reference)."""
    dense = copy.deepcopy(model)
    for name, module in dense.named_modules():
        if name in masks:
            module.weight.data *= pattern.expand(masks[name].float(), tuple(module.weight.shape))
    return dense


def mask_artifact(model, masks, pattern, model_ref: str = "tiny", method: str = "magnitude",
                  target_sparsity: float = 0.5, seed: int = 0):
    """A ``MaskArtifact`` of ``masks`` over ``model`` (uniform allocation, no calibration)."""
    from gmc.formats.artifact import MaskArtifact, build_manifest, model_fingerprint

    shapes = {name: tuple(model.get_submodule(name).weight.shape) for name in masks}
    manifest = build_manifest(
        model_ref=model_ref, fingerprint=model_fingerprint(model), pattern=pattern, masks=masks,
        shapes=shapes, method=method, allocation="uniform", target_sparsity=target_sparsity,
        calibration="none", seed=seed,
    )
    return MaskArtifact(masks, manifest)


def save_random_artifact(path: Path, model_ref: str, model: torch.nn.Module, keep: float, seed: int = 0) -> Path:
    """A 1x16 masks artifact over every attention/MLP projection keeping about ``keep`` of groups."""
    from gmc.formats.artifact import save_artifact
    from gmc.groups import parse_pattern

    pattern = parse_pattern("1x16")
    generator = torch.Generator().manual_seed(seed)
    masks = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith("_proj"):
            masks[name] = torch.rand(pattern.grid(tuple(module.weight.shape)), generator=generator) < keep
    artifact = mask_artifact(model, masks, pattern, model_ref, method="hand", target_sparsity=1 - keep, seed=seed)
    return save_artifact(path, artifact)


@pytest.fixture
def magnitude_workspace(tmp_path):
    """``(model_dir, artifact_dir, calib_txt)``: a tiny Llama, 1x16 magnitude masks, some text."""
    from gmc.formats.artifact import save_artifact
    from gmc.groups import parse_pattern

    model = tiny_model("llama")
    model_dir = tmp_path / "tiny"
    model.save_pretrained(model_dir)
    letters_tokenizer().save_pretrained(model_dir)
    pattern = parse_pattern("1x16")
    masks = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith("_proj"):
            scores = pattern.group_sum(module.weight.abs())
            masks[name] = scores >= scores.median()
    artifact = mask_artifact(model, masks, pattern, str(model_dir))
    artifact_dir = save_artifact(tmp_path / "masks", artifact, [("train_log.jsonl", b"{}\n")])
    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join("the quick brown fox jumps over the lazy dog and keeps running far away " * 3
                               for _ in range(20)))
    return model_dir, artifact_dir, calib


# ------------------------------------------------------------------------------ packed layers

# (group, weight shape): the 1xN row and NxN block group shapes, plus ragged shapes in both dimensions.
GROUP_CASES = [
    ("1x64", (128, 320)),
    ("1x128", (96, 384)),
    ("1x256", (64, 512)),
    ("16x16", (80, 96)),
    ("32x32", (96, 128)),
    ("64x64", (192, 256)),
    ("1x256", (96, 576)),
    ("32x32", (100, 70)),
]


def random_selectors(spec, shape, sparsity: float, seed: int) -> torch.Tensor:
    """Selectors keeping about ``1 - sparsity`` of the groups, with an empty output group
    (rows with no kept group) and an empty input block."""
    gen = torch.Generator().manual_seed(seed)
    G_out, G_in = spec.grid(shape)
    keep = (torch.rand(G_out, G_in, generator=gen) >= sparsity).float()
    keep[0] = 0
    if G_in > 1:
        keep[:, 1] = 0
    return keep


@pytest.fixture
def packed_case():
    """``make(group, shape, sparsity, dtype, seed) -> (packed, dense masked weight fp32)``."""
    from gmc.groups import GroupSpec
    from gmc.kernels.packed import pack

    def make(group: str, shape, sparsity: float, dtype=torch.float32, seed: int = 0):
        spec = GroupSpec(*map(int, group.split("x")))
        gen = torch.Generator().manual_seed(seed + 1)
        weight = torch.randn(shape, generator=gen)
        bias = torch.randn(shape[0], generator=gen)
        packed = pack(weight, random_selectors(spec, shape, sparsity, seed), spec, bias).to(dtype=dtype)
        return packed, packed.unpack().float()

    return make


# ------------------------------------------------------------------------------ texts and lm-eval tasks


def write_text(path: Path, paragraphs: int = 40) -> Path:
    lines = [f"Paragraph {i}: the quick brown fox jumps over the lazy dog {i * 7 % 13} times."
             for i in range(paragraphs)]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_mc_task(directory: Path, name: str = "gmc_test_mc", docs: int = 8,
                  metrics: tuple[str, ...] = ("acc",)) -> Path:
    """A local multiple-choice lm-eval task (YAML + JSONL) in ``directory``; returns the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / f"{name}.jsonl"
    rows = [{"question": f"Is {i} an even number?", "choices": ["yes", "no"], "label": i % 2} for i in range(docs)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    metric_list = "".join(
        f"  - metric: {metric}\n    aggregation: mean\n    higher_is_better: true\n" for metric in metrics
    )
    (directory / f"{name}.yaml").write_text(
        f"task: {name}\n"
        "output_type: multiple_choice\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: label\n"
        f"metric_list:\n{metric_list}"
    )
    return directory


# ------------------------------------------------------------------------------ report manifests

# 4 layers x 7 projections with hand-chosen preserved rates
REPORT_SHAPES = {"q": (64, 64), "k": (32, 64), "v": (32, 64), "o": (64, 64),
                 "gate": (128, 64), "up": (128, 64), "down": (64, 128)}
REPORT_LAYERS = 4


def target_name(layer: int, proj: str) -> str:
    block = "self_attn" if proj in ("q", "k", "v", "o") else "mlp"
    return f"model.layers.{layer}.{block}.{proj}_proj"


def write_manifest(path, rate, target_sparsity=0.5):
    """An artifact directory whose target (layer, proj) keeps ``rate(layer, proj)`` of its weights."""
    path.mkdir(parents=True, exist_ok=True)
    names = {target_name(layer, proj): (layer, proj) for layer in range(REPORT_LAYERS) for proj in REPORT_SHAPES}
    manifest = {
        "gmc_version": "0.1.0", "model": "hand-made", "model_fingerprint": "0" * 16, "group": "1x16",
        "method": "hand", "allocation": "adaptive", "target_sparsity": target_sparsity,
        "global_sparsity": None, "calibration": "none", "seed": 0,
        "layer_sparsity": {n: 1 - rate(*lp) for n, lp in names.items()},
        "shapes": {n: list(REPORT_SHAPES[proj]) for n, (_, proj) in names.items()},
    }
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def correlated(layer, proj):
    """Q and K perfectly correlated (k = 2q - 0.2), gate and up perfectly anti-correlated."""
    q = 0.3 + 0.1 * layer
    return {"q": q, "k": 2 * q - 0.2, "v": 0.5, "o": 0.25 + 0.05 * layer,
            "gate": 0.5 + 0.05 * layer, "up": 0.8 - 0.05 * layer, "down": 0.75}[proj]


def additive(layer, proj):
    """rate = type effect + depth effect, no interaction."""
    return 0.1 * (list(REPORT_SHAPES).index(proj) + 1) + 0.05 * layer


# ------------------------------------------------------------------------------ running gmc


def invoke_gmc(*args):
    """``gmc ARGS`` through click's CliRunner (the one-line error handler is the group's ``main``)."""
    from click.testing import CliRunner

    from gmc.cli.main import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


def run_gmc(*args, cwd=None) -> subprocess.CompletedProcess:
    """``python -m gmc ARGS`` in a child process, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "gmc", *map(str, args)], capture_output=True, text=True, cwd=cwd)


# The parent of ``run_gmc_cases``: it imports what ``python -m gmc`` imports before calling ``main``
# (its output then goes to import.out/err), then forks one child per case, which runs the rest of
# ``python -m gmc ARGS`` with descriptors 1 and 2 on the case's own files and exits with its status.
_FORKED_GMC = r"""
import json, os, sys

cases, scratch = json.loads(sys.argv[1]), sys.argv[2]
pipes = os.dup(1), os.dup(2)


def point(targets):
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, target in zip((1, 2), targets):
        if isinstance(target, str):
            opened = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(opened, fd)
            os.close(opened)
        else:
            os.dup2(target, fd)


point([f"{scratch}/import.out", f"{scratch}/import.err"])
from gmc.cli.main import main
point(pipes)
codes = []
for index, args in enumerate(cases):
    point([f"{scratch}/{index}.out", f"{scratch}/{index}.err"])
    pid = os.fork()
    if pid == 0:
        os.close(pipes[0])
        os.close(pipes[1])
        sys.argv = ["gmc", *args]
        main()
        sys.exit(0)
    point(pipes)
    codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
with open(f"{scratch}/codes.json", "w") as file:
    json.dump(codes, file)
"""


def run_gmc_cases(cases, cwd=None, env=None) -> list[subprocess.CompletedProcess]:
    """``run_gmc(*case)`` for each case, at the cost of one interpreter start instead of one per case.

    Each case still runs in a process of its own, its result read at the descriptor level (library
    loggers and warnings included) with its own exit status: a parent imports gmc's CLI once and
    forks a child per case that runs ``main()`` as ``python -m gmc`` does. What the parent printed
    while importing goes before every case's output, as each ``python -m gmc`` would print it.
    ``cwd`` and ``env`` (read at import, like ``HF_HUB_OFFLINE``) are those of every case."""
    import tempfile

    arguments = [[str(a) for a in case] for case in cases]
    with tempfile.TemporaryDirectory(prefix="gmc-cases-") as scratch:
        parent = subprocess.run([sys.executable, "-c", _FORKED_GMC, json.dumps(arguments), scratch],
                                capture_output=True, text=True, cwd=cwd, env=env)

        def read(name: str) -> str:
            path = Path(scratch) / name
            return path.read_text() if path.is_file() else ""

        assert parent.returncode == 0 and (Path(scratch) / "codes.json").is_file(), \
            read("import.err")[-3000:] + parent.stderr[-3000:]
        codes = json.loads(read("codes.json"))
        return [subprocess.CompletedProcess(["gmc", *args], code, read("import.out") + read(f"{i}.out"),
                                            read("import.err") + read(f"{i}.err"))
                for i, (args, code) in enumerate(zip(arguments, codes))]


LEARN_CLI_STEPS = 40  # long enough that a signal sent after the first checkpoint lands before the end


def learn_cli_args(model_dir, out, *extra, steps: int = LEARN_CLI_STEPS) -> list[str]:
    """``gmc prune`` arguments of the kill-and-resume tests' learned run on ``model_dir``: 1x64 groups
    on the bundled text, a checkpoint every 4 steps."""
    return ["prune", str(model_dir), "--group", "1x64", "--calib", "bundled", "--seq-len", "32", "--nsamples", "8",
            "--steps", str(steps), "--lr", "5e-3", "--checkpoint-every", "4", "--quiet", "-o", str(out), *extra]


@pytest.fixture(scope="session")
def learned_run(tiny_model_dir, tmp_path_factory) -> Path:
    """The artifact of ``learn_cli_args`` on ``tiny_model_dir`` run through in a child process on one
    thread, as the kill-and-resume tests run theirs: what an interrupted and resumed run must give
    bit for bit. One run serves them all; read only."""
    out = tmp_path_factory.mktemp("learned") / "ref"
    done = subprocess.run([sys.executable, "-m", "gmc", *learn_cli_args(tiny_model_dir, out)],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return out


def wait_for_checkpoint(path, proc, min_step: int, timeout: float = 300) -> None:
    """Poll a learner checkpoint until it records ``min_step`` (for kill-and-resume tests)."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if path.exists():
            try:
                if torch.load(path, weights_only=True)["step"] >= min_step:
                    return
            except Exception:
                pass  # being replaced right now; the atomic rename makes the next read whole
        time.sleep(0.2)
    raise AssertionError("no checkpoint appeared")


def run_log(directory: Path) -> list[dict]:
    """The records of a run's ``train_log.jsonl`` in ``directory`` without the throughput keys
    (``RATE_KEYS``: the host's speed, not the run's), for comparing two runs record by record."""
    from gmc.masks.checkpoint import LOG_FILE
    from gmc.masks.harness import RATE_KEYS

    lines = (Path(directory) / LOG_FILE).read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in RATE_KEYS} for line in lines]
