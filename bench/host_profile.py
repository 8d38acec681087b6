"""Where the host time of an eager strictnorm call goes: cProfile over many tiny calls (GPU machine).

    python3 bench/host_profile.py [out.txt]
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

import torch

import strictnorm as sn


def main() -> None:
    with open(sys.argv[1], "w") if len(sys.argv) > 1 else sys.stdout as out:  # noqa: SIM115
        _profile(out)


def _profile(out) -> None:
    x = torch.randn(4, 4096, device="cuda").bfloat16()
    w = torch.ones(4096, device="cuda").bfloat16()
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    dy = torch.randn_like(x)
    for backend in ("triton", "cuda"):
        def fwd(backend=backend):
            sn.rms_norm(x, w, backend=backend)

        def fwd_bwd(backend=backend):
            torch.autograd.grad(sn.rms_norm(xg, wg, backend=backend), (xg, wg), dy)

        for name, fn in (("forward", fwd), ("forward+backward", fwd_bwd)):
            for _ in range(100):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(1000):
                fn()
            us = (time.perf_counter() - t0) / 1000 * 1e6
            torch.cuda.synchronize()
            print(f"== {backend} {name}: {us:.1f} us per call (host, no sync)", file=out, flush=True)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(300):
                fn()
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
            print(s.getvalue(), file=out, flush=True)


if __name__ == "__main__":
    main()
