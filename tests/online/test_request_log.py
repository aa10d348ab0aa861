"""The request log: rotation never loses or repeats a line, partial lines wait, cut lines are reported."""

from __future__ import annotations

import json

from specdistill.decode.request_log import LogPosition, RequestLogWriter, list_segments, read_lines, segment_name

START = LogPosition()  # a log's beginning (frozen: safe as a shared default)


def read_all(log_dir, start=START, batch=3):
    got, pos = [], start
    while lines := read_lines(log_dir, pos, batch):
        got += lines
        pos = lines[-1].end
    return got, pos


def test_rotation_mid_read_loses_and_repeats_nothing(tmp_path):
    writer = RequestLogWriter(tmp_path, max_bytes=1024)
    got, pos, written = [], LogPosition(), []
    for i in range(120):
        rec = {"id": f"r{i}", "pad": "x" * (i % 37)}
        writer.append(rec)
        written.append(rec)
        if i % 7 == 0:  # the reader catches up in small bites while the writer rotates under it
            lines, pos = read_all(tmp_path, pos, batch=2)
            got += lines
    lines, pos = read_all(tmp_path, pos)
    got += lines
    assert len(list_segments(tmp_path)) > 3
    assert [json.loads(x.raw) for x in got] == written
    assert not any(x.truncated for x in got)


def test_a_partial_last_line_waits_for_its_newline(tmp_path):
    (tmp_path / segment_name(0)).write_bytes(b'{"id": "a"}\n{"id": "b"')
    lines, pos = read_all(tmp_path)
    assert [x.raw for x in lines] == [b'{"id": "a"}']
    with open(tmp_path / segment_name(0), "ab") as f:
        f.write(b"}\n")
    lines, _ = read_all(tmp_path, pos)
    assert [x.raw for x in lines] == [b'{"id": "b"}']


def test_a_cut_line_in_a_closed_segment_is_reported_truncated_and_reading_goes_on(tmp_path):
    (tmp_path / segment_name(0)).write_bytes(b'{"id": "a"}\n{"id": "b", "cut')
    writer = RequestLogWriter(tmp_path)  # a restarted server starts the next segment
    writer.append({"id": "c"})
    lines, _ = read_all(tmp_path)
    assert [(x.raw, x.truncated) for x in lines] == [(b'{"id": "a"}', False), (b'{"id": "b", "cut', True),
                                                     (b'{"id":"c"}', False)]
    assert writer.segment == 1
