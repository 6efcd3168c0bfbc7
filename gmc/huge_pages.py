"""Memory on 2 MiB pages for what a decode step streams: a compiled package's weights, read from
their safetensors file, and the KV cache.

A decode step reads each weight once. On 4 KiB pages the lowered int4 SmolLM2's 62 MiB span about
16,000 pages, five times what a core's second-level TLB maps (3,072 entries on Zen 4), so every
page of every layer costs a page walk, and the hardware prefetchers stop at each 4 KiB boundary.
On 2 MiB pages the same weights are 32 pages; the KV cache, read a few KiB per head and layer each
step, likewise. Linux backs a mapping with them when transparent huge pages are ``always`` or
``madvise`` (most distributions' default) and the mapping asks for them (``MADV_HUGEPAGE``); under
``never``, or off Linux, the mapping is ordinary memory. docs/speed.md has what it changes
("Weights on huge pages").

A file's bytes go straight from disk into the mapping (no second copy in memory); its header is
JSON, read as data, and every entry is checked against the file before a byte is placed.
"""
from __future__ import annotations

import json
import math
import mmap
import os

import torch

from gmc.errors import GmcError

HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page
ALIGN = 64  # bytes: each tensor starts on a cache line
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


def _entries(path: str, file_size: int, header: dict, start: int) -> list[tuple[str, torch.dtype, list, int, int]]:
    """(name, dtype, shape, first byte, bytes) of each tensor of a safetensors header, checked."""
    entries = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = DTYPES[entry["dtype"]], [int(n) for n in entry["shape"]], entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as error:
            raise GmcError(f"corrupted {path}: tensor {name!r} has an entry gmc cannot read ({error}); "
                           f"compile again") from error
        nbytes = math.prod(shape) * dtype.itemsize
        if not (isinstance(a, int) and isinstance(b, int) and 0 <= a <= b and b - a == nbytes
                and start + b <= file_size and min(shape, default=0) >= 0):
            raise GmcError(f"corrupted {path}: tensor {name!r} ({entry['dtype']} {shape}) does not fit bytes "
                           f"{a}..{b} of the file's data; compile again")
        entries.append((name, dtype, shape, start + a, nbytes))
    return entries


def _placed(sizes: list[int]) -> tuple[torch.Tensor, list[int]]:
    """An arena for tensors of ``sizes`` bytes and each one's offset in it (on a cache line)."""
    offsets, total = [], 0
    for nbytes in sizes:
        offsets.append(total)
        total += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return arena(total), offsets


def arena(nbytes: int) -> torch.Tensor:
    """``nbytes`` zero bytes (uint8, at least one) starting on a huge page boundary, in one anonymous
    mapping advised onto huge pages; the mapping lives as long as any view of the tensor."""
    rounded = max(HUGE_PAGE, (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE)
    mapping = mmap.mmap(-1, rounded + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds `mapping` alive
    start = -whole.data_ptr() % HUGE_PAGE  # the first huge page boundary inside the mapping
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE, start, rounded)
    return whole[start:start + max(nbytes, 1)]


def zeros_on_huge_pages(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Zero tensors of ``shapes`` and ``dtype`` on the CPU, each contiguous on a cache line, in one
    mapping advised onto huge pages."""
    sizes = [math.prod(shape) * dtype.itemsize for shape in shapes]
    memory, offsets = _placed(sizes)
    return [memory[offset:offset + nbytes].view(dtype).view(shape)
            for shape, nbytes, offset in zip(shapes, sizes, offsets)]


def load_on_huge_pages(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of safetensors file ``path`` on the CPU, by name, in one mapping advised onto huge
    pages (each tensor contiguous, on a cache line). The mapping lives as long as any of them."""
    path = str(path)
    try:
        file = open(path, "rb")
    except OSError as error:
        raise GmcError(f"cannot read {path}: {error.strerror or error}; compile again") from error
    with file:
        file_size = os.fstat(file.fileno()).st_size
        try:
            length = int.from_bytes(file.read(8), "little")
            if not 0 < length <= file_size - 8:
                raise ValueError(f"a header of {length} bytes in a file of {file_size}")
            header = json.loads(file.read(length))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
        except ValueError as error:
            raise GmcError(f"corrupted {path}: {error}; compile again") from error
        entries = sorted(_entries(path, file_size, header, 8 + length), key=lambda entry: entry[3])
        memory, offsets = _placed([nbytes for *_, nbytes in entries])
        tensors = {}
        for (name, dtype, shape, first, nbytes), offset in zip(entries, offsets):
            file.seek(first)
            if file.readinto(memory[offset:offset + nbytes].numpy()) != nbytes:
                raise GmcError(f"corrupted {path}: tensor {name!r} is cut short; compile again")
            tensors[name] = memory[offset:offset + nbytes].view(dtype).view(shape)
    return tensors
