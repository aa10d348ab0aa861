"""train.phases: each phase's time, its own sampled peak RSS and the job's high-water mark, kept when it raises."""

import json
import time

import numpy as np
import pytest

from specdistill.train import phases


@pytest.fixture(autouse=True)
def no_earlier_phases(monkeypatch):
    monkeypatch.setattr(phases, "_finished", [])
    monkeypatch.setattr(phases, "_highest", None)


def test_a_phase_that_holds_memory_reports_it_and_the_next_does_not():
    with phases.phase("holds 600 MB"):
        block = np.ones(75_000_000)  # 600 MB (0.56 GiB), touched
        time.sleep(3 * phases.SAMPLE_SECONDS)
        del block
    with phases.phase("idle"):
        time.sleep(2 * phases.SAMPLE_SECONDS)
    held, idle = phases.finished_phases()
    assert held["name"] == "holds 600 MB" and idle["name"] == "idle"
    assert held["peak_rss_gib"] - held["end_rss_gib"] > 0.3  # the array was freed before the phase ended
    assert idle["peak_rss_gib"] < held["peak_rss_gib"] - 0.3  # a phase's peak is its own, not the job's so far
    assert idle["job_peak_rss_gib"] >= held["peak_rss_gib"]  # the high-water mark keeps the job's
    assert held["peak_anon_gib"] - idle["peak_anon_gib"] > 0.3  # an array is anonymous memory
    assert held["seconds"] >= 3 * phases.SAMPLE_SECONDS


def test_a_mapped_files_pages_count_in_the_resident_set_and_not_in_the_anonymous_peak(tmp_path):
    path = tmp_path / "weights.bin"
    np.ones(62_500_000, dtype=np.float32).tofile(path)  # 250 MB, as a safetensors file of weights is mapped
    with phases.phase("idle"):
        time.sleep(2 * phases.SAMPLE_SECONDS)
    with phases.phase("reads a mapped file"):
        weights = np.memmap(path, dtype=np.float32, mode="r")
        assert float(weights[::1024].sum()) == len(range(0, 62_500_000, 1024))  # a float a 4 KiB page: all touched
        time.sleep(3 * phases.SAMPLE_SECONDS)
        del weights
    idle, mapped = phases.finished_phases()
    file_backed = [p["peak_rss_gib"] - p["peak_anon_gib"] for p in (idle, mapped)]
    assert file_backed[1] - file_backed[0] > 0.2  # 0.23 GiB of the file resident
    assert mapped["peak_anon_gib"] - idle["peak_anon_gib"] < 0.05
    assert "of it anonymous" in phases.describe(mapped)


def test_a_phase_that_raises_is_still_recorded():
    with pytest.raises(ValueError), phases.phase("fails"):
        raise ValueError("bad input")
    assert [p["name"] for p in phases.finished_phases()] == ["fails"]


def test_written_phases_are_the_finished_ones_whole(tmp_path):
    with phases.phase("one"):
        pass
    path = tmp_path / "work" / "phases.json"
    phases.write_phases(path)
    assert json.loads(path.read_text()) == phases.finished_phases()
    assert list(path.parent.iterdir()) == [path]  # no temporary file left beside it


def test_without_proc_status_the_time_is_kept_and_memory_is_none(monkeypatch, tmp_path):
    monkeypatch.setattr(phases, "_STATUS", tmp_path / "absent")
    with phases.phase("elsewhere"):
        pass
    (record,) = phases.finished_phases()
    assert record["peak_rss_gib"] is None and record["peak_anon_gib"] is None and record["seconds"] >= 0
    assert "memory not measured" in phases.describe(record)
