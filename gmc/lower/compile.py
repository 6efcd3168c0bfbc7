"""The compile step of the lowering stage: prefill and decode programs -> AOTInductor packages.

``gmc lower --compile`` (the packed backend) and ``gmc generate --compile`` on the CPU run it; what
it writes, and how a package is loaded, is ``gmc.formats.compiled``. On the CPU each gmc op is a
direct call of its C shim in ``libgmc_ops.so`` (the package links against that soname).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Mapping

import torch

from gmc.formats.compiled import COMPILED_DIR, CONSTANTS_FILE, INFO_FILE, RUNTIME_LIBRARY, SCHEMAS, program_constants
from gmc.formats.hf_checkpoint import FORMAT_VERSION
from gmc.graph.decode import PROGRAMS
from gmc.kernels.cpu_group_sparse import C_SHIMS, SONAME

# always_keep_tensor_constants: Inductor inlines constants of up to 8 numbers, so every packed
# layer's row_ptr was rebuilt by a generated kernel into a fresh buffer before each op call (~3 us
# a call, 121 calls a SmolLM2 token: docs/lowering.md).
INDUCTOR_CONFIGS = {"aot_inductor.package_constants_in_so": False, "always_keep_tensor_constants": True}


def compile_programs(programs: Mapping[str, torch.export.ExportedProgram], directory: str | os.PathLike,
                     max_len: int) -> Path:
    """AOTInductor-compile ``programs`` (``prefill`` and ``decode``) into ``directory/compiled``."""
    from safetensors.torch import save_file

    from gmc.kernels.cpu_group_sparse import build_runtime_library

    out = Path(directory) / COMPILED_DIR
    out.mkdir(parents=True, exist_ok=True)
    constants = {name: tensor for program in programs.values() for name, tensor in program_constants(program).items()}
    device = next(iter(constants.values())).device
    runtime = build_runtime_library(SCHEMAS) if device.type == "cpu" else None
    for name in PROGRAMS:
        with warnings.catch_warnings(), _linking(runtime):  # torch's pickling of tree specs warns about itself
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            torch._inductor.aoti_compile_and_package(programs[name], package_path=str(out / f"{name}.pt2"),
                                                     inductor_configs=_configs(runtime))
    stored, aliases = _tied_once(constants)
    save_file({name: tensor.detach().contiguous().cpu() for name, tensor in stored.items()}, str(out / CONSTANTS_FILE))
    if runtime is not None:
        shutil.copyfile(runtime, out / RUNTIME_LIBRARY)
    dtype = next(t for t in constants.values() if t.is_floating_point()).dtype
    keys = programs["decode"].example_inputs[0][2]  # the cache a step reads and writes (static shapes)
    info = {"max_len": max_len, "dtype": str(dtype).removeprefix("torch."), "device": device.type,
            "torch": torch.__version__, "packed_format": FORMAT_VERSION, "aliases": aliases,
            "cache": {"layers": len(keys), "shape": list(keys[0].shape),
                      "dtype": str(keys[0].dtype).removeprefix("torch.")}}
    (out / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return out


def _configs(runtime: Path | None) -> dict:
    """Inductor configs of a package; with the CPU runtime library, the op as a call of its C shim."""
    if runtime is None:
        return INDUCTOR_CONFIGS
    shims = {getattr(torch.ops.gmc, name).default: [declaration] for name, declaration in C_SHIMS.items()}
    return {**INDUCTOR_CONFIGS, "aot_inductor.custom_ops_to_c_shims": shims,
            "aot_inductor.custom_op_libs": [SONAME.removeprefix("lib").removesuffix(".so")]}


@contextlib.contextmanager
def _linking(runtime: Path | None):
    """The runtime library's directory on the linker's search path (``LIBRARY_PATH``) while
    Inductor links a package against it."""
    saved = os.environ.get("LIBRARY_PATH")
    if runtime is not None:
        os.environ["LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(runtime.parent), saved]))
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("LIBRARY_PATH", None)
        else:
            os.environ["LIBRARY_PATH"] = saved


def _tied_once(constants: Mapping[str, torch.Tensor]) -> tuple[dict, dict]:
    """Each tensor once (safetensors refuses shared memory), and ``{alias: stored name}`` for
    tied ones such as ``lm_head.weight`` -> ``embed_tokens.weight``."""
    stored, aliases, seen = {}, {}, {}
    for name, tensor in constants.items():
        ident = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.dtype)
        if ident in seen:
            aliases[name] = seen[ident]
        else:
            seen[ident] = name
            stored[name] = tensor
    return stored, aliases
