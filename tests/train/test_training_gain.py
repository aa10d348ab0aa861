"""train.tools.training_gain: what training bought at a fixed depth and what it is worth at the adaptive depth, from
two evaluation reports; a mismatching method or a missing one is an error naming it."""

import json

import pytest

from specdistill.train.tools.training_gain import main


def row(tokens_per_s, tau=None, acceptance=None, mismatches=0):
    return {"tokens_per_s": tokens_per_s, "tau": tau, "acceptance_per_position": acceptance,
            "mismatches": mismatches, "turns": 4}


def write(path, methods):
    path.write_text(json.dumps({"methods": methods}))
    return path


@pytest.fixture
def reports(tmp_path):
    fixed = write(tmp_path / "fixed.json", {
        "baseline": row(100.0), "speculative[t]": row(90.0, 1.9, [0.5, 0.3, 0.2]),
        "speculative[u]": row(70.0, 1.1, [0.1, 0.02, 0.0])})
    speed = write(tmp_path / "speed.json", {
        "baseline": row(100.0), "speculative[t]": row(99.0, 1.2), "speculative[t+prompt_lookup]": row(121.0, 1.6),
        "speculative[prompt_lookup]": row(116.0, 1.4)})
    return fixed, speed


def test_it_prints_acceptance_per_position_and_every_methods_speed_fastest_first(reports, tmp_path, capsys):
    fixed, speed = reports
    assert main(["--fixed-depth", str(fixed), "--speed", str(speed), "--trained", "t", "--untrained", "u"]) == 0
    out = capsys.readouterr().out
    assert "       1        0.10      0.50" in out and "       3        0.00      0.20" in out
    assert "tau (tokens per target forward): 1.10 untrained, 1.90 trained" in out
    order = [out.index(f"speculative[{m}]: ") for m in ("t+prompt_lookup", "prompt_lookup", "t")]
    assert order == sorted(order) and "speculative[t+prompt_lookup]: 1.21x" in out
    assert (tmp_path / "acceptance_gain.png").stat().st_size > 0


def test_a_mismatching_method_or_a_missing_one_is_an_error_naming_it(reports, tmp_path, capsys):
    fixed, speed = reports
    bad = write(tmp_path / "bad.json", {"baseline": row(100.0), "speculative[t]": row(99.0, mismatches=2)})
    with pytest.raises(SystemExit):
        main(["--fixed-depth", str(fixed), "--speed", str(bad), "--trained", "t", "--untrained", "u"])
    assert "speculative[t]: 2 of 4 turns differ" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--fixed-depth", str(fixed), "--speed", str(speed), "--trained", "x", "--untrained", "u"])
    assert "no method 'speculative[x]'" in capsys.readouterr().err
