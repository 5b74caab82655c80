"""The top README's "Measured" table, written by `neuron-serving bench report`.

The table lives between two marker comments in README.md; everything between them
is replaced on every report, everything outside is left alone, so the README never
shows figures that no result file holds. Rows come from ``report.readme_rows`` (the
targets of the newest result of each benchmark); this module only renders and
splices, so it needs nothing of the report.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

BEGIN = "<!-- measured:begin (written by `neuron-serving bench report`; edits are overwritten) -->"
END = "<!-- measured:end -->"


@dataclass(frozen=True, slots=True)
class MeasuredRow:
    run: str  # "`executor`: executor.json, 2026-12-04, AMD EPYC" on a benchmark's first row
    target: str
    measured: str
    status: str


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(rows: list[MeasuredRow]) -> str:
    """The markdown between the markers: the table, then where it comes from."""
    lines = ["| benchmark: result, date, CPU | target | measured | status |",
             "| --- | --- | --- | --- |",
             *(f"| {_cell(r.run)} | {_cell(r.target)} | {_cell(r.measured)} | {_cell(r.status)} |"
               for r in rows),
             "",
             "Medians with the spread over repeats (min..max, n); every figure, the rows kept "
             "for information and the plots are in [bench/REPORT.md](bench/REPORT.md)."]  # fmt: skip
    return "\n".join(lines)


def splice(text: str, block: str) -> str:
    """``text`` with what lies between the markers replaced by ``block``."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start or text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"README needs exactly one {BEGIN!r} followed by one {END!r}")
    return text[: start + len(BEGIN)] + "\n" + block + "\n" + text[end:]


def rewrite_readme(path: Path, rows: list[MeasuredRow]) -> bool:
    """Rewrite the table in ``path``; False (nothing written) when the file or its
    markers are missing, as in an installed package without a checkout."""
    try:
        text = path.read_text(encoding="utf-8")
        new = splice(text, render(rows))
    except (OSError, ValueError):
        return False
    if new != text:
        path.write_text(new, encoding="utf-8")
    return True
