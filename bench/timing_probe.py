"""Why two timings of one forward part: strictnorm.bench and bench/exactness_probe.py, both by Timer.kernel_us, gave
strictnorm triton's 128 x 4096 forward 2.46 and 1.92 us on one H200 (bench/results/2026-12-06-h200-run53), the
bytes-only copy 1.79 and 1.44, and torch.compile 1.86 in both.

This probe times the same forwards (strictnorm.bench's providers as f(x, w, r): torch.compile, the bytes-only copy,
strictnorm's Triton and CUDA backends, and exactness_probe's exact tile) in one process by two timers (kernel_us:
the profiler, one call alone after an idle host gap; queued_us: the call enqueued behind a sleep kernel, so the GPU
is busy until it starts), in two phases: on inputs made at the start (as exactness_probe makes them), then again on
inputs made after the copy-ceiling measurement has allocated and freed 4 GiB (as strictnorm.bench makes them), each
phase in provider order and again reversed. A figure that moves with the phase or the order, and not with the timer,
points at the inputs' memory; one that moves with the timer points at the GPU's idle gap. Run 54 (H100) ruled out the
inputs' memory and the order; a last phase times the forward as the bench does, in rounds with the bench's other
steps between two forwards (SEQUENCES: none, the forward-backward step, then also the eager timings; in
inductor_probe a torch.compile step before strictnorm's forward was enough for 2.53 us), with y's placement beside.
Run 55 (H100) found the forward-backward step to be what slows the next eager forward (0.26-0.35 us at 128 x 4096,
PyTorch's copy and strictnorm's alike, torch.compile's not), and the slowdown lasting into later rounds. The trigger
mode looks for its cause: in a fresh process, the forwards timed as the bench times them, then one step of TRIGGERS
(each a suspect: autograd's engine on the CPU or the GPU, the backward's allocations, a dx-sized kernel, a backward
timed under the profiler or run plainly), then the forwards twice more (right after, and after a second timing: does
it last). Run 57 (H100): no one-round trigger moved them, the bench's whole round included; bench_preamble (what the
bench does before its first shape) and bench_main (the bench itself) are the next.
Run on the GPU machine:
    PROBE_SHAPES=128x4096 python3 bench/timing_probe.py [out.json]
    python3 bench/timing_probe.py --trigger NAME [out.json]    # at 128 x 4096 unless PROBE_SHAPES names one shape
    python3 bench/timing_probe.py --triggers all|NAME,NAME [out.json]   # each in a fresh process, clocks between
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from exactness_probe import Variant, launcher

from strictnorm.bench import (
    BYTES_ONLY,
    Timer,
    _norm_inputs,
    _norm_once,
    copy_ceiling_gbps,
    environment,
    norm_calls,
    norm_providers,
)
from strictnorm.bench import main as bench_main

# the bench's steps a provider takes in a round (strictnorm.bench._norm_once), cumulatively: which one, run before
# the next round's forward, moves that forward's kernel_us
SEQUENCES = {"fwd only": ("fwd",), "fwd, fwd_bwd": ("fwd", "fwd_bwd"),
             "fwd, fwd_bwd, eager": ("fwd", "fwd_bwd", "eager")}

WANTED = ("torch.compile", BYTES_ONLY, "strictnorm triton fast", "strictnorm cuda fast")


def forwards(dev: torch.device, x: torch.Tensor, w: torch.Tensor, r: torch.Tensor) -> dict[str, Callable]:
    """The forwards to time on these inputs, each a no-argument call."""
    providers, _ = norm_providers(dev, compile_anchor=True)
    calls = {name: (lambda f=providers[name]: f(x, w, r)) for name in WANTED if name in providers}
    calls["exactness_probe tile 1x8"] = launcher(x, w, 1, 8, Variant("exact"))
    return calls


def _tiny_grad(device: torch.device) -> Callable[[], object]:
    a = torch.randn(64, device=device, requires_grad=True)
    return lambda: torch.autograd.grad((a * 2).sum(), a)


def _backward_buffers(x: torch.Tensor) -> Callable[[], object]:
    """The backward's allocations without its kernels: dx (x's size) and fp32 dW partials of x's size."""
    return lambda: (torch.empty_like(x), torch.empty(x.shape, dtype=torch.float32, device=x.device))


