"""Every path a job writes, checked before anything heavy runs: a typo in an output path costs a
second, not a model load, and no output ever lands on (or inside) something the job reads.

An output file's folder must exist or be creatable, be a folder and take a new file; the file itself
(and its report beside it) must not be a folder; and it must be none of the job's inputs (same file
by any spelling of its path, or by inode through a link) nor inside an input folder (a model folder,
a dataset folder). An output folder (plots) is checked the same way.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from moelight.errors import MoelightError

IMAGE_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg")


class OutputPathError(MoelightError):
    """An output path the job cannot or must not write; the message names the option and the path."""


def _resolved(path: Path) -> Path:
    return Path(os.path.abspath(os.path.expanduser(path)))


def input_conflict(out: Path, read: Path) -> str | None:
    """How `out` collides with the input `read`: "itself" (the same file by any spelling, a symbolic or
    hard link), "inside" (a file inside the folder `read`), or None."""
    out_r, read_r = os.path.realpath(_resolved(out)), os.path.realpath(_resolved(read))
    try:
        same = os.path.exists(out_r) and os.path.exists(read_r) and os.path.samefile(out_r, read_r)
    except OSError:
        same = False
    if same or out_r == read_r:
        return "itself"
    if os.path.isdir(read_r) and Path(read_r) in Path(out_r).parents:
        return "inside"
    return None


def check_not_an_input(path: Path, option: str, inputs: Iterable[tuple[str, Path | None]]) -> None:
    """Refuse an output that is (or lies inside) one of the job's inputs, whatever the other flags say."""
    for what, read in inputs:
        conflict = None if read is None else input_conflict(path, read)
        if conflict == "itself":
            raise OutputPathError(f"{option} {path}: is the {what} {read} itself; moelight never writes over what "
                                  f"a job reads: name another {option} file")
        if conflict == "inside":
            raise OutputPathError(f"{option} {path}: is inside the {what} {read}; moelight never writes into what "
                                  f"a job reads: name a {option} file elsewhere")


def check_not_replaced(path: Path, overwrite: bool, option: str = "--output") -> None:
    """A file a command made before (a trace, a collection, eval results) is replaced only when asked."""
    if path.exists() and not overwrite:
        raise OutputPathError(f"{option} {path}: exists; pass --overwrite to replace it")


def check_output_file(path: Path, option: str, inputs: Iterable[tuple[str, Path]] = (),
                      companions: Iterable[Path] = ()) -> None:
    """`path` (and `companions`, files written beside it: a report, a sidecar) can be written as files,
    and none of them is (or lies inside) an input."""
    inputs = list(inputs)
    check_not_an_input(path, option, inputs)
    for p in companions:
        for what, read in inputs:
            if read is not None and input_conflict(p, read):
                raise OutputPathError(f"{option} {path}: the job writes {p} beside it, which is the {what} {read}; "
                                      f"moelight never writes over what a job reads: name another {option} file")
    for p in (path, *companions):
        if p.is_dir():
            raise OutputPathError(f"{option} {path}: {p} is a folder; name a file")
        if p.exists() and not os.access(p, os.W_OK):
            raise OutputPathError(f"{option} {path}: {p} exists and is not writable")
    check_output_dir(Path(os.path.dirname(_resolved(path))), option, label=path)


def check_output_dir(path: Path, option: str, label: Path | None = None) -> None:
    """`path` is a folder this process can write a file into, or one it can create: tried for real (the
    missing folders made, a file made and removed, then the folders this check made removed again),
    since permission bits say nothing for root, a read-only mount or a pseudo file system such as /proc,
    where a job would otherwise fail at its end."""
    shown = label if label is not None else path
    target = _resolved(path)
    if target.exists() and not target.is_dir():
        raise OutputPathError(f"{option} {shown}: {path} is a file, not a folder"
                              + ("" if label is not None else "; name a folder (it is created if missing)"))
    made = [p for p in (target, *target.parents) if not p.exists()]
    if made and not made[-1].parent.is_dir():
        raise OutputPathError(f"{option} {shown}: cannot create the folder {path}: {made[-1].parent} is a file")
    try:
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputPathError(f"{option} {shown}: cannot create the folder {path}: {e.strerror or e}") from None
        try:
            fd, probe = tempfile.mkstemp(dir=target, prefix=".moelight-write-check-")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise OutputPathError(f"{option} {shown}: the folder {path} is not writable ({e.strerror or e}); "
                                  "name a folder you can write to") from None
    finally:
        for folder in made:  # deepest first: the job creates them when it writes
            with contextlib.suppress(OSError):
                folder.rmdir()


def check_image_file(path: Path, option: str) -> None:
    """A chart's path: a writable file whose suffix names an image format matplotlib writes."""
    if path.suffix.lower() not in IMAGE_SUFFIXES:
        raise OutputPathError(f"{option} {path}: a chart is written as {', '.join(IMAGE_SUFFIXES)}; "
                              f"name the file with one of these suffixes (e.g. {path.with_suffix('.png')})")
    check_output_file(path, option)
