"""Text in tables, read with pyarrow (optional: `pip install 'gpudl[text]'`): a Parquet file's column,
row group by row group, and the Arrow stream files of a Hugging Face dataset saved with
`datasets.save_to_disk`, without the `datasets` package.

A saved dataset is a folder with `state.json` (which names its `data-*-of-*.arrow` files) and
`dataset_info.json`; a DatasetDict is a folder with `dataset_dict.json` and one such folder per
split (training reads `train`). Those JSON files are untrusted: a name in them that leads out of
the dataset's folder is refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from ...errors import UserError


def _pyarrow(path: Path, what: str):
    try:
        import pyarrow
    except ImportError:
        raise UserError(f"{path}: reading {what} needs pyarrow: pip install 'gpudl[text]' (or pip install pyarrow)") from None
    return pyarrow


def parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    pa = _pyarrow(path, "Parquet files")
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(str(path))
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{path}: not a Parquet file ({str(e)[:120]})") from None
    _text_column(pa, pf.schema_arrow, text_field, path)
    row = 0
    for group in range(pf.num_row_groups):  # one row group in memory at a time
        try:
            column = pf.read_row_group(group, columns=[text_field]).column(0)
        except (pa.ArrowException, OSError) as e:
            raise UserError(f"{path}: row group {group} cannot be read ({str(e)[:120]}): the file is damaged") from None
        for chunk in column.chunks:
            yield from _texts(pa, chunk, path, text_field, row)
            row += len(chunk)


def arrow_documents(path: Path, text_field: str) -> Iterator[str]:
    """The texts of an Arrow IPC stream file (as `datasets` writes them; the IPC file format also reads)."""
    pa = _pyarrow(path, "a Hugging Face dataset's Arrow files")
    with pa.memory_map(str(path)) as source:
        batches, schema = _open_ipc(pa, source, path)
        index, row = _text_column(pa, schema, text_field, path), 0
        try:
            for batch in batches:
                yield from _texts(pa, batch.column(index), path, text_field, row)
                row += batch.num_rows
        except (pa.ArrowException, OSError) as e:
            raise UserError(f"{path}: damaged after row {row:,} ({str(e)[:120]}): save the dataset again") from None


def _open_ipc(pa, source, path: Path):
    try:
        reader = pa.ipc.open_stream(source)
        return reader, reader.schema
    except pa.ArrowInvalid:
        pass
    try:
        source.seek(0)
        reader = pa.ipc.open_file(source)
        return (reader.get_batch(i) for i in range(reader.num_record_batches)), reader.schema
    except pa.ArrowInvalid as e:
        raise UserError(f"{path}: not an Arrow stream or file ({str(e)[:120]})") from None


def _text_column(pa, schema, text_field: str, path: Path) -> int:
    names = schema.names
    if text_field not in names:
        raise UserError(f"{path}: no column {text_field!r} (its columns: {', '.join(names) or 'none'}): name the one "
                        f"that holds the text with --set data.text_field=...")
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise UserError(f"{path}: column {text_field!r} holds {kind}, not text: --set data.text_field=<a string column>")
    return names.index(text_field)


def _texts(pa, column, path: Path, text_field: str, first_row: int) -> list[str]:
    if column.null_count:
        row = first_row + column.is_null().to_pylist().index(True)
        raise UserError(f"{path}: row {row:,}: {text_field!r} is null: every row needs its text")
    try:
        return column.to_pylist()
    except UnicodeDecodeError:  # Arrow does not check UTF-8 on reading: find the row to name it
        for i in range(len(column)):
            try:
                column[i].as_py()
            except UnicodeDecodeError as e:
                raise UserError(f"{path}: row {first_row + i:,}: {text_field!r} is not UTF-8 text (byte offset "
                                f"{e.start}): write the column as UTF-8 strings") from None
        raise


def hf_dataset_files(folder: Path) -> tuple[list[Path], str] | None:
    """(the Arrow files, " (train split)" or "") of a dataset saved by `datasets`; None: not one."""
    split = ""
    if (folder / "dataset_dict.json").is_file():
        index = folder / "dataset_dict.json"
        splits = _json(index).get("splits")
        if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
            raise UserError(f"{index}: no list of splits in it: it is not as datasets writes it")
        if "train" not in splits:
            raise UserError(f"{folder}: a dataset with the splits {', '.join(splits) or 'none'} and no 'train': "
                            f"point data.path at one split's folder")
        folder, split = _inside(folder, "train", index, want_dir=True), " (train split)"
    elif not ((folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()):
        return None
    state = folder / "state.json"
    entries = _json(state).get("_data_files")
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise UserError(f"{state}: no list of data files (_data_files) in it: it is not as datasets writes it")
    return [_inside(folder, e.get("filename"), state) for e in entries], split


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: not readable JSON ({e}): save the dataset again") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: a JSON {type(data).__name__}, not an object: it is not as datasets writes it")
    return data


def _inside(folder: Path, name, named_in: Path, want_dir: bool = False) -> Path:
    """`folder/name`, which must lie inside `folder` (a name from an untrusted index: no '..', no
    absolute path, no link that leads out)."""
    if not isinstance(name, str) or not name:
        raise UserError(f"{named_in}: a data file without a name: it is not as datasets writes it")
    root, path = folder.resolve(), (folder / name).resolve()
    if Path(name).is_absolute() or not path.is_relative_to(root) or path == root:
        raise UserError(f"{named_in}: {name!r} lies outside {folder}: a dataset's files stay in its folder "
                        f"(this index is not as datasets writes it)")
    if not (path.is_dir() if want_dir else path.is_file()):
        raise UserError(f"{named_in} names {name!r}, which is not in {folder}: save the dataset again")
    return path
