"""Merge a sweep's choices into a tuning file, as STRICTNORM_TRITON_TUNING / STRICTNORM_CUDA_TUNING read them:
{direction: {padded length: choice}}; the new file's entries replace the old one's per direction and length, the
rest are kept. Usage: python3 bench/tuning_merge.py INTO.json NEW.json (INTO.json is created where missing; a
missing NEW.json, a sweep that wrote nothing, changes nothing)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def merge(into: dict, new: dict) -> dict:
    """into's entries, with new's replacing them per direction and padded length."""
    out = {direction: dict(entries) for direction, entries in into.items()}
    for direction, entries in new.items():
        out.setdefault(direction, {}).update(entries)
    return out


def main(into_path: str, new_path: str) -> None:
    into, new = Path(into_path), Path(new_path)
    if not new.exists():
        return
    old = json.loads(into.read_text()) if into.exists() else {}
    into.write_text(json.dumps(merge(old, json.loads(new.read_text())), indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:3])
