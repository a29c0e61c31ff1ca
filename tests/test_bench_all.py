"""bench/all.py (what `make bench` runs) shows each script's output, then the lines that
carry a ratio, and fails when a script fails."""

import sys

import pytest
from script_modules import load_script


def test_bench_all_repeats_every_ratio_line_and_reports_failures(tmp_path, monkeypatch,
                                                                  capsys):
    bench = load_script("bench/all.py")
    (tmp_path / "good.py").write_text(
        "print('combination  ms  time ratio')\n"      # a table's header: no number
        "print('good 3 workers: ratio a / b 1.250')\n"
        "print('trainer: overhead vs the bare loop +2.0%')\n"
        "print('unrelated 42')\n")
    (tmp_path / "bad.py").write_text("print('bad ratio 0.5')\nraise SystemExit(3)\n")
    monkeypatch.setattr(bench, "HERE", tmp_path)
    monkeypatch.setattr(bench, "SCRIPTS", ("good", "bad"))
    monkeypatch.setattr(sys, "argv", ["all.py"])
    with pytest.raises(SystemExit) as exit_info:
        bench.main()
    assert exit_info.value.code == 1
    out = capsys.readouterr().out
    assert "unrelated 42" in out  # the output is shown as it comes
    summary = out.split("===== ratios\n", 1)[1].splitlines()
    assert summary[0].startswith("bench/good.py (") and summary[0].endswith(" s)")
    assert summary[1:] == ["  good 3 workers: ratio a / b 1.250",
                           "  trainer: overhead vs the bare loop +2.0%",
                           "bench/bad.py (FAILED (exit 3))", "  bad ratio 0.5"]
    monkeypatch.setattr(sys, "argv", ["all.py", "nope"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "no benchmark nope; there are good, bad" in capsys.readouterr().err
