"""The app's configuration schema.

A Ray Serve config file (``configs/*.yaml``) names ``serve_app.app:build_app`` as its import path;
its ``args`` block is validated here by ``AppConfig``. Every model forbids unknown fields, so a
typo fails at deploy time with the field's name instead of being silently ignored.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import Field, model_validator

from serve_app.config.base import _Strict
from serve_app.config.gateway import GatewayConfig
from serve_app.config.model import ModelConfig, SplitRoute
from serve_app.config.tiers import TierConfig

# The Ray Serve application's name: `serve-app run` deploys under it, the configs' applications
# are named it, and the tools that find the app's deployments (diagnose, tests, load tools) use it.
APP_NAME = "llm"


class AppConfig(_Strict):
    """Everything ``build_app`` needs: the ``args`` block of a Ray Serve config file."""

    models: tuple[ModelConfig, ...] = Field(min_length=1)
    routes: tuple[SplitRoute, ...] = ()
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    tiers: dict[str, TierConfig] = Field(default_factory=lambda: {"standard": TierConfig()})
    default_tier: str = "standard"
    cache_dir: str = "~/.cache/serve-app"

    @model_validator(mode="after")
    def _names_unique(self) -> AppConfig:
        seen: dict[str, str] = {}
        for m in self.models:
            for name in (m.id, *m.aliases):
                if name in seen:
                    raise ValueError(
                        f"model name ({name!r}) of model {m.id!r} is already used by model {seen[name]!r}"
                    )
                seen[name] = m.id
        for m in self.models:
            for a in m.adapters:
                if a.name in seen:
                    raise ValueError(
                        f"adapter name ({a.name!r}) of model {m.id!r} is already used by model "
                        f"{seen[a.name]!r}"
                    )
                seen[a.name] = m.id
        deployments: dict[str, str] = {}
        for m in self.models:
            other = deployments.setdefault(m.deployment_name, m.id)
            if other != m.id:
                raise ValueError(
                    f"model ids ({other!r}, {m.id!r}) both become deployment {m.deployment_name!r}; "
                    "rename one"
                )
        by_id = {m.id: m for m in self.models}
        for m in self.models:
            if m.fallback is not None:
                fb = by_id.get(m.fallback)
                if fb is None or fb.id == m.id or fb.task != m.task:
                    raise ValueError(
                        f"fallback ({m.fallback!r}) of model {m.id!r} must be another {m.task} model id"
                    )
        for r in self.routes:
            if r.name in seen:
                raise ValueError(f"route name ({r.name!r}) is already used by model {seen[r.name]!r}")
            seen[r.name] = r.name
            tasks = set()
            for t in r.split:
                if t.model not in by_id:
                    raise ValueError(f"route {r.name!r}: split model ({t.model!r}) is not a model id")
                tasks.add(by_id[t.model].task)
            if len(tasks) > 1:
                raise ValueError(f"route {r.name!r} splits across models of different tasks {tasks}")
        limited = [
            name
            for name, t in self.tiers.items()
            if any((t.limits.rpm, t.limits.tpm, t.limits.max_concurrent,
                    t.key_limits.rpm, t.key_limits.tpm, t.key_limits.max_concurrent))
        ]
        if self.gateway.num_replicas > 1 and limited and not self.gateway.state.redis_url:
            raise ValueError(
                f"gateway.num_replicas ({self.gateway.num_replicas}) > 1 with limits on tiers "
                f"{limited} needs gateway.state.redis_url, so that replicas share their counters"
            )
        if self.default_tier not in self.tiers:
            raise ValueError(
                f"default_tier ({self.default_tier!r}) is not one of tiers {sorted(self.tiers)}"
            )
        return self

    @model_validator(mode="after")
    def _batch_tier_known(self) -> AppConfig:
        tier = self.gateway.batch.tier
        if tier is not None and tier not in self.tiers:
            raise ValueError(
                f"gateway.batch.tier ({tier!r}) is not one of tiers {sorted(self.tiers)}"
            )
        return self

    @property
    def batch_tier(self) -> str:
        """The tier batch lines run at: ``gateway.batch.tier``, else 'batch' if configured, else
        the lowest-priority tier (the highest priority value)."""
        if self.gateway.batch.tier is not None:
            return self.gateway.batch.tier
        if "batch" in self.tiers:
            return "batch"
        return max(self.tiers, key=lambda name: self.tiers[name].priority)

    @property
    def top_priority(self) -> int:
        """The best (lowest) tier priority: the tier that may take a model's reserved slots."""
        return min(t.priority for t in self.tiers.values())

    def model(self, model_id: str) -> ModelConfig:
        for m in self.models:
            if m.id == model_id:
                return m
        raise KeyError(model_id)

def load_app_config(serve_config_path: str | Path, app_name: str | None = None) -> AppConfig:
    """Read a Ray Serve config file and validate its application's ``args``."""
    doc = yaml.safe_load(Path(serve_config_path).read_text())
    apps = doc.get("applications") if isinstance(doc, dict) else None
    apps = apps or []
    if not apps:
        raise ValueError(f"{serve_config_path}: no applications")
    app = next((a for a in apps if app_name in (None, a.get("name"))), None)
    if app is None:
        raise ValueError(f"{serve_config_path}: no application named {app_name!r}")
    return AppConfig.model_validate(app.get("args") or {})
