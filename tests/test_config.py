import textwrap

import pytest
import yaml

from mmgoal.config import (
    apply_override,
    config_changes,
    config_text,
    describe_changes,
    load_config,
    parse_value,
)


def write(path, text):
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def config_tree(tmp_path):
    (tmp_path / "_base_").mkdir()
    write(tmp_path / "_base_" / "model.yaml", """
        model:
          type: DualEncoder
          embed_dim: 1024
          image_encoder:
            {type: TimmImageEncoder, model_name: resnet50, model_kwargs: {drop_rate: 0.1}}
        train: {epochs: 30, seed: 0}
    """)
    write(tmp_path / "_base_" / "schedule.yaml", """
        train: {epochs: 15, clip_grad: 2.0}
        optimizer: {type: Adam, lr: 0.0002, betas: [0.9, 0.999]}
    """)
    return tmp_path


def test_bases_merge_left_to_right_then_the_file(config_tree):
    path = write(config_tree / "run.yaml", """
        _base_: [_base_/model.yaml, _base_/schedule.yaml]
        model:
          embed_dim: 512
          image_encoder: {model_kwargs: {drop_path_rate: 0.2}}
        train: {seed: 7}
    """)
    cfg = load_config(path)
    assert cfg["model"] == {
        "type": "DualEncoder", "embed_dim": 512,
        "image_encoder": {"type": "TimmImageEncoder", "model_name": "resnet50",
                          "model_kwargs": {"drop_rate": 0.1, "drop_path_rate": 0.2}},
    }
    # schedule.yaml (later base) wins over model.yaml, the file wins over both
    assert cfg["train"] == {"epochs": 15, "seed": 7, "clip_grad": 2.0}
    assert "_base_" not in cfg


def test_single_string_base_and_delete_replaces_a_mapping(config_tree):
    path = write(config_tree / "run.yaml", """
        _base_: _base_/model.yaml
        model:
          image_encoder: {_delete_: true, type: GRUImage, hidden: 8}
    """)
    cfg = load_config(path)
    assert cfg["model"]["image_encoder"] == {"type": "GRUImage", "hidden": 8}
    assert cfg["model"]["embed_dim"] == 1024


def test_overrides_parse_literals(config_tree):
    path = write(config_tree / "run.yaml", "_base_: [_base_/model.yaml, _base_/schedule.yaml]\n")
    cfg = load_config(path, ["optimizer.lr=1e-3", "optimizer.betas=[0.8, 0.9]",
                             "model.type=VSE", "train.seed=None", "train.clip_grad=false",
                             "model.image_encoder.model_kwargs.drop_rate=0.5",
                             "optimizer.betas.1=0.95"])
    assert cfg["optimizer"]["lr"] == 1e-3 and isinstance(cfg["optimizer"]["lr"], float)
    assert cfg["optimizer"]["betas"] == [0.8, 0.95]
    assert cfg["model"]["type"] == "VSE"
    assert cfg["train"]["seed"] is None and cfg["train"]["clip_grad"] is False
    assert cfg["model"]["image_encoder"]["model_kwargs"]["drop_rate"] == 0.5


def test_override_of_a_missing_key_fails_with_the_choices(config_tree):
    path = write(config_tree / "run.yaml", "_base_: _base_/schedule.yaml\n")
    with pytest.raises(ValueError) as info:
        load_config(path, ["optimizer.lrr=1"])
    message = str(info.value)
    assert "no key 'lrr' under optimizer" in message
    assert "Did you mean 'lr'?" in message
    with pytest.raises(ValueError, match="no key 'nothere' under the top level"):
        load_config(path, ["nothere=1"])
    with pytest.raises(ValueError, match="not a valid index"):
        load_config(path, ["optimizer.betas.5=1"])
    with pytest.raises(ValueError, match="must look like"):
        load_config(path, ["optimizer.lr"])


