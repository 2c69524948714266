"""The prompt gate: near-duplicate bursts spread out, exact cooldown and similarity thresholds,
the never-starve rule, restart, bad arguments. A fake clock; no broker."""

import json
import random
import string

import pytest
from prometheus_client import REGISTRY

from steadyrl.model.similarity import shingles
from steadyrl.services.learner.prompt_gate import PromptGate

QUESTION = ("A farmer has 17 sheep and buys 5 more every spring. Each sheep gives 3 kilograms of wool a "
            "year, sold at 12 dollars a kilogram at the market in town, where the farmer also sells honey "
            "from 4 hives and cheese made by a neighbour. Shearing costs 2 dollars per sheep, paid in cash "
            "before the wool is weighed, and the truck to the market burns fuel worth 30 dollars per trip. "
            "How many dollars does the wool bring in during the third year, before any costs? Reply with "
            "only the final number.")
# the same question up to whitespace, case or one word (3-gram Jaccard 0.97-1.0 with QUESTION)
DUPLICATES = [QUESTION, QUESTION.upper(), "  " + QUESTION.replace(" ", "\n\t "), QUESTION.lower(),
              QUESTION.replace("farmer has", "farmer owns"), QUESTION.replace("market in", "fair in"),
              QUESTION.replace("also sells", "sells"), QUESTION.replace("bring in", "earn"),
              QUESTION.replace("truck", "van"), QUESTION.replace("Each sheep", "Every sheep")]


def jaccard(a: str, b: str) -> float:
    sa, sb = shingles(a), shingles(b)
    return len(sa & sb) / len(sa | sb)


def noise(seed: int, n: int = 120) -> str:
    return "".join(random.Random(seed).choices(string.ascii_lowercase + " ", k=n))


class Clock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class Source:
    """The dataset order: a list of (epoch, index), then fresh distinct indexes forever."""

    def __init__(self, order, fresh_from: int = 10_000):
        self.order, self.pos, self.fresh_from = list(order), 0, fresh_from

    def __call__(self):
        self.pos += 1
        if self.pos <= len(self.order):
            return self.order[self.pos - 1]
        return 0, self.fresh_from + self.pos


