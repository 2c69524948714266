"""examples/agents/guess.py, the tiny two-turn environment, through the rollout worker's episode
handler (the actor is an httpx.MockTransport; it learns through every service in
tests/integration/test_up_agents.py)."""

from steadyrl.model import agents
from steadyrl.model.models import tiny_tokenizer
from steadyrl.services.rollout.episodes import make_episode_handler
from steadyrl.wire.contracts import Prompt, RolloutGroup
from tests.helpers import ROOT
from tests.steadyrl.test_agents import FakeActor, _runner

GUESS = agents.load_env(str(ROOT / "examples" / "agents" / "guess.py") + ":Guess")


def _episode(truth: str, answer: str) -> tuple[RolloutGroup, FakeActor, list[str]]:
    tok = tiny_tokenizer()
    actor = FakeActor(tok, tok.encode(answer, add_special_tokens=False), [-0.5] * len(answer))
    handle = make_episode_handler(_runner(tok, actor, GUESS, max_turns=4))
    record = Prompt(prompt_id="r/e0-i0", epoch=0, index=0, n_samples=2, messages=[{"role": "user", "content": truth}],
                    ground_truth=truth, seed=11, max_new_tokens=4)
    topics = []
    while not isinstance(record, RolloutGroup):
        [[out]] = handle([(record, None)])
        topics.append(out.topic)
        record = out.value
    return record, actor, topics


def test_the_digit_is_only_in_the_environments_message_and_the_second_answer_ends_it():
    tok = tiny_tokenizer()
    g, actor, topics = _episode("3", "7777")
    assert topics == ["rl.episodes", "rl.rollouts"]   # two turns, under max_turns 4
    assert g.prompt_token_ids == tok.encode("?:", add_special_tokens=False)   # the first turn hides it
    assert tok.decode(actor.sent[1][0]) == "?:7777" + "3333:"                 # the second sees it
    for s in g.samples:
        assert s.loss_mask == [1] * 4 + [0] * 5 + [1] * 4 and s.text == "7777"


def test_a_right_first_guess_does_not_end_the_episode():
    g, _, topics = _episode("7", "7777")
    assert topics == ["rl.episodes", "rl.rollouts"] and all(len(s.turn_versions) == 2 for s in g.samples)
