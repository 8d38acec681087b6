"""Where a default fold's time goes: the same launch with its consumer's adds or its converters' loads taken out.

The fold (as the backend plans it, no FoldTuning) runs in several variants, each a kernel compiled from fold.cu
with a text edit and launched with the plan's grid, block and arguments:
  as built     the source as it is
  no adds      the consumer keeps one lane of each 16-byte load instead of adding it (no chain of adds): the
               converters' supply of rows alone sets the pace
  no loads     the converters write constants instead of loading rows (no global loads): the consumer's chain and
               the buffers' handshakes alone
  neither      both edits: the handshakes alone
  clocked      as built, with the first consumer lane's span in SM cycles and in ns and its cycles waiting for full
               buffers written over out[0:3]: the SM clock the fold ran at, the consumer's cycles a row in place
               (bench/consumer_probe.py: alone) and how many of them it waits
  spin         clocked, the consumer's waits polling mbarrier.test_wait (never suspended) instead of try_wait
  handshakes   no loads, and the converters store nothing: the consumer's adds and the buffers' hand-overs alone
  handshakes clocked  the same, clocked as above: the consumer's cycles a row so
Kernel-only µs (L2 flushed) and ns a row. The edits' results are not the fold's (only "as built" is checked against
the Python loop). SUPPLY_VARIANTS picks variants. (Run 26's "split last", the last block's adds in halves around the
next stage's wait, gained nothing and was removed.) Run on the GPU machine: python3 bench/supply_probe.py
[out.json]; SUPPLY_SHAPES=MxN[:dw],... picks the cases (default 4096x128,16384x128,32768x1024:dw,32768x4096:dw; :dw
the strict dW fold of bf16 dy and x).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

from strictnorm.backends.cuda import nvrtc
from strictnorm.backends.cuda.backend import fold_launch
from strictnorm.backends.layout import row_layout
from strictnorm.backends.registry import get_backend
from strictnorm.bench import CHAIN_NS_PER_ROW, Timer

# (what the edit replaces, with what): each must occur in fold.cu, else the probe stops (the source has moved on)
_NO_ADDS = [("acc = add4(acc, cur[j]);", "acc = cur[j].x;")]
_NO_LOADS = [
    ("load_upto<a_t, A_CODE, S_VEC>(v[k], a + fold_row_offset(r, la) + c, WHOLE ? S_VEC : n - c, true);",
     "for (int j = 0; j < S_VEC; ++j) v[k][j] = static_cast<float>(row + j); (void)r;"),
    ("load_upto<b_t, B_CODE, S_VEC>(vb[k], b + fold_row_offset(r, lb) + c, WHOLE ? S_VEC : n - c, true);",
     "for (int j = 0; j < S_VEC; ++j) vb[k][j] = 1.0f;"),
    ("rs[k] = rstd[r];", "rs[k] = 1.0f;"),
]
# The consumer's span in SM cycles and in ns (lane 0 of CTA 0's first consumer warp, from its start to its result)
# and the cycles it spent in its waits for full buffers, written over out[0:3]: the SM clock while the fold runs is
# the first two's ratio. With spin, those waits poll mbar_test (mbarrier.test_wait) instead of mbar_wait's try_wait
# (which may suspend the thread until the phase completes, and wake it some time later).
_WAITS = """// the consumer's waits for full buffers, timed (supply_probe)
__device__ __forceinline__ void consumer_wait(unsigned long long* bar, int parity, long long& waited) {
    const long long t0 = clock64();
#if PROBE_SPIN
    while (!mbar_test(bar, parity)) {
    }
#else
    mbar_wait(bar, parity);
#endif
    waited += clock64() - t0;
}

