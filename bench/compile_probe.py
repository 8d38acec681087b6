"""Compile strictnorm's Triton kernels for sm_90 without a GPU and report what costs no device time:
compile seconds, PTX size, shared-memory traffic, barriers, local-memory spills, ptxas's registers and
stack per thread (cuobjdump -res-usage, where triton ships cuobjdump), and the global loads ahead of the
first barrier or branch with how many of them reuse the register of an earlier one (cuobjdump -sass), per N.

A pathological compile shows here before it burns device time (Triton 3.6 turned a tl.split tree
into 25x more PTX than a reshape + sum tree). A load into the register of an earlier load waits for that
load's data to arrive and be used: two memory round trips where one was meant (run 27: the forward of 2 rows
of 4096 without its rstd store, 22% slower on an H200). ptxas ships with triton, so the SASS is the one a GPU
machine with the same triton version gets. Usage: python bench/compile_probe.py [N[@ROWS] ...] (ROWS: the
table's entry for that row count; default its unbounded one)

    python bench/compile_probe.py --weight-layout N ROWS WARPS
prints, as JSON, the forward of bf16 rows with its shared weight loaded as one row and in the rows' layout
(TileChoice.w_rows), the latter also without rstd's store (TileChoice.drop_rstd): each one's bar.sync count and
registers.

    python bench/compile_probe.py --warp-blocks N ROWS WARPS
prints, as JSON, the forward of bf16 rows (with and without a residual) and the backward (with and without the
residual's gradient; the fast dW's partials where rows of N take them) compiled with the row's columns in order and
in warp blocks (kernels.py's notes): each one's bar.sync count and the xor distances of the shuffles after its first
barrier, where the warp-block kernel's blocks' sums meet ([WARPS/2, ..., 1]: the butterfly its order needs).

    python bench/compile_probe.py --dense N ROWS WARPS
prints, as JSON, the forward of bf16 rows of N (a power of two) in a tile of ROWS rows at WARPS warps (the weight first,
in the rows' layout): masked as the table's tiles are, without masks (TileChoice.dense, as a call whose rows fill the
tiles takes it), so with the rows held as loaded (rewiden), and the masked one with rstd's reciprocal by rcp_rn
(TileChoice.rcp_rn): each one's registers, predicated global loads, predicated global stores, setp instructions, and
rcp.rn / div.rn instructions in the PTX.

    python bench/compile_probe.py --cuda-forward N ROWS [inference]
prints, as JSON, the CUDA backend's forward of ROWS bf16 rows of N as its tables plan it (the training forward, or an
inference call's without rstd), compiled by NVRTC for sm_90 as the backend loads it: registers, threads a block, and its
global loads in all, ahead of the row sum's first shuffle and ahead of its first store (ptxas places a load by its first
use: the weight's, used only after the sum, comes after the shuffles unless something ties it to the row's loads).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from strictnorm.backends.triton import backend as tb
from strictnorm.backends.triton import kernels as k
from strictnorm.reference import exact_mean_scale

TARGET = GPUTarget("cuda", 90, 32)
PIECE = 8  # bf16 elements in 16 bytes: the warp blocks' piece of aligned bf16 rows (backend._warp_block_piece)
NO_DW_COLUMNS = {"DW_MB": 0, "DW_BN": 0, "WDT": 0}  # the backward without the few rows' dW by columns


def _compile(fn, sig: dict, const: dict, num_warps: int, max_registers: int = 0):
    """fn compiled as a launch on contiguous rows of N % 16 == 0 would be: pointers, strides and N divisible by 16
    (the JIT's specialization; without it loads are not vectorized and registers are counted for scalar
    addresses); with max_registers, bounded where ptxas takes more unbounded, as backend._Launcher does."""
    sig = {**sig, **{name: "constexpr" for name in const}}
    aligned = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name, kind in sig.items()
               if kind.startswith("*") or (kind == "i64" and not name.endswith("sg")) or name == "N"}
    options = {"num_warps": num_warps, "enable_fp_fusion": False}
    t0 = time.perf_counter()
    c = triton.compile(ASTSource(fn, sig, const, aligned), target=TARGET, options=options)
    if max_registers and _registers(c.asm["cubin"]) > max_registers:
        c = triton.compile(ASTSource(fn, sig, const, aligned), target=TARGET,
                           options={**options, "maxnreg": max_registers})
    return c, time.perf_counter() - t0


def _cuobjdump(cubin: bytes, flag: str) -> str:
    """cuobjdump's output for one cubin ("" where triton ships no cuobjdump)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True).stdout


