"""Tables from bench/ncu_source.sh's source page (OUT_PREFIX-sass.csv): the warp-stall samples of each SASS
instruction by reason, grouped by how often the instruction ran (instructions run the same number of times belong
to one loop of one kind of warp: the consumer's loop and the converters' come apart), and the instructions with
the most samples.
    python3 bench/ncu_source_table.py OUT_PREFIX-sass.csv [top]
"""

from __future__ import annotations

import csv
import sys
from collections import defaultdict


def main() -> None:
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 25
    with open(path) as f:
        rows = list(csv.reader(f))
    header, data = rows[1], rows[2:]
    col = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    samples = lambda r: float(r[col["Warp Stall Sampling (All Samples)"]] or 0)  # noqa: E731
    executed = lambda r: int(float(r[col["Instructions Executed"]] or 0))  # noqa: E731
    total = sum(samples(r) for r in data)
    print(f"{path}: {len(data)} instructions, {total:.0f} samples")
    groups: dict[int, list] = defaultdict(list)
    for r in data:
        groups[executed(r)].append(r)
    print("\nby executions (a loop of one kind of warp): instructions, samples, top reasons, opcodes")
    for count, members in sorted(groups.items(), key=lambda kv: -sum(samples(r) for r in kv[1]))[:12]:
        s = sum(samples(r) for r in members)
        by = sorted(((sum(float(r[col[h]] or 0) for r in members), h[6:]) for h in reasons), reverse=True)[:4]
        ops = defaultdict(int)
        for r in members:
            ops[r[1].split()[0] if not r[1].startswith("@") else r[1].split()[1]] += 1
        common = ", ".join(f"{k} {v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:6])
        print(f"{count:>9} x: {len(members):4d} instr {s:7.0f} samples ({s / total:5.1%}) "
              f"{', '.join(f'{n} {v:.0f}' for v, n in by if v)} | {common}")
    print(f"\ntop {top} instructions: samples, executions, SASS, top reasons")
    for r in sorted(data, key=lambda r: -samples(r))[:top]:
        by = sorted(((float(r[col[h]] or 0), h[6:]) for h in reasons), reverse=True)[:3]
        print(f"{samples(r):7.0f} {executed(r):9d}  {r[1][:58]:58} {', '.join(f'{n} {v:.0f}' for v, n in by if v)}")


if __name__ == "__main__":
    main()
