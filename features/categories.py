"""Categorical user features: labels as read (strings; integer columns as their decimal text), vocabularies fitted
on the training split, and ids. Id 0 is the unknown slot: a label unseen in training gets it, and is reported."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from features.text import listed

UNKNOWN_ID = 0  # every vocabulary's slot for labels unseen in training


def fit_vocabulary(labels: np.ndarray) -> tuple[str, ...]:
    """The distinct labels of `labels` (object or str [N]), sorted: label vocab[k] has id k + 1."""
    return tuple(sorted({str(x) for x in np.unique(labels.astype(str))}))


def encode(labels: np.ndarray, vocabulary: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Ids (int64, labels' shape) of `labels` in `vocabulary`, and where a label is unseen (bool, same shape)."""
    text = np.asarray(labels).astype(str)
    if not vocabulary:
        return np.zeros(text.shape, dtype=np.int64), np.ones(text.shape, dtype=bool)
    vocab = np.array(vocabulary, dtype=str)
    at = np.minimum(np.searchsorted(vocab, text), vocab.size - 1)
    seen = vocab[at] == text
    return np.where(seen, at + 1, UNKNOWN_ID).astype(np.int64), ~seen


def cardinality(vocabulary: tuple[str, ...]) -> int:
    """Embedding rows of a vocabulary: its labels and the unknown slot."""
    return len(vocabulary) + 1


def unseen_note(unseen: Mapping[str, np.ndarray], labels: Mapping[str, np.ndarray]) -> list[str]:
    """One line per categorical column with labels unseen in training (`unseen` masks, `labels` as given)."""
    return [f"categorical feature {name!r}: {listed(sorted({str(x) for x in np.asarray(labels[name])[mask]}))} not "
            "seen in training; forecast with the unknown category" for name, mask in unseen.items() if mask.any()]
