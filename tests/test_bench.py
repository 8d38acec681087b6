"""The benchmark's arithmetic and its CLI, end to end on the CPU (tiny shapes)."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import strictnorm as sn
from strictnorm import bench


def test_byte_counts():
    fwd, bwd = bench.norm_bytes(8, 16)
    assert fwd == 2 * 8 * 16 * 2 + 16 * 2 + 4 * 8  # read x, write y, read w, write rstd
    assert bwd == 3 * 8 * 16 * 2 + 2 * 16 * 2 + 4 * 8  # read x, dy, write dx, read w, write dW, read rstd
    assert bench.norm_bytes(8, 16, x_size=4, w_size=4)[0] == 2 * 8 * 16 * 4 + 16 * 4 + 4 * 8
    assert bench.norm_bytes(8, 16, fused=True)[0] == 4 * 8 * 16 * 2 + 16 * 2 + 4 * 8  # + residual in and out


def test_ratios_against_best_anchor_excluding_aa_control():
    rows = [dict(provider="Quack", M=1, N=2, fwd_us=4.0, bwd_us=10.0),
            dict(provider="Liger", M=1, N=2, fwd_us=5.0, bwd_us=8.0),
            dict(provider=bench.AA_CONTROL, M=1, N=2, fwd_us=1.0, bwd_us=1.0),
            dict(provider="strictnorm fast", M=1, N=2, fwd_us=2.0, bwd_us=4.0),
            dict(provider="strictnorm fast", M=3, N=4, error="boom")]
    bench.ratios(rows)
    assert rows[3]["fwd_speedup_vs_best_anchor"] == 2.0  # best anchor 4.0 (the A/A control is no anchor)
    assert rows[3]["bwd_speedup_vs_best_anchor"] == 2.0  # best anchor 8.0
    assert rows[0]["fwd_speedup_vs_best_anchor"] == 1.0
    assert "fwd_speedup_vs_best_anchor" not in rows[4]


def test_bytes_only_reference_is_no_anchor_and_divides_every_row():
    rows = [dict(provider="Quack", M=1, N=2, fwd_us=4.0, bwd_us=10.0),
            dict(provider=bench.BYTES_ONLY, M=1, N=2, fwd_us=1.0, bwd_us=5.0),
            dict(provider="strictnorm fast", M=1, N=2, fwd_us=2.0, bwd_us=8.0),
            dict(provider="strictnorm fast", M=3, N=4, fwd_us=2.0, bwd_us=8.0)]
    bench.ratios(rows)
    assert rows[2]["fwd_speedup_vs_best_anchor"] == 2.0  # best anchor Quack's 4.0, not the reference's 1.0
    assert rows[2]["bwd_speedup_vs_best_anchor"] == 1.25
    assert (rows[2]["fwd_over_bytes_only"], rows[2]["bwd_over_bytes_only"]) == (2.0, 1.6)
    assert rows[0]["fwd_over_bytes_only"] == 4.0
    assert "fwd_over_bytes_only" not in rows[3]  # no reference at its shape


def test_bytes_only_moves_the_norms_bytes():
    providers, _ = bench.norm_providers(torch.device("cpu"), False)
    x = torch.randn(5, 24, requires_grad=True)
    dy = torch.randn(5, 24)
    y = providers[bench.BYTES_ONLY](x, torch.randn(24, requires_grad=True), None)
    assert torch.equal(y, x.detach()) and y.data_ptr() != x.data_ptr()
    (dx,) = torch.autograd.grad(y, (x,), dy)
    assert torch.equal(dx, x.detach() + dy)
    assert bench.BYTES_ONLY not in bench.norm_providers(torch.device("cpu"), False, "fused_add")[0]


def test_aa_spread():
    rows = [dict(provider="torch F.rms_norm", M=1, N=2, fwd_us=10.0),
            dict(provider=bench.AA_CONTROL, M=1, N=2, fwd_us=11.0)]
    assert bench.aa_spread(rows) == {"fwd_us": pytest.approx(0.1)}


def test_parse_shapes():
    assert bench.parse_shapes("128x4096,2048X18432") == [(128, 4096), (2048, 18432)]


def test_backward_less_the_training_forward_where_it_differs_from_inference():
    """bwd_us is the forward-backward less the inference forward (PERF.md's anchors); bwd_only_us less the training
    forward, timed alone: a provider whose training forward is slower than its inference forward (here by a call's
    own count of kernels) shows it there and not in bwd_only_us."""
    kernels = {"fwd": 2.0, "train_fwd": 5.0, "fwd_bwd": 12.0}  # what each timed call "runs", us
    seen = []

    class CountingTimer:
        def kernel_us(self, fn):
            seen.append(fn.__name__)
            fn()
            return kernels[fn.__name__]

        def eager_us(self, fn):
            fn()
            return 0.0

    x, w, dy, r = (torch.randn(3, 8) for _ in range(4))
    row = bench._norm_once(CountingTimer(), lambda x, w, r: x * w, x, w[0], dy, r)
    assert sorted(seen) == ["fwd", "fwd_bwd", "train_fwd"]
    assert (row["fwd_us"], row["train_fwd_us"]) == (2.0, 5.0)
    assert (row["bwd_us"], row["bwd_only_us"]) == (10.0, 7.0)


def test_a_provider_that_raises_is_reported_not_fatal():
    timer = bench.Timer(torch.device("cpu"), iters=2)

    def broken(x, w):
        raise RuntimeError("no kernel for you")

    rows: list[dict] = []
    providers = {"torch F.rms_norm": lambda x, w, r: torch.nn.functional.rms_norm(x, (x.shape[-1],), w),
                 "broken": lambda x, w, r: broken(x, w)}
    bench.bench_norm(timer, [(4, 32)], 10.0, providers, rounds=2, log=lambda r: None, rows=rows)
    assert "no kernel for you" in rows[1]["error"]
    assert rows[0]["fwd_us"] > 0 and "error" not in rows[0]


def test_compile_anchor_is_static_and_compiled_afresh_at_each_shape(monkeypatch):
    """torch.compile is timed as PERF.md's anchors compile it, dynamic=False, and dynamo is reset at each shape: under
    automatic dynamic shapes every shape after the second ran one dynamic kernel (run 53, 1323 us at 262144 x 128)."""
    compiled_with, resets = [], []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled_with.append(kw) or fn)
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(len(rows)))
    providers, skipped = bench.norm_providers(torch.device("cpu"), True)
    assert compiled_with == [{"dynamic": False}, {"dynamic": False, "options": {"emulate_precision_casts": True}}]
    assert {bench.COMPILE_ANCHOR, bench.COMPILE_EXACT_ANCHOR} <= set(providers)
    assert bench.COMPILE_ANCHOR not in skipped and bench.COMPILE_EXACT_ANCHOR not in skipped
    rows: list[dict] = []
    only = {name: providers[name] for name in ("torch F.rms_norm", bench.COMPILE_ANCHOR)}
    bench.bench_norm(bench.Timer(torch.device("cpu"), 1), [(4, 32), (8, 64)], 10.0, only, 1, lambda r: None, rows)
    assert resets == [0, 2]  # before each shape's rows
    rows.clear()
    native = {"torch F.rms_norm": only["torch F.rms_norm"]}
    bench.bench_norm(bench.Timer(torch.device("cpu"), 1), [(4, 32)], 10.0, native, 1, lambda r: None, rows)
    assert resets == [0, 2]  # no compile anchor, no reset


def test_compile_anchor_with_eager_casts_gives_the_eager_modules_bits():
    """The torch.compile anchor with Inductor's emulate_precision_casts computes what the HF module computes eagerly,
    bit for bit (its (x * rstd).to(bf16) round trip kept), on the CPU's Inductor: the anchor of strictnorm's own
    computation (llama casting). The default anchor drops that round trip (a cheaper kernel with other bits)."""
    torch._dynamo.reset()
    providers, _ = bench.norm_providers(torch.device("cpu"), True)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(96, 128, generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(128, generator=g)).to(torch.bfloat16)
    eager = providers["HF llama eager"](x, w, None)
    exact = providers[bench.COMPILE_EXACT_ANCHOR](x, w, None)
    assert torch.equal(exact.view(torch.int16), eager.view(torch.int16))
    torch._dynamo.reset()


def test_timing_probe_replays_the_bench_round_on_cpu(monkeypatch):
    """bench/timing_probe.py's bench sequence (the forward timed in the bench's rounds, with the round's other steps
    between two forwards) runs end to end on the CPU: one row per sequence and provider it times, each with every
    round's figure, the median among them, and where y landed each round (before it spends GPU time)."""
    pytest.importorskip("triton")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # the round's structure, not Inductor, is under test
    import timing_probe

    rows = timing_probe.bench_sequence(bench.Timer(torch.device("cpu"), 1), torch.device("cpu"), 4, 64, rounds=3)
    timed = [name for name in timing_probe.WANTED if name in (bench.COMPILE_ANCHOR, bench.BYTES_ONLY)]
    assert [(r["sequence"], r["what"]) for r in rows] == [(seq, name) for seq in timing_probe.SEQUENCES
                                                          for name in timed]
    for r in rows:
        assert len(r["rounds"]) == 3 and r["us"] == sorted(r["rounds"])[1] and r["us"] > 0
        assert len(r["y_at"]) == 3 and all(0 <= within < 2 << 20 for within, _ in r["y_at"])


