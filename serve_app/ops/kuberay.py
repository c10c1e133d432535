"""The KubeRay manifest for a Serve config file: ``python -m serve_app.ops.kuberay``.

``deploy/kuberay/rayservice.yaml`` is generated from ``configs/prod.yaml`` and committed; ``--check``
fails when it is stale (a test runs it). The manifest holds:

- a ``RayService`` whose ``serveConfigV2`` is the Serve config file itself (parsed and dumped, so it
  is the same document ``serve deploy`` reads), with the keys Secret mounted read-only where
  ``gateway.keys.file`` points, a model cache volume at ``cache_dir`` and a state volume (shared by
  every pod: the batch files, the audit trail, SQLite) holding ``gateway.state.dir`` and the batch
  files folder, on every pod. The Secret is read-only: nothing may be written beside the keys
  file (the batch folder's default is there, so the config must name ``gateway.batch.files_dir``);
  ``writable_paths`` lists what the gateway writes, and a test checks each is on a writable mount;
- the Redis that the gateway replicas share their limit counters through (``gateway.state.redis_url``).

HAProxy's stats and metrics listeners (Ray Serve's throughput mode) are not exposed: no container
port and no Service names them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from serve_app.config import AppConfig, load_app_config
from serve_app.state.files import files_root

DEFAULT_CONFIG = "configs/prod.yaml"
DEFAULT_OUT = "deploy/kuberay/rayservice.yaml"
RAY_VERSION = "2.60.0"
IMAGE = "serve-app:0.1.0"  # built from this repo with `pip install -e '.[gpu]'` on rayproject/ray
KEYS_SECRET = "serve-app-keys"
CACHE_CLAIM = "serve-app-model-cache"
STATE_CLAIM = "serve-app-state"  # ReadWriteMany: the gateway replicas of every pod share it
STATE_MOUNT = "/var/lib/serve-app"
# Ray Serve's documented throughput mode, and the middleware that bounds X-Request-Id.
SERVE_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "serve_app.gateway.http.proxy_middleware:middlewares",
}


def _container(name: str, resources: dict[str, Any], ports: list[dict[str, Any]], keys_dir: str,
               cache_dir: str) -> dict[str, Any]:
    return {
        "name": name,
        "image": IMAGE,
        # Hub weights go to the model cache volume too, so a restarted pod does not fetch them.
        "env": [{"name": k, "value": v}
                for k, v in {**SERVE_ENV, "HF_HOME": f"{cache_dir}/hf"}.items()],
        "ports": ports,
        "resources": {"limits": resources, "requests": resources},
        "volumeMounts": [
            {"name": "keys", "mountPath": keys_dir, "readOnly": True},
            {"name": "model-cache", "mountPath": cache_dir},
            {"name": "state", "mountPath": STATE_MOUNT},
        ],
    }


def _volumes() -> list[dict[str, Any]]:
    return [
        {"name": "keys", "secret": {"secretName": KEYS_SECRET, "defaultMode": 0o440}},  # r--r-----
        {"name": "model-cache", "persistentVolumeClaim": {"claimName": CACHE_CLAIM}},
        {"name": "state", "persistentVolumeClaim": {"claimName": STATE_CLAIM}},
    ]


def writable_paths(cfg: AppConfig) -> list[str]:
    """Every folder the app writes on a pod: the model cache, the state folder (audit trail,
    SQLite) and the Batch API's files (``state.files.files_root``: beside the keys file unless
    ``gateway.batch.files_dir`` names one)."""
    paths = [cfg.cache_dir, str(files_root(cfg))]
    if cfg.gateway.state.dir:
        paths.append(cfg.gateway.state.dir)
    return paths


def _redis(host: str, port: int) -> list[dict[str, Any]]:
    labels = {"app": host}
    return [
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": host},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"containers": [{
                        "name": "redis",
                        "image": "redis:7.0",
                        "args": ["--save", "", "--appendonly", "no"],
                        "ports": [{"containerPort": port}],
                    }]},
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": host},
            "spec": {"selector": labels, "ports": [{"port": port, "targetPort": port}]},
        },
    ]


def manifest(config_path: Path) -> list[dict[str, Any]]:
    """The documents of the manifest for one Serve config file (validated by the app's schema)."""
    doc = yaml.safe_load(config_path.read_text())
    cfg = load_app_config(config_path)
    keys_dir = str(Path(cfg.gateway.keys.file).parent)
    gpus_per_replica = max(m.world_size for m in cfg.models if m.accelerator.kind == "gpu")
    max_replicas = sum(
        (m.deployment.autoscaling_config.max_replicas if m.deployment.autoscaling_config
         else m.deployment.replicas)
        for m in cfg.models
    )
    head = _container(
        "ray-head", {"cpu": "8", "memory": "32Gi"},
        [{"containerPort": 6379, "name": "gcs"}, {"containerPort": 8265, "name": "dashboard"},
         {"containerPort": 8000, "name": "serve"}],
        keys_dir, cfg.cache_dir,
    )
    worker = _container(
        "ray-worker", {"cpu": "16", "memory": "96Gi", "nvidia.com/gpu": str(gpus_per_replica)},
        [{"containerPort": 8000, "name": "serve"}], keys_dir, cfg.cache_dir,
    )
    service = {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": "serve-app"},
        "spec": {
            "serveConfigV2": yaml.safe_dump(doc, sort_keys=False),
            "rayClusterConfig": {
                "rayVersion": RAY_VERSION,
                "enableInTreeAutoscaling": True,
                "headGroupSpec": {
                    # The head schedules no replicas (num-cpus 0): the gateway and engines run
                    # on the workers, whose GPUs the placement groups ask for.
                    "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
                    "template": {"spec": {"containers": [head], "volumes": _volumes()}},
                },
                "workerGroupSpecs": [{
                    "groupName": "gpu-workers",
                    "replicas": 1,
                    "minReplicas": 1,
                    "maxReplicas": max_replicas,
                    "rayStartParams": {},
                    "template": {"spec": {"containers": [worker], "volumes": _volumes()}},
                }],
            },
        },
    }
    docs = [service]
    if cfg.gateway.state.redis_url:
        url = urlsplit(cfg.gateway.state.redis_url)
        docs += _redis(url.hostname or "serve-app-redis", url.port or 6379)
    return docs


class _Dumper(yaml.SafeDumper):
    """Writes multi-line strings (serveConfigV2) as literal blocks, and no YAML anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render(config_path: Path) -> str:
    header = (f"# Generated from {config_path} by `python -m serve_app.ops.kuberay`; do not edit.\n"
              f"# Before applying: create the Secret `{KEYS_SECRET}` (key keys.yaml) and the "
              f"PersistentVolumeClaims `{CACHE_CLAIM}` and `{STATE_CLAIM}` (ReadWriteMany).\n")
    return header + yaml.dump_all(manifest(config_path), Dumper=_Dumper, sort_keys=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m serve_app.ops.kuberay", description=__doc__.split("\n")[0])
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--check", action="store_true", help="exit 1 if --out is not what would be written")
    ns = p.parse_args(argv)
    text = render(Path(ns.config))
    out = Path(ns.out)
    if ns.check:
        if not out.exists() or out.read_text() != text:
            print(f"{out} is stale: run python -m serve_app.ops.kuberay", file=sys.stderr)
            return 1
        print(f"{out} is up to date")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
