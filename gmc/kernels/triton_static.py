"""The CUDA kernel's machine code without a GPU: compile a launch for an NVIDIA target, read its SASS.

    python -m gmc.kernels.triton_static [--json PATH]    # every launch of the matrix below, a line each

The ``triton`` wheel ships ``ptxas`` and ``cuobjdump``, so on any machine a launch that
``gmc.kernels.triton_group_sparse.plan_launch`` plans (on ``meta`` tensors: only dtypes, sizes and
16-byte alignment matter) compiles for sm_90 or sm_80 as the GPU's own launch would: the same
signature, the same specialisation of aligned pointers and of integers divisible by 16 or equal to
one, the same block sizes. What that answers without a GPU (``tests/kernels/test_triton_static.py``):

- registers, and local memory (spills, or an array the compiler could not keep in registers);
- how wide the value loads are: ``LDG.E.128`` (a direct 16-byte load) or ``LDGSTS.E.BYPASS.128``
  (a 16-byte asynchronous copy into shared memory, what a pipelined loop issues), and that the loop
  issues no load of one value's width;
- atomics: none in an unsplit launch (each output is written once); a split one (decode programs
  sharing a tile's entries) stores its partial sums and counts itself in with one ordered atomic a
  program (its fence included): no reductions, never one atomic per element;
- how wide the stores are: the dense-weight launch of a prefill (``plan_dense``) writes the whole
  weight, ``STG.E.128`` only.

``launch_matrix`` is what the command and the test compile: decode (1, 16 tokens) and prefill
(2,048) launches of LLaMA-2-7B-shaped 1x256, 1x64 and 32x32 layers; fp16, bf16 and fp32 (IEEE
and TF32 products); float, int8 and int4 values; sm_90, and sm_80 for the bf16 ones; and the
dense-weight launches a prefill makes of the same layers. Triton
compiles a kernel the interpreter runs (``TRITON_INTERPRET=1``) only as Python, so the command
must run without it. Triton caches what it compiles; the disassembly is kept beside it, by the
cubin's hash (``_disassemble``), so a second run reads no SASS it has read before.
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from gmc.kernels.triton_group_sparse import Launch, dot4_config

_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
          torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8"}


@dataclass(frozen=True)
class Machine:
    """What one compiled launch is: its SASS and the resources ``cuobjdump`` reports."""

    sass: str
    registers: int
    local_bytes: int  # local memory and stack frame a thread: spills, or arrays indexed at run time

    def loop_lines(self) -> list[str]:
        """SASS lines inside a loop: between a backward branch's target and the branch."""
        lines = self.sass.splitlines()
        at = [int(m.group(1), 16) if (m := re.match(r"^\s*/\*([0-9a-f]+)\*/", line)) else None for line in lines]
        spans = [(int(m.group(1), 16), address) for line, address in zip(lines, at)
                 if address is not None and (m := re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", line))
                 and int(m.group(1), 16) < address]
        return [line for line, address in zip(lines, at)
                if address is not None and any(low <= address <= high for low, high in spans)]

    def instructions(self, opcode: str) -> list[str]:
        """SASS lines whose opcode starts with ``opcode`` (``LDG``, ``LDGSTS``, ``ATOM``, ``RED``)."""
        pattern = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?" + re.escape(opcode) + r"[\s.]")
        return [line.strip() for line in self.sass.splitlines() if pattern.match(line)]


def _bin(tool: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool)


def compile_launch(launch: Launch, arch: int = 90) -> Machine:
    """``launch`` compiled for ``sm_<arch>`` (90: H100/H200, 80: A100), as its GPU launch would be."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = launch.kernel.arg_names
    signature, constexprs, attrs = {}, dict(launch.constexprs), {}
    for index, (name, value) in enumerate(zip(names, launch.args)):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:  # meta tensors: 0; a fresh CUDA allocation: 256-aligned
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif value == 1:  # Triton makes an integer argument equal to 1 a constant
            signature[name], constexprs[name] = "constexpr", 1
        else:
            signature[name] = "i64" if abs(value) >= 2 ** 31 else "i32"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    for name in launch.constexprs:
        signature[name] = "constexpr"
    signature = {name: signature[name] for name in names}  # the kernel's parameter order
    source = ASTSource(launch.kernel, signature, constexprs, attrs)
    options = {"num_warps": launch.config.num_warps, "num_stages": launch.config.num_stages}
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    sass, usage = _disassemble(compiled.asm["cubin"])
    found = {key: int(value) for key, value in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", usage)}
    return Machine(sass, found.get("REG", 0), found.get("STACK", 0) + found.get("LOCAL", 0))


def _disassemble(cubin: bytes) -> tuple[str, str]:
    """``cuobjdump``'s SASS and resource usage of ``cubin``. Disassembling takes about half a second a
    launch, so the text is kept (gzipped JSON) in Triton's cache directory under a hash of the cubin
    and the Triton release whose ``cuobjdump`` wrote it: the same bytes always read the same."""
    import triton

    key = hashlib.sha256(triton.__version__.encode() + b"\0" + cubin).hexdigest()
    kept = _sass_cache() / f"{key}.json.gz"
    try:
        sass, usage = json.loads(gzip.decompress(kept.read_bytes()))
        return sass, usage
    except (OSError, EOFError, ValueError):  # not there yet, or a torn or foreign file: disassemble again
        pass
    with tempfile.TemporaryDirectory(prefix="gmc-sass-") as scratch:
        path = os.path.join(scratch, "kernel.cubin")
        Path(path).write_bytes(cubin)
        sass = subprocess.run([_bin("cuobjdump"), "-sass", path], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([_bin("cuobjdump"), "-res-usage", path], capture_output=True, text=True,
                               check=True).stdout
    try:  # written whole, then renamed into place: a reader never sees half a file
        kept.parent.mkdir(parents=True, exist_ok=True)
        partial = kept.with_name(f"{kept.name}.{os.getpid()}.partial")
        partial.write_bytes(gzip.compress(json.dumps([sass, usage]).encode()))
        os.replace(partial, kept)
    except OSError:  # a read-only cache directory: keep going without it
        pass
    return sass, usage


def _sass_cache() -> Path:
    try:
        from triton import knobs

        return Path(knobs.cache.dir) / "gmc-sass"
    except (ImportError, AttributeError):  # a Triton without knobs reads TRITON_CACHE_DIR itself
        return Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache")) / "gmc-sass"


LAYERS = {"1x256": (4096, 4096, 256, 128), "1x64": (4096, 11008, 64, 128), "32x32": (4096, 4096, 32, 64)}
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "tf32": torch.float32}


def _meta_layer(layer: str, float_dtype: torch.dtype, how: str) -> tuple:
    """``(values, entries, tile_ptr, scales)`` of a tiled ``layer`` of ``LAYERS`` at 50%, on ``meta``."""
    d_out, d_in, g_in, tile_r = LAYERS[layer]
    meta = dict(device="meta")
    value_dtype = {"none": float_dtype, "int8": torch.int8, "int4": torch.uint8}[how]
    values = torch.empty(d_out * d_in // 2, dtype=value_dtype, **meta)
    entries = torch.empty(-(-d_out // tile_r) * -(-d_in // g_in), 3 + tile_r // 16, dtype=torch.int32, **meta)
    tile_ptr = torch.empty(-(-d_out // tile_r) + 1, dtype=torch.int32, **meta)
    scales = None if how == "none" else torch.empty(d_out * d_in // 16, **meta,
                                                    dtype=torch.float32 if how == "int8" else torch.float16)
    return values, entries, tile_ptr, scales


def meta_launch(layer: str, dtype: str, how: str, tokens: int, arch: int = 90, config=None) -> Launch:
    """The launch the op plans for a ``layer`` of ``LAYERS`` on an ``sm_<arch>`` GPU of 132 multiprocessors
    (``dtype`` ``tf32``: fp32 with TF32 allowed); ``config``: other block sizes than its default."""
    from gmc.kernels.triton_group_sparse import default_config, plan_launch, workspace_sizes

    d_out, d_in, g_in, tile_r = LAYERS[layer]
    float_dtype = _DTYPES[dtype]
    meta = dict(device="meta")
    values, entries, tile_ptr, scales = _meta_layer(layer, float_dtype, how)
    x, out = torch.empty(tokens, d_in, dtype=float_dtype, **meta), torch.empty(tokens, d_out, dtype=float_dtype, **meta)
    bias = torch.empty(d_out, dtype=float_dtype, **meta)
    allow = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        gpu = (132, arch // 10)
        config = config or default_config(x, values, entries, scales, d_out, g_in, gpu)
        sums, arrived = workspace_sizes(tokens, d_out, tile_r, config)
        workspace = (torch.empty(sums, dtype=torch.float32, **meta), torch.empty(arrived, dtype=torch.int32, **meta))
        return plan_launch(x, values, entries, tile_ptr, bias, out, d_out, g_in, scales, config, gpu, workspace)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow


def meta_dense(layer: str, dtype: str, how: str) -> Launch:
    """The dense-weight launch (``plan_dense``) of a prefill of a ``layer`` of ``LAYERS``, the weight in ``dtype``."""
    from gmc.kernels.triton_group_sparse import plan_dense

    d_out, d_in, g_in, _ = LAYERS[layer]
    values, entries, tile_ptr, scales = _meta_layer(layer, _DTYPES[dtype], how)
    dense = torch.empty(d_out, d_in, dtype=_DTYPES[dtype], device="meta")
    return plan_dense(values, entries, tile_ptr, dense, d_out, d_in, g_in, scales)


def launch_matrix():
    """``(name, launch, arch)`` of every launch the checks compile: the defaults, each one-token int4 launch
    with its codes made floats through the mantissa too (``KernelConfig.mantissa``; ``int4-mantissa`` in
    the name), each one-token int8 and int4 launch with bf16 x by integer dot products (``dot4_config``;
    ``int8-dot4``, ``int4-dot4``), and the dense-weight launches of a prefill (``plan_dense``; names ending
    ``dense weight``)."""
    for layer in LAYERS:
        for dtype in _DTYPES:
            for how in ("none", "int8", "int4"):
                if (how == "int4" and LAYERS[layer][2] % 8) or (dtype == "tf32" and how != "none"):
                    continue
                for tokens in (1, 16, 2048):
                    for arch in (90, 80) if dtype == "bf16" and layer == "1x256" else (90,):
                        launch = meta_launch(layer, dtype, how, tokens, arch)
                        yield f"{layer} {dtype} {how} T={tokens} sm_{arch}", launch, arch
                        if how == "int4" and tokens == 1:
                            config = dataclasses.replace(launch.config, mantissa=True)
                            yield (f"{layer} {dtype} int4-mantissa T=1 sm_{arch}",
                                   meta_launch(layer, dtype, how, tokens, arch, config), arch)
                        if how != "none" and tokens == 1 and dtype == "bf16":
                            _, _, g_in, tile_r = LAYERS[layer]
                            config = dot4_config(launch.config, tile_r, -(-g_in // 32) * 32, how)
                            yield (f"{layer} {dtype} {how}-dot4 T=1 sm_{arch}",
                                   meta_launch(layer, dtype, how, tokens, arch, config), arch)
        for dtype in ("bf16", "fp32"):
            for how in ("none", "int8", "int4"):
                yield f"{layer} {dtype} {how} sm_90 dense weight", meta_dense(layer, dtype, how), 90


# loads of one value's width (a byte, for int8 and int4 codes): what a 16-byte path never issues
_NARROW = {torch.float16: ("LDG.E.U16", "LDG.E.S16"), torch.bfloat16: ("LDG.E.U16", "LDG.E.S16"),
           torch.int8: ("LDG.E.U8", "LDG.E.S8"), torch.uint8: ("LDG.E.U8", "LDG.E.S8")}


def summarize(machine: Machine, launch: Launch) -> dict:
    """What the checks read of a compiled launch."""
    values = launch.args[launch.kernel.arg_names.index("values_ptr")].dtype
    # the values are read in the loop (after it: the bias, a program's few outputs of the same width); the
    # dense-weight launch has no loop and reads nothing else of their width
    lines = machine.loop_lines() if launch.config.block_t else machine.sass.splitlines()
    narrow = [line for line in lines if any(op in line for op in _NARROW.get(values, ()))]
    config = launch.config
    loop = lines if config.block_t else []
    weights = config.sub_r * config.block_k // (32 * config.num_warps) if config.block_t else 0
    return {"config": dataclasses.asdict(launch.config), "values": str(values).removeprefix("torch."),
            "registers": machine.registers, "local_bytes": machine.local_bytes,
            "wide_loads": len(machine.instructions("LDG.E.128") + machine.instructions("LDGSTS.E.BYPASS.128")),
            "stores": len(machine.instructions("STG")), "wide_stores": len(machine.instructions("STG.E.128")),
            "narrow_value_loads": len(narrow),
            "split": launch.config.split,
            # a split program stores its partial sums and counts itself in with one ordered atomic
            # (MEMBAR, ATOMG); nothing else may touch memory atomically (REDG: reductions)
            "reductions": len(machine.instructions("REDG")) + len(machine.instructions("RED")),
            "ordered_atomics": len(machine.instructions("ATOMG")) + len(machine.instructions("ATOM")),
            "fences": sum(".GPU" in line or ".SYS" in line for line in machine.instructions("MEMBAR")),  # not CTA ones
            "tensor_core_ops": len(machine.instructions("HMMA")) + len(machine.instructions("HGMMA")),
            "cuda_core_fmas": len(machine.instructions("FFMA")),
            # what a step issues a thread, against the weights it reads in the step (rows x columns over the
            # launch's threads); integer-to-float conversions run at a fraction of the FMA rate
            "loop_instructions": len(loop), "weights_a_thread_step": weights,
            "int_to_float": sum(bool(re.search(r"\sI2F", line)) for line in loop),
            "dot_products": sum(bool(re.search(r"\sIDP", line)) for line in loop)}  # dp4a: 4 products each


def main() -> None:
    parser = argparse.ArgumentParser(description="Compile the CUDA kernel's launches for sm_90/sm_80 and read the SASS")
    parser.add_argument("--json", metavar="PATH", help="write every launch's summary here")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("TRITON_INTERPRET=1 makes the kernel Python: run without it")
    found = {}
    for name, launch, arch in launch_matrix():
        found[name] = summarize(compile_launch(launch, arch), launch)
        row = found[name]
        print(f"{name:<32} {row['registers']:>3} regs  local {row['local_bytes']:>4} B  16-byte loads "
              f"{row['wide_loads']:>3}  narrow value loads {row['narrow_value_loads']}  split {row['split']}: "
              f"reductions {row['reductions']}, ordered atomics {row['ordered_atomics']}, fences {row['fences']}  "
              f"tensor-core ops {row['tensor_core_ops']}"
              + (f"  a step: {row['loop_instructions'] / row['weights_a_thread_step']:.1f} instructions a weight, "
                 f"{row['int_to_float']} int-to-float, {row['dot_products']} dp4a"
                 if row["weights_a_thread_step"] else ""),
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
