"""Render benchmark CSVs as markdown tables inside the docs.

A doc marks a generated table with two comment lines::

    <!-- results-table: FILE.csv cols=colA,colB,... [where=col=value] -->
    | colA | colB | ... |
    ...
    <!-- /results-table -->

Everything between the two marker lines is replaced by a table of ``DIR/FILE.csv`` (``DIR`` from
``--csv-dir``): one header row naming the columns, then one row per CSV row, with the columns
``cols`` in the order given. ``where=col=value`` keeps only the rows whose ``col`` equals
``value``; ``value`` may list alternatives separated by ``|`` (``where=M=1|16|1024``), numbers
compare as numbers (``1`` matches ``1.0``), and several ``where=`` options must all hold.

Cells: integers as written; other numbers to 3 significant digits, trailing zeros dropped
(``12.345`` -> ``12.3``, ``0.5`` -> ``0.5``), whole numbers from 1000 up, never an exponent; ``nan``
and empty cells as ``-``; text as written (``|`` escaped). A column whose cells are all numbers (or
missing) is right-aligned.

    python -m tools.results_table --csv-dir DIR docs/w8a8_gemm.md docs/kv_cache.md
    python -m tools.results_table --csv-dir DIR --check docs/*.md

prints one line per block (updated, unchanged, or left as is and why). A CSV that is not in
``DIR`` leaves its block as it is, with a warning. ``--check`` writes nothing and exits 1 if a
block would change. A malformed block (no end marker, no ``cols=``, a column or option the CSV
does not have) is an error: the block stays as it is and the exit status is 2. Only the Python
standard library is used, so this runs anywhere the docs are edited.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import re
import sys

START = re.compile(r"^\s*<!--\s*results-table:\s*(?P<spec>.*?)\s*-->\s*$")
END = re.compile(r"^\s*<!--\s*/results-table\s*-->\s*$")


class BlockError(Exception):
    """A block that cannot be rendered as written (the doc or the CSV must change)."""


def parse_spec(spec: str) -> tuple[str, list[str], list[tuple[str, list[str]]]]:
    """``FILE.csv cols=a,b [where=c=v1|v2]...`` -> (file, columns, filters)."""
    words = spec.split()
    if not words or not words[0].endswith(".csv"):
        raise BlockError(f"the marker must name a .csv file first, got {spec!r}")
    csv_name, cols, where = words[0], None, []
    for word in words[1:]:
        key, sep, value = word.partition("=")
        if key == "cols" and sep and value:
            cols = [c for c in value.split(",") if c]
        elif key == "where" and sep:
            col, sep2, alternatives = value.partition("=")
            if not col or not sep2:
                raise BlockError(f"where= needs col=value, got {word!r}")
            where.append((col, alternatives.split("|")))
        else:
            raise BlockError(f"unknown option {word!r} (known: cols=..., where=col=value)")
    if not cols:
        raise BlockError(f"no cols= in {spec!r}")
    return csv_name, cols, where


def as_number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def is_int(text: str) -> bool:
    return re.fullmatch(r"[+-]?\d+", text.strip()) is not None


def same_value(cell: str, wanted: str) -> bool:
    if cell.strip() == wanted.strip():
        return True
    a, b = as_number(cell), as_number(wanted)
    return a is not None and b is not None and a == b


def format_cell(text: str) -> str:
    text = (text or "").strip()
    if text == "":
        return "-"
    if is_int(text):
        return text
    v = as_number(text)
    if v is None:
        return text.replace("|", "\\|")
    if math.isnan(v):
        return "-"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if abs(v) >= 1000:
        return f"{v:.0f}"
    out = f"{v:.3g}"
    if "e" in out:  # below 1e-4: write the digits out
        digits = 2 - math.floor(math.log10(abs(v)))
        out = f"{v:.{digits}f}"
    return out


def render(csv_path: str, cols: list[str], where: list[tuple[str, list[str]]]) -> list[str]:
    """The table's lines (without line ends). Raises BlockError on unknown columns."""
    with open(csv_path, newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        rows = list(reader)
    missing = [c for c in cols + [w[0] for w in where] if c not in header]
    if missing:
        raise BlockError(
            f"{os.path.basename(csv_path)} has no column {', '.join(missing)} (it has: {', '.join(header)})"
        )
    rows = [r for r in rows if all(any(same_value(r[c], v) for v in vs) for c, vs in where)]
    if not rows:
        raise BlockError(f"no row of {os.path.basename(csv_path)} passes the filter")
    cells = [[format_cell(r[c]) for c in cols] for r in rows]
    numeric = [all(r[c].strip() == "" or as_number(r[c]) is not None for r in rows) for c in cols]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return lines


def process(path: str, csv_dir: str, check: bool) -> tuple[int, int]:
    """Rewrites (or, with check, compares) every block of one doc.
    Returns (blocks that would change or changed, errors)."""
    with open(path, newline="") as f:
        lines = f.read().splitlines(keepends=True)
    newline = "\r\n" if lines and lines[0].endswith("\r\n") else "\n"
    out, changed, errors, i = [], 0, 0, 0
    while i < len(lines):
        m = START.match(lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        start = i
        j = start + 1
        while j < len(lines) and not END.match(lines[j]) and not START.match(lines[j]):
            j += 1
        where_txt = f"{path}:{start + 1}"
        if j == len(lines) or START.match(lines[j]):
            print(f"{where_txt}: error: no <!-- /results-table --> before the next block or the end", file=sys.stderr)
            out.extend(lines[start:j])
            errors += 1
            i = j
            continue
        old = lines[start + 1 : j]
        new = old
        try:
            csv_name, cols, filters = parse_spec(m.group("spec"))
            csv_path = os.path.join(csv_dir, csv_name)
            if not os.path.exists(csv_path):
                print(f"{where_txt}: warning: {csv_path} not found; block left as it is", file=sys.stderr)
            else:
                new = [line + newline for line in render(csv_path, cols, filters)]
                state = "unchanged" if new == old else ("would change" if check else "updated")
                print(f"{where_txt}: {csv_name}: {len(new) - 2} rows, {state}")
        except BlockError as e:
            print(f"{where_txt}: error: {e}; block left as it is", file=sys.stderr)
            errors += 1
            new = old
        changed += new != old
        out.append(lines[start])
        out.extend(new)
        out.append(lines[j])
        i = j + 1
    if not check and out != lines:
        with open(path, "w", newline="") as f:
            f.write("".join(out))
    return changed, errors


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--csv-dir", required=True, help="the folder of the benchmark CSVs (a bench --out DIR)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a block would change")
    ap.add_argument("docs", nargs="+", help="markdown files whose results-table blocks are rewritten")
    args = ap.parse_args(argv)
    changed = errors = 0
    for path in args.docs:
        c, e = process(path, args.csv_dir, args.check)
        changed, errors = changed + c, errors + e
    if errors:
        return 2
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
