"""train.malloc: the heap's free pages handed back while a job runs."""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time

import pytest

from specdistill.train import malloc
from specdistill.train.config import ConfigError
from specdistill.train.distill_config import DistillConfig
from specdistill.train.malloc import glibc, start_trimming, trim_periodically
from specdistill.train.online_config import OnlineConfig
from specdistill.train.phases import status_kib

MIB = 1 << 20


class CountingLibc:
    """A C library whose malloc_trim records its calls."""

    def __init__(self):
        self.calls: list[int] = []
        self.called = threading.Event()

    def malloc_trim(self, pad: int) -> int:
        self.calls.append(pad)
        if len(self.calls) >= 3:
            self.called.set()
        return 1


def test_the_thread_trims_every_interval_and_does_not_hold_the_process():
    libc = CountingLibc()
    thread = trim_periodically(0.01, libc)
    assert thread.daemon and libc.called.wait(5.0)  # a daemon: the job ends without waiting for it
    assert set(libc.calls) == {0}  # pad 0: every free page goes back


def test_a_job_that_asks_for_no_trimming_starts_no_thread(monkeypatch):
    monkeypatch.setattr(malloc, "trim_periodically", lambda *args: pytest.fail("a thread was started"))
    assert start_trimming(0, logging.getLogger("job")) is None


def test_a_job_off_glibc_goes_on_untrimmed_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(malloc, "glibc", lambda: None)
    with caplog.at_level(logging.WARNING, logger="job"):
        assert start_trimming(5.0, logging.getLogger("job")) is None
    assert "malloc_trim_seconds: not glibc" in caplog.text


@pytest.mark.parametrize("seconds", [0, -1.0])
def test_an_interval_that_is_not_positive_is_an_error_naming_the_field(seconds):
    with pytest.raises(ValueError, match="malloc_trim_seconds"):
        trim_periodically(seconds, CountingLibc())


def test_a_negative_interval_in_the_config_names_the_field(tmp_path):
    with pytest.raises(ConfigError, match="malloc_trim_seconds"):
        DistillConfig(method="eagle3", malloc_trim_seconds=-5)
    assert DistillConfig(method="eagle3", malloc_trim_seconds=0).malloc_trim_seconds == 0  # 0: never
    dirs = dict(log_dir=str(tmp_path / "logs"), store=str(tmp_path / "store"), work_dir=str(tmp_path / "work"))
    with pytest.raises(ConfigError, match="malloc_trim_seconds"):
        OnlineConfig(malloc_trim_seconds=-1, **dirs)
    assert OnlineConfig(**dirs).malloc_trim_seconds == 5.0


@pytest.mark.skipif(glibc() is None or status_kib("VmRSS") is None, reason="glibc on Linux only")
@pytest.mark.skipif(bool(os.environ.get("MALLOC_MMAP_THRESHOLD_")), reason="a fixed mmap threshold mmaps every block")
def test_trimming_gives_back_free_memory_held_between_live_blocks():
    """The mechanism the job relies on: 1 MiB blocks freed between live ones stay resident until malloc_trim."""
    libc = glibc()
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    big = libc.malloc(8 * MIB)  # freeing an mmapped block raises the mmap threshold above 1 MiB, as in training
    ctypes.memset(big, 1, 8 * MIB)
    libc.free(big)
    blocks = [libc.malloc(MIB) for _ in range(160)]
    for block in blocks:
        ctypes.memset(block, 1, MIB)  # resident
    kept = blocks[::16]  # live blocks between the freed ones (the last one pins the heap's top)
    for block in blocks:
        if block not in kept:
            libc.free(block)
    held = status_kib("VmRSS")
    libc.malloc_trim(0)
    time.sleep(0.05)
    given_back = held - status_kib("VmRSS")
    for block in kept:
        libc.free(block)
    assert given_back > 64 * 1024  # KiB: most of the 150 freed MiB
