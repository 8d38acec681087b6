"""The same `strictnorm bench` run on two or more source trees in turn, in one call: an A/B of a kernel change.

Each round runs the bench once per tree (PYTHONPATH=TREE/src), in a rotated order, so drift over the call (clocks,
temperature) falls on every tree alike; the table gives each (provider, shape)'s forward and backward us per tree:
the median over the rounds, and every round's figure. Trees with the same kernels can still differ by a steady few
percent at shapes of a few us (bench/results/2026-12-03-h200-run37, call d: an unchanged 5.9 us backward, 0.2 us
apart in every round): name a tree twice (main=. again=.ab/main) to measure that spread in the same call.
A tree is NAME=PATH (its `src/` holds the package), e.g. main's checkout and a branch's files unpacked beside it
(`git archive BRANCH src | tar -x -C .ab/BRANCH`). NAME=PATH,TUNING runs the tree with the Triton tuning file TUNING
(STRICTNORM_TRITON_TUNING): a table candidate beside the table. Run on the GPU machine (or on the CPU, where the bench
times by wall clock):
    python3 bench/ab_bench.py OUT_DIR ROUNDS main=. row-walk=.ab/row-walk -- --shapes 4096x128 --only cuda
    python3 bench/ab_bench.py OUT_DIR 2 table=. dense=.,bench/candidates/dense-128.json -- --shapes 65536x128
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple


class Tree(NamedTuple):
    """A source tree (its `src/` holds the package) and the Triton tuning file it runs with (None: its table)."""

    path: Path
    tuning: Path | None = None

    @classmethod
    def parse(cls, spec: str) -> tuple[str, Tree]:
        """NAME=PATH or NAME=PATH,TUNING -> (NAME, Tree)."""
        name, _, where = spec.partition("=")
        path, _, tuning = where.partition(",")
        return name, cls(Path(path).resolve(), Path(tuning).resolve() if tuning else None)


def run_rounds(out: Path, rounds: int, trees: dict[str, Tree], bench_args: list[str]) -> dict[str, list[dict]]:
    """Every tree's bench JSON of each round (the bench's own --json), the trees' order rotated a round."""
    out.mkdir(parents=True, exist_ok=True)
    names = list(trees)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            path = out / f"{name}-{r + 1}.json"
            tree = trees[name]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree.path / "src"),
                                                                              os.environ.get("PYTHONPATH")]))}
            env.pop("STRICTNORM_TRITON_TUNING", None)
            if tree.tuning is not None:
                env["STRICTNORM_TRITON_TUNING"] = str(tree.tuning)
            with open(out / f"{name}-{r + 1}.log", "w") as log:
                subprocess.run([sys.executable, "-m", "strictnorm.bench", "--json", str(path), *bench_args],
                               env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
            runs[name].append(json.loads(path.read_text()))
    return runs


def table(runs: dict[str, list[dict]]) -> list[str]:
    """Lines: provider, shape, then per tree the median fwd / bwd us and the rounds' figures."""
    figures: dict[tuple, dict[str, list[tuple]]] = {}
    for name, datas in runs.items():
        for data in datas:
            for row in data["norm"]:
                key = (row["provider"], f"{row['M']}x{row['N']}")
                figures.setdefault(key, {}).setdefault(name, []).append((row.get("fwd_us"), row.get("bwd_us")))
    lines = []
    for (provider, shape), by_tree in figures.items():
        cells = []
        for name in runs:
            got = by_tree.get(name, [])
            fwd = [f for f, _ in got if f is not None]
            bwd = [b for _, b in got if b is not None]
            med = "/".join(f"{statistics.median(v):.2f}" if v else "-" for v in (fwd, bwd))
            cells.append(f"{name} {med} ({', '.join(f'{f:.2f}' for f in fwd)} | {', '.join(f'{b:.2f}' for b in bwd)})")
        lines.append(f"{provider:28s} {shape:>12s}  " + "  ".join(cells))
    return lines


def main(argv: list[str]) -> int:
    if "--" not in argv or len(argv[:argv.index("--")]) < 4:
        print(__doc__, file=sys.stderr)
        return 2
    head, bench_args = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    out, rounds = Path(head[0]), int(head[1])
    trees = dict(Tree.parse(spec) for spec in head[2:])
    runs = run_rounds(out, rounds, trees, bench_args)
    lines = table(runs)
    (out / "ab.txt").write_text("\n".join(lines) + "\n")
    print("us, median fwd/bwd per tree (each round's fwd | bwd):", *lines, sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
