"""The kernel weights' arena of 2 MiB pages (models.huge_pages): the same values, aligned, in memory the kernel may
back with huge pages; nothing changes where the pages cannot be had."""

import os

import pytest
import torch

from specdistill.models import huge_pages
from specdistill.models.huge_pages import ALIGN, HugePageArena, huge_pages_unavailable, in_huge_pages


def mapping_flags(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address`."""
    flags, inside = {}, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            start, end = (int(a, 16) for a in head.split("-"))
            if inside:
                break
            inside = start <= address < end
        elif inside:
            key, _, value = line.partition(":")
            flags[key] = value.strip()
    return flags


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int32, torch.float32, torch.float16])
def test_copy_keeps_values_dtype_shape_and_aligns(dtype):
    arena = HugePageArena(chunk=1 << 20)
    source = [(torch.randn(3, 5, 7) * 50).to(dtype) for _ in range(4)]
    copies = [arena.copy(t) for t in source]
    for t, c in zip(source, copies):
        assert c.dtype == t.dtype and c.shape == t.shape and torch.equal(c, t)
        assert c.data_ptr() % ALIGN == 0 and c.data_ptr() != t.data_ptr()
    t = source[0].clone()
    t.add_(1)  # a copy, not a view of the source
    assert torch.equal(copies[0], source[0])


def test_a_tensor_larger_than_a_chunk_gets_a_mapping_of_its_own():
    arena = HugePageArena(chunk=1 << 16)
    small, large = arena.copy(torch.ones(100)), arena.copy(torch.arange(1 << 20, dtype=torch.float32))
    assert torch.equal(large, torch.arange(1 << 20, dtype=torch.float32)) and torch.equal(small, torch.ones(100))


def test_empty_tensor():
    assert HugePageArena().copy(torch.empty(0, 4)).shape == (0, 4)


@pytest.mark.skipif(huge_pages_unavailable() is not None, reason=str(huge_pages_unavailable()))
def test_the_arena_is_advised_huge_pages():
    t = in_huge_pages(torch.ones(1 << 19))  # 2 MiB of floats
    flags = mapping_flags(t.data_ptr())
    assert flags.get("THPeligible") == "1", flags
    plain = torch.ones(1 << 19)
    if "[madvise]" in huge_pages.THP_SETTING.read_text() and not os.environ.get("THP_MEM_ALLOC_ENABLE"):
        # torch's own memory is not advised (unless told to be before it started)
        assert mapping_flags(plain.data_ptr()).get("THPeligible") == "0"


def test_switched_off_returns_the_tensor_itself(monkeypatch):
    monkeypatch.setenv(huge_pages.NO_HUGE_PAGES_ENV, "1")
    t = torch.ones(10)
    assert in_huge_pages(t) is t and "SPECDISTILL_NO_HUGE_PAGES" in huge_pages_unavailable()
