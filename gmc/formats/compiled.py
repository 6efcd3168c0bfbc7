"""Compiled programs: AOTInductor packages of the prefill and decode programs (``gmc.graph.decode``),
as stored and loaded; the lowering stage's compile step (``gmc.lower.compile``) builds them.

``gmc lower --compile`` and ``gmc generate --compile`` write ``<dir>/compiled/``::

    prefill.pt2, decode.pt2   AOTInductor packages: generated code only (package_constants_in_so
                              off), every op Inductor does not generate an extern call; on CPU
                              gmc's ops (group-sparse linear, decode attention) are direct calls
                              of their C shims in libgmc_ops.so (the package links against that
                              soname); on CUDA Inductor compiles the ops' Triton kernels into the
                              package (``gmc.kernels.inline_on_cuda``)
    constants.safetensors     the programs' weights and packed layers by program name, stored once
                              and shared by both loaded packages (``user_managed``: no copy); read
                              into one mapping on 2 MiB pages (``gmc.huge_pages``)
    libgmc_ops.so             the ops' runtime: schemas + C++ CPU kernels, for a process without gmc
    compiled.json             max_len, dtype, device, torch version, packed format version, the
                              KV cache a step reads (layers, shape, dtype: a step refuses another)

A process without gmc runs a package with ``torch.ops.load_library(libgmc_ops.so)``,
``torch._inductor.aoti_load_package`` and ``load_constants`` (``tests/formats/test_compiled.py`` does).
Inside gmc the op is already defined and gmc's C++ kernel, which carries the same soname and shim,
is what a CPU package links to: ``load_compiled`` loads the kernel, not the runtime library.

A package is native code that runs when loaded: ``load_compiled`` only loads a directory owned by
this user and writable by nobody else, and nothing else in gmc loads one.
"""
from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gmc.errors import GmcError
from gmc.formats.hf_checkpoint import FORMAT_VERSION
from gmc.graph.decode import PROGRAMS
from gmc.huge_pages import load_on_huge_pages
from gmc.kernels import attention_block, decode_attention, gated_mlp, group_sparse_linear
from gmc.kernels.cpu_group_sparse import SONAME, backend, kernel

COMPILED_DIR = "compiled"
CONSTANTS_FILE = "constants.safetensors"
RUNTIME_LIBRARY = SONAME
INFO_FILE = "compiled.json"
SCHEMAS = (group_sparse_linear.SCHEMA, decode_attention.SCHEMA, gated_mlp.SCHEMA,  # the ops a package may call
           attention_block.SCHEMA)


CUDA_PACKAGES = ("AOTInductor's loader crashed (a segmentation fault) on the CUDA packages of the decode programs, "
                 "lowered and dense alike (torch 2.11, an H200: bench/gpu_check.py --sections aoti); on CUDA, "
                 "`gmc generate --compile --device cuda` records the decode step as one CUDA graph instead")


def program_constants(program: torch.export.ExportedProgram) -> dict[str, torch.Tensor]:
    """The tensors an AOTInductor package of ``program`` expects from ``load_constants``, by name."""
    constants = {**program.state_dict, **program.constants}
    return {name: tensor for name, tensor in constants.items() if isinstance(tensor, torch.Tensor)}


class CompiledStep:
    """A loaded package as ``step(tokens, position, keys, values) -> logits`` (``gmc.runtime.generate.Step``).

    torch's package runner parses its two call specs from JSON on every call (3.7 KB for SmolLM2's
    62 inputs) and flattens the arguments through pytree; the objects that makes set off Python's
    garbage collector, which took ~5% of the main thread of a 2-thread compiled decode step
    (``perf``). Here the specs are read once, checked against the
    step's own arguments, and a call hands the flat inputs to the runner's ``boxed_run``.

    The runner checks no input: a KV cache of another length, layout or dtype than the package was
    compiled for is read and written out of bounds (a segfault at best). A call checks the number of
    layers and the first key and value tensor against ``cache`` (``compiled.json``'s), and refuses
    another cache in one line; the rest are the same ``KVCache``'s (under 1 us a step).
    """

    def __init__(self, runner, path: Path, cache: tuple[torch.Size, torch.dtype] | None = None):
        import torch.utils._pytree as pytree

        in_spec, out_spec = (pytree.treespec_loads(spec) for spec in runner.loader.get_call_spec())
        layers = (in_spec.num_leaves - 2) // 2
        expected = pytree.tree_flatten(((0, 0, [0] * layers, [0] * layers), {}))[1]
        if in_spec != expected or not out_spec.is_leaf():
            raise GmcError(f"{path} takes other inputs than (tokens, position, keys, values) -> logits: compile again")
        self._run = runner.loader.boxed_run
        self._path = path
        self._layers = layers
        self._shape, self._dtype = cache if cache is not None else (None, None)

    def __call__(self, tokens: torch.Tensor, position: torch.Tensor, keys, values) -> torch.Tensor:
        if len(keys) != self._layers or len(values) != self._layers or (self._shape is not None and (
                keys[0].shape != self._shape or values[0].shape != self._shape or keys[0].dtype != self._dtype
                or values[0].dtype != self._dtype or not keys[0].is_contiguous() or not values[0].is_contiguous()
                or not keys[0].is_cpu or not values[0].is_cpu)):
            self._refuse(keys, values)
        return self._run([tokens, position, *keys, *values])[0]

    def _refuse(self, keys, values) -> None:
        def described(tensors) -> str:
            if not len(tensors):
                return "none"
            first = tensors[0]
            layout = "" if first.is_contiguous() else ", not contiguous"
            layout += "" if first.is_cpu else f", on {first.device}"
            return f"{len(tensors)} x {list(first.shape)} {str(first.dtype).removeprefix('torch.')}{layout}"

        if self._shape is None:
            want, make = f"{self._layers} layers", "KVCache.empty(config, compiled.max_len)"
        else:
            dtype = str(self._dtype).removeprefix("torch.")
            want = f"{self._layers} x {list(self._shape)} {dtype}, contiguous, on the CPU"
            make = f"KVCache.empty(config, {self._shape[2]}, torch.{dtype})"
        raise GmcError(f"{self._path} reads a KV cache of {want}; got keys {described(keys)}, values "
                       f"{described(values)}: make it with {make}")


