"""load_on_huge_pages: a safetensors file's tensors, equal to safetensors' own reading, in one
mapping advised onto 2 MiB pages; a damaged file is one GmcError line."""
import gc
import json
import mmap
import struct
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from gmc.errors import GmcError
from gmc.huge_pages import ALIGN, HUGE_PAGE, load_on_huge_pages, zeros_on_huge_pages


def mixed_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "values": torch.randint(-128, 128, (3000, 7), dtype=torch.int8, generator=g),
        "codes": torch.randint(0, 256, (4097,), dtype=torch.uint8, generator=g),
        "halves": torch.randn(33, 5, generator=g).half(),
        "weight": torch.randn(700, 300, generator=g),
        "bf": torch.randn(9, generator=g).bfloat16(),
        "row_idx": torch.arange(123, dtype=torch.int64),
        "row_ptr": torch.arange(5, dtype=torch.int32),
        "keep": torch.rand(17, generator=g) > 0.5,
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``address`` (Linux)."""
    lines = open("/proc/self/smaps").read().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(part, 16) for part in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_tensors_equal_safetensors_reading_each_contiguous_on_a_cache_line(tmp_path):
    path = tmp_path / "constants.safetensors"
    save_file(mixed_tensors(), str(path))
    expected, got = load_file(str(path)), load_on_huge_pages(path)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name
        assert got[name].is_contiguous() and got[name].data_ptr() % ALIGN == 0, name


def test_the_tensors_share_one_mapping_that_starts_on_a_huge_page_and_outlives_the_dict(tmp_path):
    path = tmp_path / "constants.safetensors"
    save_file(mixed_tensors(), str(path))
    got = load_on_huge_pages(path)
    pointers = sorted(t.data_ptr() for t in got.values() if t.numel())
    assert pointers[0] % HUGE_PAGE == 0
    assert pointers[-1] - pointers[0] < 4 << 20  # one arena: ~0.9 MB of tensors
    weight = got["weight"]
    expected = load_file(str(path))["weight"]
    del got
    gc.collect()
    assert torch.equal(weight, expected)  # the mapping lives while a tensor of it does


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"),
                    reason="MADV_HUGEPAGE is Linux's")
def test_the_mapping_is_advised_onto_huge_pages(tmp_path):
    path = tmp_path / "constants.safetensors"
    save_file({"weight": torch.randn(1024, 1024)}, str(path))  # 4 MiB: two huge pages
    weight = load_on_huge_pages(path)["weight"]
    assert "hg" in _vm_flags(weight.data_ptr())  # VM_HUGEPAGE: what madvise(MADV_HUGEPAGE) sets


def _write(path, header: dict, data: bytes, length: int | None = None) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)


@pytest.mark.parametrize("case, match", [
    ("dtype", "entry gmc cannot read"),
    ("offsets", "does not fit bytes"),
    ("past the end", "does not fit bytes"),
    ("header length", "a header of"),
    ("not json", "corrupted"),
])
def test_a_damaged_file_is_one_line_naming_it(tmp_path, case, match):
    path = tmp_path / "constants.safetensors"
    entry = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    data = bytes(16)
    if case == "dtype":
        _write(path, {"w": {**entry, "dtype": "F8_E9"}}, data)
    elif case == "offsets":
        _write(path, {"w": {**entry, "data_offsets": [0, 12]}}, data)
    elif case == "past the end":
        _write(path, {"w": entry}, bytes(8))
    elif case == "header length":
        _write(path, {"w": entry}, data, length=1 << 40)
    else:
        path.write_bytes(struct.pack("<Q", 5) + b"{oops" + data)
    with pytest.raises(GmcError, match=match) as error:
        load_on_huge_pages(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_a_missing_file_is_one_line_naming_it(tmp_path):
    path = tmp_path / "constants.safetensors"
    with pytest.raises(GmcError, match="cannot read .*constants.safetensors: No such file") as error:
        load_on_huge_pages(path)
    assert "\n" not in str(error.value)


def test_zeros_are_contiguous_on_cache_lines_in_one_advised_mapping():
    shapes = [(1, 3, 7, 5), (2,), (), (0, 4), (1, 3, 7, 5)]
    tensors = zeros_on_huge_pages(shapes, torch.bfloat16)
    assert [tuple(t.shape) for t in tensors] == shapes
    for t in tensors:
        assert t.dtype == torch.bfloat16 and t.is_contiguous() and t.data_ptr() % ALIGN == 0
        assert not t.any()
    tensors[0].fill_(1.0)  # the tensors do not overlap
    assert not tensors[4].any() and not tensors[1].any()
    if sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE"):
        assert "hg" in _vm_flags(tensors[0].data_ptr())


def test_a_cpu_kv_cache_lies_on_huge_pages_and_a_step_writes_it():
    from conftest import tiny_model

    from gmc.graph.decode import CachedLM, KVCache

    model = tiny_model("llama")
    cache = KVCache.empty(model.config, 16)
    assert len(cache.keys) == len(cache.values) == model.config.num_hidden_layers
    if sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE"):
        assert "hg" in _vm_flags(cache.keys[0].data_ptr())
    lm = CachedLM(model)
    ids = torch.tensor([[1, 2, 3]])
    logits = lm(ids, torch.tensor(0), cache.keys, cache.values)
    with torch.no_grad():
        expected = model(ids).logits[:, -1]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert cache.keys[0][:, :, :3].abs().sum() > 0 and not cache.keys[0][:, :, 3:].any()
