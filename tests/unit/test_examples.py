"""The runnable examples in gpudl's docstrings run, and show what they say."""

import doctest
import importlib
import pkgutil
from pathlib import Path

import pytest

import gpudl


def importable(name: str) -> bool:
    """False for a module whose extra is not installed (`gpudl.serve.http` without fastapi, say):
    its examples are not this machine's to run. A module gpudl or the core cannot import still fails."""
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in ("gpudl", "torch", "numpy", "rich"):
            raise
        return False
    return True


def modules_with_examples() -> list[str]:
    names = [m.name for m in pkgutil.walk_packages(gpudl.__path__, "gpudl.") if not m.name.endswith("__main__")]
    finder = doctest.DocTestFinder()
    return sorted(n for n in ["gpudl", *names]
                  if importable(n) and any(t.examples for t in finder.find(importlib.import_module(n))))


@pytest.mark.parametrize("name", modules_with_examples())
def test_docstring_examples(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples that write (runs, benchmarks) write here
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, f"{result.failed} of {result.attempted} failed in {name}"


def readme_block(marker: str) -> str:
    """The README's Python code block that contains `marker`."""
    text = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf8")
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"{len(found)} README code blocks hold {marker!r}"
    return found[0]


def test_the_readme_fit_example_that_resumes_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # it writes runs/mlp here
    exec(compile(readme_block('resume="runs/mlp"'), "README.md", "exec"), {})
    val_loss, val_accuracy = map(float, capsys.readouterr().out.split()[-2:])
    assert 0 < val_loss and 0 <= val_accuracy <= 1
    assert sorted(p.name for p in (tmp_path / "runs" / "mlp" / "checkpoints").iterdir()) == \
        ["step_00000150", "step_00000200"]