# name -> (source, how, maker). source: the provider whose fwd_bwd is the step ("NAME:fwd": its forward), "*" (every
# WANTED provider), or None (the maker's call from (device, x, dy)); how: "profiled" (as the bench times a step),
# "plain" (run iters + 2 times), "eager" (the bench's eager timing), "round" (the bench's whole round of each source),
# "once" (run once).
# Each trigger is run by itself in a fresh process.
TRIGGERS: dict[str, tuple[str | None, str, Callable | None]] = {
    "nothing": (None, "profiled", lambda dev, x, dy: (lambda: None)),
    "cpu_autograd": (None, "profiled", lambda dev, x, dy: _tiny_grad(torch.device("cpu"))),
    "gpu_autograd": (None, "profiled", lambda dev, x, dy: _tiny_grad(dev)),
    "backward_buffers": (None, "profiled", lambda dev, x, dy: _backward_buffers(x)),
    "dx_sized_add": (None, "profiled", lambda dev, x, dy: (lambda: torch.add(x, dy))),
    "copy_fwd_bwd": (BYTES_ONLY, "profiled", None),
    "triton_fwd_bwd": ("strictnorm triton fast", "profiled", None),
    "triton_fwd_bwd_plain": ("strictnorm triton fast", "plain", None),
    "compile_fwd_bwd": ("torch.compile", "profiled", None),
    "cuda_fwd_bwd": ("strictnorm cuda fast", "profiled", None),
    # the bench's eager step (triton's do_bench: its own 256 MB L2-clearing buffer, made and zeroed every call)
    "eager_copy_fwd": (BYTES_ONLY + ":fwd", "eager", None),
    "eager_triton_fwd_bwd": ("strictnorm triton fast", "eager", None),
    # the bench's whole round (strictnorm.bench._norm_once) of every WANTED provider
    "bench_round": ("*", "round", None),
    # what the bench does before its first shape (its environment record, the copy ceiling's 4 GiB copies), and the
    # bench itself on this shape with the WANTED providers (run 57: every one-round trigger left the forwards fast,
    # the bench's own figures were slow)
    "bench_preamble": (None, "once", lambda dev, x, dy: (lambda: (environment(), copy_ceiling_gbps(dev)))),
    "bench_main": (None, "once", lambda dev, x, dy: _bench_main(dev, x)),
}


def _bench_main(dev: torch.device, x: torch.Tensor) -> Callable[[], object]:
    """`strictnorm bench` on x's shape, as a call: the providers whose names contain a WANTED name (--only matches
    parts of names, so both compiled anchors: the default and eager's casts)."""
    only = ",".join(name.split(",")[0] for name in WANTED)  # --only splits at commas ("bytes only: copy, add")
    args = ["--compile", "--shapes", f"{x.shape[0]}x{x.shape[1]}", "--only", only, "--device", dev.type]
    return lambda: bench_main(args)


