"""The package graph runs one way: each room of `gpudl` imports only from the rooms above it.

docs/design.md lists the rooms in this order and says why; the imports are read from the source
(every `import`, at module level or inside a function), so a lazy import that closes a cycle counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

import gpudl

SRC = Path(gpudl.__file__).parent

# Top to bottom: a room may import from the rooms on earlier rows, never from its own row or below.
LAYERS = [
    {"errors"}, {"cache", "version"}, {"config"},
    {"device"},
    {"models"},
    {"data"},
    {"distributed"},
    {"checkpoint", "observe"},
    {"interop"},  # the way out and in: Hugging Face, ONNX and torchvision layouts of the models
    {"training"},
    {"memory"},
    {"run"},
    {"bench", "serve"},
    {"commands", "__init__"},  # the public surface: the command line's functions and `import gpudl`
    {"cli"}, {"__main__"},
]
RANK = {room: i for i, layer in enumerate(LAYERS) for room in layer}


def room_of(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return parts[0]


def imported_rooms(path: Path) -> set[tuple[str, int]]:
    """(room, line) of every gpudl import in the file: relative ones resolved against its package."""
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    package = parts[:-1]  # an __init__'s package is its folder, as a module's is
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - (node.level - 1)]
            target = base + (node.module.split(".") if node.module else [])
            names = [target[0]] if target else [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "gpudl":
            rest = node.module.split(".")[1:]
            names = rest[:1] or [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".")[1] for a in node.names if a.name.startswith("gpudl.")]
        else:
            continue
        # `from .. import fit`: a name of the package itself, not a room
        found |= {(n if n in RANK else "__init__", node.lineno) for n in names}
    return found


def test_every_room_is_placed():
    rooms = {room_of(p) for p in SRC.rglob("*.py")}
    assert rooms <= set(RANK), f"place {sorted(rooms - set(RANK))} in LAYERS and docs/design.md"


def test_rooms_import_only_from_rooms_above():
    upward = []
    for path in sorted(SRC.rglob("*.py")):
        room = room_of(path)
        for target, line in imported_rooms(path):
            if target != room and RANK[target] >= RANK[room]:
                upward.append(f"{path.relative_to(SRC)}:{line} ({room}) imports {target}")
    assert not upward, "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path):
    """The negative control: a lazy import inside a function, from a room below, is found."""
    fake = SRC / "device" / "_probe_for_test.py"
    try:
        fake.write_text("def f():\n    from ..run.recipe import train\n")
        assert ("run", 2) in imported_rooms(fake)
    finally:
        fake.unlink()
