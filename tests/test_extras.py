"""Optional extras: mmgoal works without them, and what needs one names it.

A missing package is simulated with ``sys.modules[name] = None``, under which
``import name`` fails and ``importlib.util.find_spec(name)`` finds nothing, as
for a package that was never installed.
"""

import configparser
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from mmgoal.extras import EXTRAS, pyplot, require_extra
from mmgoal.registry import STRATEGIES

ROOT = Path(__file__).resolve().parents[1]


def run_without(modules, code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter in which ``modules`` cannot be imported."""
    block = "".join(f"sys.modules[{m!r}] = None\n" for m in modules)
    return subprocess.run([sys.executable, "-c", f"import sys\n{block}{code}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def requirements(value: str) -> list[Requirement]:
    """The requirements of one setup.cfg entry, one a line."""
    return [Requirement(line) for line in value.strip().splitlines()]


def test_each_optional_package_is_in_the_extra_its_message_names():
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    extras = {name: requirements(value)
              for name, value in setup["options.extras_require"].items()}
    for module, extra in EXTRAS.items():
        assert module in [r.name for r in extras[extra]], f"[{extra}] does not list {module}"
    (everything,) = extras["all"]
    assert everything.name == "mmgoal" and everything.extras == set(EXTRAS.values())
    required = {r.name for r in requirements(setup["options"]["install_requires"])}
    assert not required & set(EXTRAS), "an optional package is also in install_requires"


def test_the_readme_table_lists_every_extra_and_what_it_installs():
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    rows = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 3:
            rows[cells[0].strip("`")] = cells[1]
    assert set(rows) == set(setup["options.extras_require"]), "README's extras table"
    for name, value in setup["options.extras_require"].items():
        if name != "all":
            for requirement in requirements(value):
                assert requirement.name in rows[name], f"README: [{name}] installs {requirement}"


@pytest.mark.parametrize("strategy", ["deepspeed", "accelerate"])
def test_a_strategy_without_its_package_names_the_extra(monkeypatch, strategy):
    monkeypatch.setitem(sys.modules, strategy, None)
    with pytest.raises(ImportError, match=rf"strategy: {{type: {strategy}}} needs {strategy}, "
                                          rf"which is not installed; install it with pip "
                                          rf"install 'mmgoal\[{strategy}\]'"):
        STRATEGIES.build({"type": strategy, "device": "cpu"})


def test_plots_without_matplotlib_name_the_plot_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"the PR curve needs matplotlib.*"
                                          r"pip install 'mmgoal\[plot\]' \(or 'mmgoal\[all\]'\)"):
        pyplot("the PR curve")
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"pip install 'mmgoal\[tracking\]'"):
        require_extra("wandb", "logging to W&B")


def test_an_installed_extra_passes_and_pyplot_draws_to_files():
    pytest.importorskip("matplotlib")
    plt = pyplot("a test")
    assert plt.get_backend().lower() == "agg"


@pytest.mark.slow
def test_mmgoal_imports_and_builds_without_any_extra():
    code = (
        "import torch, mmgoal, mmgoal.engine.trainer\n"
        "from mmgoal.registry import MODELS, STRATEGIES, TOKENIZERS\n"
        "torch.manual_seed(0)\n"
        "tokenizer = TOKENIZERS.build({'type': 'WordTokenizer', 'vocab': ['a', 'red', 'disc']})\n"
        "model = MODELS.build({'type': 'DualEncoder', 'embed_dim': 8, 'image_encoder': {\n"
        "    'type': 'TimmImageEncoder', 'model_name': 'mmgoal_small_cnn',\n"
        "    'model_kwargs': {'widths': [4, 8]}}, 'text_encoder': {'type': 'GRUTextEncoder',\n"
        "    'word_dim': 4, 'hidden_size': 8}}, tokenizer=tokenizer).eval()\n"
        "strategy = STRATEGIES.build({'type': 'torch', 'device': 'cpu'})\n"
        "text = model.encode_text(tokenizer(['a red disc', 'a disc'])).embedding\n"
        "image = model.encode_image({'images': torch.rand(3, 3, 32, 32)}).embedding\n"
        "norms = [f'{float(x.norm(dim=1).mean()):.4f}' for x in (image, text)]\n"
        "print(type(strategy).__name__, mmgoal.__version__, tuple(image.shape),\n"
        "      tuple(text.shape), *norms)\n"
    )
    result = run_without(EXTRAS, code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["TorchStrategy", "0.1.0", "(3,", "8)", "(2,", "8)",
                                     "1.0000", "1.0000"]


@pytest.mark.slow
def test_importing_mmgoal_imports_no_extra():
    """mmgoal itself imports no extra (timm imports wandb where it is installed: that is
    timm's, so the extras loaded by the dependencies alone are the baseline)."""
    loaded = f"sorted(m for m in {sorted(EXTRAS)!r} if m in sys.modules)"
    code = (f"import sys, timm, timm.utils, transformers, webdataset\nprint({loaded})\n"
            f"import mmgoal, mmgoal.engine.trainer\nprint({loaded})\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    by_dependencies, with_mmgoal = result.stdout.strip().splitlines()
    assert with_mmgoal == by_dependencies


@pytest.mark.slow
@pytest.mark.parametrize("tool,command,args", [
    ("plot_weights.py", "plot-weights", ["--out", "never.png"]),
    ("plot_attention.py", "plot-attention", ["missing.yaml", "missing.pt", "--word", "0"]),
])
def test_plot_tools_without_matplotlib_say_which_extra(tool, command, args):
    code = (f"import runpy\nsys.argv = {[tool, *args]!r}\n"
            f"runpy.run_path({str(ROOT / 'tools' / tool)!r}, run_name='__main__')\n")
    result = run_without(["matplotlib"], code)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        f"error: mmgoal {command} needs matplotlib, which is not installed; install it with "
        f"pip install 'mmgoal[plot]' (or 'mmgoal[all]')")


@pytest.mark.slow
def test_finetune_with_deepspeed_missing_says_which_extra(tiny_benchmark, tmp_path,
                                                          monkeypatch):
    out, _ = tiny_benchmark
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "cli"))
    from test_cli import tiny_overrides

    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_overrides("quickstart.yaml", out)))
    code = (f"import runpy\nsys.argv = ['finetune.py', {str(config)!r}, '--deepspeed', "
            f"'--work-dir', {str(tmp_path / 'run')!r}]\n"
            f"runpy.run_path({str(ROOT / 'tools' / 'finetune.py')!r}, run_name='__main__')\n")
    result = run_without(["deepspeed"], code)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().endswith(
        "error: strategy: {type: deepspeed} needs deepspeed, which is not installed; install it "
        "with pip install 'mmgoal[deepspeed]' (or 'mmgoal[all]')")
