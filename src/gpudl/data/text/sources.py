"""Text as people have it, read as documents: a text file or a folder of them, JSON Lines, Parquet,
or a Hugging Face dataset saved with `datasets.save_to_disk` (read with pyarrow: `datasets` itself is
not needed). A folder may mix them; files of other kinds are skipped and counted.

A text file is one document, a JSON Lines line or a table's row is one. Every file is somebody
else's: a line that is not JSON, a row without the text, bytes that are not UTF-8 are one line
naming the file and the line (or row, or byte), and a dataset's own index (`state.json`) names no
file outside its folder.
"""

from __future__ import annotations

import functools
import hashlib
import sysconfig
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import UserError
from .tables import arrow_documents, hf_dataset_files, parquet_documents

# Text by suffix: prose, markup and source code. A .json file is one structured value, not text
# (its records go in a .jsonl file); anything else (images, archives, .arrow outside a dataset) is skipped.
TEXT_SUFFIXES = frozenset({
    ".txt", ".text", ".md", ".markdown", ".rst", ".tex", ".org", ".html", ".htm", ".xml", ".csv", ".tsv",
    ".py", ".pyi", ".ipynb", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".java", ".kt", ".scala", ".js", ".ts",
    ".go", ".rs", ".rb", ".php", ".swift", ".sh", ".sql", ".toml", ".yaml", ".yml", ".ini", ".cfg"})
TABLE_SUFFIXES = {".jsonl": "jsonl", ".parquet": "parquet"}
NEWLINE = b"\n"
KIND_NAMES = {"text": "text", "jsonl": "JSON Lines", "parquet": "Parquet", "arrow": "Arrow"}

# Parts of the standard library that are data-like or test fixtures rather than typical code.
_SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__"}


