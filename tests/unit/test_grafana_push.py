"""``serve-app dashboards push``: real grafana-client against a stand-in for Grafana's HTTP API
(no Grafana server can be installed here), recording what a Grafana server would receive."""

from __future__ import annotations

import json
import threading
import tomllib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from dashboards.__main__ import GRAFANA_DIR
from serve_app.cli import main
from serve_app.ops.grafana_push import DASHBOARD_DIR, dashboard_files

ROOT = Path(__file__).resolve().parents[2]


class _Grafana(BaseHTTPRequestHandler):
    calls: list[tuple[str, str, Any, str | None]] = []
    folders: list[dict[str, Any]] = []

    def _reply(self, body: Any, status: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(n)) if n else None
        self.calls.append((self.command, self.path, body, self.headers.get("Authorization")))
        return body

    def do_GET(self) -> None:  # noqa: N802
        self._record()
        if self.path.startswith("/api/folders"):
            self._reply(self.folders)
        else:
            self._reply({"message": "not found"}, 404)

    def do_POST(self) -> None:  # noqa: N802
        body = self._record()
        if self.path == "/api/folders":
            folder = {"uid": "f-1", "title": body["title"]}
            self.folders.append(folder)
            self._reply(folder)
        elif self.path == "/api/dashboards/db":
            uid = body["dashboard"]["uid"]
            self._reply({"status": "success", "uid": uid, "url": f"/d/{uid}/x", "version": 1})
        else:
            self._reply({"message": "not found"}, 404)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture()
def grafana() -> Iterator[str]:
    _Grafana.calls, _Grafana.folders = [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Grafana)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_push_creates_the_folder_and_overwrites_each_dashboard(grafana: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dashboards", "push", "--url", grafana, "--token", "glsa_test"]) == 0
    posts = [(p, b) for m, p, b, _ in _Grafana.calls if m == "POST"]
    assert posts[0] == ("/api/folders", {"title": "serve-app"})
    pushed = {b["dashboard"]["uid"]: b for p, b in posts if p == "/api/dashboards/db"}
    assert set(pushed) == {f.name.removesuffix(".json") for f in dashboard_files()}
    for body in pushed.values():
        assert body["overwrite"] is True and body["folderUid"] == "f-1"
        assert body["dashboard"]["panels"]
    assert {a for *_, a in _Grafana.calls} == {"Bearer glsa_test"}
    assert "serve-app-sla.json: " + grafana + "/d/serve-app-sla/x" in capsys.readouterr().out


def test_push_reuses_an_existing_folder(grafana: str) -> None:
    _Grafana.folders.append({"uid": "existing", "title": "serve-app"})
    assert main(["dashboards", "push", "--url", grafana, "--token", "t"]) == 0
    posts = [(p, b) for m, p, b, _ in _Grafana.calls if m == "POST"]
    assert all(p == "/api/dashboards/db" and b["folderUid"] == "existing" for p, b in posts)


def test_push_to_nothing_is_a_message_not_a_traceback() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["dashboards", "push", "--url", "http://127.0.0.1:9", "--token", "t"])
    assert "push to http://127.0.0.1:9 failed" in str(exc.value)


def test_the_dashboards_are_package_data() -> None:
    # Found through importlib.resources (as in a wheel install), where `python -m dashboards`
    # writes them, and declared as package data so that a wheel carries them.
    assert Path(str(DASHBOARD_DIR)).resolve() == GRAFANA_DIR.resolve()
    assert {f.name for f in dashboard_files()} == {
        "serve-app-capacity.json", "serve-app-engines.json", "serve-app-sla.json"}
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_data = pyproject["tool"]["setuptools"]["package-data"]
    assert "dashboards/*.json" in package_data["serve_app.ops"]


def test_push_from_a_folder_without_dashboards_is_a_message(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["dashboards", "push", "--url", "http://127.0.0.1:9", "--dir", str(tmp_path / "none")])
    assert f"no dashboard JSON in {tmp_path / 'none'}" in str(exc.value)
