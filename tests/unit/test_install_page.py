"""docs/install.md says what pyproject.toml says: the Python it needs, and every extra with exactly the
packages it installs (an extra added, dropped or changed in pyproject fails here until the page follows)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[2]
PAGE = ROOT / "docs" / "install.md"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf8"))


def requirement_name(requirement: str) -> str:
    """`tritonclient[http]>=2.40` -> `tritonclient[http]`: the name and its extras, without the version."""
    return re.match(r"\s*([A-Za-z0-9_.\-]+(?:\[[^\]]*\])?)", requirement).group(1).lower()


def extras_table() -> dict[str, set[str]]:
    """The page's table of extras: {extra: the packages its `installs` column names}."""
    text = PAGE.read_text(encoding="utf8").split("## Extras", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    table = {}
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        table[cells[0].strip("`")] = {name.lower() for name in re.findall(r"`([^`]+)`", cells[1])}
    return table


def test_requirement_names_are_read_as_pip_reads_them():
    assert requirement_name("tritonclient[http]>=2.40") == "tritonclient[http]"
    assert requirement_name("prometheus-client>=0.20") == "prometheus-client"
    assert requirement_name("Pillow") == "pillow"


def test_the_extras_table_lists_every_extra_with_exactly_its_packages():
    extras = {name: {requirement_name(r) for r in reqs}
              for name, reqs in PYPROJECT["project"]["optional-dependencies"].items()}
    table = extras_table()
    assert len(table) >= 8  # not vacuous: the rows were found
    assert set(table) == set(extras), f"extras in pyproject but not on the page: {sorted(set(extras) - set(table))}; " \
                                      f"on the page but not in pyproject: {sorted(set(table) - set(extras))}"
    for name, packages in extras.items():
        assert table[name] == packages, f"docs/install.md's `{name}` row lists {sorted(table[name])}, " \
                                        f"pyproject.toml's extra installs {sorted(packages)}"


def test_the_page_names_the_python_pyproject_requires():
    version = re.fullmatch(r">=\s*(\d+\.\d+)", PYPROJECT["project"]["requires-python"]).group(1)
    assert f"Python {version} or newer" in PAGE.read_text(encoding="utf8")


def test_the_page_names_the_torch_pyproject_requires():
    torch = next(r for r in PYPROJECT["project"]["dependencies"] if requirement_name(r) == "torch")
    version = re.fullmatch(r"torch>=(\d+\.\d+)", torch).group(1)
    assert f"torch {version} or newer" in PAGE.read_text(encoding="utf8")
