"""Strict pydantic models of the whole app: the only place where defaults live.

One module per section of the config file: ``engine`` (how a model runs: engine arguments,
accelerator, deployment and autoscaling), ``model`` (``models[]`` and ``routes[]``), ``tiers``,
``keys`` (key records, budgets and ``gateway.keys``), ``gateway`` and its sections ``http``,
``state``, ``accounting``, ``batch``, ``responses`` and ``console``, and ``app`` (the whole ``args`` block
and its loading); ``base`` holds the strict base model and the error formatting they share.
Import the names from here.
"""

from serve_app.config.accounting import AccountingConfig
from serve_app.config.app import APP_NAME, AppConfig, load_app_config
from serve_app.config.base import format_validation_error
from serve_app.config.batch import BatchConfig
from serve_app.config.console import ConsoleConfig
from serve_app.config.engine import (
    Accelerator,
    AutoscalingConfig,
    DeploymentOptions,
    EngineArgs,
    ObjectivePolicyConfig,
    SimulatedEngine,
    SyntheticUpstream,
)
from serve_app.config.gateway import GatewayConfig
from serve_app.config.http import HttpConfig
from serve_app.config.keys import Budget, KeyRecord, KeysConfig, KeysFile, expiry_time
from serve_app.config.model import (
    BUILTIN_ADAPTERS,
    AdapterConfig,
    AdmissionConfig,
    FlowConfig,
    ModelConfig,
    RoutingConfig,
)
from serve_app.config.responses import ResponsesConfig
from serve_app.config.state import StateConfig
from serve_app.config.tiers import Limits, Objectives, TierConfig

__all__ = [
    "APP_NAME",
    "BUILTIN_ADAPTERS",
    "Accelerator",
    "AdapterConfig",
    "AccountingConfig",
    "AdmissionConfig",
    "AppConfig",
    "AutoscalingConfig",
    "BatchConfig",
    "Budget",
    "ConsoleConfig",
    "DeploymentOptions",
    "EngineArgs",
    "FlowConfig",
    "GatewayConfig",
    "HttpConfig",
    "KeyRecord",
    "KeysConfig",
    "KeysFile",
    "Limits",
    "ModelConfig",
    "ObjectivePolicyConfig",
    "Objectives",
    "ResponsesConfig",
    "RoutingConfig",
    "StateConfig",
    "SimulatedEngine",
    "SyntheticUpstream",
    "TierConfig",
    "expiry_time",
    "format_validation_error",
    "load_app_config",
]