@dataclass
class CompiledLM:
    """Loaded packages: ``steps`` for ``gmc.runtime.generate``, over weights held in ``constants``."""

    steps: dict
    constants: dict = field(repr=False)  # kept alive: the packages read them in place
    max_len: int
    dtype: torch.dtype
    device: str


def has_compiled(directory: str | os.PathLike) -> bool:
    return (Path(directory) / COMPILED_DIR / INFO_FILE).is_file()


def load_compiled(directory: str | os.PathLike) -> CompiledLM:
    """The compiled programs of ``directory`` (a ``gmc lower --compile`` output), ready to run."""
    out = Path(directory) / COMPILED_DIR
    if not (out / INFO_FILE).is_file():
        raise GmcError(f"{directory} has no compiled programs: run `gmc lower ... --compile`")
    _check_owned(out)
    try:
        info = json.loads((out / INFO_FILE).read_text())
        max_len, dtype, device = int(info["max_len"]), getattr(torch, info["dtype"]), info["device"]
        aliases = {str(alias): str(name) for alias, name in info.get("aliases", {}).items()}
        cache = info.get("cache")  # (shape, dtype); absent: a step checks the layer count only
        if cache is not None:
            cache = torch.Size(int(size) for size in cache["shape"]), getattr(torch, str(cache["dtype"]), None)
            if len(cache[0]) != 4 or not isinstance(cache[1], torch.dtype):
                raise ValueError(f"cache {info['cache']!r}")
    except (ValueError, KeyError, AttributeError, TypeError) as error:
        raise GmcError(f"corrupted {out / INFO_FILE}: {error}; compile again") from error
    if info.get("torch") != torch.__version__:
        raise GmcError(f"{out} was compiled with torch {info.get('torch')}, this is {torch.__version__}: compile again")
    if device != "cpu":
        raise GmcError(f"{out} holds CUDA packages, which gmc does not load: {CUDA_PACKAGES}")
    if info.get("packed_format") != FORMAT_VERSION:  # its constants hold packed layers in that layout
        raise GmcError(f"{out} holds packed layers of format v{info.get('packed_format', 2)}, this gmc runs "
                       f"v{FORMAT_VERSION}: compile again")
    if kernel() is None:  # the library a CPU package links to (its soname)
        raise GmcError(f"{out} calls gmc's C++ CPU kernel, which this process cannot load: {backend()}")
    constants = load_on_huge_pages(out / CONSTANTS_FILE)
    constants.update({alias: constants[name] for alias, name in aliases.items() if name in constants})
    steps = {}
    for name in PROGRAMS:
        try:
            runner = torch._inductor.aoti_load_package(str(out / f"{name}.pt2"))
        except Exception as error:  # the loader raises RuntimeError with a C++ message
            first = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
            raise GmcError(f"cannot load compiled {name} program {out / (name + '.pt2')}: {first}") from error
        wanted = runner.get_constant_fqns()
        missing = sorted(set(wanted) - set(constants))
        if missing:
            raise GmcError(f"{out / CONSTANTS_FILE} lacks {missing[0]!r} ({len(missing)} missing): compile again")
        runner.load_constants({key: constants[key] for key in wanted}, check_full_update=True, user_managed=True)
        steps[name] = CompiledStep(runner, out / f"{name}.pt2", cache)
    return CompiledLM(steps, constants, max_len, dtype, device)


def _check_owned(path: Path) -> None:
    """A package runs native code: refuse one another user could have written."""
    for entry in (path, *path.iterdir()):
        info = entry.lstat()
        if stat.S_ISLNK(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
            raise GmcError(f"refusing to load compiled code from {entry}: it must be a plain file or directory "
                           f"owned by you and writable by nobody else (it runs native code when loaded)")
