"""The actor's HTTP API: `POST /generate`.

    POST /generate  {"prompts": [{"messages": [...]} | {"prompt_ids": [...]}], "n": 4, ...}
      -> {"policy_version": 3, "engine": "torch", "prompt_ids": [[...], ...],
          "completions": [[{token_ids, logprobs, text, finish_reason}, ...], ...]}

Every response names the policy_version that generated it. Errors (`detail` says which limit):

- 401 (`WWW-Authenticate: Bearer`): `http_token_file` is set and the call has no
  `Authorization: Bearer <token>` (the probes and /metrics stay open).
- 408: the body took longer than `body_timeout_s` to arrive; 413: it is above `max_body_bytes`.
- 422: `max_new_tokens` above `max_new_tokens_limit`, prompts x n above `max_sequences`, a
  token id outside the vocabulary, a prompt (its ids, or its chat template tokenized) above
  `max_prompt_tokens`, prompt + max_new_tokens beyond the model's context
  (`max_position_embeddings`), or log-probs that are not all finite (NaN or infinity: an extreme
  temperature; the same request fails the same way). Counted in
  `steadyrl_actor_requests_refused_total{reason}`.
- 503 with Retry-After: `max_concurrent` calls in progress (steadyrl/http.py `add_work_route`:
  the probes never wait behind /generate); the model not built or the policy not caught up
  yet; a dead vLLM engine (the actor exits to be restarted).
- 503 / 409: the version gate (gate.py) for a call naming `run_id` and `min_policy_version`;
  a call the version being loaded would serve waits for it, at most LOADING_WAIT_S.

Each prompt may carry its own sampling `seed` (reproducible samples, see generation.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, HTTPException
from prometheus_client import Counter, Histogram
from pydantic import BaseModel, Field, model_validator

from steadyrl.http import add_work_route
from steadyrl.local.limits import MAX_SAMPLES_PER_PROMPT
from steadyrl.model.data import PromptRow
from steadyrl.rl.generation import Completion, SamplingParams

from . import gate
from .config import ActorSection
from .follower import ServedVersion
from .model import ServedModel
from .vllm_engine import EngineDead

GEN_SECONDS = Histogram("steadyrl_actor_generate_seconds", "Time of one /generate call",
                        buckets=(0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300))
GEN_TOKENS = Counter("steadyrl_actor_generated_tokens", "Completion tokens generated")
#: Longest a /generate call waits for the version gate to settle (seconds).
LOADING_WAIT_S = 30.0
REFUSED_REASONS = ("max_new_tokens", "max_sequences", "token_ids", "prompt_tokens", "context", "non_finite")
REFUSED = Counter("steadyrl_actor_requests_refused", "/generate calls refused with 422", ["reason"])
for _r in REFUSED_REASONS:
    REFUSED.labels(_r)


class PromptIn(BaseModel):
    messages: list[dict[str, str]] | None = None
    prompt_ids: list[int] | None = None
    seed: int | None = Field(None, ge=0, description="Sampling seed of this prompt's completions.")

    @model_validator(mode="after")
    def _one_of(self) -> PromptIn:
        if (self.messages is None) == (self.prompt_ids is None):
            raise ValueError("give exactly one of messages or prompt_ids")
        return self


class GenerateRequest(BaseModel):
    prompts: list[PromptIn] = Field(min_length=1)
    n: int = Field(1, ge=1, le=MAX_SAMPLES_PER_PROMPT)
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(64, ge=1)
    seed: int | None = Field(None, ge=0, description="Seed of prompts without their own.")
    run_id: str = Field("", description="Learner run the prompts belong to ('' = any).")
    min_policy_version: int = Field(0, ge=0, description="Oldest version of run_id acceptable.")


def refuse(reason: str, detail: str) -> None:
    """Count a refused /generate call (`reason`: one of REFUSED_REASONS) and raise its 422."""
    REFUSED.labels(reason).inc()
    raise HTTPException(422, detail)


class Generation:
    """The work of one /generate call on `model`, at the version `served` holds, within the
    limits of `section`."""

    def __init__(self, section: ActorSection, model: ServedModel, served: ServedVersion):
        self.section, self.model, self.served = section, model, served

    def __call__(self, req: GenerateRequest) -> dict[str, Any]:
        """The /generate answer. Raises HTTPException: 422 (a limit, a bad token id, non-finite
        log-probs), 503 or 409 (the version gate), 503 (a dead engine)."""
        ids = self.prompt_ids(req)
        params = SamplingParams(n=req.n, temperature=req.temperature, top_p=req.top_p,
                                max_new_tokens=req.max_new_tokens, seed=req.seed)
        seeds = [p.seed for p in req.prompts]
        wanted = gate.Wanted(req.run_id, req.min_policy_version, since=time.monotonic())
        settled = self.served.wait_settled(wanted, LOADING_WAIT_S)
        t0 = time.perf_counter()
        with self.model.swap.shared(), self.model.serial:
            now = self.served.snapshot()
            d = gate.verdict(now, wanted, settled)
            if d is not gate.Decision.SERVE:
                raise HTTPException(gate.STATUS[d], gate.explain(d, now, wanted))
            try:
                out = self.model.gen.generate(ids, params, seeds=seeds)
            except EngineDead as e:   # the follower sees it too and ends the process
                raise HTTPException(503, f"{e}; the actor exits and is restarted",
                                    headers={"Retry-After": "5"}) from e
        GEN_SECONDS.observe(time.perf_counter() - t0)
        GEN_TOKENS.inc(sum(len(c.token_ids) for g in out for c in g))
        check_finite(out, req.temperature)
        return {"policy_version": now.version, "engine": self.model.backend, "prompt_ids": ids,
                "completions": [[c.__dict__ for c in g] for g in out]}

    def prompt_ids(self, req: GenerateRequest) -> list[list[int]]:
        """Each prompt's token ids (chat messages through the chat template), within the limits;
        422 (`refuse`) otherwise."""
        a = self.section
        if req.max_new_tokens > a.max_new_tokens_limit:
            refuse("max_new_tokens", f"max_new_tokens {req.max_new_tokens} > limit {a.max_new_tokens_limit}")
        if len(req.prompts) * req.n > a.max_sequences:
            refuse("max_sequences", f"{len(req.prompts)} prompts x n={req.n} > max_sequences {a.max_sequences}")
        tok = self.model.tok
        ids: list[list[int]] = []
        for i, p in enumerate(req.prompts):
            if p.prompt_ids is not None:
                if any(t < 0 or t >= len(tok) for t in p.prompt_ids):
                    refuse("token_ids", f"prompt_ids must be in [0, {len(tok)})")
                ids.append(p.prompt_ids)
            else:
                # heavy: steadyrl.rl.loop brings the trainer (torch.distributed and all) into the actor
                from steadyrl.model.data import encode_prompt  # lazy: heavy (the trainer); chat prompts only

                assert p.messages is not None  # PromptIn: exactly one of messages and prompt_ids
                ids.append(encode_prompt(tok, PromptRow(messages=p.messages, ground_truth="")))
            self.check_length(i, len(ids[-1]), req.max_new_tokens)
        return ids

    def check_length(self, i: int, tokens: int, max_new_tokens: int) -> None:
        """422 if prompt i (`tokens` long) is over max_prompt_tokens or does not fit the context."""
        limit = self.section.max_prompt_tokens
        if tokens > limit:
            refuse("prompt_tokens", f"prompt {i} has {tokens} tokens > max_prompt_tokens {limit}")
        context = self.model.context
        if context is not None and tokens + max_new_tokens > context:
            refuse("context", f"prompt {i}: {tokens} tokens + max_new_tokens {max_new_tokens} = "
                              f"{tokens + max_new_tokens} > the model's context {context} "
                              f"(max_position_embeddings)")


def check_finite(out: list[list[Completion]], temperature: float) -> None:
    """422 if any log-prob of the completions `out` is NaN or infinite (JSON has no such number,
    and the learner must not train on it); names how many completions and the first one."""
    bad = [(i, j, next(x for x in c.logprobs if not math.isfinite(x)))
           for i, group in enumerate(out) for j, c in enumerate(group)
           if not all(math.isfinite(x) for x in c.logprobs)]
    if bad:
        i, j, x = bad[0]
        total = sum(len(g) for g in out)
        refuse("non_finite", f"generation produced non-finite log-probs in {len(bad)} of {total} completions "
                             f"(first: prompt {i} sample {j}, {x}) at temperature {temperature:g}; "
                             f"the same request fails the same way")


def add_routes(app: FastAPI, section: ActorSection, get: Callable[[], Generation | None],
               token: str | None = None) -> None:
    """`POST /generate` on `app`, answered by `get()` once it is built and its policy caught up
    (503 with Retry-After before), with the section's body, time and concurrency limits."""
    def generate(req: GenerateRequest) -> dict[str, Any]:
        work = get()
        if work is None or not work.served.caught_up:
            raise HTTPException(503, "model loading or policy not caught up yet", headers={"Retry-After": "1"})
        return work(req)

    add_work_route(app, "/generate", GenerateRequest, generate, max_concurrent=section.max_concurrent,
                   max_body_bytes=section.max_body_bytes, body_timeout_s=section.body_timeout_s, token=token)
