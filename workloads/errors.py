"""Errors for bad datasets and result files.

One exception type for every input problem, so the CLI can print it and exit cleanly,
and so a user fixing a file sees every broken line at once instead of one per run.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_LISTED = 20


@dataclass(frozen=True)
class Problem:
    """One bad record: where it is (``file:line`` or ``file:row N``) and what is wrong."""

    where: str
    message: str
    id: str | None = None  # an OpenAI record's custom_id, whose output answers it with an error line

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


def format_problems(problems: list[Problem], limit: int = MAX_LISTED) -> str:
    """List problems one a line, capped at ``limit`` with an "and N more" tail."""
    lines = [str(p) for p in problems[:limit]]
    if len(problems) > limit:
        lines.append(f"... and {len(problems) - limit} more")
    return "\n".join(lines)


class DatasetError(ValueError):
    """A dataset (or result file) cannot be read as asked; the message names file and line(s)."""

    def __init__(self, message: str, problems: list[Problem] | None = None):
        self.problems: list[Problem] = list(problems or [])
        super().__init__(message)

    @classmethod
    def from_problems(cls, path: str, problems: list[Problem], hint: str = "") -> DatasetError:
        """Build one error that lists every bad record of ``path``."""
        n = len(problems)
        head = f"{path}: {n} bad record{'s' if n != 1 else ''}"
        msg = f"{head}:\n{format_problems(problems)}"
        if hint:
            msg += f"\n{hint}"
        if n == 1:
            # A single problem reads best on one line: "file:17: invalid JSON (...)".
            msg = str(problems[0]) + (f"\n{hint}" if hint else "")
        return cls(msg, problems)


class OutputExistsError(FileExistsError):
    """The output file exists and neither resume nor overwrite was asked for."""


class OutputPathError(ValueError):
    """An output path whose extension names no format moelight writes."""


class OutputWriteError(OSError):
    """The output (or its report) could not be written: a full disk, a lost mount. The results written
    before are in it whole; a cut last line is dropped on --resume."""