def _resources(cubin: bytes) -> str:
    """ptxas's registers and stack bytes per thread ("REG:64 STACK:184": a stack is spilled registers)."""
    fields = next((line.split() for line in _cuobjdump(cubin, "-res-usage").splitlines() if "REG:" in line), [])
    return " ".join(v for v in fields if v.startswith(("REG:", "STACK:")))


def _registers(cubin: bytes) -> int:
    """ptxas's registers per thread (0 where triton ships no cuobjdump)."""
    return int(next(iter(re.findall(r"REG:(\d+)", _resources(cubin))), 0))


_LOAD = re.compile(r"\bLDG(?:\.[A-Z0-9]+)+\s+R(\d+),")  # any qualifiers (.E, .128, .EF: evict_first, ...)


def load_reuse(sass: str) -> tuple[int, int]:
    """(global loads before the first barrier or branch, how many of them write a register that an earlier one of
    them wrote): ptxas reusing a load's destination makes the later load wait until the earlier one's data has
    arrived and been read. A 64- or 128-bit load writes 2 or 4 registers from its first. (A branch ends the count:
    a persistent loop's body reloads its prologue's registers by design.)"""
    loads = reused = 0
    taken: set[int] = set()
    for line in sass.splitlines():
        if "BAR.SYNC" in line or re.search(r"\bBRA\b", line):
            break
        m = _LOAD.search(line)
        if not m:
            continue
        width = 4 if ".128" in line else 2 if ".64" in line else 1
        regs = set(range(int(m.group(1)), int(m.group(1)) + width))
        loads += 1
        reused += bool(regs & taken)
        taken |= regs
    return loads, reused


def loads_before_the_sum(sass: str) -> dict[str, int]:
    """The first kernel's global loads in all, those issued before its first warp shuffle (the row sum's) and those
    before its first global store (a load issued between stores waits a round trip of its own)."""
    kernel = sass.split("Function :")[1] if "Function :" in sass else sass
    ahead = {"ahead of the sum": "SHFL", "ahead of the first store": "STG"}
    return {"loads": len(_LOAD.findall(kernel)),
            **{name: len(_LOAD.findall(kernel.split(mark, 1)[0])) for name, mark in ahead.items()}}


def cuda_forward(n: int, rows: int, inference: bool = False) -> dict:
    """The CUDA backend's forward of `rows` bf16 rows of N (llama, 16-byte aligned), as its tables plan it, compiled
    by NVRTC for sm_90 (see the usage)."""
    import torch

    from strictnorm.backends.cuda import backend as cb
    from strictnorm.backends.cuda import nvrtc

    bf16 = torch.bfloat16
    launch = cb.norm_launch(n, bf16, None, bf16, bf16, "llama", False, cb.forward_tuning(n, rows, not inference),
                            True, not inference)
    cubin = nvrtc.compile_for_load("rms_norm.cu", "sm_90", launch.defines, "rms_fwd")  # the kernel the backend loads
    return {"registers": nvrtc.cubin_registers(cubin)["rms_fwd"], "threads": launch.threads,
            **loads_before_the_sum(_cuobjdump(cubin, "-sass"))}


def dense_kernels(n: int, rows: int, warps: int) -> dict:
    """The forward of bf16 rows of N at a tile of `rows` x `warps`, masked, dense, dense with rewiden and masked with
    rcp_rn: {name: {"registers", "predicated loads", "predicated stores", "setp", "rcp", "div"}} (the module's
    usage)."""
    out = {}
    for name, dense, rewiden, rcp in (("masked", False, False, False), ("dense", True, False, False),
                                      ("dense, rewiden", True, True, False), ("masked, rcp_rn", False, False, True)):
        tile = tb.RowTile(rows, n, 0, warps, w_first=True, w_rows=True, rewiden=rewiden, dense=dense, rcp_rn=rcp)
        const = dict(tile.constexprs(), MODE=0, XDT=1, HAS_W=True, PER_HEAD=False, R1=1, G=1, YDT=1, HAS_RES=False,
                     MEAN_SCALE=exact_mean_scale(n), STORE_RSTD=True,
                     **tile.forward_constexprs(piece=8, dense_ok=dense))
        const["RCP_RN"] = rcp  # compiled for NVIDIA here, whatever this machine has
        c = _compile(k.rms_fwd_kernel, _FWD_SIG, const, warps)[0]
        ptx = c.asm["ptx"]
        out[name] = {"registers": _registers(c.asm["cubin"]),
                     "predicated loads": len(re.findall(r"@%p\d+ ld\.global", ptx)),
                     "predicated stores": len(re.findall(r"@%p\d+ st\.global", ptx)),
                     "setp": len(re.findall(r"\bsetp\.", ptx)), "rcp": len(re.findall(r"\brcp\.rn", ptx)),
                     "div": len(re.findall(r"\bdiv\.rn", ptx))}
    return out


