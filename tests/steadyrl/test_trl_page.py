"""docs/trl.md's table names steadyrl keys that exist (a renamed key fails here, not a reader)."""

import re
import typing

from pydantic import BaseModel

from steadyrl.services.actor.config import ActorSection
from steadyrl.services.learner.config import LearnerSection
from tests.helpers import ROOT


def _model_of(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):   # X | None
        if (found := _model_of(arg)) is not None:
            return found
    return None


SECTIONS: dict[str, type[BaseModel]] = {"learner": LearnerSection, "actor": ActorSection}


def _exists(key: str) -> bool:
    section, *parts = key.split(".")
    model: type[BaseModel] | None = SECTIONS[section]
    for part in parts:
        if model is None or part not in model.model_fields:
            return False
        model = _model_of(model.model_fields[part].annotation)
    return True


def test_every_steadyrl_key_in_the_trl_table_exists():
    doc = (ROOT / "docs/trl.md").read_text()
    rows = [line.split("|")[2] for line in doc.splitlines() if line.startswith("| `")]
    keys = {k for cell in rows for k in re.findall(r"`((?:learner|actor)\.[a-z_.]+)", cell)}
    assert len(keys) >= 15, keys
    missing = sorted(k for k in keys if not _exists(k))
    assert not missing, missing
