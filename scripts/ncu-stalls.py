#!/usr/bin/env python3
"""Where the warps of a kernel wait, instruction by instruction, from Nsight Compute's samples.

On the GPU machine, profile with the source counters and export the SASS page as CSV:

    ncu --clock-control none -k regex:KERNEL -c 1 --section WarpStateStats \\
        --section SourceCounters --import-source no -o prof ./program ARGS
    ncu --import prof.ncu-rep --page source --csv --print-source sass > sass.csv

then, anywhere:

    scripts/ncu-stalls.py sass.csv [--top N]

For each kernel in the file it prints the share of every stall reason over all samples and the
N instructions holding the most samples, with their two largest reasons. A long-scoreboard wait
sits on the first instruction that uses a load's register, so the instruction named is the
consumer; its operands say which load it waits for.
"""

import argparse
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def kernels(rows):
    """(name, header, data rows) for each kernel section of the CSV."""
    name, header, data = None, None, []
    for row in rows:
        if row and row[0] == "Kernel Name":
            if name is not None:
                yield name, header, data
            name, header, data = row[1], None, []
        elif name is not None and header is None:
            header = row
        elif name is not None and row:
            data.append(row)
    if name is not None:
        yield name, header, data


def report(name, header, data, top, out):
    col = {h: i for i, h in enumerate(header)}
    if SAMPLES not in col or "Source" not in col:
        print(f"{name}: no stall samples in this export (profile with SourceCounters)", file=out)
        return
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(number(r[col[SAMPLES]]) for r in data)
    print(f"{name}: {int(total)} samples over {len(data)} instructions", file=out)
    if total == 0:
        return
    shares = sorted(
        ((sum(number(r[col[c]]) for r in data), c) for c in reasons), reverse=True
    )
    print(
        "  reasons: "
        + ", ".join(f"{c[len('stall_'):]} {100 * s / total:.1f}%" for s, c in shares if s > 0),
        file=out,
    )
    busiest = sorted(data, key=lambda r: -number(r[col[SAMPLES]]))[:top]
    for r in busiest:
        held = number(r[col[SAMPLES]])
        why = sorted(((number(r[col[c]]), c) for c in reasons), reverse=True)[:2]
        why = ", ".join(f"{c[len('stall_'):]} {int(s)}" for s, c in why if s > 0)
        address = r[col["Address"]] if "Address" in col else "?"
        print(
            f"  {100 * held / total:5.1f}%  {address}  {r[col['Source']].strip()}  ({why})",
            file=out,
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="`ncu --page source --csv --print-source sass` output")
    parser.add_argument("--top", type=int, default=12, help="instructions to list per kernel")
    args = parser.parse_args()
    with open(args.csv, newline="") as f:
        found = False
        for name, header, data in kernels(csv.reader(f)):
            found = True
            report(name, header or [], data, args.top, sys.stdout)
        if not found:
            sys.exit(f"{args.csv}: no 'Kernel Name' section (is it the source page's CSV?)")


if __name__ == "__main__":
    main()
