"""How a message repeats a caller's or a file's string: quoted, escaped and cut, so that a message never grows
with the size of what it quotes."""

from __future__ import annotations

from collections.abc import Sequence


def bounded(text: str, limit: int = 48) -> str:
    """`text` quoted and escaped, about `limit` characters at most: a longer one is cut and its length given."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def listed(texts: Sequence[str], most: int = 5, limit: int = 24) -> str:
    """The first `most` of `texts`, each `bounded`, and how many more there are."""
    more = f" (+{len(texts) - most} more)" if len(texts) > most else ""
    return ", ".join(bounded(t, limit) for t in texts[:most]) + more
