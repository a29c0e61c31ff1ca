"""What an attacker puts in a file a user receives: code that leaves a mark when it runs."""

from pathlib import Path


class WritesMarker:
    """Unpickled by a full unpickler, writes ``marker``: the code an attacker would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def marker_module(folder: Path, name: str, marker: Path) -> Path:
    """A module ``name``.py in ``folder`` that writes ``marker`` when imported."""
    path = folder / f"{name}.py"
    path.write_text(f"open({str(marker)!r}, 'w').write('imported')\n")
    return path


def checked_devices(patch) -> list[str]:
    """Record, through ``patch`` (a ``MonkeyPatch``), the device of every model that
    ``mmgoal.runs.loading.check_same_model`` checks against a file: ``meta`` where the
    file was refused before the real model was built."""
    from mmgoal.runs import loading

    checked: list[str] = []
    check = loading.check_same_model
    patch.setattr(loading, "check_same_model", lambda built, *args: checked.append(
        next(built.parameters()).device.type) or check(built, *args))
    return checked