def metric(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


def burst_texts(i: int) -> str:
    """Indexes 0..9: the near-duplicates; any other: a distinct random text."""
    return DUPLICATES[i] if i < 10 else noise(i)


def test_burst_of_near_duplicates_is_spread_out_by_the_cooldown():
    assert min(jaccard(QUESTION, d) for d in DUPLICATES) >= 0.97   # near-duplicates by construction
    assert max(jaccard(noise(a), noise(b)) for a in range(100, 130) for b in range(a + 1, 130)) < 0.3
    # 10 near-duplicates among 20 distinct prompts (every third one), then distinct ones forever
    order = [(0, k // 3) if k % 3 == 0 else (0, 100 + k) for k in range(30)]
    clock, src = Clock(), Source(order)
    gate = PromptGate(burst_texts, cooldown_s=1800, clock=clock)
    before = {m: metric(m) for m in ("steadyrl_feeder_prompts_deferred_total",
                                     "steadyrl_feeder_prompts_forced_total")}
    taken = []
    for _ in range(300):
        taken.append((clock.t, gate.take(src)))
        clock.t += 60
    distinct = [100 + k for k in range(30) if k % 3]
    assert len({gate.cluster_of(i) for i in range(10)}) == 1 and len({gate.cluster_of(i) for i in distinct}) == 20
    dup_times = [t for t, (_, i) in taken if i < 10]
    assert dup_times == [1800.0 * k for k in range(10)]                        # one per cooldown, exactly
    assert [i for _, (_, i) in taken if i < 10] == list(range(10))             # in their order
    assert [i for _, (_, i) in taken if 100 <= i < 130] == distinct           # not delayed
    pulled = [src.order[k] if k < 30 else (0, 10_001 + k) for k in range(src.pos)]
    items = [it for _, it in taken]
    assert len(set(items)) == len(items) and set(items) <= set(pulled)         # none twice, none invented
    assert set(pulled) - set(items) == {tuple(w) for w in gate.state()["waiting"]} == set()  # none dropped
    assert gate.deferred == 9 and gate.forced == 0
    assert metric("steadyrl_feeder_prompts_deferred_total") - before["steadyrl_feeder_prompts_deferred_total"] == 9
    assert metric("steadyrl_feeder_prompts_forced_total") == before["steadyrl_feeder_prompts_forced_total"]
    recent = [gate.cluster_of(i) for _, (_, i) in taken[-256:]]
    assert gate.diversity == pytest.approx(len(set(recent)) / 256) and gate.diversity < 1.0
    assert metric("steadyrl_feeder_prompt_diversity") == pytest.approx(gate.diversity)
    assert metric("steadyrl_feeder_prompts_waiting") == 0
    # without a cooldown the same order goes straight through: 3 takes between duplicates
    plain, src2 = PromptGate(burst_texts, cooldown_s=0, clock=Clock()), Source(order)
    assert [plain.take(src2) for _ in range(30)] == order


def test_cooldown_boundary_exactly_cooldown_passes_a_millisecond_less_defers():
    texts = {0: QUESTION, 1: QUESTION.upper(), 2: noise(2), 3: QUESTION.lower(), 4: noise(4)}
    clock = Clock(1000.0)
    gate = PromptGate(texts.__getitem__, cooldown_s=1800, clock=clock)
    assert gate.take(Source([(0, 0)])) == (0, 0)                     # cluster stamped at 1000
    clock.t = 1000 + 1800 - 0.001
    src = Source([(0, 1), (0, 2)])
    assert gate.take(src) == (0, 2) and gate.deferred == 1          # 1 799.999 s: still cooling
    clock.t = 1000 + 1800
    assert gate.take(Source([])) == (0, 1)                           # 1 800 s: the deferred one passes
    clock.t = 2800 + 1800
    assert gate.take(Source([(0, 3)])) == (0, 3) and gate.deferred == 1  # straight from the order
    clock.t = 4600 + 1800 - 0.001
    assert gate.take(Source([(0, 0), (0, 4)])) == (0, 4) and gate.deferred == 2


def test_never_starves_forcing_the_prompt_whose_cluster_was_sampled_longest_ago():
    texts = lambda i: QUESTION if i % 2 == 0 else noise(7)           # two clusters: even A, odd B
    # A0, B1, then B, A, B, A, ...
    order = [(0, 0), (0, 1)] + [(0, 3 + 4 * k if j == 0 else 2 + 4 * k) for k in range(20) for j in (0, 1)]
    clock, src = Clock(), Source(order)
    gate = PromptGate(texts, cooldown_s=1e6, max_deferred=4, clock=clock)
    before = metric("steadyrl_feeder_prompts_forced_total")
    taken, pulls = [], []
    for _ in range(8):
        pos = src.pos
        taken.append(gate.take(src)[1])
        pulls.append(src.pos - pos)
        assert len(gate.state()["waiting"]) <= 4
        clock.t += 60
    # take 3: waiting B3 A2 B7 A6, A was sampled at 0 and B at 60 -> A2 (not the first waiting)
    assert taken == [0, 1, 2, 3, 6, 7, 10, 11]
    assert pulls == [1, 1, 4, 1, 1, 1, 1, 1] and max(pulls) <= 4     # never blocks
    assert gate.forced == 6 and metric("steadyrl_feeder_prompts_forced_total") - before == 6
    assert gate.deferred == 9


@pytest.mark.parametrize("threshold", [0.8, 0.95])
def test_similarity_threshold_just_above_joins_just_below_does_not(threshold):
    base = noise(42, 300)

    def variant(target: float) -> tuple[str, float]:
        """base with its tail rewritten until the exact 3-gram Jaccard drops to target."""
        for m in range(1, 300):
            v = base[:-m] + noise(43, m)
            if jaccard(base, v) <= target:
                return v, jaccard(base, v)
        raise AssertionError(target)

    # MinHash (128 permutations) estimates Jaccard J with sd sqrt(J(1-J)/128) (0.035 at 0.8, 0.019 at
    # 0.95): the texts sit 2 sd above and below the threshold
    margin = 2 * (threshold * (1 - threshold) / 128) ** 0.5
    above, j_above = variant(threshold + margin)
    below, j_below = variant(threshold - margin)
    assert threshold + margin - 0.01 < j_above <= threshold + margin
    assert threshold - margin - 0.01 < j_below <= threshold - margin
    texts = [base, above, below]
    gate = PromptGate(texts.__getitem__, threshold=threshold)
    assert gate.cluster_of(0) == 0
    assert gate.cluster_of(1) == 0                                   # joins the representative's cluster
    assert gate.cluster_of(2) == 2                                   # forms its own


def test_state_restore_makes_the_same_next_decisions():
    texts = lambda i: DUPLICATES[i % 10] if i < 60 else noise(i % 5)  # one cluster of 60, five of 2
    order = [(e, i) for e in range(3) for i in random.Random(1).sample(range(70), 70)]
    clock, src = Clock(5000.0), Source(order)
    a = PromptGate(texts, cooldown_s=600, max_deferred=8, diversity_window=16, clock=clock)
    for _ in range(25):
        a.take(src)
        clock.t += 60
    saved = json.loads(json.dumps(a.state()))
    assert saved["waiting"] and saved["last"]                        # something to carry over
    assert len(saved["reps"]) + len(saved["members"]) == len({i for _, i in order[:src.pos]}) < 70  # int per index
    b = PromptGate(texts, cooldown_s=600, max_deferred=8, diversity_window=16, clock=clock)
    b.restore(saved)
    norm = lambda st: {**st, "last": sorted(st["last"])}
    assert norm(b.state()) == norm(a.state()) and b.diversity == a.diversity < 1.0
    src_b = Source(order)
    src_b.pos = src.pos                                              # the feeder's pull count
    for _ in range(150):
        assert a.take(src) == b.take(src_b)
        clock.t += 60
    assert norm(a.state()) == norm(b.state()) and a.diversity == b.diversity and src.pos == src_b.pos
    # another threshold: clusters are formed afresh, waiting prompts survive
    c = PromptGate(texts, threshold=0.99, clock=clock)
    c.restore(saved)
    assert c.state()["waiting"] == saved["waiting"] and c.state()["reps"] == []


@pytest.mark.parametrize("kwargs,name", [({"cooldown_s": -1}, "cooldown_s"), ({"threshold": 0}, "threshold"),
                                         ({"threshold": 1.01}, "threshold"), ({"max_deferred": 0}, "max_deferred"),
                                         ({"diversity_window": 0}, "diversity_window")])
def test_bad_arguments_raise_naming_the_field(kwargs, name):
    with pytest.raises(ValueError, match=name):
        PromptGate(str, **kwargs)


def test_threshold_one_and_zero_cooldown_are_valid():
    gate = PromptGate(lambda i: QUESTION if i < 2 else QUESTION + " Show your work.", threshold=1.0, cooldown_s=0)
    assert gate.cluster_of(0) == gate.cluster_of(1) == 0 and gate.cluster_of(2) == 2
