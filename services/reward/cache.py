"""Cached-score fallback: rewards of recently scored prompts, found again by similarity.

While the reward server's circuit breaker is open, a group is scored from the most
similar prompt among the last `capacity` (default 1000) prompts the server scored:

    prompt similarity   MinHash estimate of the Jaccard similarity of the prompts'
                        character 3-gram sets (datasketch MinHash + LSH, 128 permutations)
    sample reward       for each new response, the reward of the most similar response
                        of that cached prompt (exact Jaccard similarity of character
                        3-gram sets, 1.0 = identical text; an identical response is found
                        by a dictionary lookup first)

Matching each response, not only the prompt, keeps a learning signal: giving every sample
of a group the prompt's mean reward would make every GRPO advantage zero. A group whose
best prompt similarity is below `floor` gets no cached reward (the caller holds it until
the server recovers). The group's similarity is the prompt's; each sample's response
similarity is reported too.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from datasketch import MinHash, MinHashLSH

NUM_PERM = 128


def _shingles(text: str, k: int = 3) -> set[bytes]:
    """Character k-grams of the lower-cased, whitespace-collapsed text."""
    t = " ".join(text.lower().split())
    if len(t) <= k:
        return {t.encode()}
    return {t[i:i + k].encode() for i in range(len(t) - k + 1)}


def minhash(text: str) -> MinHash:
    """MinHash (128 permutations, seed 1) of the text's character 3-grams."""
    m = MinHash(num_perm=NUM_PERM, seed=1)
    m.update_batch(list(_shingles(text)))
    return m


@dataclass
class CachedScores:
    """Rewards for one group from the cache: (n,) rewards, each sample's response similarity,
    the prompt similarity (0..1), and which scored prompt and scorer they came from."""

    rewards: list[float]
    response_similarity: list[float]
    similarity: float
    source_prompt_id: str
    scorer: str


class ScoreCache:
    """The last `capacity` scored prompts with their responses and rewards.

    Args:
        capacity: prompts kept (oldest evicted first).
        floor: least prompt similarity (MinHash Jaccard estimate, 0..1) a lookup accepts.

    Raises ValueError for capacity < 1 or a floor outside (0, 1].
    """

    def __init__(self, capacity: int = 1000, floor: float = 0.95):
        if capacity < 1 or not 0 < floor <= 1:
            raise ValueError(f"capacity must be >= 1 and floor in (0, 1], got {capacity}, {floor}")
        self.capacity, self.floor = capacity, floor
        self._lsh = MinHashLSH(threshold=floor, num_perm=NUM_PERM)
        # prompt_id -> (MinHash, prompt, [(response, its 3-grams, reward)], {response: reward}, scorer)
        self._entries: OrderedDict[str, tuple] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, prompt_id: str, prompt: str, responses: list[str], rewards: list[float], scorer: str) -> None:
        """Remember a group the server scored (a prompt seen again replaces its entry)."""
        mh = minhash(prompt)
        with self._lock:
            if prompt_id in self._entries:
                self._lsh.remove(prompt_id)
                del self._entries[prompt_id]
            scored = [(r, _shingles(r), float(w)) for r, w in zip(responses, rewards)]
            self._entries[prompt_id] = (mh, prompt, scored, {r: w for r, _, w in reversed(scored)}, scorer)
            self._lsh.insert(prompt_id, mh)
            while len(self._entries) > self.capacity:
                old, _ = self._entries.popitem(last=False)
                self._lsh.remove(old)

    def lookup(self, prompt: str, responses: list[str]) -> CachedScores | None:
        """Rewards for `responses` from the most similar cached prompt, or None when no cached
        prompt reaches the floor."""
        mh = minhash(prompt)
        with self._lock:
            best, best_sim = None, -1.0
            for key in self._lsh.query(mh):
                sim = mh.jaccard(self._entries[key][0])
                if sim > best_sim:
                    best, best_sim = key, sim
            if best is None or best_sim < self.floor:
                return None
            _, _, scored, exact, scorer = self._entries[best]
        rewards, sims = [], []
        for response in responses:
            if response in exact:
                rewards.append(exact[response])
                sims.append(1.0)
                continue
            grams = _shingles(response)
            r_sim, reward = max(((len(grams & g) / (len(grams | g) or 1), w) for _, g, w in scored),
                                key=lambda t: t[0])  # ties: the first scored
            rewards.append(reward)
            sims.append(round(r_sim, 4))
        return CachedScores(rewards, sims, round(best_sim, 4), best, scorer)