def _stats(c) -> str:
    ptx = c.asm["ptx"]
    sass = _cuobjdump(c.asm["cubin"], "-sass")
    loads = "loads ahead {} (reusing a register {})".format(*load_reuse(sass)) if sass else ""
    return (f"ptx {len(ptx.splitlines()):6d} lines  bar.sync {ptx.count('bar.sync'):3d}  "
            f"ld.shared {ptx.count('ld.shared'):4d}  local {ptx.count('ld.local') + ptx.count('st.local'):3d}  "
            f"launch_dependents {ptx.count('griddepcontrol.launch_dependents')}  "
            f"{_resources(c.asm['cubin'])}  {loads}")


_BWD_SIG = {"DY": "*bf16", "Z": "*bf16", "W": "*bf16", "RSTD": "*fp32", "DRES": "*bf16", "DX": "*i16",
            "DW_PART": "*fp32", **{s: "i64" for s in ("ds0", "ds1", "dsg", "zs0", "zs1", "zsg", "wsg", "es0", "es1",
                                                      "esg", "xs0", "xs1", "xsg")},
            **{s: "i32" for s in ("M", "N", "R1", "G")}, "offset": "fp32"}
_FWD_SIG = {"X": "*bf16", "RES": "*bf16", "Z": "*i16", "W": "*bf16", "Y": "*i16", "RSTD": "*fp32",
            **{s: "i64" for s in ("xs0", "xs1", "xsg", "rs0", "rs1", "rsg", "wsg")},
            **{s: "i32" for s in ("M", "N", "R1", "G")}, "eps": "fp32", "offset": "fp32"}


def warp_block_kernels(n: int, rows: int, warps: int) -> dict:
    """The forward and backward of `rows` bf16 rows of N a program at `warps` warps (N not a power of two: two column
    tiles, as TileChoice.split makes them), their columns in order and in warp blocks, without and with a residual
    (its gradient): {name: {"barriers": count, "xors": [...]}}, names "in order", "blocks", "backward blocks", ...,
    with " + residual" (see the usage)."""
    out = {}
    pa, t = tb.column_tiles(n, True) if n & (n - 1) else (n, 0)
    for blocks in (False, True):
        tile = tb.RowTile(rows, pa, t, warps, warp_blocks=blocks)
        for res in (False, True):
            name = ("blocks" if blocks else "in order") + (" + residual" if res else "")
            common = dict(tile.constexprs(), MODE=0, XDT=1, HAS_W=True, PER_HEAD=False, R1=1, G=1)
            fwd = dict(common, YDT=1, HAS_RES=res, MEAN_SCALE=exact_mean_scale(n), STORE_RSTD=True,
                       **tile.forward_constexprs(piece=8))
            bwd = dict(common, HAS_DRES=res, DW_PARTIALS=pa + t <= 8192, MEAN_SCALE=exact_mean_scale(n), GDC=False,
                       **NO_DW_COLUMNS, **tile.backward_constexprs(piece=8),
                       **tile.chunk_constexprs())
            for label, fn, sig, const in (("", k.rms_fwd_kernel, _FWD_SIG, fwd),
                                          ("backward ", k.rms_bwd_kernel, _BWD_SIG, bwd)):
                ptx = _compile(fn, sig, const, warps)[0].asm["ptx"]
                after = (ptx.split("bar.sync", 1) + [""])[1]
                out[label + name] = {
                    "barriers": ptx.count("bar.sync"),
                    "xors": [int(v) for v in re.findall(r"shfl\.sync\.bfly\.b32\s+%r\d+, %r\d+, (\d+),", after)]}
    return out