def triggered(timer: Timer, dev: torch.device, m: int, n: int, trigger: str) -> list[dict]:
    """The forwards of WANTED (kernel_us as the bench takes it) before TRIGGERS[trigger], right after it, and after
    those timings again: one row per forward with the three figures."""
    x, w, dy, r = _norm_inputs(dev, m, n)
    providers, _ = norm_providers(dev, compile_anchor=True)
    fwds = {name: norm_calls(providers[name], x, w, dy, r).fwd for name in WANTED if name in providers}
    source, how, make = TRIGGERS[trigger]
    if source is None:
        step = make(dev, x, dy)
    elif source != "*":
        name = source.removesuffix(":fwd")
        calls = norm_calls(providers[name], x, w, dy, r)
        step = calls.fwd if name != source else calls.fwd_bwd
    got: dict[str, list[float]] = {name: [timer.kernel_us(f)] for name, f in fwds.items()}
    if how == "profiled":
        timer.kernel_us(step)
    elif how == "eager":
        timer.eager_us(step)
    elif how == "round":
        for name in fwds:
            _norm_once(timer, providers[name], x, w, dy, r)
    elif how == "once":
        step()
        timer.sync()
    else:
        for _ in range(timer.iters + 2):
            step()
        timer.sync()
    for _ in ("after", "after again"):
        for name, f in fwds.items():
            got[name].append(timer.kernel_us(f))
    rows = []
    for name, (before, after, again) in got.items():
        row = dict(phase="trigger", M=m, N=n, trigger=trigger, what=name, before=before, after=after,
                   after_again=again)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def bench_sequence(timer: Timer, dev: torch.device, m: int, n: int, rounds: int = 3) -> list[dict]:
    """The forward's kernel_us as the bench takes it (iters 9, rounds of the providers with the steps of SEQUENCES
    between two forwards), one row per sequence and provider: the median over the rounds and every round."""
    x, w, dy, r = _norm_inputs(dev, m, n)
    providers, _ = norm_providers(dev, compile_anchor=True)
    rows = []
    for seq, steps in SEQUENCES.items():
        got: dict[str, list[float]] = {name: [] for name in WANTED if name in providers}
        # where y lands (its address within its 2 MiB page, and its page counted from x's), in case the placement
        # (a page the kernel shares with x or not, after the flush has emptied the TLBs) is what moves
        y_at: dict[str, list[tuple[int, int]]] = {name: [] for name in got}
        for _ in range(rounds):
            for name, f in providers.items():
                if name not in got:
                    continue
                fwd, fwd_bwd, _ = norm_calls(f, x, w, dy, r)  # the bench's own calls (strictnorm.bench._norm_once)
                got[name].append(timer.kernel_us(fwd))
                y = fwd().data_ptr()
                y_at[name].append((y % (2 << 20), (y >> 21) - (x.data_ptr() >> 21)))
                if "fwd_bwd" in steps:
                    timer.kernel_us(fwd_bwd)
                if "eager" in steps:
                    timer.eager_us(fwd)
                    timer.eager_us(fwd_bwd)
        for name, us in got.items():
            row = dict(phase="bench sequence", M=m, N=n, sequence=seq, what=name, us=sorted(us)[len(us) // 2],
                       rounds=us, y_at=y_at[name])
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def gpu_state() -> str:
    """The GPU's SM and memory clocks, temperature and power draw now (nvidia-smi), or why not."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw",
                               "--format=csv,noheader", "-i", "0"], capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"nvidia-smi: {e}"


TRIGGER_TIMEOUT_S = 300  # one trigger's process (compiling torch.compile's kernels included)


def run_triggers(names: list[str], out: str | None) -> list[dict]:
    """Each trigger of names by itself in a fresh process (this script's --trigger), the GPU's clocks read before
    each; every row gets its trigger's process's state."""
    rows = []
    for name in names:
        state = gpu_state()
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            try:
                run = subprocess.run([sys.executable, __file__, "--trigger", name, tmp.name], capture_output=True,
                                     text=True, timeout=TRIGGER_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                print(f"trigger {name}: past {TRIGGER_TIMEOUT_S} s, left out; GPU before it: {state}", flush=True)
                continue
            got = json.loads(Path(tmp.name).read_text() or "[]") if run.returncode == 0 else []
        print(f"trigger {name}: rc {run.returncode}; GPU before it: {state}", flush=True)
        if run.returncode != 0:
            print(run.stdout[-2000:], run.stderr[-4000:], sep="\n", flush=True)
        elif run.stdout.strip():  # what the trigger printed (bench_main: the bench's own tables, its figures)
            print(run.stdout[-3000:], flush=True)
        rows += [dict(row, gpu_before=state) for row in got]
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


def print_triggered(rows: list[dict]) -> None:
    print(f"\n{'trigger':>22s} {'what':>26s} {'before':>7s} {'after':>7s} {'again':>7s}")
    for row in rows:
        print(f"{row['trigger']:>22s} {row['what']:>26s} {row['before']:7.2f} {row['after']:7.2f} "
              f"{row['after_again']:7.2f}")


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("timing_probe.py times CUDA kernels: run it on a GPU machine")
    dev = torch.device("cuda")
    if len(sys.argv) > 2 and sys.argv[1] == "--triggers":
        names = list(TRIGGERS) if sys.argv[2] == "all" else sys.argv[2].split(",")
        unknown = sorted(set(names) - set(TRIGGERS))
        if unknown:
            sys.exit(f"unknown triggers {unknown}; known: {', '.join(TRIGGERS)}")
        print_triggered(run_triggers(names, sys.argv[3] if len(sys.argv) > 3 else None))
        return
    if len(sys.argv) > 2 and sys.argv[1] == "--trigger":
        m, n = (int(v) for v in os.environ.get("PROBE_SHAPES", "128x4096").split("x"))
        rows = triggered(Timer(dev, iters=9), dev, m, n, sys.argv[2])
        if len(sys.argv) > 3:
            with open(sys.argv[3], "w") as f:
                json.dump(rows, f, indent=1)
        print_triggered(rows)
        return
    shapes = [tuple(int(v) for v in s.split("x")) for s in os.environ.get("PROBE_SHAPES", "128x4096").split(",")]
    timer = Timer(dev, iters=21)
    rows = []
    for phase in ("inputs first", "after copy ceiling"):
        if phase == "after copy ceiling":
            print(f"copy ceiling {copy_ceiling_gbps(dev):.0f} GB/s", flush=True)
        for m, n in shapes:
            x, w, _, r = _norm_inputs(dev, m, n)
            calls = forwards(dev, x, w, r)
            for order in ("forward", "reversed"):
                names = list(calls) if order == "forward" else list(reversed(calls))
                for name in names:
                    for how in ("kernel", "queued"):
                        us = (timer.kernel_us if how == "kernel" else timer.queued_us)(calls[name])
                        row = dict(phase=phase, M=m, N=n, order=order, what=name, timer=how, us=us)
                        rows.append(row)
                        print(json.dumps(row), flush=True)
            del x, w, r, calls
            torch.cuda.empty_cache()
    sequence_rows = [row for m, n in shapes for row in bench_sequence(Timer(dev, iters=9), dev, m, n)]
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(rows + sequence_rows, f, indent=1)
    print(f"\n{'phase':>19s} {'M x N':>12s} {'what':>26s} {'kernel fwd/rev':>15s} {'queued fwd/rev':>15s}")
    for phase in ("inputs first", "after copy ceiling"):
        for m, n in shapes:
            for name in dict.fromkeys(r["what"] for r in rows):
                us = {(r["timer"], r["order"]): r["us"] for r in rows
                      if (r["phase"], r["M"], r["N"], r["what"]) == (phase, m, n, name)}
                print(f"{phase:>19s} {m:>5d} x {n:<5d} {name:>26s} "
                      f"{us['kernel', 'forward']:7.2f}/{us['kernel', 'reversed']:<7.2f}"
                      f"{us['queued', 'forward']:7.2f}/{us['queued', 'reversed']:<7.2f}")
    print(f"\n{'bench sequence (iters 9, 3 rounds)':>36s} {'M x N':>12s} {'what':>26s} {'kernel us':>10s}")
    for row in sequence_rows:
        print(f"{row['sequence']:>36s} {row['M']:>5d} x {row['N']:<5d} {row['what']:>26s} {row['us']:10.2f}")


if __name__ == "__main__":
    main()
