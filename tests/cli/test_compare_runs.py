import json

import yaml
from script_modules import load_tool

compare_runs = load_tool("compare-runs")


def fake_run(path, seed, rsum, i2t=50.0, t2i=40.0, logged=None):
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump({"train": {"seed": seed}}))
    test = {"i2t_r1": i2t, "t2i_r1": t2i, "rsum": rsum}
    (path / "report.json").write_text(json.dumps({"test": test}))
    records = [{"type": "train", "step": 10, "positive_median": 0.0, "lam": 0.0},
               {"type": "val", "epoch": 0, "rsum": 1.0},
               {"type": "train", "step": 20, **(logged or {})}]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_paired_differences_and_last_scores(tmp_path, capsys):
    fake_run(tmp_path / "a" / "seed0", 0, 500.0, i2t=50.0)
    fake_run(tmp_path / "a" / "seed1", 1, 510.0, i2t=52.0)
    fake_run(tmp_path / "a" / "seed2", 2, 432.2199999999999)
    fake_run(tmp_path / "b" / "lam=0.5" / "seed1", 1, 508.0,
             logged={"positive_median": 0.7, "negative_median": 0.3, "lam": 0.5})
    fake_run(tmp_path / "b" / "lam=0.5" / "seed0", 0, 505.0,
             logged={"positive_median": 0.5, "negative_median": 0.2, "lam": 0.4})
    fake_run(tmp_path / "c" / "seed2", 2, 432.22)  # the same recalls summed in another order
    out = tmp_path / "table.md"
    assert compare_runs.main([f"ctl={tmp_path}/a/seed[01]", f"{tmp_path}/b/lam=0.5/seed*",
                              "--out", str(out)]) == 0
    rows = out.read_text().splitlines()
    # the control's last logged values come from step 10 (step 20 logged none of them)
    assert rows[2] == ("| ctl | 2 | 51.0 ± 1.4 | 40.0 ± 0.0 | 505.0 ± 7.1 |  |  | 0.00 ± 0.00 "
                       "|  | 0.00 ± 0.00 |")
    # paired by seed: 505 - 500 = +5, 508 - 510 = -2; ahead on one seed of two
    # scores of the last logged step: (0.5 + 0.7) / 2, (0.2 + 0.3) / 2, (0.4 + 0.5) / 2
    assert rows[3] == (f"| {tmp_path}/b/lam=0.5/seed* | 2 | 50.0 ± 0.0 | 40.0 ± 0.0 | "
                       f"506.5 ± 2.1 | 1.5 ± 4.9 (n=2) | 1/2 | 0.60 ± 0.14 | 0.25 ± 0.07 | "
                       f"0.45 ± 0.07 |")
    assert capsys.readouterr().out == out.read_text()
    assert compare_runs.main([f"{tmp_path}/a/seed*", f"tie={tmp_path}/c/seed*"]) == 0
    assert "| 0.0 (n=1) | 0/1 |" in capsys.readouterr().out
    assert compare_runs.main([f"{tmp_path}/a/seed*", "--prefix", "itc_"]) == 2
    assert "no test metric 'itc_rsum'; check --prefix" in capsys.readouterr().err


def test_unfinished_run_and_empty_glob_are_errors(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    assert compare_runs.main([str(tmp_path / "run")]) == 2
    assert "has no report.json: the run has not finished" in capsys.readouterr().err
    assert compare_runs.main([f"x={tmp_path}/missing*"]) == 2
    assert "no run directory matches" in capsys.readouterr().err


def test_runs_on_other_test_sets_or_a_seed_twice_are_not_compared(tmp_path, capsys):
    same = [["test-0.tar", 100, "1a2b"]]
    for group, seed, listing in (("a", 0, same), ("a", 1, same),
                                 ("b", 0, [["test-0.tar", 100]]),  # a report before digests
                                 ("c", 0, [["test-0.tar", 90, "1a2b"]]),
                                 ("e", 0, [["test-0.tar", 100, "3c4d"]])):  # other content
        fake_run(tmp_path / group / f"seed{seed}", seed, 500.0)
        report = tmp_path / group / f"seed{seed}" / "report.json"
        report.write_text(json.dumps({**json.loads(report.read_text()), "test_set": listing}))
    assert compare_runs.main([f"{tmp_path}/a/seed*", f"{tmp_path}/b/seed*"]) == 0
    capsys.readouterr()
    assert compare_runs.main([f"{tmp_path}/a/seed*", f"{tmp_path}/c/seed*"]) == 2
    assert (f"{tmp_path}/a/seed0 and {tmp_path}/c/seed0 were tested on different test sets "
            f"([['test-0.tar', 100, '1a2b']] vs [['test-0.tar', 90, '1a2b']])"
            ) in capsys.readouterr().err
    assert compare_runs.main([f"{tmp_path}/a/seed*", f"{tmp_path}/e/seed*"]) == 2
    assert "were tested on different test sets" in capsys.readouterr().err
    fake_run(tmp_path / "dup" / "first", 0, 400.0)  # seed 0 twice in one group
    fake_run(tmp_path / "dup" / "second", 0, 410.0)
    assert compare_runs.main([f"ctl={tmp_path}/dup/*"]) == 2
    assert "group 'ctl' has seed 0 more than once" in capsys.readouterr().err
    # a report without test metrics (no data.test) is an error, not a traceback
    fake_run(tmp_path / "d" / "seed0", 0, 500.0)
    (tmp_path / "d" / "seed0" / "report.json").write_text(json.dumps({"epochs": 1}))
    assert compare_runs.main([f"{tmp_path}/d/seed0"]) == 2
    assert "report.json has no test metrics" in capsys.readouterr().err
