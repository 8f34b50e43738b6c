"""The runnable examples in gpudl's docstrings run, and show what they say."""

import doctest
import importlib
import pkgutil

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
