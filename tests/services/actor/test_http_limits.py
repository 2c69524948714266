"""The actor's POST /generate over real HTTP on 127.0.0.1 (the app run_service builds): probes
that a flood of slow calls cannot starve, and the body, concurrency, prompt and finiteness limits."""

import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from steadyrl.http import Health, HealthServer, make_app
from steadyrl.services.actor import routes
from steadyrl.services.actor.config import ActorSection
from steadyrl.services.actor.follower import ServedVersion
from steadyrl.services.actor.model import ServedModel
from steadyrl.services.actor.routes import Generation, add_routes
from tests.helpers import in_flight, probes_while_held


def _serve(section: ActorSection, gate: threading.Event | None = None):
    """An actor on the tiny model, caught up, served like run_service does; with `gate`, each
    generation waits for it inside the actor's lock, as a real generation holds it."""
    model = ServedModel(section)
    served = ServedVersion(model, section.policy_root)
    served.caught_up = True
    if gate is not None:
        real = model.gen.generate

        def held(*args, **kwargs):
            gate.wait(60)
            return real(*args, **kwargs)

        model.gen.generate = held
    health = Health()
    health.beat()
    health.add_check("policy", lambda: (served.caught_up, f"version {served.version}"))
    app = make_app("actor", health)
    work = Generation(section, model, served)
    add_routes(app, section, lambda: work)
    return work, HealthServer(app).start()


BODY = {"prompts": [{"prompt_ids": [5, 6, 7]}], "n": 2, "max_new_tokens": 3, "temperature": 1.0, "seed": 1}


@pytest.mark.parametrize("max_concurrent", [16, 64])
def test_probes_answer_under_sixty_generate_calls_in_progress(tmp_path, max_concurrent):
    """60 concurrent /generate calls, held in the actor's lock until the probes have answered
    (bound by calls, not timing). At max_concurrent 16 the calls past it get 503 + Retry-After at
    once; at 64 all 60 hold a thread (the old design ran out of its 40 at this point). Either way
    /livez and /readyz keep answering."""
    gate = threading.Event()
    _, server = _serve(ActorSection(model="tiny", policy_root=tmp_path, max_concurrent=max_concurrent), gate)
    # One client for the flood: 60 httpx.post calls would each build an SSL context, and those
    # threads share this process's GIL with the server and the probing thread.
    flood = httpx.Client(limits=httpx.Limits(max_connections=100), timeout=120)
    holding = min(60, max_concurrent)
    try:
        with ThreadPoolExecutor(60) as pool:
            calls = [pool.submit(flood.post, f"{server.url}/generate", json=BODY) for _ in range(60)]
            try:
                lat = probes_while_held(server.url, lambda: in_flight("/generate") == holding
                                        and sum(c.done() for c in calls) == 60 - holding)
            finally:
                gate.set()
            answers = [c.result() for c in calls]
    finally:
        gate.set()
        flood.close()
        server.stop()
    codes = sorted(r.status_code for r in answers)
    assert codes.count(200) == holding and codes.count(503) == 60 - holding, codes
    for r in answers:
        if r.status_code == 503:
            assert r.headers["retry-after"] == "1" and f"max_concurrent {max_concurrent}" in r.json()["detail"]
        else:
            assert [len(g) for g in r.json()["completions"]] == [2]
    print(f"max_concurrent {max_concurrent}: {codes.count(200)} x 200, {codes.count(503)} x 503; " + ", ".join(  # noqa: T201
        f"{p} n={len(s)} max {max(s) * 1000:.1f} ms" for p, s in lat.items()))


@pytest.fixture
def served(tmp_path):
    work, server = _serve(ActorSection(model="tiny", policy_root=tmp_path, max_body_bytes=4096,
                                       max_prompt_tokens=32))
    yield work, server.url
    server.stop()


def test_an_oversize_body_is_413_naming_the_limit(served):
    _, url = served
    r = httpx.post(f"{url}/generate", json={**BODY, "prompts": [{"prompt_ids": [5] * 3000}]})
    assert r.status_code == 413 and r.json()["detail"] == "body above max_body_bytes 4096"
    assert httpx.post(f"{url}/generate", json=BODY).status_code == 200


def test_a_prompt_over_max_prompt_tokens_is_422_ids_or_chat(served):
    _, url = served
    r = httpx.post(f"{url}/generate", json={**BODY, "prompts": [{"prompt_ids": [5, 6]}, {"prompt_ids": [5] * 33}]})
    assert r.status_code == 422 and r.json()["detail"] == "prompt 1 has 33 tokens > max_prompt_tokens 32"
    chat = [{"messages": [{"role": "user", "content": "7" * 40}]}]  # the tiny tokenizer: a token a character
    r = httpx.post(f"{url}/generate", json={**BODY, "prompts": chat})
    assert r.status_code == 422 and r.json()["detail"] == "prompt 0 has 41 tokens > max_prompt_tokens 32"
    assert httpx.post(f"{url}/generate", json={**BODY, "prompts": [{"prompt_ids": [5] * 32}]}).status_code == 200


def test_prompt_and_max_new_tokens_must_fit_the_models_context(served):
    work, url = served
    assert work.model.context == 128  # the tiny model's max_position_embeddings
    r = httpx.post(f"{url}/generate", json={**BODY, "prompts": [{"prompt_ids": [5] * 30}], "max_new_tokens": 99})
    assert r.status_code == 422
    assert r.json()["detail"] == ("prompt 0: 30 tokens + max_new_tokens 99 = 129 > the model's context 128 "
                                  "(max_position_embeddings)")
    r = httpx.post(f"{url}/generate", json={**BODY, "prompts": [{"prompt_ids": [5] * 30}], "max_new_tokens": 98})
    assert r.status_code == 200, r.text


def test_non_finite_log_probs_are_422_not_500(served):
    """At temperature 1e-45 logits / T overflow and the sampling distribution is NaN."""
    _, url = served
    r = httpx.post(f"{url}/generate", json={**BODY, "temperature": 1e-45})
    assert r.status_code == 422, r.text
    # the drawn token's logit minus logsumexp: inf - inf (nan) or -inf - inf (-inf)
    assert re.match(r"generation produced non-finite log-probs in 2 of 2 completions \(first: prompt 0 "
                    r"sample 0, (nan|-inf)\) at temperature 1e-45", r.json()["detail"]), r.text
    assert httpx.post(f"{url}/generate", json=BODY).status_code == 200  # and it serves on


def test_anything_else_it_cannot_send_as_json_is_422(served, monkeypatch):
    from steadyrl.rl.generation import Completion

    work, url = served
    monkeypatch.setattr(routes, "check_finite", lambda out, t: None)  # the route's own net catches it
    monkeypatch.setattr(work.model.gen, "generate", lambda ids, params, seeds: [[Completion([5], [float("inf")], "x",
                                                                                        "length")]])
    r = httpx.post(f"{url}/generate", json={**BODY, "n": 1})
    assert r.status_code == 422 and "cannot be sent as finite JSON" in r.json()["detail"]


def test_before_the_policy_is_caught_up_it_is_503_with_retry_after(served):
    work, url = served
    work.served.caught_up = False
    r = httpx.post(f"{url}/generate", json=BODY)
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and "not caught up" in r.json()["detail"]
