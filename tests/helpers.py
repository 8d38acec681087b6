"""Shared test helpers: independent scalar implementations of the contract's building blocks."""

from __future__ import annotations

import struct

import torch

from strictnorm.verify import bits_equal, mismatches  # noqa: F401


def f32(v: float) -> float:
    """Round a Python float (double) to the nearest fp32, ties to even."""
    return struct.unpack("f", struct.pack("f", v))[0]


def tree_sum_py(vals: list[float]) -> float:
    """canon_sum written independently: recursive halves over a zero-padded power-of-two list."""
    p = 1
    while p < len(vals):
        p *= 2
    vals = list(vals) + [0.0] * (p - len(vals))

    def rec(lo: int, hi: int) -> float:
        if hi - lo == 1:
            return vals[lo]
        mid = (lo + hi) // 2
        return f32(rec(lo, mid) + rec(mid, hi))

    return rec(0, p)


def randn(*shape: int, dtype=torch.float32, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)