def test_timing_probe_triggers_run_on_cpu(monkeypatch):
    """bench/timing_probe.py's trigger mode: every suspect step it can run on the CPU (those not needing a GPU
    provider) runs between the forwards' timings, and each forward gets three positive figures (before, right after,
    after again) under the trigger's name."""
    pytest.importorskip("triton")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    import timing_probe

    cpu = torch.device("cpu")
    providers, _ = bench.norm_providers(cpu, compile_anchor=True)
    runnable = [t for t, (source, _, _) in timing_probe.TRIGGERS.items()
                if source in (None, "*") or source.removesuffix(":fwd") in providers]
    assert {"nothing", "gpu_autograd", "dx_sized_add", "copy_fwd_bwd", "compile_fwd_bwd", "eager_copy_fwd",
            "bench_round", "bench_preamble", "bench_main"} <= set(runnable)
    benched = []  # the providers bench_main's bench timed
    bench_norm = bench.bench_norm
    monkeypatch.setattr(bench, "bench_norm", lambda t, s, c, p, *a, **k: benched.append(sorted(p)) or
                        bench_norm(t, s, c, p, *a, **k))
    for trigger in runnable:
        rows = timing_probe.triggered(bench.Timer(cpu, 1), cpu, 4, 64, trigger)
        assert [r["what"] for r in rows] == [n for n in timing_probe.WANTED if n in providers]
        assert all(r["trigger"] == trigger and min(r["before"], r["after"], r["after_again"]) > 0 for r in rows)
    assert len(benched) == 1 and {n for n in timing_probe.WANTED if n in providers} <= set(benched[0])


def test_timing_probe_runs_each_trigger_apart(monkeypatch, tmp_path):
    """timing_probe's --triggers: each named trigger in its own `--trigger` process (here the process replaced by
    the same call in this one, on the CPU), the GPU's state read before each, the rows merged into one JSON."""
    pytest.importorskip("triton")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    import timing_probe

    cpu, calls = torch.device("cpu"), []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        if cmd[0] == "nvidia-smi":
            return subprocess.CompletedProcess(cmd, 0, stdout=f"state {len(calls)}\n", stderr="")
        assert cmd[1:3] == [timing_probe.__file__, "--trigger"]
        Path(cmd[4]).write_text(json.dumps(timing_probe.triggered(bench.Timer(cpu, 1), cpu, 4, 64, cmd[3])))
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    monkeypatch.setattr(timing_probe.subprocess, "run", fake_run)
    out = tmp_path / "triggers.json"
    rows = timing_probe.run_triggers(["nothing", "dx_sized_add"], str(out))
    assert json.loads(out.read_text()) == rows
    assert [c[3] for c in calls if c[0] != "nvidia-smi"] == ["nothing", "dx_sized_add"]
    assert sorted({(r["trigger"], r["gpu_before"]) for r in rows}) == [("dx_sized_add", "state 3"),
                                                                       ("nothing", "state 1")]


