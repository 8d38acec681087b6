"""The `strictnorm` command: info, verify (and bench, where the benchmark module is present)."""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch


def _info(args: argparse.Namespace) -> int:
    from . import __version__
    from .backends import registry

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    print(f"strictnorm {__version__}  python {platform.python_version()}  torch {torch.__version__}")
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        print(f"device: {p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs)"
              f"{'  ROCm ' + torch.version.hip if torch.version.hip else '  CUDA ' + str(torch.version.cuda)}")
    else:
        print("device: cpu (no GPU visible to torch)")
    print(f"{'backend':8s} {'status':12s} {'ops':22s} why")
    for name in registry.names():
        st = registry.status(name, device)
        print(f"{name:8s} {'available' if st.available else 'unavailable':12s} {','.join(st.ops):22s} {st.reason}")
    try:
        from .backends.cuda.nvrtc import cache_dir, nvrtc_version

        print(f"NVRTC {nvrtc_version()}; compiled kernels cached in {cache_dir()}")
    except Exception as e:  # cuda-core or the NVRTC library missing: the cuda backend line says so too
        print(f"NVRTC not usable: {type(e).__name__}: {e}"[:200])
    for op in ("rms_norm", "left_fold"):
        chosen, skipped = registry.automatic_choice(device, op)
        why = f" (passed over: {'; '.join(skipped)})" if skipped else ""
        print(f"automatic choice for {op}: {chosen}{why}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from .verify import as_dicts, iter_checks

    print(f"{'backend':8s} {'device':6s} {'check':20s} {'case':44s} result", flush=True)
    results = []
    for r in iter_checks(args.backend or None, quick=args.quick):  # printed as they run
        results.append(r)
        verdict = "ok" if r.ok else "MISMATCH"
        if r.detail.startswith("skipped"):
            verdict = r.detail
        elif r.detail:
            verdict += f" ({r.detail})"
        print(f"{r.backend:8s} {r.device:6s} {r.check:20s} {r.case:44s} {verdict}", flush=True)
    bad = [r for r in results if not r.ok]
    ran = [r for r in results if not r.detail.startswith("skipped")]
    print(f"verify: {len(ran) - len(bad)} passed, {len(bad)} failed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": as_dicts(results), "torch": torch.__version__}, f, indent=1)
    return 1 if bad else 0


def _bench(argv: list[str]) -> int:
    from .bench import main as bench_main

    return bench_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its own parser: `strictnorm bench --help`
        return _bench(argv[1:])
    parser = argparse.ArgumentParser(prog="strictnorm", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="device, backends, what is available and why not").set_defaults(fn=_info)
    v = sub.add_parser("verify", help="check every available backend against the reference, bit for bit")
    v.add_argument("--backend", action="append", help="only this backend (repeatable)")
    v.add_argument("--quick", action="store_true", help="fewer shapes and dtypes")
    v.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    v.set_defaults(fn=_verify)
    sub.add_parser("bench", help="strictnorm and anchors side by side (strictnorm bench --help)")
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
