"""Reading CLI messages whatever the terminal: width, box drawing, colour and path length.

typer prints parameter errors in a rich box wrapped at the terminal's width, so a phrase can
break across lines (and a long path mid-word). Compare with all whitespace, box characters and
ANSI escapes removed, on both sides.
"""

from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_BOX = re.compile(r"[\u2500-\u257f]")  # box drawing: │ ╭ ╮ ╰ ╯ ─


def flat(text: str) -> str:
    return "".join(_BOX.sub("", _ANSI.sub("", text)).split())


def says(output: str, phrase: str) -> bool:
    """True when `output` holds `phrase`, however the terminal wrapped or boxed it."""
    return flat(phrase) in flat(output)
