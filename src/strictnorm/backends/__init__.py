"""Kernel backends and their registry."""
