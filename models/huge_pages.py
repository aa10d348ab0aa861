"""The weights the kernels stream every token, held in 2 MiB pages.

A real-size target's forward reads its packed K-quant blocks (1.0 GB for Qwen2.5-Coder-1.5B) once a token. In 4 KiB
pages that is a quarter of a million TLB entries a token, each walked again; in 2 MiB pages, 500. Linux gives
anonymous memory 2 MiB pages where it is advised MADV_HUGEPAGE before it is first touched (transparent huge pages in
"madvise" mode, the common default; "always" gives them anyway, "never" not at all). torch's allocator does not
advise (unless THP_MEM_ALLOC_ENABLE=1 is set before torch starts), so the kernel matrices' tensors are copied here:
`in_huge_pages(t)` returns the same values in an arena of anonymous mappings, each 2 MiB aligned and advised before
its first byte is written. Measured: docs/design/kquant-kernels.md ("Pages").

Where the advice cannot be given (not Linux, or THP "never"), or $SPECDISTILL_NO_HUGE_PAGES is set (comparisons),
`in_huge_pages` returns the tensor itself and says so once in the log: the pages are a matter of speed, never of the
numbers.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from pathlib import Path

import torch

log = logging.getLogger("specdistill.kernels")

HUGE_PAGE = 2 << 20
CHUNK = 64 << 20  # one mapping's size (larger for a larger tensor); untouched pages of it cost no memory
ALIGN = 64  # each tensor starts on a cache line, as the kernels' loads expect
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
NO_HUGE_PAGES_ENV = "SPECDISTILL_NO_HUGE_PAGES"


def huge_pages_unavailable() -> str | None:
    """Why 2 MiB pages cannot be asked for here, or None."""
    if os.environ.get(NO_HUGE_PAGES_ENV):
        return f"${NO_HUGE_PAGES_ENV} is set"
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "this OS has no MADV_HUGEPAGE"
    try:
        setting = THP_SETTING.read_text()
    except OSError as e:
        return f"cannot read {THP_SETTING}: {e}"
    return "transparent huge pages are off ([never])" if "[never]" in setting else None


class HugePageArena:
    """Hands out 64-byte aligned tensors from anonymous mappings advised MADV_HUGEPAGE before any page is touched.
    Each tensor holds its mapping: a mapping the arena has moved past is unmapped when the last tensor in it is
    freed (the one it is filling stays; its untouched pages cost no memory)."""

    def __init__(self, chunk: int = CHUNK):
        self.chunk = chunk
        self._mapping: mmap.mmap | None = None
        self._next = self._end = 0
        self._lock = threading.Lock()

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor in the arena with t's dtype, shape and values (contiguous)."""
        if t.numel() == 0:
            return t.contiguous()
        with self._lock:
            if self._mapping is None or self._next + t.nbytes > self._end:
                self._map_chunk(t.nbytes)
            mapping, start = self._mapping, self._next
            self._next += -(-t.nbytes // ALIGN) * ALIGN
        out = torch.frombuffer(mapping, dtype=torch.uint8, count=t.nbytes, offset=start)
        return out.view(t.dtype).view(t.shape).copy_(t)

    def _map_chunk(self, nbytes: int) -> None:
        size = max(self.chunk, -(-nbytes // HUGE_PAGE) * HUGE_PAGE) + HUGE_PAGE  # room to align the start
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared memory is shmem: no THP
        address = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
        start = -address % HUGE_PAGE
        mapping.madvise(mmap.MADV_HUGEPAGE, start, size - start)
        self._mapping, self._next, self._end = mapping, start, size


_arena = HugePageArena()
_reported = False


def in_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """t's values in 2 MiB pages (a copy), or t itself where they cannot be had (logged once)."""
    global _reported
    reason = huge_pages_unavailable()
    if reason is None:
        return _arena.copy(t)
    if not _reported:
        log.info("kernel weights stay in ordinary pages: %s", reason)
        _reported = True
    return t
