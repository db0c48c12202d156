"""Small wording helpers for what the commands print (any layer of ``search`` may use them; imports nothing of it)."""

from __future__ import annotations

__all__ = ["count"]


def count(n: int, noun: str) -> str:
    """'1 trial', '2 trials', '0 trials': ``n`` and ``noun``, plural unless n is 1 (nouns taking an s)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
