"""Strict pydantic models of the whole app: the only place where defaults live."""

from serve_app.config.models import (
    Accelerator,
    AdmissionConfig,
    AppConfig,
    AutoscalingConfig,
    DeploymentOptions,
    EngineArgs,
    GatewayConfig,
    KeyRecord,
    KeysFile,
    Limits,
    ModelConfig,
    Objectives,
    SyntheticUpstream,
    TierConfig,
    format_validation_error,
    load_app_config,
)

__all__ = [
    "Accelerator",
    "AdmissionConfig",
    "AppConfig",
    "AutoscalingConfig",
    "DeploymentOptions",
    "EngineArgs",
    "GatewayConfig",
    "KeyRecord",
    "KeysFile",
    "Limits",
    "ModelConfig",
    "Objectives",
    "SyntheticUpstream",
    "TierConfig",
    "format_validation_error",
    "load_app_config",
]
