"""A model ready to evaluate from a checkpoint or an export (mmgoal/runs/loading.py): the sizes
its stored config gives are checked before anything is built from them."""

import pytest
from script_modules import load_tool
from test_received_files import received_export  # tests/: pytest puts it on sys.path

from mmgoal.runs.checkpoint import load_checkpoint
from mmgoal.runs.loading import load_for_evaluation


def stored_config(run):
    return load_checkpoint(run / "checkpoints" / "best.pt")["config"]


def test_a_tokenizer_length_below_one_is_refused(tiny_quickstart_run, tmp_path, capsys):
    # max_length -1 once cut every caption's last word ([:-1]) and evaluated to other metrics
    run, _ = tiny_quickstart_run
    config = stored_config(run)
    export = received_export(run, tmp_path, data={
        **config["data"], "tokenizer": {**config["data"]["tokenizer"], "max_length": -1}})
    with pytest.raises(ValueError, match=r"^data.tokenizer.max_length must be at least 1, "
                                         r"got -1$"):
        load_for_evaluation(export, device="cpu")
    assert load_tool("eval").main([str(export), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "error: data.tokenizer.max_length must be at least 1, got -1" in err
    assert "Traceback" not in err


def test_a_model_size_below_one_is_refused(tiny_quickstart_run, tmp_path, capsys):
    # was torch's "RuntimeError: Trying to create tensor with negative dimension -1"
    run, _ = tiny_quickstart_run
    export = received_export(run, tmp_path, model={**stored_config(run)["model"],
                                                   "embed_dim": -1})
    with pytest.raises(ValueError, match=r"^model.embed_dim must be at least 1, got -1$"):
        load_for_evaluation(export, device="cpu")
    assert load_tool("eval").main([str(export), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "error: model.embed_dim must be at least 1, got -1" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("model_kwargs,reason", [
    # a nested component's size, past the run schema: SmallCNN's hints, checked in timm's call
    ({"widths": [8, -1]}, r"ValueError: mmgoal_small_cnn.widths\[1\] must be at least 1, got -1"),
    # a value no hint can refuse, which torch refuses deep inside a layer
    ({"widths": [8, 12], "norm": "group"},
     r"ValueError: num_channels \(12\) must be divisible by num_groups \(8\)"),
], ids=["negative_width", "torch_refuses"])
def test_a_stored_config_that_cannot_build_its_model_names_the_checkpoint(
        tiny_quickstart_run, tmp_path, model_kwargs, reason):
    run, _ = tiny_quickstart_run
    model = stored_config(run)["model"]
    image_encoder = {**model["image_encoder"],
                     "model_kwargs": {**model["image_encoder"]["model_kwargs"], **model_kwargs}}
    export = received_export(run, tmp_path, model={**model, "image_encoder": image_encoder})
    with pytest.raises(ValueError, match=rf"^checkpoint {export}: the config it is loaded with "
                                         rf"cannot build the model \({reason}\); correct that "
                                         rf"value \(--cfg-options\), or give the config it was "
                                         rf"trained with$"):
        load_for_evaluation(export, device="cpu")