def test_parse_value():
    assert parse_value("3") == 3
    assert parse_value("1e-4") == 1e-4
    assert parse_value("true") is True
    assert parse_value("null") is None
    assert parse_value("'x'") == "x"
    assert parse_value("resnet50") == "resnet50"
    assert parse_value("{'a': 1}") == {"a": 1}


def test_missing_base_and_cycles_are_reported(tmp_path):
    path = write(tmp_path / "a.yaml", "_base_: b.yaml\n")
    with pytest.raises(FileNotFoundError, match="b.yaml does not exist .a _base_ of"):
        load_config(path)
    write(tmp_path / "b.yaml", "_base_: a.yaml\n")
    with pytest.raises(ValueError, match="cycle"):
        load_config(path)
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "missing.yaml")


def test_configs_are_data_not_code(tmp_path):
    path = write(tmp_path / "evil.yaml", "x: !!python/object/apply:os.system ['echo hi']\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(path)


def test_dump_round_trips(tmp_path, config_tree):
    cfg = load_config(write(config_tree / "run.yaml", "_base_: _base_/model.yaml\n"))
    assert yaml.safe_load(config_text(cfg)) == cfg
    cfg2 = dict(cfg)
    apply_override(cfg2, "train.epochs=3")
    assert cfg2["train"]["epochs"] == 3


def test_shipped_configs_resolve():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "configs"
    files = [p for p in root.rglob("*.yaml") if "_base_" not in p.parts]
    assert files
    for path in files:
        cfg = load_config(path)
        assert {"model", "objective", "data", "optimizer"} <= set(cfg), path


def test_a_key_given_twice_is_refused_with_its_lines(tmp_path):
    path = write(tmp_path / "twice.yaml", """
        train:
          epochs: 2
        optimizer: {lr: 1.0e-3}
        train:
          seed: 1
        """)
    with pytest.raises(ValueError, match="the key 'train' appears twice in one mapping, on "
                                         "lines 2 and 5"):
        load_config(path)


def test_exponent_numbers_are_numbers(tmp_path):
    path = write(tmp_path / "numbers.yaml", """
        optimizer: {lr: 1e-3, weight_decay: 5E-4, eps: 1.5e-8, momentum: -2e+1, name: "1e-3"}
        """)
    assert load_config(path)["optimizer"] == {"lr": 1e-3, "weight_decay": 5e-4, "eps": 1.5e-8,
                                              "momentum": -20.0, "name": "1e-3"}


def test_describe_changes_lists_each_change_then_how_many_more():
    changes = config_changes({"model": {"embed_dim": 16, "type": "VSE"}, "seed": 0},
                             {"model": {"embed_dim": 8, "type": "SCAN"}, "seed": 1})
    assert describe_changes(changes) == ("model.embed_dim: 16 -> 8; model.type: 'VSE' -> "
                                         "'SCAN'; seed: 0 -> 1")
    assert describe_changes(changes, 1) == "model.embed_dim: 16 -> 8 (and 2 more)"
    assert describe_changes(changes, 3) == describe_changes(changes)


def test_each_base_is_read_and_merged_once_however_often_it_is_named(tmp_path, monkeypatch):
    import mmgoal.config

    write(tmp_path / "c0.yaml", "depth: 0\nkeep: {a: 1}\n")
    for depth in range(1, 17):  # each names the one before twice: 2**16 reads before
        write(tmp_path / f"c{depth}.yaml", f"_base_: [c{depth - 1}.yaml, c{depth - 1}.yaml]\n"
                                           f"depth: {depth}\n")
    reads = []
    read = mmgoal.config.read_config_text
    monkeypatch.setattr(mmgoal.config, "read_config_text",
                        lambda path, where="": reads.append(path) or read(path, where))
    assert load_config(tmp_path / "c16.yaml") == {"depth": 16, "keep": {"a": 1}}
    assert len(reads) == len(set(reads)) == 17
    # a base named twice is merged at its last place: as merging it twice would give
    write(tmp_path / "a.yaml", "x: a\ny: a\n")
    write(tmp_path / "b.yaml", "x: b\nz: b\n")
    write(tmp_path / "aba.yaml", "_base_: [a.yaml, b.yaml, a.yaml]\n")
    assert load_config(tmp_path / "aba.yaml") == {"x": "a", "y": "a", "z": "b"}
    write(tmp_path / "bad.yaml", "_base_: {a: 1}\n")
    with pytest.raises(ValueError, match=r"_base_ must be a file name or a list of them, got "
                                         r"\{'a': 1\}"):
        load_config(tmp_path / "bad.yaml")


def test_an_anchor_holding_its_own_alias_is_a_sentence(tmp_path):
    path = write(tmp_path / "self.yaml", "model: {type: x}\ntrain: &a {epochs: 1, x: *a}\n")
    with pytest.raises(ValueError, match=rf"^config {path}: the value anchored on line 2 holds "
                                         rf"an alias of itself \(a: &x \{{b: \*x\}}\), a value "
                                         rf"with no end"):
        load_config(path)
    write(tmp_path / "list.yaml", "a: &l [1, *l]\n")
    with pytest.raises(ValueError, match="line 1 holds an alias of itself"):
        load_config(tmp_path / "list.yaml")


def test_a_typed_section_reads_as_its_resolved_dict():
    from pathlib import Path

    from mmgoal.runs.schema import RunConfig, load_run_config

    cfg = load_run_config(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml")
    typed = RunConfig.from_dict(cfg, "")
    for section in ("data", "train", "evaluation"):
        for key, value in cfg[section].items():
            got = typed[section][key]
            assert (got.to_dict() if hasattr(got, "to_dict") else got) == value
    assert typed["data"].get("no_such_key", "default") == "default"
    with pytest.raises(KeyError, match="no_such_key"):
        typed["data"]["no_such_key"]


def test_a_configs_problems_are_said_together(tmp_path):
    from pathlib import Path

    from mmgoal.config import ConfigProblems
    from mmgoal.runs.schema import check_data_paths, load_run_config

    root = Path(__file__).resolve().parents[1] / "configs"
    with pytest.raises(ConfigProblems) as error:
        load_run_config(root / "quickstart.yaml", [
            "train.epochz=2", "train.epochs=-1", "train.precision=fp8", "data.num_workers=x"])
    lines = str(error.value).splitlines()
    assert lines[0] == "the config has 4 problems:" and len(lines) == 5
    assert "train.epochz" in lines[1] and "did you mean 'epochs'" in lines[1].lower()
    assert [any(key in line for line in lines[2:]) for key in
            ("train.epochs", "train.precision", "data.num_workers")] == [True] * 3
    # the file's own mistakes, the trainer's sections' and the components', in one go
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"_base_: {root / 'quickstart.yaml'}\nobjective: {{type: TripletLos}}\n"
                   f"optimizer: {{lr: abc, wieght_decay: 0.1, betas: x}}\ntrain: {{seed: x}}\n"
                   f"schedule: {{warmup_steps: -5}}\n")
    with pytest.raises(ConfigProblems) as error:
        load_run_config(bad)
    assert str(error.value).splitlines()[0] == "the config has 6 problems:"
    for said in ("train.seed must be an integer", "Did you mean 'TripletLoss'?",
                 "'wieght_decay' (did you mean 'weight_decay'?)",
                 "optimizer.lr must be a number", "optimizer.betas must be",
                 "schedule.warmup_steps must be at least 0, got -5"):
        assert said in str(error.value)
    cfg = {"data": {"train": {"shards": str(tmp_path / "a" / "train-*.tar")},
                    "val": {"shards": str(tmp_path / "v.tar")}}}
    with pytest.raises(ConfigProblems, match=r"(?s)2 problems.*data\.train: .*data\.val: "):
        check_data_paths(cfg)
