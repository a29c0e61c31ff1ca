"""bench/gpu_check.py --dry-run: the GPU check builds and runs everything it can on a CPU, so a
GPU session spends its minutes measuring, not debugging the script."""

import re

import pytest
from script_modules import load_script


def gpu_check():
    return load_script("bench/gpu_check.py")


@pytest.mark.slow
def test_the_dry_run_fills_every_row_of_the_report(tmp_path):
    check = gpu_check()
    out = tmp_path / "gpu.md"
    assert check.main(["--dry-run", "--out", str(out)]) == 0
    text = out.read_text()
    # the gpu tests are found (collected, not run, on a CPU): 12 model/precision cases,
    # 15 GOAL combinations, SCAN + retrieval, ITM, DeepSpeed, quickstart
    assert re.search(r"`python -m pytest -m gpu .*`: 31 tests collected", text)
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    for model in ("quickstart (CNN + GRU)", "VSE-infinity EfficientNet-Lite0 + MiniLM",
                  "tiny X-VLM"):
        speeds = [float(r.split("|")[5].replace(",", "")) for r in rows if model in r]
        assert len(speeds) == 2 and all(s > 0 for s in speeds), model  # fp32 and bf16
    assert len([r for r in rows if r.startswith("| GOAL ")]) == 15
    assert re.search(r"\| cpu \| highest \| 20 x 50 \| \d", text)
    assert re.search(r"\| cpu \| fp32 \| 64 \| \d+ \|", text)  # the whole trainer
    # gallery encoding at 0 and 2 workers against the bare loop
    assert len(re.findall(r"\| cpu \| [02] \| 64 \| [\d,]+ \| [\d,]+ \| \d", text)) == 2
    # the tiled objectives beside open_clip's formula, and the cached step against plain ones
    tiled = text.split("## Score tiles on one GPU", 1)[1].split("## ", 1)[0]
    objectives = r"(InfoNCELoss|SigLIPLoss|TripletLoss|GoalObjective cir x sig_ms|ClipLoss)"
    assert len(re.findall(rf"\| {objectives}[^|]* \| 256 \| \d", tiled)) == 5
    cache = text.split("## Gradient caching", 1)[1].split("## ", 1)[0]
    assert re.search(r"\| plain \| 4 \| \d", cache) and re.search(r"\| plain \| 16 \| \d", cache)
    assert re.search(r"\| grad_cache_chunk: 4 \| 16 \| \d", cache)
    # the gather on 2 gloo ranks: a reduce-scatter backward sends 2/3 of the previous bytes
    gather = text.split("## The feature gather", 1)[1]
    assert "2 gloo CPU ranks" in gather
    assert re.search(r"gather mmgoal/previous, bytes sent ratio 0\.6", gather)


def test_without_cuda_and_without_dry_run_it_says_what_to_do(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert gpu_check().main([]) == 2
    assert "no CUDA device here; run with --dry-run" in capsys.readouterr().err
