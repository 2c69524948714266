"""JSON Schema files in `schemas/` (shipped as steadyrl/assets/schemas), generated from the
contracts and checked against them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from steadyrl.assets import asset_dir
from steadyrl.wire.contracts import ALL_CONTRACTS, Contract

SCHEMA_DIR = asset_dir("schemas")


def schema_path(c: type[Contract]) -> Path:
    """`schemas/<name>.v<MAJOR>.schema.json`."""
    return SCHEMA_DIR / f"{c.SCHEMA_NAME}.v{c.major()}.schema.json"


def json_schema(c: type[Contract]) -> dict[str, Any]:
    """The model's JSON Schema with `$id` and `x-schema-version` (the full MAJOR.MINOR)."""
    s = c.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": c.schema_header(),
            "x-schema-version": c.SCHEMA_VERSION, **s}


def _render(c: type[Contract]) -> str:
    return json.dumps(json_schema(c), indent=2, sort_keys=True) + "\n"


def export_schemas() -> list[Path]:
    """Write every contract's schema file; returns the paths."""
    out = []
    for c in ALL_CONTRACTS:
        p = schema_path(c)
        p.write_text(_render(c))
        out.append(p)
    return out


def check_schemas() -> list[str]:
    """Differences between the checked-in files and the models (empty when they agree)."""
    problems = []
    for c in ALL_CONTRACTS:
        p = schema_path(c)
        if not p.exists():
            problems.append(f"{p.name}: missing (run `steadyrl schemas export`)")
        elif p.read_text() != _render(c):
            problems.append(f"{p.name}: differs from {c.__name__} (run `steadyrl schemas export` and review)")
    return problems
