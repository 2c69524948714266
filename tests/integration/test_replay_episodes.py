"""`steadyrl replay --topic rl.episodes` against a real broker: each group's turns in order, from
its states on rl.episodes (read_committed: a state a killed worker's aborted transaction wrote is
never shown), with the finished group's last answers and rewards from rl.scored."""

from __future__ import annotations

import json
import time

from steadyrl.bus.topics import create_topics
from steadyrl.cli import main
from steadyrl.model import agents
from steadyrl.replay.episodes import read_episodes
from steadyrl.wire import codec
from steadyrl.wire.contracts import Prompt, RewardSource, ScoredGroup
from tests.helpers import unique_prefix


def _states(pid: str, question: str):
    """Turn 1 and turn 2 states of a 1-episode group (the environment answers "try again")."""
    p = Prompt(prompt_id=pid, epoch=0, index=0, n_samples=1, messages=[{"role": "user", "content": question}],
               run_id="r1")
    s = agents.start(p, [{"role": "user", "content": question}], [5, 6])
    out = []
    for turn, (answer, version) in enumerate((("4", 7), ("5", 8)), start=1):
        ep = s.episodes[0]
        agents.add_turn(ep, [10 + turn], [-0.5], answer, "stop", version)
        agents.add_observation(ep, [{"role": "user", "content": f"wrong, try again ({turn})"}], [20, 21])
        s.turn = turn
        out.append(s.model_copy(deep=True))
    return out


def test_replay_shows_an_episodes_turns_in_order_with_its_final_answer(bootstrap, tmp_path, capsys):
    from confluent_kafka import Producer

    prefix = unique_prefix()
    create_topics(bootstrap, prefix)
    base = int(time.time() * 1000) - 1   # the records' own times: the transaction markers' are the broker's
    a1, a2 = _states("a", "2+2?")
    (b1, _) = _states("b", "3+3?")
    ghost = a2.model_copy(deep=True)
    ghost.episodes[0].messages[-1].content = "a turn a killed worker never committed"
    final = agents.finished(a2)
    scored = ScoredGroup(group=final, rewards=[1.0], reward_source=RewardSource.rule, scorer="rule:t@1")
    p = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"replay-episodes-{prefix}"})
    p.init_transactions(30)
    for records, commit in (([("rl.episodes", a1), ("rl.episodes", b1)], True), ([("rl.episodes", ghost)], False),
                            ([("rl.episodes", a2), ("rl.scored", scored)], True)):
        p.begin_transaction()
        for topic, value in records:
            v, h = codec.encode(value)
            p.produce(f"{prefix}{topic}", v, key=value.prompt_id, headers=h)
        p.flush(10)
        p.commit_transaction(30) if commit else p.abort_transaction(30)
    end = int(time.time() * 1000) + 1000
    deadline = time.monotonic() + 30   # commit markers reach every partition a little after the commit
    while sum(len(v) for v in read_episodes(bootstrap, f"{prefix}rl.episodes", base, end).groups.values()) < 3:
        assert time.monotonic() < deadline, "the committed states never became visible"
        time.sleep(0.2)

    out_json = tmp_path / "a.json"
    common = ["replay", "--bootstrap", bootstrap, "--prefix", prefix, "--topic", "rl.episodes",
              "--from", str(base / 1000), "--to", str(end / 1000)]
    capsys.readouterr()
    assert main([*common, "--prompt", "a", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "== a " in out and "== b " not in out and "killed worker" not in out
    order = ["-- turn 1", "user: 2+2?", "assistant: 4", "user: wrong, try again (1)",
             "-- turn 2", "assistant: 5", "user: wrong, try again (2)", "-- finished", "reward 1"]
    at = [out.index(x) for x in order]
    assert at == sorted(at), out
    assert out.count("user: 2+2?") == 1          # turn 2 shows only what it added
    assert "versions [7, 8]" in out
    saved = json.loads(out_json.read_text())
    assert [r["state"]["turn"] for r in saved["a"]] == [1, 2]

    assert main([*common]) == 0                   # every group of the window
    assert "== b " in capsys.readouterr().out
    assert main([*common, "--prompt", "nope"]) == 1
    assert "no episode states" in capsys.readouterr().err
    assert main([*common, "--rescore", "tiny_copy"]) == 2
