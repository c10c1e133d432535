"""deploy/kuberay/rayservice.yaml: generated from configs/prod.yaml, and the keys Secret's updates
reach running gateways the way the kubelet performs them."""

from __future__ import annotations

import os
import time
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from serve_app.config import AppConfig, load_app_config
from serve_app.ops import kuberay
from serve_app.ops.kuberay import main, manifest, render
from tests.keys import create_key, file_store, run

ROOT = Path(__file__).resolve().parents[2]
PROD = ROOT / "configs/prod.yaml"
MANIFEST = ROOT / "deploy/kuberay/rayservice.yaml"


def _docs() -> list[dict[str, Any]]:
    return list(yaml.safe_load_all(MANIFEST.read_text()))


def _pods(service: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = service["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [g["template"]["spec"] for g in groups]


def test_committed_manifest_is_what_the_generator_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the manifest names its source as the command is run from the repo
    assert main(["--check"]) == 0


def test_check_fails_on_a_stale_manifest(tmp_path: Path) -> None:
    stale = tmp_path / "rayservice.yaml"
    stale.write_text(render(PROD).replace("maxReplicas: 6", "maxReplicas: 7"))
    assert main(["--config", str(PROD), "--out", str(stale), "--check"]) == 1
    stale.write_text(render(PROD))
    assert main(["--config", str(PROD), "--out", str(stale), "--check"]) == 0


def test_serve_config_is_prod_yaml_and_passes_the_schema() -> None:
    service = _docs()[0]
    assert service["kind"] == "RayService"
    embedded = yaml.safe_load(service["spec"]["serveConfigV2"])
    assert embedded == yaml.safe_load(PROD.read_text())
    args = embedded["applications"][0]["args"]
    assert AppConfig.model_validate(args) == load_app_config(PROD)


def test_every_pod_mounts_the_keys_secret_read_only_and_the_model_cache() -> None:
    cfg = load_app_config(PROD)
    for pod in _pods(_docs()[0]):
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["keys"]["secret"]["secretName"] == "serve-app-keys"
        assert "persistentVolumeClaim" in volumes["model-cache"]
        (container,) = pod["containers"]
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["keys"]["readOnly"] is True
        assert mounts["keys"]["mountPath"] == str(Path(cfg.gateway.keys.file).parent)
        assert mounts["model-cache"]["mountPath"] == cfg.cache_dir
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
        assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"


def test_haproxy_stats_and_metrics_ports_are_not_exposed() -> None:
    text = MANIFEST.read_text()
    for port in ("8404", "9101"):
        assert port not in text
    for pod in _pods(_docs()[0]):
        ports = {p["containerPort"] for c in pod["containers"] for p in c["ports"]}
        assert ports <= {6379, 8265, 8000}


def test_gpu_workers_fit_the_largest_tensor_parallel_replica() -> None:
    cfg = load_app_config(PROD)
    worker = _pods(_docs()[0])[1]["containers"][0]
    gpus = int(worker["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus == max(m.world_size for m in cfg.models) == 2


def test_redis_service_is_the_one_the_gateway_names() -> None:
    docs = manifest(PROD)
    service = next(d for d in docs if d["kind"] == "Service")
    assert load_app_config(PROD).gateway.state.redis_url == (
        f"redis://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}/0")


def _kubelet_publish(mount: Path, content: str, n: int) -> None:
    """What the kubelet does to a Secret volume: write a new timestamped folder, then swap the
    ``..data`` symlink atomically (rename over it); ``keys.yaml`` links through ``..data``."""
    folder = mount / f"..2026_12_03_{n:02d}"
    folder.mkdir()
    (folder / "keys.yaml").write_text(content)
    tmp = mount / "..data_tmp"
    tmp.symlink_to(folder.name)
    os.replace(tmp, mount / "..data")
    if not (mount / "keys.yaml").is_symlink():
        (mount / "keys.yaml").symlink_to("..data/keys.yaml")


def test_key_hot_reload_survives_a_secret_volume_update(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch.yaml"
    old = create_key(scratch, "team-a", "standard", ["*"])
    mount = tmp_path / "keys"
    mount.mkdir()
    _kubelet_publish(mount, scratch.read_text(), 1)
    store = file_store(mount / "keys.yaml", interval_s=0.0)
    assert store.lookup(old) is not None

    new = create_key(scratch, "team-b", "premium", ["*"])
    _kubelet_publish(mount, scratch.read_text(), 2)
    deadline = time.monotonic() + 5
    while store.lookup(new) is None and time.monotonic() < deadline:
        time.sleep(0.01)
        run(store.refresh())  # the replica's poll (keep_fresh)
    found = store.lookup(new)
    assert found is not None and found.id == "team-b"
    assert store.lookup(old) is not None  # the rest of the file still holds


def test_every_path_the_app_writes_is_on_a_writable_mount_of_every_pod() -> None:
    """Issue 36: the batch folder defaulted to beside the keys file, on the read-only Secret mount
    (EROFS at start), and without a state dir the audit trail was never written."""
    cfg = load_app_config(ROOT / "configs/prod.yaml")
    docs = kuberay.manifest(ROOT / "configs/prod.yaml")
    groups = [docs[0]["spec"]["rayClusterConfig"]["headGroupSpec"],
              *docs[0]["spec"]["rayClusterConfig"]["workerGroupSpecs"]]
    paths = kuberay.writable_paths(cfg)
    assert cfg.gateway.state.dir in paths  # the audit trail and SQLite have a home
    for group in groups:
        for container in group["template"]["spec"]["containers"]:
            mounts = container["volumeMounts"]
            for path in paths:
                under = [m for m in mounts if PurePosixPath(path).is_relative_to(m["mountPath"])]
                assert under, f"{path} is on no volume of {container['name']}"
                deepest = max(under, key=lambda m: len(m["mountPath"]))
                assert not deepest.get("readOnly"), f"{path} is on read-only {deepest['name']}"
