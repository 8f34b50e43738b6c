"""The README is a front door that works as written.

Every `gpudl ...` line of its bash blocks parses with the real CLI parser, and the recipes, settings,
target GPUs and sizes it names load through the real config loader and model presets (a typo in a
setting fails here); its Python blocks compile, name only what gpudl and the test extras provide, and
call `gpudl.fit` with keywords it takes (the block that resumes runs as written in
test_examples.py; the others need a server, a download-free but slow Hugging Face model, or minutes of
CPU, so they are checked, not run); it stays short; every relative link in it and in docs/ leads to a
file and, with an #anchor, to a heading of that file. The commands in docs/ are parsed too.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
import shlex
from pathlib import Path

import pytest

import gpudl
from gpudl import models
from gpudl.cli import build_parser
from gpudl.commands import DEFAULT_RECIPE, train_config
from gpudl.config import load_config, recipe_names
from gpudl.config.sizes import parse_size
from gpudl.memory.plan import target_machine

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
SET_UP = ["pip install . && gpudl train", "pip install '.[test]' && pytest"]


def blocks(path: Path, *languages: str) -> list[tuple[int, str, str]]:
    """The fenced code blocks of `path` in `languages`: (line of the fence, language, body)."""
    found, fence, start, body = [], None, 0, []
    for n, line in enumerate(path.read_text(encoding="utf8").splitlines(), 1):
        if fence is None and line.lstrip().startswith("```"):
            fence, start, body = line.strip()[3:].strip(), n, []
        elif fence is not None and line.strip() == "```":
            if fence in languages:
                found.append((start, fence, "\n".join(body) + "\n"))
            fence = None
        elif fence is not None:
            body.append(line)
    assert fence is None, f"{path.name}: the block opened at line {start} is never closed"
    return found


def shell_commands(script: str) -> list[list[str]]:
    """The simple commands of a shell snippet: continuations joined, comments and redirections dropped,
    split at && ; |."""
    commands = []
    for line in script.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        words: list[str] = []
        tokens = iter([*lexer, ";"])
        for token in tokens:
            if token in ("&&", "||", ";", "|", "&"):
                commands += [words] if words else []
                words = []
            elif token[0] in "<>":  # a redirection and its file (2>&1 too): not the command's arguments
                if words and words[-1].isdigit():
                    words.pop()
                next(tokens, None)
            else:
                words.append(token)
    return commands


def gpudl_argv(words: list[str]) -> list[str] | None:
    """The arguments given to gpudl: `gpudl ...`, `torchrun ... -m gpudl ...`, `srun ... gpudl ...`."""
    for i, word in enumerate(words):
        if word == "gpudl" and (i == 0 or words[i - 1] == "-m" or words[0] in ("srun", "sudo", "env")):
            return words[i + 1:]
    return None


def commands_of(path: Path) -> list[tuple[int, list[str]]]:
    return [(line, argv) for line, _, body in blocks(path, "bash", "sh", "shell")
            for argv in map(gpudl_argv, shell_commands(body)) if argv is not None]


def parse(argv: list[str]):
    try:
        return build_parser().parse_args(argv)
    except SystemExit:
        raise AssertionError(f"gpudl {shlex.join(argv)}: the CLI refuses it (see stderr)") from None


def check(argv: list[str]) -> None:
    """What `gpudl` would check before doing anything, without doing it: the arguments, the recipe, every
    --set (the model's own fields too), the target GPU and sizes. Raises on a mistake."""
    args = parse(argv)
    if args.command in ("train", "plan"):
        if getattr(args, "memory_limit", None):
            parse_size(args.memory_limit)
        args.resume = None  # a run folder to resume is not here: its --sets are checked against the recipe
        # nor are the weights a run starts from (model.init_from, read when the config loads): the rest is checked
        args.sets = [s for s in args.sets if not s.startswith("model.init_from=")]
        models.from_config(train_config(args))
        if args.command == "plan" and args.target:
            target_machine(args.target, args.nproc_per_node, args.nnodes)
    elif args.command == "bench":
        for name in args.models:
            assert name in recipe_names() or name in models.PRESETS, f"gpudl bench --model {name}: no such model"
        models.from_config(load_config(args.config or DEFAULT_RECIPE, args.sets))


README_COMMANDS = commands_of(README)


def test_the_readme_shows_the_set_up_commands_exactly_and_ci_runs_its_test_command():
    bash = [line.strip() for _, _, body in blocks(README, "bash") for line in body.splitlines()]
    for command in SET_UP:
        assert command in bash, f"README's set-up command {command!r} is not a line of a bash block"
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert SET_UP[1] in ci, ".ci/run must run the README's test command as written"


def test_the_readme_stays_a_front_door():
    lines = len(README.read_text(encoding="utf8").splitlines())
    assert lines <= 260, f"README.md has {lines} lines: move reference and history into docs/"


def test_the_readme_has_the_commands_this_test_checks():
    """Not vacuous: the examples are found, train, plan, serve and a launcher among them."""
    assert len(README_COMMANDS) >= 15
    assert {argv[0] for _, argv in README_COMMANDS} >= {"train", "plan", "serve", "info"}
    assert any("--nproc-per-node" in argv for _, argv in README_COMMANDS)


@pytest.mark.parametrize("line, argv", README_COMMANDS, ids=[f"L{n}:{' '.join(a)[:60]}" for n, a in README_COMMANDS])
def test_each_readme_command_parses_and_names_real_recipes_and_settings(line, argv):
    check(argv)


@pytest.mark.parametrize("argv", [
    ["train", "--config", "gpt2-124mm"],                      # no such recipe
    ["train", "--set", "train.max_step=10"],                  # no such setting
    ["train", "--set", "model.n_layers=6"],                   # no such field of the GPT model
    ["train", "--config", "resnet50", "--set", "data.image_size=2"],  # below the setting's limit
    ["plan", "--target", "h300"],                             # no such GPU
    ["plan", "--memory-limit", "12 gigs"],                    # not a size
    ["train", "--nproc-per-node", "eight"],                   # not a number
    ["bench", "--model", "resnet51"],                         # no such model
])
def test_the_check_catches_a_typo(argv):
    with pytest.raises((AssertionError, gpudl.UserError)):
        check(argv)


def test_every_command_in_the_docs_parses():
    for page in PAGES[1:]:
        for line, argv in commands_of(page):
            assert parse(argv), f"{page.name}, block at line {line}"


README_PYTHON = blocks(README, "python")


@pytest.mark.parametrize("line, body", [(n, b) for n, _, b in README_PYTHON], ids=[f"L{n}" for n, _, _ in README_PYTHON])
def test_each_readme_python_block_compiles_and_names_what_exists(line, body):
    tree = ast.parse(compile(body, f"README.md:{line}", "exec", flags=ast.PyCF_ONLY_AST))
    from gpudl.run.fit import fit  # gpudl.fit passes its **options on to this one

    fit_keywords = set(inspect.signature(fit).parameters)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                assert importlib.util.find_spec(alias.name), f"README.md:{line}: no module {alias.name}"
        elif isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"README.md:{line}: {node.module} has no {alias.name}"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "fit" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "gpudl":
            unknown = {k.arg for k in node.keywords if k.arg} - fit_keywords
            assert not unknown, f"README.md:{line}: gpudl.fit takes no {sorted(unknown)}"


def test_the_readme_shows_a_module_and_a_hugging_face_model_through_fit():
    assert any("gpudl.fit(" in b and "resume=" in b for _, _, b in README_PYTHON)
    assert any("transformers" in b and "gpudl.fit(" in b for _, _, b in README_PYTHON)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: markup gone, lowercase, punctuation dropped, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    in_code = False
    for line in path.read_text(encoding="utf8").splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)):
            a = anchor(m.group(1))
            seen[a] = seen.get(a, -1) + 1
            if seen[a]:
                seen[f"{a}-{seen[a]}"] = 0
    return set(seen)


