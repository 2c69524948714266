"""Text similarity plumbing shared by the reward cache and the prompt gate.

A text is the set of its character 3-grams (lower-cased, whitespace collapsed), and two
texts are as similar as the Jaccard index of those sets; `minhash` is datasketch's
estimate of it (128 permutations, seed 1: the same text always gives the same signature,
in every process, so LSH indexes can be rebuilt after a restart).
"""

from __future__ import annotations

from datasketch import MinHash

NUM_PERM = 128


def shingles(text: str, k: int = 3) -> set[bytes]:
    """Character k-grams of the lower-cased, whitespace-collapsed text (one gram for a text
    of k characters or fewer)."""
    t = " ".join(text.lower().split())
    if len(t) <= k:
        return {t.encode()}
    return {t[i:i + k].encode() for i in range(len(t) - k + 1)}


def minhash(text: str) -> MinHash:
    """MinHash (128 permutations, seed 1) of the text's character 3-grams."""
    m = MinHash(num_perm=NUM_PERM, seed=1)
    m.update_batch(list(shingles(text)))
    return m
