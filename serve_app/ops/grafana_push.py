"""Upload the generated dashboards to a Grafana server with grafana-client (``serve-app dashboards push``).

The dashboards refer to their Prometheus datasource by uid ``prometheus``; provision it with
``dashboards/provisioning/datasources/prometheus.yaml`` (or create one with that uid) first.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DASHBOARD_DIR = Path(__file__).resolve().parents[2] / "dashboards" / "grafana"


def _folder_uid(api: Any, title: str) -> str:
    for f in api.folder.get_all_folders():
        if f.get("title") == title:
            return str(f["uid"])
    return str(api.folder.create_folder(title)["uid"])


def push(url: str, token: str | None, folder: str, files: list[Path]) -> list[str]:
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
