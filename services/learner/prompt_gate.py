"""Prompt gate (learner's feeder): near-duplicate prompts are spread out in time, never dropped.

Clusters. A prompt's text (the learner passes the joined message contents of its dataset
row) is a set of character 3-grams (`steadyrl.model.similarity`: lower-cased, whitespace
collapsed), summarised by a 128-permutation MinHash. A prompt joins the cluster of the most
similar representative whose MinHash estimate of the Jaccard similarity is >= `threshold`
(ties: the smaller key), else it forms a new cluster and becomes its representative; the
cluster key is the representative's dataset index. Candidates come from a datasketch
MinHashLSH built at threshold - 0.1 (recall >= 99 % at the default 0.95), each checked by its
estimate. The cluster of a dataset index is computed once and cached: epochs repeat the same
indexes.

Rules, per prompt taken (`take`), with now = clock() (wall seconds):

    1. the oldest waiting (deferred) prompt whose cluster has cooled is taken; a cluster
       has cooled when it was last sampled >= `cooldown_s` ago (exactly cooldown_s passes)
       or never;
    2. else the next prompt of the dataset order is pulled: a cool one is taken, one whose
       cluster is cooling is deferred (kept, in order; `..._prompts_deferred_total`);
    3. never starve: once `max_deferred` prompts wait and none has cooled, the waiting
       prompt whose cluster was sampled longest ago is taken (`..._prompts_forced_total`).
       `take` never blocks and calls `pull` at most `max_deferred` times.

Taking a prompt stamps its cluster with now. Every pulled prompt is taken exactly once.
Defaults: cooldown_s 1800 (30 min), threshold 0.95, max_deferred 64, diversity_window 256.

Why 0.95. Measured on data/arithmetic/train.parquet (1 500 templated rows, 1 477 distinct
texts after normalisation; the clusters this module forms):

    threshold   clusters   largest   rows whose cluster holds another question
    0.7           245        160     1 383 (92 %)
    0.8           612        129     1 058 (71 %)
    0.9         1 204         11       436 (29 %)
    0.95        1 446          3        60 (4.0 %)
    0.97        1 476          2         2 (0.1 %)

Character 3-grams cannot tell a changed number from a changed word: in these ~65-character
prompts one digit changed or added gives Jaccard 0.90-0.95 (another question), one word
changed 0.79-0.84. Same text up to whitespace and case is Jaccard 1.0 (always one cluster);
in prompts of ~200-350 characters (GSM8K-like) one word changed gives 0.95-0.975. So 0.95
groups repeats and one-word edits of longer prompts while 96 % of this templated set's rows
stay in clusters of their own question (a wrong merge delays a prompt by at most
cooldown_s, it loses none); at 0.8 most rows share a cluster with other questions and would
be deferred for nothing. MinHash is an estimate (standard deviation ~0.02 at Jaccard 0.95
with 128 permutations): pairs within a few points of the threshold may go either way,
deterministically (seed 1). Cost: ~0.3 ms per new dataset index (MinHash ~0.25 ms, LSH and
checks ~0.04 ms), ~0.2 us for an index seen before.

Metrics: steadyrl_feeder_prompt_clusters (clusters seen), steadyrl_feeder_prompts_waiting
(deferred now), steadyrl_feeder_prompts_deferred_total, steadyrl_feeder_prompts_forced_total,
steadyrl_feeder_prompt_diversity (distinct clusters / prompts among the last
diversity_window taken; 1.0 = all different).

Restart. `state()` is JSON-able and small (one int per dataset index seen, one time per
cluster sampled within the cooldown, the waiting prompts and the recent cluster keys);
`restore()` makes the same next decisions. The LSH is rebuilt from the representatives'
texts when the next unseen index needs it (~0.25 ms per cluster).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from datasketch import MinHash, MinHashLSH
from prometheus_client import Counter, Gauge
from pydantic import BaseModel, ConfigDict, Field

from steadyrl.model.similarity import NUM_PERM, minhash

CLUSTERS = Gauge("steadyrl_feeder_prompt_clusters", "Prompt clusters (near-duplicate groups) seen by the prompt gate")
WAITING = Gauge("steadyrl_feeder_prompts_waiting", "Prompts deferred by the prompt gate and not yet taken")
DEFERRED = Counter("steadyrl_feeder_prompts_deferred", "Prompts deferred because their cluster was cooling")
FORCED = Counter("steadyrl_feeder_prompts_forced", "Prompts taken while their cluster was cooling "
                 "(max_deferred waiting, none cool)")
DIVERSITY = Gauge("steadyrl_feeder_prompt_diversity", "Distinct clusters / prompts among the recent prompts taken "
                  "(1.0 = all different)")


class PromptGateConfig(BaseModel):
    """`learner.prompt_gate`: the PromptGate's arguments (cooldown_s 0: the gate defers nothing)."""

    model_config = ConfigDict(extra="forbid")

    cooldown_s: float = Field(1800.0, ge=0, description="Seconds a near-duplicate cluster cools after one of its "
                                                        "prompts is published (0: off).")
    threshold: float = Field(0.95, gt=0, le=1, description="Jaccard similarity (character 3-grams, MinHash) from "
                                                           "which two prompts are one cluster.")
    max_deferred: int = Field(64, ge=1, description="Prompts kept waiting before the longest-cooled one is forced.")
    diversity_window: int = Field(256, ge=1, description="Recent prompts the diversity figure covers.")


