"""Upload the generated dashboards to a Grafana server with grafana-client (``serve-app dashboards push``).

The dashboards (``python -m dashboards`` writes them) ship inside the package, in
``serve_app/ops/dashboards/``, so that the command works from a wheel as well as from a checkout.
They refer to their Prometheus datasource by uid ``prometheus``; provision it with
``dashboards/provisioning/datasources/prometheus.yaml`` (or create one with that uid) first.
"""

from __future__ import annotations

import json
import logging
import os
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DASHBOARD_DIR: Traversable = resources.files("serve_app.ops") / "dashboards"


def dashboard_files(folder: Traversable = DASHBOARD_DIR) -> list[Traversable]:
    """The dashboard JSON files in ``folder`` by name; none if it is not a folder."""
    if not folder.is_dir():
        return []
    return sorted((f for f in folder.iterdir() if f.name.endswith(".json")), key=lambda f: f.name)


def _folder_uid(api: Any, title: str) -> str:
    for f in api.folder.get_all_folders():
        if f.get("title") == title:
            return str(f["uid"])
    return str(api.folder.create_folder(title)["uid"])


def push(url: str, token: str | None, folder: str, files: list[Traversable]) -> list[str]:
    """Create or overwrite each dashboard in ``folder``; returns the URL Grafana gives each."""
    from grafana_client.api import GrafanaApi

    api = GrafanaApi.from_url(url, credential=token)
    folder_uid = _folder_uid(api, folder)
    urls = []
    for path in files:
        dashboard = json.loads(path.read_text())
        dashboard.pop("id", None)  # Grafana matches on uid; a stale numeric id would conflict
        answer = api.dashboard.update_dashboard({
            "dashboard": dashboard, "folderUid": folder_uid, "overwrite": True,
            "message": "serve-app dashboards push",
        })
        urls.append(str(answer.get("url", "")))
        logger.info("pushed %s -> %s", path.name, answer.get("url"))
    return urls


def push_command(url: str, token: str | None, folder: str, directory: str | None) -> int:
    """``serve-app dashboards push``: every dashboard in ``directory`` (default: the packaged
    ones), a line with its Grafana URL each; SystemExit with a message if none or if Grafana fails.
    The token defaults to $GRAFANA_TOKEN."""
    token = token or os.environ.get("GRAFANA_TOKEN")
    source: Traversable = Path(directory) if directory else DASHBOARD_DIR
    files = dashboard_files(source)
    if not files:
        raise SystemExit(f"no dashboard JSON in {source}")
    try:
        urls = push(url, token, folder, files)
    except Exception as exc:  # grafana-client raises its own hierarchy; show it, without a traceback
        raise SystemExit(f"push to {url} failed: {type(exc).__name__}: {exc}") from None
    for f, answer in zip(files, urls, strict=True):
        print(f"{f.name}: {url.rstrip('/')}{answer}")
    return 0