def links(path: Path) -> list[tuple[int, str]]:
    """Every link target outside code: [text](target) and images alike."""
    found, in_code = [], False
    for n, line in enumerate(path.read_text(encoding="utf8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if not in_code:
            prose = re.sub(r"`[^`]*`", "", line)
            found += [(n, t) for t in re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose)]
    return found


def test_the_anchor_rule_is_githubs():
    assert anchor("Serving: `gpudl serve`") == "serving-gpudl-serve"
    assert anchor("The loop's own cost (2026-12-05, 2-core Xeon with AVX-512 and AMX, torch 2.13.0+cpu)") == \
        "the-loops-own-cost-2026-12-05-2-core-xeon-with-avx-512-and-amx-torch-2130cpu"
    assert anchor("Memory: will it fit?") == "memory-will-it-fit"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_leads_to_a_file_and_a_heading(page):
    found = links(page)
    assert page != README or len(found) >= 10  # not vacuous: the README links into docs/
    for line, target in found:
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not this test's to check
            continue
        file, _, fragment = target.partition("#")
        where = (page.parent / file).resolve() if file else page
        assert where.exists(), f"{page.name}:{line}: {target} -> no file {where.relative_to(ROOT)}"
        if fragment:
            assert where.suffix == ".md" and fragment in anchors(where), \
                f"{page.name}:{line}: {target} -> no heading #{fragment} in {where.name}"
