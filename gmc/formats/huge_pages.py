"""A safetensors file read onto 2 MiB pages: one anonymous mapping holding the tensors a decode step streams.

A decode step reads each weight once. On 4 KiB pages the lowered int4 SmolLM2's 62 MiB span about
16,000 pages, five times what a core's second-level TLB maps (3,072 entries on Zen 4), so every
page of every layer costs a page walk, and the hardware prefetchers stop at each 4 KiB boundary.
On 2 MiB pages the same weights are 32 pages. Linux backs a mapping with them when transparent huge
pages are ``always`` or ``madvise`` (most distributions' default) and the mapping asks for them
(``MADV_HUGEPAGE``); under ``never``, or off Linux, the mapping is ordinary memory.
docs/speed.md has what it changes ("Weights on huge pages").

The file's bytes go straight from disk into the mapping (no second copy in memory); its header is
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


def load_on_huge_pages(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of safetensors file ``path`` on the CPU, by name, in one mapping advised onto huge
    pages (each tensor contiguous, on a cache line). The mapping lives as long as any of them."""
    path = str(path)
    with open(path, "rb") as file:
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
        entries = _entries(path, file_size, header, 8 + length)
        size = sum((nbytes + ALIGN - 1) // ALIGN * ALIGN for *_, nbytes in entries)
        rounded = (size + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
        mapping = mmap.mmap(-1, max(rounded, 1) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        arena = torch.frombuffer(mapping, dtype=torch.uint8)  # holds `mapping` alive
        offset = -arena.data_ptr() % HUGE_PAGE  # the first huge page boundary inside the mapping
        if rounded and hasattr(mmap, "MADV_HUGEPAGE"):
            mapping.madvise(mmap.MADV_HUGEPAGE, offset, rounded)
        window = memoryview(mapping)
        tensors = {}
        for name, dtype, shape, first, nbytes in sorted(entries, key=lambda entry: entry[3]):
            file.seek(first)
            if file.readinto(window[offset:offset + nbytes]) != nbytes:
                raise GmcError(f"corrupted {path}: tensor {name!r} is cut short; compile again")
            tensors[name] = arena[offset:offset + nbytes].view(dtype).view(shape)
            offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN
        window.release()
    return tensors
