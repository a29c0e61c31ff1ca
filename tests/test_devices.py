"""Device choice, batch transfer and autocast (mmgoal/devices.py)."""

from dataclasses import dataclass

import pytest
import torch

from mmgoal.devices import autocast, check_precision, move_to_device, resolve_device
from mmgoal.structures import ImageFeatures

NO_CUDA = not torch.cuda.is_available()


def test_auto_is_the_cpu_without_cuda_and_a_bad_name_is_refused():
    if NO_CUDA:
        assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="must be auto, cpu, cuda or cuda:N, got 'gpu'"):
        resolve_device("gpu")
    with pytest.raises(ValueError, match="got 'cuda:first'"):
        resolve_device("cuda:first")


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
@pytest.mark.parametrize("spec", ["cuda", "cuda:1"])
def test_cuda_without_cuda_names_what_was_asked_and_what_was_found(spec):
    with pytest.raises(ValueError, match=rf"train.device '{spec}' asks for a GPU, but this "
                                         rf"machine has no CUDA device \(torch .*\); use "
                                         rf"train.device auto .* or cpu"):
        resolve_device(spec)


def test_cuda_means_this_process_gpu_under_a_launcher(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "GPU")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device("auto") == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "2")  # a third process on a node with two GPUs
    with pytest.raises(ValueError, match="would use cuda:2, but this machine has 2 CUDA"):
        resolve_device("auto")


def test_precisions_the_device_cannot_train_in_are_refused():
    check_precision("bf16", torch.device("cpu"))
    with pytest.raises(ValueError, match="precision must be fp32, bf16 or fp16, got 'fp8'"):
        check_precision("fp8", torch.device("cpu"))
    with pytest.raises(ValueError, match="fp16 trains on GPUs only"):
        check_precision("fp16", torch.device("cpu"))


@dataclass
class Tagged:
    values: torch.Tensor
    name: str


def test_every_tensor_of_a_batch_moves_and_nothing_else_changes():
    batch = {"images": torch.zeros(2, 3), "image_ids": ["a", "b"], "skipped": 3,
             "source_counts": {"coco": 2}, "pair": (torch.ones(1), torch.ones(2)),
             "features": ImageFeatures(torch.ones(2, 4), tokens=torch.ones(2, 3, 4),
                                       mask=torch.ones(2, 3, dtype=torch.bool)),
             "tagged": [Tagged(torch.ones(1), "x")]}
    moved = move_to_device(batch, torch.device("meta"))
    assert moved["images"].device.type == "meta" and moved["images"].shape == (2, 3)
    assert moved["image_ids"] == ["a", "b"] and moved["skipped"] == 3
    assert moved["source_counts"] == {"coco": 2}
    assert isinstance(moved["pair"], tuple) and all(t.is_meta for t in moved["pair"])
    features = moved["features"]
    assert isinstance(features, ImageFeatures)
    assert features.embedding.is_meta and features.tokens.is_meta and features.mask.is_meta
    assert features.mask.dtype == torch.bool
    assert moved["tagged"][0].values.is_meta and moved["tagged"][0].name == "x"
    assert batch["images"].device.type == "cpu"  # the input is left as it was


def test_autocast_runs_products_in_bf16_and_fp32_leaves_them_alone():
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with autocast(torch.device("cpu"), "bf16"):
        assert (a @ b).dtype == torch.bfloat16
    with autocast(torch.device("cpu"), "fp32"):
        assert (a @ b).dtype == torch.float32


def write_caches(root, caches):
    """A sysfs cache folder: (level, type, size, shared_cpu_list) per index<N>/."""
    for n, (level, kind, size, shared) in enumerate(caches):
        index = root / f"index{n}"
        index.mkdir(parents=True)
        for name, value in {"level": level, "type": kind, "size": size,
                            "shared_cpu_list": shared}.items():
            (index / name).write_text(f"{value}\n")
    return str(root)


def test_the_cache_share_is_the_last_level_over_the_cpus_sharing_it_times_the_threads(tmp_path):
    from mmgoal.devices import cache_share_mb

    # 48 KiB L1d, 32 KiB L1i, 2 MiB L2 per core, 32 MiB L3 shared by CPUs 0-7 and 16-23
    caches = write_caches(tmp_path / "cache", [(1, "Data", "48K", "0,16"),
                                               (1, "Instruction", "32K", "0,16"),
                                               (2, "Unified", "2048K", "0,16"),
                                               (3, "Unified", "32M", "0-7,16-23")])
    assert cache_share_mb(threads=1, caches=caches) == 2.0  # 32 MiB over 16 CPUs
    assert cache_share_mb(threads=4, caches=caches) == 8.0
    assert cache_share_mb(threads=64, caches=caches) == 32.0  # no more than the whole cache
    # an instruction cache never counts; no folder at all: the system does not say
    only_l1i = write_caches(tmp_path / "l1i", [(1, "Instruction", "1G", "0")])
    assert cache_share_mb(threads=1, caches=only_l1i) is None
    assert cache_share_mb(threads=1, caches=str(tmp_path / "missing")) is None


def test_the_cpu_scoring_block_is_the_cache_share_within_bounds(monkeypatch):
    from mmgoal.evaluation import gallery

    cpu = torch.device("cpu")
    for share, budget in ((150.0, 150.0), (1.5, 32.0), (4096.0, 1024.0), (None, 128.0)):
        monkeypatch.setattr(gallery, "cache_share_mb", lambda share=share: share)
        assert gallery.block_budget_mb(cpu) == budget
    assert gallery.block_budget_mb(cpu, max_block_mb=7) == 7.0  # the config's bound wins