def weight_layout_kernels(n: int, rows: int, warps: int) -> dict:
    """The forward of `rows` bf16 rows of N (a power of two) a program at `warps` warps with the shared weight loaded
    as one row, in the rows' layout (TileChoice.w_rows), and so without rstd's store (an inference call's kernel
    where the tile drops it, TileChoice.drop_rstd): {"weight row" | "weight in the rows' layout" | "... no rstd":
    {"barriers": count, "registers": count}}."""
    out = {}
    for name, w_rows, store in (("weight row", False, True), ("weight in the rows' layout", True, True),
                                ("weight in the rows' layout, no rstd", True, False)):
        tile = tb.RowTile(rows, n, 0, warps, w_rows=w_rows)
        const = dict(tile.constexprs(), MODE=0, XDT=1, HAS_W=True, PER_HEAD=False, R1=1, G=1, YDT=1, HAS_RES=False,
                     MEAN_SCALE=exact_mean_scale(n), STORE_RSTD=store, **tile.forward_constexprs(piece=8))
        c = _compile(k.rms_fwd_kernel, _FWD_SIG, const, warps)[0]
        out[name] = {"barriers": c.asm["ptx"].count("bar.sync"), "registers": _registers(c.asm["cubin"])}
    return out


def main(args: list[str]) -> None:
    if args[:1] == ["--warp-blocks"]:
        print(json.dumps(warp_block_kernels(*(int(v) for v in args[1:4]))))
        return
    if args[:1] == ["--cuda-forward"]:
        print(json.dumps(cuda_forward(int(args[1]), int(args[2]), args[3:4] == ["inference"])))
        return
    if args[:1] == ["--dense"]:
        print(json.dumps(dense_kernels(*(int(v) for v in args[1:4]))))
        return
    if args[:1] == ["--weight-layout"]:
        print(json.dumps(weight_layout_kernels(*(int(v) for v in args[1:4]))))
        return
    ptr16, ptr32 = "*bf16", "*fp32"
    fwd_sig, bwd_sig = _FWD_SIG, _BWD_SIG
    fold_sig = {"A": ptr16, "B": ptr16, "RSTD": ptr32, "OUT": ptr32,
                **{s: "i64" for s in ("as0", "as1", "asg", "bs0", "bs1", "bsg")},
                **{s: "i32" for s in ("ROWS_PER_GROUP", "N", "R1", "G", "GROUP_STEP")}}
    print(f"triton {triton.__version__}, sm_90")
    for arg in args:
        n, _, rows_text = arg.partition("@")
        n, rows = int(n), int(rows_text) if rows_text else None

        def tiled(direction: str, n: int = n, rows: int | None = rows) -> tuple[tb.RowTile, dict]:
            # the tiles bf16 rows take (16-byte aligned: warp blocks where the tile asks for them)
            tile = tb.forward_tile(n, rows, PIECE) if direction == "fwd" else tb.row_tile(n, direction, rows)
            # R1 = G = 1 (one leading dim): the JIT specializes ints equal to 1 as constants
            return tile, dict(tile.constexprs(), MODE=0, XDT=1, HAS_W=True, PER_HEAD=False, R1=1, G=1)

        # ASTSource takes no parameter defaults: every constexpr is passed
        tile, common = tiled("fwd")
        c, s = _compile(k.rms_fwd_kernel, fwd_sig, {**common, "YDT": 1, "HAS_RES": False, "STORE_RSTD": True,
                                                    "MEAN_SCALE": exact_mean_scale(n),
                                                    **tile.forward_constexprs(PIECE)}, tile.num_warps,
                        tile.max_registers)
        print(f"N={arg:>12s} fwd  {s:6.1f} s  {_stats(c)}", flush=True)
        tile, common = tiled("bwd")
        # GDC: the early signal to the dependent partial sum, as the backward with partials runs on sm_90
        c, s = _compile(k.rms_bwd_kernel, bwd_sig, {**common, "HAS_DRES": False, "DW_PARTIALS": True, "GDC": True,
                                                    **NO_DW_COLUMNS,
                                                    "MEAN_SCALE": exact_mean_scale(n),
                                                    **tile.backward_constexprs(PIECE), **tile.chunk_constexprs()},
                        tile.num_warps, tile.max_registers)
        print(f"N={arg:>12s} bwd  {s:6.1f} s  {_stats(c)}", flush=True)
    c, s = _compile(k.fold_kernel, fold_sig, {"BN": tb._FOLD_BN, "UNROLL": tb._FOLD_UNROLL, "WHAT": 1, "XDT": 1}, 2)
    print(f"fold        {s:6.1f} s  {_stats(c)}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["1", "7", "128", "1000", "4096@128", "4096@2048", "4096", "8192", "18432", "65536"])
