"""Cached-score fallback: rewards of recently scored prompts, found again by similarity.

While the reward server's circuit breaker is open, a group is scored from the most
similar prompt among the last `capacity` (default 1000) prompts the server scored:

    prompt similarity   MinHash estimate of the Jaccard similarity of the prompts'
                        character 3-gram sets (datasketch MinHash + LSH, 128 permutations)
    same answer key     a cached prompt only counts if its `ground_truth` and `data_source`
                        equal the new one's (templated prompts that differ in one number
                        are textually near-identical but have other answers)
    sample reward       a response identical to one the server scored gets that reward
                        (response_similarity 1.0); any other gets the cached prompt's mean
                        scored reward, its expected reward (response_similarity 0.0)

Text similarity says nothing about whether "41" or "42" is the right answer, so a
response that is not a repeat gets the expected value rather than a neighbour's reward:
repeats keep a learning signal (their GRPO advantage is right), the rest carry none.
A group whose best prompt similarity is below `floor` gets no cached reward (the caller
holds it until the server recovers).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from datasketch import MinHash, MinHashLSH

from steadyrl.model.similarity import NUM_PERM, minhash

# one cached prompt: (MinHash, answer_key, {response: reward}, mean reward, scorer)
_Entry = tuple[MinHash, tuple[Any, ...], dict[str, float], float, str]


@dataclass
class CachedScores:
    """Rewards for one group from the cache: (n,) rewards, each sample's response similarity
    (1.0: a repeat, its own reward; 0.0: the prompt's mean reward), the prompt similarity
    (0..1), and which scored prompt and scorer they came from."""

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
        # prompt_id -> (MinHash, answer_key, {response: reward}, mean reward, scorer)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, prompt_id: str, prompt: str, responses: list[str], rewards: list[float], scorer: str,
            answer_key: tuple[Any, ...] = ()) -> None:
        """Remember a group the server scored (a prompt seen again replaces its entry).
        `answer_key` (e.g. (data_source, ground_truth)) must match on lookup."""
        mh = minhash(prompt)
        with self._lock:
            if prompt_id in self._entries:
                self._lsh.remove(prompt_id)
                del self._entries[prompt_id]
            mean = sum(rewards) / len(rewards) if rewards else 0.0
            exact = {r: float(w) for r, w in reversed(list(zip(responses, rewards, strict=True)))}  # first scored wins
            self._entries[prompt_id] = (mh, tuple(answer_key), exact, mean, scorer)
            self._lsh.insert(prompt_id, mh)
            while len(self._entries) > self.capacity:
                old, _ = self._entries.popitem(last=False)
                self._lsh.remove(old)

    def lookup(self, prompt: str, responses: list[str], answer_key: tuple[Any, ...] = ()) -> CachedScores | None:
        """Rewards for `responses` from the most similar cached prompt with the same
        `answer_key`, or None when none reaches the floor."""
        mh, key = minhash(prompt), tuple(answer_key)
        with self._lock:
            best, best_sim = None, -1.0
            for pid in self._lsh.query(mh):
                entry = self._entries[pid]
                if entry[1] != key:
                    continue
                sim = mh.jaccard(entry[0])
                if sim > best_sim:
                    best, best_sim = pid, sim
            if best is None or best_sim < self.floor:
                return None
            _, _, exact, mean, scorer = self._entries[best]
        rewards = [exact.get(r, mean) for r in responses]
        sims = [1.0 if r in exact else 0.0 for r in responses]
        return CachedScores(rewards, sims, round(best_sim, 4), best, scorer)
