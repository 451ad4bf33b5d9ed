"""Reading a jsonl file line by line without stopping at the first bad line.

A file and the same bytes from a pipe are split alike, on \\n (JSON Lines' separator; a \\r before it is
JSON whitespace), so both give the same records under the same line numbers. A gzip-compressed file is
read through gzip; a UTF-16 one is refused whole, as are files whose first line is CSV or TSV."""

from __future__ import annotations

import gzip
import io
import json
import zlib
from collections.abc import Iterable
from pathlib import Path

from ..errors import DatasetError, Problem

GZIP_MAGIC = b"\x1f\x8b"
UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


def read_json_lines(source: Path | bytes, label: str) -> tuple[list[tuple[int, dict]], list[Problem]]:
    """Return ``(lineno, object)`` for every good line of a file (or its bytes, read from a pipe) and a
    Problem for every bad one.

    Blank lines are skipped silently; a line must hold one JSON object. Bytes are decoded
    per line so one bad UTF-8 sequence costs one line, not the file.
    """
    if isinstance(source, bytes):
        return iter_json_lines(io.BytesIO(_plain(source, label)), label)
    with open(source, "rb") as f:
        head = f.read(4)
    if head.startswith(GZIP_MAGIC):
        try:
            with gzip.open(source, "rb") as f:  # read line by line, as a plain file is
                return iter_json_lines(f, label)
        except (OSError, EOFError, zlib.error) as e:
            raise DatasetError(f"{label}: gzip-compressed but not readable as gzip ({e}): decompress it with "
                               "gunzip to see what it holds") from None
    _check_encoding(head, label)
    with open(source, "rb") as f:
        return iter_json_lines(f, label)


def _plain(data: bytes, label: str) -> bytes:
    """`data` decompressed if it is gzip, checked for an encoding no line can be read in."""
    if data.startswith(GZIP_MAGIC):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise DatasetError(f"{label}: gzip-compressed but not readable as gzip ({e})") from None
    _check_encoding(data[:4], label)
    return data


def _check_encoding(head: bytes, label: str) -> None:
    """UTF-16 (a BOM, or a NUL after the first `{`) fails every line as UTF-8: say it once, with the fix."""
    if head[:2] in UTF16_BOMS or head[:2] in (b"{\x00", b"\x00{"):
        raise DatasetError(f"{label}: the file is UTF-16 text; moelight reads UTF-8: convert it "
                           f"(e.g. iconv -f UTF-16 -t UTF-8 {label} > converted.jsonl)")


def iter_json_lines(lines: Iterable[bytes], label: str) -> tuple[list[tuple[int, dict]], list[Problem]]:
    """read_json_lines over raw lines already in hand (a file's bytes read by Ray)."""
    records: list[tuple[int, dict]] = []
    problems: list[Problem] = []
    first = True
    for lineno, raw in enumerate(lines, start=1):
        where = f"{label}:{lineno}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            problems.append(Problem(where, f"not valid UTF-8 ({e.reason} at byte {e.start})"))
            continue
        if lineno == 1:
            line = line.lstrip("\ufeff")  # tolerate a BOM written by some editors
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            msg = e.msg.removesuffix(" at")  # "Invalid control character at": the column follows
            problems.append(Problem(where, f"invalid JSON ({msg} at column {e.colno}){_hint(line, first)}"))
            first = False
            continue
        first = False
        if not isinstance(obj, dict):
            problems.append(Problem(where, f"expected a JSON object, got {type(obj).__name__}"))
            continue
        records.append((lineno, obj))
    return records, problems


def _hint(line: str, first: bool) -> str:
    """What a line that is not JSON may be instead: old Mac line endings, or (the file's first line) a table."""
    if "\r" in line.rstrip("\r\n"):
        return ("; the line holds a bare carriage return (\\r): JSON Lines ends each line with \\n; convert the "
                "line endings (e.g. tr '\\r' '\\n' < FILE > FILE.jsonl)")
    if first and not line.lstrip().startswith(("{", "[")) and ("," in line or "\t" in line):
        return "; the file looks like CSV/TSV, not JSON Lines: convert it to one JSON object a line"
    return ""