@functools.cache  # the installed standard library does not change while a process runs; walking it takes a second
def stdlib_sources() -> tuple[Path, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return tuple(p for p in sorted(root.rglob("*.py")) if not _SKIP_DIRS & set(p.relative_to(root).parts[:-1]))


def file_fingerprint(files: list[Path]) -> str:
    """Which files, how long, when last written: a changed file is another corpus."""
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        h.update(f"{p}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Source:
    path: Path
    kind: str   # "text", "jsonl", "parquet" or "arrow" (a dataset's stream file)


@dataclass
class Corpus:
    """The files of data.path, in reading order, and what was left out."""

    sources: list[Source]
    label: str            # a name for cache files
    what: str             # "3 JSON Lines files", for the start block
    text_field: str
    skipped: Counter = field(default_factory=Counter)   # why (a suffix, "binary") -> files
    path: str | None = None   # data.path as given (None: the standard library)
    sizes: dict = field(default_factory=dict)   # tokenise.text_size's answers, counted once

    @property
    def path_label(self) -> str:
        return self.path if self.path is not None else "the standard library"

    @property
    def plain_text(self) -> bool:
        return all(s.kind == "text" for s in self.sources)

    @functools.cached_property
    def fingerprint(self) -> str:
        h = hashlib.sha256(f"{file_fingerprint([s.path for s in self.sources])}|{self.text_field}".encode())
        h.update(",".join(s.kind for s in self.sources).encode())
        return h.hexdigest()[:16]

    def skipped_note(self) -> str:
        return skipped_note(self.skipped)


def skipped_note(skipped: Counter) -> str:
    """"; skipped 3 files (.png 2, binary 1)", or "" where none was."""
    if not skipped:
        return ""
    parts = ", ".join(f"{why} {n:,}" for why, n in sorted(skipped.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"; skipped {sum(skipped.values()):,} file{'s' if sum(skipped.values()) > 1 else ''} ({parts})"


def find_corpus(path: str | None, text_field: str = "text") -> Corpus:
    """The documents' files of data.path (None: the standard library's Python source)."""
    if path is None:
        files = stdlib_sources()
        return Corpus([Source(p, "text") for p in files], "stdlib", f"{len(files):,} text files", text_field)
    src = Path(path).expanduser()
    if not src.exists():
        raise UserError(f"data.path {path!r} does not exist: point it at a text file or a folder of text files")
    label = "".join(c if c.isalnum() or c in "._-" else "_" for c in src.name) or "data"
    if src.is_file():
        kind = TABLE_SUFFIXES.get(src.suffix.lower(), "text")
        if kind == "text" and _is_binary(src):
            raise UserError(f"{src}: not text (it holds NUL bytes): point data.path at text, .jsonl or .parquet files")
        return Corpus([Source(src, kind)], label, f"{KIND_NAMES[kind]} file", text_field, path=path)
    hf = hf_dataset_files(src)
    if hf is not None:
        files, split = hf
        return Corpus([Source(p, "arrow") for p in files], label,
                      f"Hugging Face dataset{split}, {len(files):,} Arrow files", text_field, path=path)
    sources, skipped = _walk(src)
    if not sources:
        listed = "no files" if not skipped else f"no text files{skipped_note(skipped)}"
        raise UserError(f"data.path {path!r} holds {listed}: add files ending in .txt, .md, .py, .jsonl, .parquet "
                        f"(or another text suffix) or choose another folder")
    return Corpus(sources, label, _folder_what(sources), text_field, skipped, path)


def _walk(folder: Path) -> tuple[list[Source], Counter]:
    sources, skipped = [], Counter()
    for p in sorted(folder.rglob("*")):
        if any(part.startswith(".") for part in p.relative_to(folder).parts) or not p.is_file():
            continue  # hidden (.git, .DS_Store): not the user's text
        suffix = p.suffix.lower()
        if suffix in TABLE_SUFFIXES:
            sources.append(Source(p, TABLE_SUFFIXES[suffix]))
        elif suffix in TEXT_SUFFIXES and not _is_binary(p):
            sources.append(Source(p, "text"))
        else:
            skipped["binary" if suffix in TEXT_SUFFIXES else suffix or "no suffix"] += 1
    return sources, skipped


def _folder_what(sources: list[Source]) -> str:
    kinds = Counter(s.kind for s in sources)
    parts = [f"{n:,} {KIND_NAMES[k]}" for k, n in kinds.items()]
    joined = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"{joined} file{'s' if len(sources) > 1 else ''}"


def _is_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\x00" in f.read(4096)  # a NUL byte marks a binary file, not text


def documents(source: Source, text_field: str) -> Iterator[str]:
    """The texts of one file, in order; a bad one is a UserError naming the file and where."""
    if source.kind == "text":
        yield utf8(source.path.read_bytes(), source.path)
    elif source.kind == "jsonl":
        yield from _jsonl_documents(source.path, text_field)
    elif source.kind == "parquet":
        yield from parquet_documents(source.path, text_field)
    else:
        yield from arrow_documents(source.path, text_field)


def utf8(data: bytes, path: Path, line: int | None = None) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        where = f"{path}:{line if line is not None else data.count(NEWLINE, 0, e.start) + 1}"
        raise UserError(f"{where}: not UTF-8 text (byte 0x{data[e.start]:02x} at byte offset {e.start}"
                        f"{' of the line' if line is not None else ''}): convert the file to UTF-8 "
                        f"(e.g. iconv -f latin1 -t utf-8), or train on raw bytes with data.tokenizer=bytes "
                        f"(plain text files only)") from None


def _jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
    import json

    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            line = utf8(raw, path, n)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{n}: not JSON ({e.msg}, column {e.colno}): each line of a .jsonl file "
                                f"is one JSON object") from None
            if not isinstance(row, dict):
                raise UserError(f"{path}:{n}: a JSON {type(row).__name__}, not an object: each line of a .jsonl "
                                f"file is one object with a {text_field!r} field")
            yield _field(row, text_field, f"{path}:{n}")


def _field(row: dict, text_field: str, where: str) -> str:
    if text_field not in row:
        keys = ", ".join(repr(k) for k in list(row)[:12]) + (", ..." if len(row) > 12 else "")
        raise UserError(f"{where}: no field {text_field!r} (the line has {keys or 'no keys'}): name the one that "
                        f"holds the text with --set data.text_field=...")
    text = row[text_field]
    if not isinstance(text, str):
        raise UserError(f"{where}: field {text_field!r} is {'null' if text is None else type(text).__name__}, "
                        f"not text: every line needs its text there (or --set data.text_field=...)")
    return text
