"""Builders of configs and key records for unit tests, shared so that each test says only what is
special about its case: every field a test does not name keeps a default that validates.

The ``*_doc`` builders return the raw documents (what a config file's ``args`` holds), for tests
of validation and its messages; the others return the validated models. Either kind may be
nested in the other (``app_config(model(id="a"), tiers={"p": tier(priority=0)})``): pydantic takes
a model where its document is expected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from serve_app.config import AppConfig, KeyRecord, ModelConfig, TierConfig

ROOT = Path(__file__).resolve().parents[2]
# A well-formed digest of no secret: tests that never authenticate a request need no real one.
DIGEST = "sha256:" + "0" * 64


def model_doc(id: str = "m", source: str = "builtin:tiny-chat", **over: Any) -> dict[str, Any]:
    """One ``models[]`` entry: a generate model with every setting at its default but ``over``."""
    return {"id": id, "source": source, **over}


def model(id: str = "m", source: str = "builtin:tiny-chat", **over: Any) -> ModelConfig:
    """A validated ``ModelConfig`` (see ``model_doc``)."""
    return ModelConfig.model_validate(model_doc(id, source, **over))


def app_doc(*models: dict[str, Any] | ModelConfig, **over: Any) -> dict[str, Any]:
    """An ``args`` block: the given models (one default ``model_doc()`` if none) and the top-level
    fields in ``over`` (``gateway``, ``tiers``, ``default_tier``, ``routes``...). Nothing is
    inferred: tiers without a 'standard' one need their ``default_tier`` named."""
    return {"models": list(models) or [model_doc()], **over}


def app_config(*models: dict[str, Any] | ModelConfig, **over: Any) -> AppConfig:
    """A validated ``AppConfig`` (see ``app_doc``)."""
    return AppConfig.model_validate(app_doc(*models, **over))


def tier(priority: int = 0, **over: Any) -> TierConfig:
    """A validated ``TierConfig``: ``priority`` and ``over`` (``shed_at``, ``limits``...)."""
    return TierConfig.model_validate({"priority": priority, **over})


def key_record(id: str = "k", **over: Any) -> KeyRecord:
    """A client key of the 'standard' tier for every model, with ``DIGEST`` unless ``over`` gives
    one; ``over`` may hold documents (``budget={"tokens": 10}``), which are validated."""
    return KeyRecord.model_validate({"id": id, "digest": DIGEST, **over})


def shipped_args(name: str = "local") -> dict[str, Any]:
    """The ``args`` block of ``configs/<name>.yaml``, read afresh: a test may edit it."""
    doc = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    args: dict[str, Any] = doc["applications"][0]["args"]
    return args


def shipped_config(name: str = "local") -> AppConfig:
    """``configs/<name>.yaml`` validated, as the app deploys it."""
    return AppConfig.model_validate(shipped_args(name))