def test_cli_end_to_end_on_cpu(tmp_path):
    pytest.importorskip("matplotlib")
    j, c, png, md = tmp_path / "b.json", tmp_path / "b.csv", tmp_path / "b.png", tmp_path / "b.md"
    p = subprocess.run([sys.executable, "-m", "strictnorm.cli", "bench", "--device", "cpu", "--shapes", "16x64",
                        "--rounds", "2", "--iters", "2", "--json", str(j), "--csv", str(c), "--plot", str(png),
                        "--markdown", str(md), "--flush", "read"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    data = json.loads(j.read_text())
    assert data["device"] == "cpu" and "wall-clock" in data["note"]
    names = {r["provider"] for r in data["norm"]}
    assert {"torch F.rms_norm", bench.AA_CONTROL, bench.BYTES_ONLY, "strictnorm torch fast",
            "strictnorm torch strict"} <= names
    assert all(r["fwd_us"] > 0 for r in data["norm"])
    assert all(r["fwd_over_bytes_only"] > 0 for r in data["norm"])
    assert data["copy_GBps"] > 0 and "fwd_us" in data["aa_spread"]
    with open(c) as f:
        assert len(list(csv.DictReader(f))) == len(data["norm"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "copy ceiling" in p.stdout and "A/A control" in p.stdout
    text = md.read_text()
    assert "| strictnorm torch strict | 16 × 64 |" in text and "Copy ceiling" in text
    assert data["flush"] == "read" and "by reading a 256 MB buffer" in text


def test_timer_flush_mode_from_argument_or_environment(monkeypatch):
    """Timer's L2 flush: the argument, else STRICTNORM_BENCH_FLUSH, else "write" (PERF.md's anchors' method); an
    unknown mode is an error that names the variable, not a silent default."""
    cpu = torch.device("cpu")
    monkeypatch.delenv("STRICTNORM_BENCH_FLUSH", raising=False)
    assert bench.Timer(cpu, 1).flush_mode == "write"
    monkeypatch.setenv("STRICTNORM_BENCH_FLUSH", "read")
    assert bench.Timer(cpu, 1).flush_mode == "read"
    assert bench.Timer(cpu, 1, "write").flush_mode == "write"
    monkeypatch.setenv("STRICTNORM_BENCH_FLUSH", "evict")
    with pytest.raises(ValueError, match="STRICTNORM_BENCH_FLUSH"):
        bench.Timer(cpu, 1)


def test_fused_add_section_on_cpu():
    providers, _ = bench.norm_providers(torch.device("cpu"), False, "fused_add")
    x, r = torch.randn(4, 32).bfloat16(), torch.randn(4, 32).bfloat16()
    w = torch.randn(32).bfloat16()
    want = torch.nn.functional.rms_norm(x + r, (32,), w, 1e-6)
    assert torch.equal(providers["torch F.rms_norm"](x, w, r), want)
    y = providers["strictnorm torch strict"](x, w, r)
    assert y.shape == x.shape and ((y.float() - want.float()).abs().max() < 0.05)
    rows: list[dict] = []
    bench.bench_norm(bench.Timer(torch.device("cpu"), 2), [(4, 32)], 10.0, providers, 1, lambda r: None, rows,
                     op="fused_add")
    assert all(r["op"] == "fused_add" and "error" not in r for r in rows)


@pytest.mark.parametrize("mode", ["llama", "gemma", "none"])
def test_qk_norm_section_and_modes_on_cpu(mode):
    """op qk_norm: per-head weights (QK_HEADS, N); every provider's output has x's shape and the
    strictnorm providers run the requested casting mode (gemma: offset 1.0, as the HF gemma anchor)."""
    providers, skipped = bench.norm_providers(torch.device("cpu"), False, "qk_norm", mode)
    x = torch.randn(16, 32).float()
    w = 0.1 * torch.randn(bench.QK_HEADS, 32)
    y = providers["strictnorm torch strict"](x, w, None)
    want = sn.qk_norm(x.view(-1, bench.QK_HEADS, 32), w, 1e-6, offset=1.0 if mode == "gemma" else 0.0,
                      casting_mode=mode, backend="torch").reshape(x.shape)
    assert torch.equal(y, want)
    eager = "HF gemma eager" if mode == "gemma" else "HF llama eager"
    assert eager in providers and providers[eager](x, w, None).shape == x.shape
    assert "qk_norm" in skipped["Liger"] or "GPU" in skipped["Liger"]
    rows: list[dict] = []
    bench.bench_norm(bench.Timer(torch.device("cpu"), 2), [(16, 32)], 10.0, providers, 1, lambda r: None, rows,
                     op="qk_norm", dtype=torch.float32)
    assert rows and all(r["op"] == "qk_norm" and r["dtype"] == "float32" and "error" not in r for r in rows)
    bad: list[dict] = []  # M not divisible by the heads: reported per provider, not fatal
    bench.bench_norm(bench.Timer(torch.device("cpu"), 2), [(10, 32)], 10.0, providers, 1, lambda r: None, bad,
                     op="qk_norm", dtype=torch.float32)
    assert all("divisible" in r["error"] for r in bad)


def test_cli_dtype_mode_and_op_options_on_cpu(tmp_path):
    j = tmp_path / "q.json"
    p = subprocess.run([sys.executable, "-m", "strictnorm.cli", "bench", "--device", "cpu", "--shapes", "16x64",
                        "--op", "qk_norm", "--dtype", "fp16", "--mode", "gemma", "--rounds", "1", "--iters", "2",
                        "--json", str(j)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    data = json.loads(j.read_text())
    assert data["case"] == {"op": "qk_norm", "dtype": "fp16", "mode": "gemma"}
    assert {r["dtype"] for r in data["norm"]} == {"float16"}
    assert "HF gemma eager" in {r["provider"] for r in data["norm"]}


def _bench_scripts(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "bench"))


def test_triton_sweep_tries_warp_blocks_and_keeps_them(tmp_path, monkeypatch):
    """SWEEP_WARP_BLOCKS=1: each configuration also in warp blocks (held whole, in chunks, in two column tiles); a
    warp-block choice that wins is written with its knob and loads as a warp-block tile."""
    _bench_scripts(monkeypatch)
    import sweep_triton

    from strictnorm.backends.triton import backend as tb

    monkeypatch.setenv("SWEEP_CHUNKS", "1024")
    plain = sweep_triton.configs(5120, 2048)
    monkeypatch.setenv("SWEEP_WARP_BLOCKS", "1")
    both = sweep_triton.configs(5120, 2048)
    blocks = [c for c in both if c.warp_blocks]
    assert both[:len(plain)] == plain and blocks and len(both) == len(plain) + len(blocks)
    assert any(c.split for c in blocks) and any(c.chunk for c in blocks)
    assert [dataclasses.replace(c, warp_blocks=False) for c in blocks] == plain
    rows = [dict(M=m, N=4096, direction="fwd", default=False, rows=1, num_warps=8, split=False, w_first=False,
                 warp_blocks=wb, bitwise=True, us=us) for m, wb, us in ((128, False, 2.6), (128, True, 2.4),
                                                                       (8192, False, 35.0), (8192, True, 34.0))]
    best = sweep_triton.best_tunings(rows)
    assert best["fwd"]["4096"] == {"rows": 1, "num_warps": 8, "split": False, "w_first": False, "warp_blocks": True}
    _load_as_tuning_file(best, tmp_path, monkeypatch)
    assert tb.row_tile(4096, "fwd").warp_blocks


def _load_as_tuning_file(best: dict, tmp_path, monkeypatch) -> None:
    """A sweep's best_tunings loaded by the Triton backend as its tuning file, over an empty table."""
    from strictnorm.backends.triton import backend as tb

    path = tmp_path / "tiles.json"
    path.write_text(json.dumps(best))
    monkeypatch.setattr(tb, "TILE_TABLE", {"fwd": {}, "bwd": {}})
    monkeypatch.setenv("STRICTNORM_TRITON_TUNING", str(path))
    tb._load_tuning_file()


def test_triton_sweep_tries_dense_tiles_and_keeps_them(tmp_path, monkeypatch):
    """SWEEP_DENSE=1: each configuration also with TileChoice.dense toggled; a dense choice that wins is written with
    its knob and loads as a dense tile."""
    _bench_scripts(monkeypatch)
    import sweep_triton

    from strictnorm.backends.triton import backend as tb

    plain = sweep_triton.configs(128, 65536)
    monkeypatch.setenv("SWEEP_DENSE", "1")
    both = sweep_triton.configs(128, 65536)
    assert both[:len(plain)] == plain and len(both) == 2 * len(plain)
    assert [dataclasses.replace(c, dense=not c.dense) for c in both[len(plain):]] == plain
    rows = [dict(M=65536, N=128, direction="fwd", default=False, rows=8, num_warps=2, split=False, w_first=True,
                 dense=dense, bitwise=True, us=us) for dense, us in ((False, 10.2), (True, 9.6))]
    best = sweep_triton.best_tunings(rows)
    assert best["fwd"]["128"] == {"rows": 8, "num_warps": 2, "split": False, "w_first": True, "dense": True}
    _load_as_tuning_file(best, tmp_path, monkeypatch)
    assert tb.row_tile(128, "fwd").dense


def test_triton_sweep_tile_rows_and_warps_narrow_the_sweep(monkeypatch):
    """SWEEP_TILE_ROWS / SWEEP_TILE_WARPS: only those rows a program and warps among the tiles held whole, each still
    bounded by the lanes a thread (32 rows of 128 columns need 2 warps at least: 64 lanes a thread)."""
    _bench_scripts(monkeypatch)
    import sweep_triton

    full = sweep_triton.configs(128, 65536)
    assert {c.rows for c in full} == {1, 2, 4, 8, 16, 32}
    monkeypatch.setenv("SWEEP_TILE_ROWS", "32,8,64")
    monkeypatch.setenv("SWEEP_TILE_WARPS", "1,2,8")
    narrow = sweep_triton.configs(128, 65536)
    assert [(c.rows, c.num_warps) for c in narrow] == [(8, 1), (8, 2), (8, 8), (32, 2), (32, 8), (64, 8)]


def test_triton_sweep_choice_loads_as_tiles(tmp_path, monkeypatch):
    """bench/sweep_triton.best_tunings: per direction and padded length the configuration with the least mean
    slowdown over that length's shapes (the backend's own choice, measured twice, counted once; configurations
    missing a shape or not bitwise left out), in the file format STRICTNORM_TRITON_TUNING loads."""
    _bench_scripts(monkeypatch)
    import sweep_triton

    from strictnorm.backends.triton import backend as tb

    def row(m, rows, warps, us, default=False, bitwise=True, w_first=False):
        return dict(M=m, N=4096, direction="fwd", default=default, rows=rows, num_warps=warps, split=False,
                    w_first=w_first, bitwise=bitwise, us=us)

    results = [row(128, 1, 8, 3.0, default=True), row(128, 1, 8, 3.0), row(32768, 1, 8, 140.0),
               row(128, 2, 8, 3.3), row(32768, 2, 8, 129.0),  # mean slowdown 1.07 against (1, 8)'s 1.06
               row(128, 1, 4, 2.0, bitwise=False), row(32768, 1, 4, 100.0, bitwise=False),
               row(128, 1, 16, 2.9, w_first=True)]  # fastest at 128 rows, not measured at 32768
    best = sweep_triton.best_tunings(results)
    assert best == {"fwd": {"4096": {"rows": 1, "num_warps": 8, "split": False, "w_first": False}}, "bwd": {},
                    "bwd_dx": {}}
    results.append(row(32768, 1, 16, 129.5, w_first=True))
    best = sweep_triton.best_tunings(results)
    assert best["fwd"]["4096"] == {"rows": 1, "num_warps": 16, "split": False, "w_first": True}
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps(best))
    monkeypatch.setattr(tb, "TILE_TABLE", {"fwd": {}, "bwd": {}})
    monkeypatch.setenv("STRICTNORM_TRITON_TUNING", str(path))
    tb._load_tuning_file()
    assert tb.row_tile(4096, "fwd") == tb.RowTile(1, 4096, 0, 16, True)
    # fewer rows whose fastest beats the general choice by more than BOUND_GAIN: a bounded entry ahead of it
    results.append(row(128, 1, 2, 2.5, w_first=True))
    best = sweep_triton.best_tunings(results)
    assert best["fwd"]["4096"] == [[128, {"rows": 1, "num_warps": 2, "split": False, "w_first": True}],
                                   [None, {"rows": 1, "num_warps": 16, "split": False, "w_first": True}]]
    path.write_text(json.dumps(best))
    tb._load_tuning_file()
    assert tb.row_tile(4096, "fwd", 128) == tb.RowTile(1, 4096, 0, 2, True)
    assert tb.row_tile(4096, "fwd", 129) == tb.row_tile(4096, "fwd") == tb.RowTile(1, 4096, 0, 16, True)
    path.write_text(json.dumps({"fwd": {"4096": [[128, {"rows": 1}]]}}))
    with pytest.raises(ValueError, match="unbounded"):
        tb._load_tuning_file()


def test_cuda_sweeps_merge_into_a_loadable_tuning_file(tmp_path, monkeypatch):
    """bench/sweep_cuda.merge: the fastest bitwise configuration per row count over several sweeps (one of them
    cut before its JSON: its logged rows), as the tuning file STRICTNORM_CUDA_TUNING loads."""
    import dataclasses

    _bench_scripts(monkeypatch)
    import sweep_cuda

    from strictnorm.backends.cuda import backend as cb

    def row(m, us, **knobs):
        return dict(M=m, N=4096, direction="bwd", bitwise=True, us=us,
                    **dataclasses.asdict(cb.NormTuning(**knobs)))

    (tmp_path / "a.json").write_text(json.dumps({"rows": [row(2048, 31.0, values=8), row(32768, 221.0, values=32)]}))
    (tmp_path / "b.log").write_text("\n".join(json.dumps(r) for r in (
        row(2048, 30.0, values=8, staged=True), row(32768, 225.0, values=32, staged=True),
        dict(row(32768, 100.0, values=16), bitwise=False))) + "\nnot a row\n")
    sweep_cuda.merge(str(tmp_path), ["a", "b"], copies=())
    data = json.loads((tmp_path / "tuning.json").read_text())
    monkeypatch.setattr(cb, "BWD_TABLE", dict(cb.BWD_TABLE))
    monkeypatch.setenv("STRICTNORM_CUDA_TUNING", str(tmp_path / "tuning.json"))
    cb._load_tuning_file()
    assert data["bwd"]["4096"][0][0] == 2048 and data["bwd"]["4096"][1][0] is None
    assert cb.tuning_for(cb.BWD_TABLE, 4096, 2048) == cb.NormTuning(values=8, staged=True)
    assert cb.tuning_for(cb.BWD_TABLE, 4096, 32768) == cb.NormTuning(values=32)


def test_cuda_sweep_keeps_the_inference_forward_apart(tmp_path, monkeypatch):
    """bench/sweep_cuda.best_tunings: fwd_nr and fwd_api rows (the inference forward) make the file's "fwd_nr"
    entries, fwd rows its "fwd" ones; loaded, an inference call takes its own."""
    _bench_scripts(monkeypatch)
    import sweep_cuda

    from strictnorm.backends.cuda import backend as cb

    def row(direction, us, **knobs):
        return dict(M=65536, N=128, direction=direction, bitwise=True, us=us,
                    **dataclasses.asdict(cb.NormTuning(**knobs)))

    best = sweep_cuda.best_tunings([row("fwd", 11.0, values=32), row("fwd", 12.0, values=16),
                                    row("fwd_api", 10.0, values=16), row("fwd_nr", 10.5, values=8)])
    assert best["fwd"]["128"][0][1]["values"] == 32 and best["fwd_nr"]["128"][0][1]["values"] == 16
    (tmp_path / "tuning.json").write_text(json.dumps(best))
    monkeypatch.setattr(cb, "FWD_TABLE", dict(cb.FWD_TABLE))
    monkeypatch.setattr(cb, "FWD_INFERENCE_TABLE", dict(cb.FWD_INFERENCE_TABLE))
    monkeypatch.setenv("STRICTNORM_CUDA_TUNING", str(tmp_path / "tuning.json"))
    cb._load_tuning_file()
    assert cb.forward_tuning(128, 65536).values == 32
    assert cb.forward_tuning(128, 65536, need_rstd=False).values == 16


def test_cuda_sweep_adds_the_weight_with_each_row(monkeypatch):
    """bench/sweep_cuda.shape_tunings with SWEEP_W_WITH_ROW: every held configuration whose weight is reloaded also
    with weight_with_row, in both directions (the tables' variants too); held weights and rows read twice not."""
    _bench_scripts(monkeypatch)
    import sweep_cuda

    monkeypatch.setattr(sweep_cuda, "W_WITH_ROW", True)
    for variants in (False, True):
        monkeypatch.setattr(sweep_cuda, "VARIANTS", variants)
        for direction in ("fwd", "bwd"):
            swept = sweep_cuda.shape_tunings(direction, 8192, 4096)
            with_row = [t for t in swept if t.weight_with_row]
            assert with_row and all(not t.hold_weight and t.hold_max_p >= 4096 for t in with_row)
            assert {dataclasses.replace(t, weight_with_row=False) for t in with_row} <= set(swept)


def test_cuda_sweep_times_the_tables_entry_and_the_inference_forward(monkeypatch):
    """bench/sweep_cuda.shape_tunings: the tables' own entry for the shape's row count is among the configurations
    (the baseline of the same run) though the grid lacks it; fwd_nr (the inference forward the bench times) sweeps
    the forward's configurations, not the backward's, with the inference forward's own entry as its baseline;
    precompile builds fwd_nr's kernels without rstd (NO_RSTD)."""
    from concurrent.futures import ThreadPoolExecutor

    _bench_scripts(monkeypatch)
    import sweep_cuda

    from strictnorm.backends.cuda.backend import FWD_INFERENCE_TABLE, FWD_TABLE, tuning_for

    monkeypatch.setattr(sweep_cuda, "FWD_TUNINGS", sweep_cuda.FWD_TUNINGS[:2])
    training, inference = tuning_for(FWD_TABLE, 128, 65536), tuning_for(FWD_INFERENCE_TABLE, 128, 65536)
    assert training != inference and not {training, inference} & set(sweep_cuda.FWD_TUNINGS[:2])
    for direction in ("fwd", "fwd_nr", "fwd_api"):
        swept = sweep_cuda.shape_tunings(direction, 65536, 128)
        assert swept == sweep_cuda.FWD_TUNINGS[:2] + [training if direction == "fwd" else inference]
    compiled = []
    monkeypatch.setattr(sweep_cuda, "SHAPES", [(65536, 128)])
    monkeypatch.setattr(sweep_cuda, "DIRECTIONS", ["fwd_nr"])
    monkeypatch.setattr(sweep_cuda, "_compile", compiled.append)
    monkeypatch.setattr(sweep_cuda, "ProcessPoolExecutor", ThreadPoolExecutor)  # compiled.append in this process
    sweep_cuda.precompile()
    bf16 = torch.bfloat16
    expected = {tuple(sorted(sweep_cuda.norm_launch(128, bf16, None, bf16, bf16, "llama", False, tu, True,
                                                    False).defines.items())) for tu in swept}
    assert sorted(tuple(sorted(d.items())) for d in compiled) == sorted(expected)
    assert all(d.get("NO_RSTD") == 1 for d in compiled)


def _device_call_plan(tmp_path, *args: str, **env: str) -> list[str]:
    """The commands bench/device_call.sh would run for these arguments (DRY_RUN), one line a job, with W and OUT under
    tmp_path and env's variables set."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {"PATH": "/usr/bin:/bin", "DRY_RUN": "1", "W": str(tmp_path / "w"), "OUT": str(tmp_path / "out"), **env}
    run = subprocess.run(["bash", "bench/device_call.sh", *args], cwd=root, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stdout.splitlines()


def test_device_call_plans_its_jobs(tmp_path):
    """bench/device_call.sh (DRY_RUN): --alone first with every GPU visible, then --first's and --second's jobs in
    order (on one GPU, or none, one after the other), each job's command with its log; an unknown argument fails."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {"PATH": "/usr/bin:/bin", "DRY_RUN": "1", "W": str(tmp_path / "w"), "OUT": str(tmp_path / "out"), "GPUS": "1"}
    run = subprocess.run(["bash", "bench/device_call.sh", "--alone", "devices", "--first", "sweep-triton bench",
                          "--second", "suite pytest:65536+or+long_rows nonsense"], cwd=root, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["[all]"] + ["[0]"] * 5
    assert "tests/test_devices.py" in lines[0] and "sweep_triton.py" in lines[1] and "strictnorm.bench" in lines[2]
    assert "--ignore=tests/test_cute.py" in lines[3] and "verify --quick" in lines[3]
    assert "-k '65536 or long_rows'" in lines[4] and "unknown job nonsense" in lines[5]
    assert all(f"{tmp_path}/w/" in line for line in lines)
    bad = subprocess.run(["bash", "bench/device_call.sh", "--bogus"], cwd=root, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown argument --bogus" in bad.stderr
    for names, want in ((None, "--triggers all"), ("nothing,bench_round", "--triggers nothing,bench_round")):
        run = subprocess.run(["bash", "bench/device_call.sh", "--first", "triggers"], cwd=root, capture_output=True,
                             env={**env, **({"TRIGGERS": names} if names else {})}, text=True)
        assert run.returncode == 0 and "bench/timing_probe.py" in run.stdout and want in run.stdout, run.stderr
        assert f"{tmp_path}/w/triggers.json" in run.stdout


def test_device_call_runs_fewer_test_workers_on_a_smaller_gpu(tmp_path):
    """device_call.sh's test jobs take 14 pytest workers on GPU 0 of more than 100000 MiB (an H200), 8 on less (an
    80 GB H100, where 14 ran out of memory), and TEST_WORKERS where it is set (nvidia-smi faked on PATH)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    fake = tmp_path / "bin"
    fake.mkdir()

    def workers(mib: int, **extra: str) -> str:
        (fake / "nvidia-smi").write_text(f"#!/bin/sh\necho {mib}\n")
        (fake / "nvidia-smi").chmod(0o755)
        env = {"PATH": f"{fake}:/usr/bin:/bin", "DRY_RUN": "1", "W": str(tmp_path / "w"), "OUT": str(tmp_path / "o"),
               "GPUS": "1", **extra}
        run = subprocess.run(["bash", "bench/device_call.sh", "--first", "suite"], cwd=root, env=env,
                             capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        return run.stdout.split(" -n ")[1].split()[0]

    assert workers(143771) == "14" and workers(81559) == "8" and workers(81559, TEST_WORKERS="5") == "5"


def test_device_call_profiles_with_ncu(tmp_path):
    """device_call.sh's ncu job: Nsight Compute over bench/ncu_probe.py with $NCU_PROBE's shape and cases and the
    named sections (each a --section flag), from the probe's profiler range on; sweep-onepass runs its sweep."""
    ncu, onepass = _device_call_plan(tmp_path, "--first", "ncu sweep-onepass",
                                     NCU_PROBE="4096 4096 fold-dw onepass-strict",
                                     NCU_SECTIONS="SpeedOfLight WarpStateStats")
    assert "--profile-from-start off" in ncu and "--section SpeedOfLight --section WarpStateStats python3" in ncu
    assert "bench/ncu_probe.py 4096 4096 fold-dw onepass-strict >" in ncu and f"{tmp_path}/w/ncu.log" in ncu
    assert "bench/sweep_onepass.py" in onepass and f"{tmp_path}/w/sweep-onepass.json" in onepass


def test_queued_time_on_the_cpu_is_the_wall_clock():
    """Timer.queued_us without a GPU: the call's wall-clock median (no sleep kernel, no events), after two warm-up
    calls, once a timed iteration."""
    calls = []
    us = bench.Timer(torch.device("cpu"), iters=3).queued_us(lambda: calls.append(1) or sum(range(20000)))
    assert len(calls) == 2 + 3 and us > 0


def test_device_call_runs_tagged_benches_with_their_arguments(tmp_path):
    """device_call.sh's bench:TAG runs the bench with $BENCH_ARGS_TAG (quotes kept), its files named by the tag, so
    that one call can time the same shapes two ways."""
    plain, tagged = _device_call_plan(tmp_path, "--first", "bench bench:rd", BENCH_ARGS="--shapes 128x4096",
                                      BENCH_ARGS_rd='--flush read --only "strictnorm triton fast,bytes"')
    assert f"{tmp_path}/w/bench.json" in plain and "--shapes 128x4096" in plain and "--flush" not in plain
    assert f"{tmp_path}/w/bench-rd.json" in tagged and f"{tmp_path}/w/bench-rd.md" in tagged
    assert '--flush read --only "strictnorm triton fast,bytes"' in tagged and "--shapes" not in tagged


def test_device_call_runs_tagged_sweeps_with_their_settings(tmp_path):
    """device_call.sh's sweep-triton:TAG runs the sweep with $SWEEP_ENV_TAG's settings, its files named by the tag,
    and merges its choices into the machine's tuning file; bench/tuning_merge.py replaces entries per direction and
    padded length and keeps the rest."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    fwd, other = _device_call_plan(tmp_path, "--first", "sweep-triton:fwd sweep-triton:other",
                                   SWEEP_ENV_fwd="SWEEP_DIRECTIONS=fwd SWEEP_PIPELINES=1")
    assert "env SWEEP_DIRECTIONS=fwd SWEEP_PIPELINES=1 timeout" in fwd and f"{tmp_path}/w/sweep-triton-fwd.json" in fwd
    assert "tuning_merge.py /tmp/strictnorm-triton-tuning.json" in fwd and "SWEEP_" not in other
    into, new = tmp_path / "into.json", tmp_path / "new.json"
    into.write_text(json.dumps({"fwd": {"4096": {"rows": 2}, "128": {"rows": 8}}, "bwd": {"128": {"rows": 16}}}))
    new.write_text(json.dumps({"fwd": {"4096": {"rows": 1, "prefetch": True}}}))
    subprocess.run([sys.executable, str(root / "bench" / "tuning_merge.py"), str(into), str(new)], check=True)
    assert json.loads(into.read_text()) == {"fwd": {"4096": {"rows": 1, "prefetch": True}, "128": {"rows": 8}},
                                            "bwd": {"128": {"rows": 16}}}
    subprocess.run([sys.executable, str(root / "bench" / "tuning_merge.py"), str(into), str(tmp_path / "none.json")],
                   check=True)  # a sweep that wrote nothing changes nothing
    assert json.loads(into.read_text())["fwd"]["4096"] == {"rows": 1, "prefetch": True}


def _compile_probe(*args: object) -> str:
    """bench/compile_probe.py's output for these arguments, compiled by the installed Triton (not interpreted) with
    this checkout's sources."""
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "bench/compile_probe.py", *map(str, args)], cwd=root, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def test_compile_probe_compiles_every_kernel_for_sm90():
    """bench/compile_probe.py (the Triton kernels compiled for sm_90 without a GPU) keeps up with the kernels'
    parameters (it passes every constexpr itself): the forward, the backward with partials and the fold, at one N.
    The backward with partials (GDC, as on sm_90) signals its dependent partial sum once; the forward does not."""
    lines = _compile_probe(4096).splitlines()
    kernels = [line for line in lines if line.startswith("N=")]
    assert [line.split()[2] for line in kernels] == ["fwd", "bwd"]
    assert [re.search(r"launch_dependents (\d+)", line).group(1) for line in kernels] == ["0", "1"]
    assert lines[-1].startswith("fold")


@pytest.mark.parametrize(("n", "rows", "warps"), [(2048, 1, 4), (4096, 1, 8), (4096, 2, 8), (1152, 1, 2),
                                                   (18432, 1, 16), (18432, 2, 8)])
def test_warp_blocks_meet_once_when_compiled(n, rows, warps):
    """The Triton forward and backward in warp blocks compiled for sm_90 by the installed Triton (no GPU;
    bench/compile_probe.py):
    fewer barriers than with its columns in order, and after the first one the butterfly over the warps' block sums
    (xor warps/2 first, down to 1) that the contract's order needs with warp w holding block bitrev(w); N = 1152 and
    18432 in two column tiles, whose block sums meet in that one butterfly (a second meeting gave the sum a second
    layout, and Triton 3.6 moved the whole row through shared memory into it). That the butterfly then gives the
    reference's bits is checked on GPUs (test_gpu.py's warp-block family)."""
    got = json.loads(_compile_probe("--warp-blocks", n, rows, warps))
    butterfly = [warps >> i for i in range(1, warps.bit_length())]
    for kernel in ("", "backward "):
        for res in ("", " + residual"):
            blocks, in_order = got[f"{kernel}blocks{res}"], got[f"{kernel}in order{res}"]
            assert blocks["barriers"] < in_order["barriers"], (kernel, res)
            assert blocks["xors"][:len(butterfly)] == butterfly, (kernel, res)


def test_weight_in_the_rows_layout_drops_its_conversion_when_compiled():
    """The Triton forward at 8 rows of 128 lanes in 2 warps (the table's tile past 16384 rows of 128), compiled for
    sm_90 by the installed Triton (bench/compile_probe.py --weight-layout): its weight loaded as one row took a layout
    Triton converted through shared memory (4 of the kernel's 5 barriers with Triton 3.6 and 3.9); loaded in the rows'
    layout (TileChoice.w_rows) it needs no conversion, with no more registers; without rstd's store
    (TileChoice.drop_rstd) none is left. At 16 rows of 128 in 8 warps the row's layout already fits: the same
    barriers either way."""
    got = json.loads(_compile_probe("--weight-layout", 128, 8, 2))
    row, rows = got["weight row"], got["weight in the rows' layout"]
    assert rows["barriers"] < row["barriers"] and rows["registers"] <= row["registers"]
    assert got["weight in the rows' layout, no rstd"]["barriers"] == 0  # an inference call's (TileChoice.drop_rstd)
    got = json.loads(_compile_probe("--weight-layout", 128, 16, 8))
    assert got["weight row"]["barriers"] == got["weight in the rows' layout"]["barriers"]


@pytest.mark.parametrize(("rows", "warps"), [(8, 2), (16, 8)])
def test_dense_tiles_compile_without_masks_and_rcp_rn_without_division(rows, warps):
    """The Triton forward at 128 columns compiled for sm_90 by the installed Triton (bench/compile_probe.py --dense):
    without masks (TileChoice.dense) no global load is predicated and one comparison is left (rstd's store, by the
    lanes that hold each row's value after the reduction), with no more registers than the masked tile; rcp_rn
    (TileChoice.rcp_rn) takes rstd's reciprocal with rcp.rn instead of div.rn (the mean of a power of two is a
    multiply: no division is left)."""
    got = json.loads(_compile_probe("--dense", 128, rows, warps))
    masked = got["masked"]
    assert masked["predicated loads"] > 0 and masked["setp"] > 1 and masked["div"] > 0 and masked["rcp"] == 0
    for name in ("dense", "dense, rewiden"):
        assert got[name]["predicated loads"] == 0 and got[name]["predicated stores"] <= 1, name
        assert got[name]["setp"] <= 1, name
        assert got[name]["registers"] <= masked["registers"], name
    assert got["masked, rcp_rn"]["rcp"] > 0 and got["masked, rcp_rn"]["div"] == 0


def test_weight_first_past_16384_rows_of_128_is_loaded_with_the_rows_when_compiled():
    """The Triton forward of rows of 128 past 16384 rows (the table's 8 rows of 2 warps, the weight first), compiled
    for sm_90 by the installed Triton: the rows' two loads and the weight's two all issued ahead of the row sum, none
    into an earlier load's register. Loaded where y needs it, ptxas issued the weight's after the sum and rstd (2 of
    4 ahead with Triton 3.6): a memory round trip on each program's critical path (run 48's A/B: 65536 x 128's
    inference forward 13.34 -> 13.04 us on an H100)."""
    line = next(line for line in _compile_probe("128@65536").splitlines() if line.split()[2:3] == ["fwd"])
    assert "loads ahead 4 (reusing a register 0)" in line, line


def test_compile_probe_counts_loads_that_reuse_a_register(monkeypatch):
    """bench/compile_probe.load_reuse on SASS lines: the global loads before the first barrier or branch, and those
    writing a register an earlier one wrote (a 128-bit load writes four from its first, a 64-bit two), as in run
    27's forward without its rstd store (R12, R4, R8, then R4 again)."""
    pytest.importorskip("triton")
    _bench_scripts(monkeypatch)
    from compile_probe import load_reuse

    def sass(*ops: str) -> str:
        return "\n".join(f"        /*{16 * i:04x}*/                   {op} ;" for i, op in enumerate(ops))

    run27 = ["@P3 LDG.E.128 R12, desc[UR12][R16.64]", "@P2 LDG.E.128 R4, desc[UR12][R16.64+0x1000]",
             "@P2 LDG.E.128 R8, desc[UR12][R2.64]", "FADD R0, R12, R13", "@P3 LDG.E.128 R4, desc[UR12][R2.64+0x1000]",
             "BAR.SYNC.DEFER_BLOCKING 0x0", "@!P1 LDG.E.128 R4, desc[UR12][R2.64]"]
    assert load_reuse(sass(*run27)) == (4, 1)
    assert load_reuse(sass(*run27[:3], "@P3 LDG.E.128 R20, desc[UR12][R2.64+0x1000]")) == (4, 0)
    assert load_reuse(sass("LDG.E.64 R6, desc[UR4][R2.64]", "LDG.E R7, desc[UR4][R4.64]")) == (2, 1)
    assert load_reuse(sass("LDG.E R6, desc[UR4][R2.64]", "@!P1 BRA 0x4c0", "LDG.E R6, desc[UR4][R4.64]")) == (1, 0)
    assert load_reuse(sass("STG.E desc[UR4][R2.64], R6", "LDS R6, [R3]")) == (0, 0)


def _interpreted_probe(script: str, tmp_path, **settings: str) -> list[dict]:
    """bench/<script> run under the Triton interpreter (CPU tensors) with the given environment settings: the rows of
    the JSON it writes."""
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", **settings,
               PYTHONPATH=os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "probe.json"
    run = subprocess.run([sys.executable, f"bench/{script}", str(out)], cwd=root, env=env, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(out.read_text())


def test_reduction_probe_checks_its_canonical_kernels(tmp_path):
    """bench/reduction_probe.py under the interpreter (CPU tensors): its canon_sum kernel's rstd has the reference's
    bits at odd and power-of-two N, the tl.sum kernel runs beside it (a check of the probe, not a timing), and the
    warps kernel (columns permuted so that each warp holds one block of the row, the blocks' sums taken last) gives
    canon_sum's rstd and y wherever it runs (here with 1-element pieces; 64 rows: a wrong block order shows in some
    of them)."""
    rows = _interpreted_probe("reduction_probe.py", tmp_path, PROBE_SHAPES="3x64,4x33,64x100,64x256,32x1000",
                              PROBE_WARPS="1,2,4,8", PROBE_VECTOR="1")
    assert {(r["M"], r["N"]) for r in rows} == {(3, 64), (4, 33), (64, 100), (64, 256), (32, 1000)}
    assert all(r["canon_bitwise"] and r["sum_rel_diff"] < 1e-6 for r in rows)
    warps_rows = [r for r in rows if "warps_bitwise" in r]
    assert {r["warps"] for r in warps_rows} == {1, 2, 4, 8} and all(r["warps_bitwise"] for r in warps_rows)


def test_exactness_probe_checks_its_exact_kernel(tmp_path):
    """bench/exactness_probe.py under the interpreter (CPU tensors): its exact kernel gives the reference's y and rstd
    at power-of-two and odd N, one row a program or several, with the mean of a power of two's squares by
    multiplication (the kernels') and by division, x loaded again after the sum and the weight loaded after it
    (Inductor's order), x held as loaded and widened again for y, with 32-bit row offsets, and unmasked (Inductor's
    addressing, also with N compiled in) wherever the rows fill the tiles and N is a power of two (only there: 5 rows
    of 128 in tiles of 4 would read past x), and every relaxed variant (rstd's steps relaxed together and apart) runs
    beside it; dropping llama's rounding changes some y (the check can fail), dropping the rstd store none."""
    rows = _interpreted_probe("exactness_probe.py", tmp_path, PROBE_SHAPES="5x128,9x100,8x64", PROBE_TILES="4x1,1x2")
    exact = [r for r in rows if "bitwise" in r]
    assert {r["what"] for r in exact} == {"exact", "mean by division", "x loaded again", "weight after sum",
                                          "Inductor's order", "32-bit offsets", "no masks", "Inductor's addressing",
                                          "x widened again", "x widened again, Inductor's addressing",
                                          "x loaded again, Inductor's addressing, N constant"}
    for unmasked_variant in ("no masks", "x loaded again, Inductor's addressing, N constant"):
        unmasked = {(r["M"], r["N"], r["rows"]) for r in exact if r["what"] == unmasked_variant}
        assert unmasked == {(5, 128, 1), (8, 64, 4), (8, 64, 1)}
    assert len(exact) == 6 * 7 + 3 * 4 and all(r["bitwise"] for r in exact)
    relaxed = {r["what"]: r["y_max_rel_diff"] for r in rows if "bitwise" not in r and r["N"] == 100}
    assert set(relaxed) == {"no rstd store", "tl.sum", "approximate rstd", "approximate sqrt", "approximate 1 / s",
                            "no llama rounding", "all relaxed", "relaxed, Inductor's order"}  # rcp_rn: compiled only
    assert relaxed["no rstd store"] == 0.0 and relaxed["no llama rounding"] > 0.0


@pytest.mark.parametrize(("p", "warps"), [(2048, 4), (4096, 8), (16384, 16)])
def test_reduction_probe_warps_kernel_meets_once_when_compiled(p, warps):
    """The warps kernel compiled for sm_90 by the installed Triton (no GPU): as few barriers as tl.sum's (fewer than
    canon_sum's), and the warps' partials combined by the butterfly its order needs (xor warps/2 first, down to 1).
    Whether that butterfly gives the reference's bits is the GPU's to check (the probe does)."""
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "bench/reduction_probe.py", "--compiled", str(p), str(warps)], cwd=root,
                         env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout)
    assert got["warps"]["barriers"] == got["tl.sum"]["barriers"] < got["canon"]["barriers"]
    assert got["warps"]["xors"] == [warps >> i for i in range(1, warps.bit_length())]


def test_fold_probes_compile_for_sm90(monkeypatch):
    """bench/consumer_probe.py's kernels, bench/supply_probe.py's edited fold.cu (each edit must still find its text)
    for the plain fold's and the dW fold's default fold_stream, and bench/pattern_probe.py's stripe reads (stripes of
    one chunk to whole rows) compile through NVRTC for sm_90 without a GPU."""
    pytest.importorskip("cuda.core")
    from strictnorm.backends.cuda.backend import fold_launch

    _bench_scripts(monkeypatch)
    import consumer_probe as consumer
    import pattern_probe as pattern
    import supply_probe as supply
    for stripe, warps, depth, ring in ((2, 4, 4, 0), (4, 8, 8, 0), (8, 16, 16, 0), (512, 8, 4, 0), (4, 16, 4, 3),
                                       (2, 8, 8, 2), (512, 8, 4, 4)):
        assert pattern.compile_probe(stripe, warps, depth, ring=ring)[:4] == b"\x7fELF"
    assert pattern.ring_bytes(16, 4, 3) == 196608  # 16 warps x 3 slots x (4 items of a and of b) x 32 lanes x 16 bytes
    for v in range(len(consumer.VARIANTS)):
        assert consumer.compile_variant(v, "sm_90")[:4] == b"\x7fELF"
    for m, n, dtype, what in ((16384, 128, torch.float32, 0), (32768, 1024, torch.bfloat16, 1)):
        fl = fold_launch(n, dtype, dtype, what, True, True, 132, None, torch.float32, m, 1, 227 * 1024)
        assert fl.kernel == "fold_stream"
        for variant in supply.VARIANTS:
            assert supply.compile_edited(variant, fl.defines, "sm_90")[:4] == b"\x7fELF"


def test_api_overhead_script_runs_and_restores_the_backend_lookup(monkeypatch, capsys):
    """bench/api_overhead.py's pieces and stubbed calls run (each once here), and the eager path's backend lookup is
    the real one again afterwards."""
    from strictnorm import ops

    _bench_scripts(monkeypatch)
    import api_overhead

    real = ops.get_backend
    monkeypatch.setattr(api_overhead, "per_call_us", lambda fn: (fn(), 0.0)[1])
    api_overhead.main()
    assert ops.get_backend is real
    assert len(capsys.readouterr().out.splitlines()) == 7


def test_partial_probe_one_segment_keeps_the_planned_columns(monkeypatch):
    """bench/partial_probe.py's forced shape sums every row in one segment with the planner's vector width and column
    blocks (where the planner cuts 4096 x 128 into four segments)."""
    _bench_scripts(monkeypatch)
    import partial_probe

    planned, one = partial_probe.PLANNED(4096, 128, 132), partial_probe.one_segment(4096, 128, 132)
    assert planned.segments == 4
    assert (one.segments, one.seg_rows, one.vec, one.col_blocks) == (1, 4096, planned.vec, planned.col_blocks)


def test_ab_bench_runs_each_tree_in_turn_on_cpu(tmp_path):
    """bench/ab_bench.py on the CPU: two trees (this checkout twice), two rounds; each tree's JSON of each round, the
    trees' order rotated, and one table line per provider and shape with both trees' figures."""
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "ab"
    p = subprocess.run([sys.executable, str(root / "bench/ab_bench.py"), str(out), "2", f"a={root}", f"b={root}",
                        "--", "--device", "cpu", "--shapes", "8x32", "--rounds", "1", "--iters", "2",
                        "--only", "strictnorm torch fast"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert sorted(f.name for f in out.glob("*.json")) == ["a-1.json", "a-2.json", "b-1.json", "b-2.json"]
    assert (out / "a-1.json").stat().st_mtime < (out / "b-1.json").stat().st_mtime  # round 1: a first
    assert (out / "b-2.json").stat().st_mtime < (out / "a-2.json").stat().st_mtime  # round 2: b first
    lines = (out / "ab.txt").read_text().splitlines()
    assert any(line.startswith("strictnorm torch fast") and "8x32" in line and " a " in f" {line} " and " b " in line
               for line in lines), lines
    usage = subprocess.run([sys.executable, str(root / "bench/ab_bench.py"), str(out)], capture_output=True)
    assert usage.returncode == 2


def test_ab_bench_tree_with_a_tuning_file(monkeypatch):
    """bench/ab_bench.py's NAME=PATH,TUNING: the tree and the Triton tuning file it runs with; NAME=PATH: none."""
    _bench_scripts(monkeypatch)
    import ab_bench

    root = Path(__file__).resolve().parent.parent
    name, tree = ab_bench.Tree.parse(f"dense={root},bench/candidates/dense-128.json")
    assert (name, tree.path, tree.tuning) == ("dense", root, Path("bench/candidates/dense-128.json").resolve())
    assert ab_bench.Tree.parse(f"main={root}") == ("main", ab_bench.Tree(root, None))


def test_host_breakdown_backward_pieces_on_cpu(monkeypatch):
    """bench/host_breakdown.py's backward pieces on the CPU (the torch backend, a few calls a figure): the engine's
    empty node, the step and the time inside the backend call (its wrapper reached on the engine's thread, so less
    than the step), and ops._direct_bwd restored afterwards."""
    from strictnorm import ops

    _bench_scripts(monkeypatch)
    import host_breakdown

    real = ops._direct_bwd
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    few_calls = host_breakdown.per_call_us
    monkeypatch.setattr(host_breakdown, "per_call_us", lambda fn: few_calls(fn, calls=5, loops=1, gpu=False))
    x = torch.randn(4, 64).bfloat16().requires_grad_(True)
    w = torch.randn(64).bfloat16().requires_grad_(True)
    got = host_breakdown._backward_pieces(x, w, torch.randn(4, 64).bfloat16(), backend="torch")
    assert ops._direct_bwd is real
    step, inside = got["backward only, sn torch, timed inside"], got["  of it inside the backend call (device thread)"]
    assert got["backward only, an empty autograd node (the engine)"] > 0
    assert 0 < inside < step


def test_cuda_forward_at_128_columns_loads_its_rows_before_the_sum_when_compiled():
    """The CUDA forward at 65536 x 128 as its tables plan it, compiled by NVRTC for sm_90 (bench/compile_probe.py
    --cuda-forward): an inference call's (FWD_INFERENCE_TABLE: the weight loaded with the row) issues every global
    load, the weight's included, before the row sum's first shuffle; the training forward (FWD_TABLE's 4 threads a
    row, 4 pieces each, the weight with the row) issues its row's four before it and the weight's right after the
    sum's shuffles, not one before each piece of y."""
    from strictnorm.backends.cuda import nvrtc

    if nvrtc.nvrtc_version() != "13.0":  # another ptxas schedules otherwise; CI pins the GPU's NVRTC
        pytest.skip(f"the load order was read with NVRTC 13.0, not {nvrtc.nvrtc_version()}")
    inference = json.loads(_compile_probe("--cuda-forward", 128, 65536, "inference"))
    assert inference["loads"] == inference["ahead of the sum"] == 4
    training = json.loads(_compile_probe("--cuda-forward", 128, 65536))
    assert training["ahead of the sum"] >= 4 and training["loads"] == training["ahead of the first store"] == 8