class PromptGate:
    """Near-duplicate cooldown over a dataset order (see the module doc).

    Args:
        text_of: dataset index -> the prompt's text.
        cooldown_s: seconds a cluster stays cooling after one of its prompts is taken (>= 0;
            0 defers nothing).
        threshold: Jaccard similarity (MinHash estimate, in (0, 1]) from which two prompts
            are one cluster.
        max_deferred: prompts kept waiting at most (>= 1) before one is forced.
        diversity_window: prompts taken that the diversity figure covers (>= 1).
        clock: wall time in seconds (time.time; a fake one in tests).

    Raises ValueError naming the argument that is out of range.
    """

    def __init__(self, text_of: Callable[[int], str], cooldown_s: float = 1800.0, threshold: float = 0.95,
                 max_deferred: int = 64, diversity_window: int = 256, clock: Callable[[], float] = time.time):
        for name, value, ok, want in (("cooldown_s", cooldown_s, cooldown_s >= 0, ">= 0"),
                                      ("threshold", threshold, 0 < threshold <= 1, "in (0, 1]"),
                                      ("max_deferred", max_deferred, max_deferred >= 1, ">= 1"),
                                      ("diversity_window", diversity_window, diversity_window >= 1, ">= 1")):
            if not ok:
                raise ValueError(f"prompt gate: {name} must be {want}, got {value!r}")
        self.text_of, self.cooldown_s, self.threshold = text_of, float(cooldown_s), float(threshold)
        self.max_deferred, self.clock = max_deferred, clock
        self.deferred = self.forced = 0                  # counts since the run started (kept by state())
        self._cluster: dict[int, int] = {}               # dataset index -> cluster key (representative index)
        self._reps: dict[int, MinHash | None] = {}       # representative -> MinHash (None: not yet recomputed)
        self._lsh: MinHashLSH | None = None              # None: rebuild from _reps when next needed
        self._last: dict[int, float] = {}                # cluster key -> clock() when last taken
        self._waiting: list[tuple[int, int]] = []        # deferred (epoch, index), oldest first
        self._recent: deque[int] = deque(maxlen=diversity_window)  # cluster keys of the last prompts taken

    # ---- clusters -----------------------------------------------------------------------
    def cluster_of(self, index: int) -> int:
        """The cluster key (a representative's dataset index) of dataset row `index`."""
        if index in self._cluster:
            return self._cluster[index]
        if self._lsh is None:
            self._lsh = MinHashLSH(threshold=min(max(self.threshold - 0.1, 0.05), 0.98), num_perm=NUM_PERM)
            for rep, mh in self._reps.items():
                if mh is None:
                    self._reps[rep] = mh = minhash(self.text_of(rep))
                self._lsh.insert(rep, mh)
        mh = minhash(self.text_of(index))
        scored = [(mh.jaccard(self._reps[r]), -r) for r in self._lsh.query(mh)]
        sim, neg_key = max(scored, default=(0.0, 0))
        if sim >= self.threshold:
            key = -neg_key
        else:
            key = index
            self._reps[index] = mh
            self._lsh.insert(index, mh)
            CLUSTERS.set(len(self._reps))
        self._cluster[index] = key
        return key

    def _cooling(self, key: int, now: float) -> bool:
        return key in self._last and now - self._last[key] < self.cooldown_s

    # ---- the rules ----------------------------------------------------------------------
    def take(self, pull: Callable[[], tuple[int, int]]) -> tuple[int, int]:
        """The next (epoch, index) to publish, by the rules of the module doc.

        `pull()` returns the next (epoch, index) of the dataset order; it is called 0 to
        max_deferred times (the caller counts the pulls: waiting prompts are pulled, not yet
        taken). Errors from `pull` and `text_of` propagate; prompts pulled before the error
        wait, none is lost.
        """
        if self.cooldown_s == 0 and not self._waiting:  # the gate is off: no clustering, no state
            return pull()
        now = self.clock()                                                   # rule 1
        pick = next((p for p, (_, i) in enumerate(self._waiting) if not self._cooling(self.cluster_of(i), now)), None)
        while pick is None and len(self._waiting) < self.max_deferred:       # rule 2
            epoch, index = pull()
            if not self._cooling(self.cluster_of(index), now):
                return self._stamp((epoch, index), now)
            self._waiting.append((epoch, index))
            self.deferred += 1
            DEFERRED.inc()
        if pick is None:                                                     # rule 3
            pick = min(range(len(self._waiting)),
                       key=lambda p: (self._last[self.cluster_of(self._waiting[p][1])], p))
            self.forced += 1
            FORCED.inc()
        return self._stamp(self._waiting.pop(pick), now)

    def _stamp(self, item: tuple[int, int], now: float) -> tuple[int, int]:
        key = self.cluster_of(item[1])
        self._last[key] = now
        self._recent.append(key)
        self._export()
        return item

    @property
    def diversity(self) -> float:
        """Distinct clusters / prompts among the last diversity_window taken (1.0 when none)."""
        return len(set(self._recent)) / len(self._recent) if self._recent else 1.0

    def _export(self) -> None:
        WAITING.set(len(self._waiting))
        DIVERSITY.set(self.diversity)
        CLUSTERS.set(len(self._reps))

    # ---- restart ------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """JSON-able state: threshold, representatives in creation order, [index, key] of
        the other indexes seen, [key, time] of clusters still cooling, waiting [epoch, index],
        recent cluster keys, and the deferred/forced counts."""
        now = self.clock()
        return {"threshold": self.threshold, "reps": list(self._reps),
                "members": [[i, k] for i, k in self._cluster.items() if i != k],
                "last": [[k, t] for k, t in self._last.items() if self._cooling(k, now)],
                "waiting": [list(w) for w in self._waiting], "recent": list(self._recent),
                "deferred": self.deferred, "forced": self.forced}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from `state()` of an earlier gate. State from a gate with another
        threshold keeps only its waiting prompts and counts (clusters are formed afresh).
        Raises KeyError for a state without those fields."""
        self._waiting = [(int(e), int(i)) for e, i in state["waiting"]]
        self.deferred, self.forced = int(state["deferred"]), int(state["forced"])
        self._cluster, self._reps, self._lsh, self._last = {}, {}, None, {}
        self._recent.clear()
        if float(state.get("threshold", -1)) == self.threshold:
            self._reps = {int(r): None for r in state["reps"]}       # MinHashes recomputed when needed
            self._cluster = {r: r for r in self._reps}
            self._cluster.update((int(i), int(k)) for i, k in state["members"])
            self._last = {int(k): float(t) for k, t in state["last"]}
            self._recent.extend(int(k) for k in state["recent"])
        self._export()