"""


def _clocked(spin: bool) -> list[tuple[str, str]]:
    return [
        ("// The fold from +0.0 of the first `whole` stages",
         f"#define PROBE_SPIN {int(spin)}\n" + _WAITS + "// The fold from +0.0 of the first `whole` stages"),
        ("unsigned long long* cfull,\n                                                   unsigned long long* cempty) {",
         "unsigned long long* cfull,\n                                                   unsigned long long* cempty,"
         " long long& waited) {"),
        ("mbar_wait(cfull + ns, mbar_use_parity(s + 1, CSTAGES));",
         "consumer_wait(cfull + ns, mbar_use_parity(s + 1, CSTAGES), waited);"),
        ("    mbar_wait(cfull, 0);", "    consumer_wait(cfull, 0, waited);"),
        ("mbar_wait(cfull + cs, mbar_use_parity(s, CSTAGES));",
         "consumer_wait(cfull + cs, mbar_use_parity(s, CSTAGES), waited);"),
        ("c % COLS), cfull, cempty);", "c % COLS), cfull, cempty, waited);"),
        ("// the fold: lane c of the consumer warps adds column col0 + c\n",
         "\n        const long long clk0 = clock64();\n        const unsigned long long ns0 = global_ns();\n"
         "        long long waited = 0;\n"),
        ("= Elem<OUT_CODE>::narrow(acc);\n        return;\n",
         "= Elem<OUT_CODE>::narrow(acc);\n"
         "        if (blockIdx.x == 0 && h == 0 && c == 0) {\n"
         "            unsigned* o = reinterpret_cast<unsigned*>(out);\n"
         "            o[0] = static_cast<unsigned>(clock64() - clk0);\n"
         "            o[1] = static_cast<unsigned>(global_ns() - ns0);\n"
         "            o[2] = static_cast<unsigned>(waited);\n"
         "        }\n        return;\n"),
    ]


# The converters store nothing (with no loads: they only hand the buffers over): beside "no loads", whether the
# converters' shared-memory stores slow the consumer's chain in place (run 24: 4096 x 128 no loads 12.7 us, ~5.2
# cycles a row, against 4.35 for the consumer alone in bench/consumer_probe.py)
_NO_STORES = [("            if (segment_row(lane, k) < rows) store_segment(dst, v[k], lane, k);",
               "            (void)dst, (void)v;")]

VARIANTS = {"as built": [], "no adds": _NO_ADDS, "no loads": _NO_LOADS, "neither": _NO_ADDS + _NO_LOADS,
            "clocked": _clocked(False), "spin": _clocked(True),
            "handshakes": _NO_LOADS + _NO_STORES, "handshakes clocked": _NO_LOADS + _NO_STORES + _clocked(False)}
# SUPPLY_VARIANTS=name,... times only those (default: all)
CHOSEN = [v for v in os.environ.get("SUPPLY_VARIANTS", ",".join(VARIANTS)).split(",") if v]


def _edited(edits: list[tuple[str, str]]) -> str:
    src = nvrtc.source("fold.cu")
    for old, new in edits:
        if old not in src:
            raise RuntimeError(f"supply_probe: fold.cu no longer has {old!r}")
        src = src.replace(old, new)
    return src


def compile_edited(variant: str, defines: dict[str, int], arch: str) -> bytes:
    """fold.cu with VARIANTS[variant]'s edits, compiled by NVRTC with the plan's macros (no GPU needed)."""
    return nvrtc.compile_source(_edited(VARIANTS[variant]), f"fold.cu ({variant})", arch, defines)


def _kernel(variant: str, name: str, defines: dict[str, int], shmem: int) -> nvrtc.LoadedKernel:
    from cuda.core import Device, ObjectCode

    dev = Device(torch.cuda.current_device())
    dev.set_current()
    major, minor = dev.compute_capability
    module = ObjectCode.from_cubin(compile_edited(variant, defines, f"sm_{major}{minor}"), name="fold.cu")
    kernel = nvrtc.LoadedKernel(module, module.get_kernel(name))
    if shmem > 48 * 1024:
        kernel.allow_dynamic_shared(shmem)
    return kernel


def _cases(dev: torch.device):
    g = torch.Generator(device=dev).manual_seed(0)
    text = os.environ.get("SUPPLY_SHAPES", "4096x128,16384x128,32768x1024:dw,32768x4096:dw")
    for item in text.split(","):
        shape, _, kind = item.partition(":")
        m, n = (int(v) for v in shape.split("x"))
        if kind == "dw":
            dy, x = (torch.randn(m, n, device=dev, generator=g).bfloat16() for _ in range(2))
            rstd = torch.rand(m, device=dev, generator=g) + 0.5
            yield f"strict dW {m}x{n}", m, dy, x, rstd, 1
        else:
            rows = torch.randn(m, n, device=dev, generator=g)
            yield f"fold {m}x{n}", m, rows, rows, rows, 0  # as left_fold passes them


def main() -> None:
    dev = torch.device("cuda")
    timer = Timer(dev, iters=9)
    cb = get_backend("cuda")
    results = []
    for name, m, a, b, rstd, what in _cases(dev):
        (ak, alay), (bk, blay) = row_layout(a), row_layout(b)
        want = cb.fold(ak, alay, bk, blay, rstd, what, 1)
        plan = next(p for k, p in cb._fold_plans.items() if k[1] == alay and k[4] == blay and k[7] == what)
        if what == 0:
            loop = torch.zeros(a.shape[1], device=dev)
            for r in a:
                loop = loop + r
            assert torch.equal(want[0].view(torch.int32), loop.view(torch.int32)), name  # want: (groups, N)
        props = torch.cuda.get_device_properties(dev)  # the plan's macros, as _fold_plan made them
        fl = fold_launch(alay.n, a.dtype, b.dtype, what, True, True, props.multi_processor_count, None, torch.float32,
                         alay.rows, 1, props.shared_memory_per_block_optin)
        for variant in CHOSEN:
            edited = dataclasses.replace(plan, kernel=_kernel(variant, fl.kernel, fl.defines, fl.shmem))
            run = lambda p=edited, a=ak, b=bk, r=rstd: cb._run_fold(p, a, b, r)  # noqa: E731
            got = run()
            us = timer.kernel_us(run)
            row = {"case": name, "rows": m, "kernel": fl.kernel, "defines": fl.defines, "variant": variant, "us": us,
                   "ns_per_row": us * 1e3 / m, "x_chain": us * 1e3 / (m * CHAIN_NS_PER_ROW),
                   "bitwise_vs_backend": bool(torch.equal(got.view(torch.int32), want.view(torch.int32)))}
            if variant in ("clocked", "spin", "handshakes clocked"):  # after the timed calls: the clock they ran at
                cycles, ns, waited = (int(v) for v in run().view(torch.int32).flatten()[:3].tolist())
                row.update(consumer_cycles=cycles, consumer_ns=ns, sm_ghz=cycles / ns, consumer_wait_cycles=waited)
            results.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'case':>22} {'variant':>18} {'us':>8} {'ns/row':>7} {'consumer: cycles/row':>21} {'waiting':>8}"
          f" {'GHz':>5}")
    for r in results:
        clock = (f" {r['consumer_cycles'] / r['rows']:21.2f} {r['consumer_wait_cycles'] / r['rows']:8.2f}"
                 f" {r['sm_ghz']:5.2f}" if "sm_ghz" in r else "")
        print(f"{r['case']:>22} {r['variant']:>18} {r['us']:8.1f} {r['ns_per_row']:7.2f}{clock}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"results": results}, f, indent=1)


if __name__ == "__main__":
    main()
