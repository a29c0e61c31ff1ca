"""No tensor made on the wrong device: every tensor factory in mmgoal/ names its device.

A CPU-only CI cannot see a tensor that a GPU run would make on the CPU and then
mix with CUDA tensors. So every ``torch.zeros/ones/empty/full/arange/eye/rand*/
randperm/tensor/as_tensor/linspace`` call in ``mmgoal/`` outside ``mmgoal/data/``
(which builds CPU batches for the loader) passes ``device=`` (``device="cpu"``
where the CPU is meant) or uses a ``*_like`` form. Construction in ``__init__``
is exempt: ``module.to(device)`` moves what it makes.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mmgoal"
FACTORIES = {"zeros", "ones", "empty", "full", "arange", "eye", "rand", "randn", "randint",
             "randperm", "tensor", "as_tensor", "linspace"}


def factory_calls_without_device(source: str, filename: str = "<source>") -> list[str]:
    """``file:line torch.name`` of every factory call without ``device=`` outside ``__init__``."""
    found = []

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            inside = (child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                      else function)
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                    and isinstance(child.func.value, ast.Name) and child.func.value.id == "torch"
                    and child.func.attr in FACTORIES and inside != "__init__"
                    and not any(k.arg == "device" for k in child.keywords)):
                found.append(f"{filename}:{child.lineno} torch.{child.func.attr}")
            visit(child, inside)

    visit(ast.parse(source), None)
    return found


def test_the_check_finds_a_factory_without_a_device():
    source = (
        "import torch\n"
        "class M:\n"
        "    def __init__(self):\n"
        "        self.t = torch.zeros(3)\n"  # exempt: moved by .to()
        "    def forward(self, x):\n"
        "        a = torch.zeros(3, device=x.device)\n"
        "        b = torch.ones_like(x)\n"
        "        return torch.arange(4) + torch.tensor([1.0],\n"
        "                                             dtype=torch.float32)\n")
    assert factory_calls_without_device(source, "m.py") == ["m.py:8 torch.arange",
                                                             "m.py:8 torch.tensor"]


def test_every_tensor_factory_in_mmgoal_names_its_device():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "data" in path.relative_to(PACKAGE).parts:
            continue
        found += factory_calls_without_device(path.read_text(), str(path.relative_to(PACKAGE)))
    assert not found, ("tensor factories without device= (pass the device of the tensors they "
                       "meet, or device='cpu'):\n" + "\n".join(found))
