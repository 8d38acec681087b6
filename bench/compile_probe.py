"""Compile strictnorm's Triton kernels for sm_90 without a GPU and report what costs no device time:
compile seconds, PTX size, shared-memory traffic, barriers, local-memory spills, and ptxas's registers and
stack per thread (cuobjdump -res-usage, where triton ships cuobjdump), per N.

A pathological compile shows here before it burns device time (Triton 3.6 turned a tl.split tree
into 25x more PTX than a reshape + sum tree). Usage: python bench/compile_probe.py [N ...]
"""

from __future__ import annotations

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

TARGET = GPUTarget("cuda", 90, 32)


def _compile(fn, sig: dict, const: dict, num_warps: int):
    """fn compiled as a launch on contiguous rows of N % 16 == 0 would be: pointers, strides and N divisible by 16
    (the JIT's specialization; without it loads are not vectorized and registers are counted for scalar
    addresses)."""
    sig = {**sig, **{name: "constexpr" for name in const}}
    aligned = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name, kind in sig.items()
               if kind.startswith("*") or (kind == "i64" and not name.endswith("sg")) or name == "N"}
    t0 = time.perf_counter()
    c = triton.compile(ASTSource(fn, sig, const, aligned), target=TARGET,
                       options={"num_warps": num_warps, "enable_fp_fusion": False})
    return c, time.perf_counter() - t0


def _resources(cubin: bytes) -> str:
    """ptxas's registers and stack bytes per thread ("REG:64 STACK:184": a stack is spilled registers)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    fields = next((line.split() for line in out.splitlines() if "REG:" in line), [])
    return " ".join(v for v in fields if v.startswith(("REG:", "STACK:")))


def _stats(c) -> str:
    ptx = c.asm["ptx"]
    return (f"ptx {len(ptx.splitlines()):6d} lines  bar.sync {ptx.count('bar.sync'):3d}  "
            f"ld.shared {ptx.count('ld.shared'):4d}  local {ptx.count('ld.local') + ptx.count('st.local'):3d}  "
            f"{_resources(c.asm['cubin'])}")


def main(ns: list[int]) -> None:
    ptr16, ptr32 = "*bf16", "*fp32"
    fwd_sig = {"X": ptr16, "RES": ptr16, "Z": "*i16", "W": ptr16, "Y": "*i16", "RSTD": ptr32,
               **{s: "i64" for s in ("xs0", "xs1", "xsg", "rs0", "rs1", "rsg", "wsg")},
               **{s: "i32" for s in ("M", "N", "R1", "G")}, "eps": "fp32", "offset": "fp32"}
    bwd_sig = {"DY": ptr16, "Z": ptr16, "W": ptr16, "RSTD": ptr32, "DRES": ptr16, "DX": "*i16", "DW_PART": ptr32,
               **{s: "i64" for s in ("ds0", "ds1", "dsg", "zs0", "zs1", "zsg", "wsg", "es0", "es1", "esg",
                                     "xs0", "xs1", "xsg")},
               **{s: "i32" for s in ("M", "N", "R1", "G")}, "offset": "fp32"}
    fold_sig = {"A": ptr16, "B": ptr16, "RSTD": ptr32, "OUT": ptr32,
                **{s: "i64" for s in ("as0", "as1", "asg", "bs0", "bs1", "bsg")},
                **{s: "i32" for s in ("ROWS_PER_GROUP", "N", "R1", "G", "GROUP_STEP")}}
    print(f"triton {triton.__version__}, sm_90")
    for n in ns:
        def tiled(direction: str, n: int = n) -> tuple[dict, int]:
            tile = tb.row_tile(n, direction)
            # R1 = G = 1 (one leading dim): the JIT specializes ints equal to 1 as constants
            return dict(tile.constexprs(), MODE=0, XDT=1, HAS_W=True, PER_HEAD=False, R1=1, G=1), tile.num_warps

        common, warps = tiled("fwd")
        fwd_tile = tb.row_tile(n, "fwd")  # ASTSource takes no parameter defaults: every constexpr is passed
        c, s = _compile(k.rms_fwd_kernel, fwd_sig, {**common, "YDT": 1, "HAS_RES": False,
                                                    **fwd_tile.forward_constexprs()}, warps)
        print(f"N={n:6d} fwd  {s:6.1f} s  {_stats(c)}", flush=True)
        common, warps = tiled("bwd")
        bwd_tile = tb.row_tile(n, "bwd")
        c, s = _compile(k.rms_bwd_kernel, bwd_sig, {**common, "HAS_DRES": False, "DW_PARTIALS": True,
                                                    **bwd_tile.backward_constexprs(), **bwd_tile.chunk_constexprs()},
                        warps)
        print(f"N={n:6d} bwd  {s:6.1f} s  {_stats(c)}", flush=True)
    c, s = _compile(k.fold_kernel, fold_sig, {"BN": tb._FOLD_BN, "UNROLL": tb._FOLD_UNROLL, "WHAT": 1, "XDT": 1}, 2)
    print(f"fold        {s:6.1f} s  {_stats(c)}")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 7, 128, 1000, 4096, 8192, 18432, 65536])
