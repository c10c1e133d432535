"""Imports point one way (DESIGN.md: app -> {gateway, engine} -> metrics -> config -> errors).

Checked by parsing the source with ``ast``; nothing is imported. Every import statement counts,
also those inside functions, so a lazy import cannot hide a dependency.

- ``serve_app/config`` imports nothing else from serve_app (it is the bottom: the schema);
  ``serve_app/errors.py`` imports nothing from serve_app.
- ``serve_app/gateway`` never imports vllm, torch or ``serve_app.engine``, not even through
  another serve_app module (gateway replicas stay light); ``serve_app/engine`` never imports
  the gateway. Neither imports ``serve_app.app`` or ``serve_app.cli``, which wire them together,
  nor the launcher and tools that sit above them (``serve_app.local``, ``serve_app.ops``).
- Inside ``serve_app/gateway`` the packages are layers, each importing only those below it
  (``GATEWAY_LAYERS``): deployment -> http -> responses -> pipeline -> forward -> outage -> admission -> keys
  -> routing -> accounting. A request's path reads top to bottom, and no lower layer reaches up.
- ``serve_app/state`` (the connections and stores) imports nothing of the gateway, the engine or
  batch: they use it, never the other way round.
- ``serve_app/batch`` runs lines through the gateway's pipeline as a domain ``Answer``: outside
  its routes module (and ``wiring``, which builds the routes' service), it imports nothing HTTP
  (fastapi, starlette) and nothing of the gateway.
- ``loadtests/`` treats the service as a black box: from serve_app it imports only
  ``serve_app.config``, and the only serve_app module it names (to run it) is ``serve_app.cli``.
  One exception: ``serve_app.local.ports``, the one free-port finder (stdlib only, no app
  behaviour), so that the harness and the launcher do not each keep a copy.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("vllm", "torch")
WIRING = ("serve_app.app", "serve_app.cli", "serve_app.local", "serve_app.ops")
# Imported by loadtests as well as serve_app.config (see the module docstring).
LOADTESTS_MAY_IMPORT = ("serve_app.config", "serve_app.local.ports")
MODULE_NAME = re.compile(r"^serve_app(\.\w+)+$")

Violations = dict[str, list[str]]

# The gateway's layers, top first: a module may import its own layer and the layers below it.
GATEWAY_LAYERS = (
    "serve_app.gateway.deployment",
    "serve_app.gateway.http",
    "serve_app.gateway.responses",
    "serve_app.gateway.pipeline",
    "serve_app.gateway.forward",
    "serve_app.gateway.outage",
    "serve_app.gateway.admission",
    "serve_app.gateway.keys",
    "serve_app.gateway.routing",
    "serve_app.gateway.accounting",
)


def within(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, root: Path) -> set[str]:
    """Every module an import statement in ``path`` names (``from a import b`` gives ``a`` and
    ``a.b``, since ``b`` may be a module), with relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                stem = ".".join([*base, node.module] if node.module else base)
            else:
                stem = node.module or ""
            found.add(stem)
            found.update(f"{stem}.{alias.name}" for alias in node.names if alias.name != "*")
    return found


def files(root: Path, folder: str) -> list[Path]:
    return sorted((root / folder).rglob("*.py"))


def _only_hits(found: dict[str, list[str]]) -> Violations:
    return {k: sorted(v) for k, v in found.items() if v}


# ---- the rules, as functions of a source tree ---------------------------------------------------
def config_violations(root: Path) -> Violations:
    found = {str(p.relative_to(root)): [n for n in imports_of(p, root) if within(n, "serve_app")
                                        and not within(n, "serve_app.config")]
             for p in files(root, "serve_app/config")}
    errors_py = root / "serve_app" / "errors.py"
    if errors_py.exists():
        found["serve_app/errors.py"] = [n for n in imports_of(errors_py, root)
                                        if within(n, "serve_app")]
    return _only_hits(found)


def gateway_violations(root: Path) -> Violations:
    """gateway module -> forbidden modules it reaches, each with the module that imports it."""
    modules = {module_name(p, root): p for p in files(root, "serve_app")}
    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        graph[mod] = {n if n in modules else n.split(".")[0] for n in imports_of(path, root)
                      if n in modules or within(n, *HEAVY)}
    found: dict[str, list[str]] = {}
    for start in modules:
        if not within(start, "serve_app.gateway"):
            continue
        seen: dict[str, str] = {}
        todo = [start]
        while todo:
            mod = todo.pop()
            for dep in graph.get(mod, ()):
                if dep not in seen:
                    seen[dep] = mod
                    todo.append(dep)
        found[start] = [f"{dep} (imported by {via})" for dep, via in seen.items()
                        if within(dep, "serve_app.engine", *WIRING, *HEAVY)]
    return _only_hits(found)


def layer_of(name: str) -> int | None:
    return next((i for i, layer in enumerate(GATEWAY_LAYERS) if within(name, layer)), None)


def gateway_layer_violations(root: Path) -> Violations:
    """gateway module -> the gateway modules of higher layers it imports."""
    found: dict[str, list[str]] = {}
    for path in files(root, "serve_app/gateway"):
        mod = module_name(path, root)
        own = layer_of(mod)
        if own is None:
            if mod != "serve_app.gateway":
                found[mod] = ["(in no layer: add it to GATEWAY_LAYERS)"]
            continue
        found[mod] = [n for n in imports_of(path, root)
                      if (layer := layer_of(n)) is not None and layer < own]
    return _only_hits(found)


def state_violations(root: Path) -> Violations:
    return _only_hits({str(p.relative_to(root)): [
        n for n in imports_of(p, root)
        if within(n, "serve_app.gateway", "serve_app.engine", "serve_app.batch", *WIRING)]
        for p in files(root, "serve_app/state")})


BATCH_MAY_SPEAK_HTTP = ("serve_app/batch/routes.py", "serve_app/batch/wiring.py")


def batch_violations(root: Path) -> Violations:
    return _only_hits({str(p.relative_to(root)): [
        n for n in imports_of(p, root) if within(n, "fastapi", "starlette", "serve_app.gateway")]
        for p in files(root, "serve_app/batch")
        if str(p.relative_to(root)) not in BATCH_MAY_SPEAK_HTTP})


def engine_violations(root: Path) -> Violations:
    return _only_hits({str(p.relative_to(root)): [n for n in imports_of(p, root)
                                                  if within(n, "serve_app.gateway", *WIRING)]
                       for p in files(root, "serve_app/engine")})


def loadtests_violations(root: Path) -> Violations:
    found: dict[str, list[str]] = {}
    for path in files(root, "loadtests"):
        names = [n for n in imports_of(path, root)
                 if within(n, "serve_app") and n != "serve_app" and not within(n, *LOADTESTS_MAY_IMPORT)]
        # Module names in strings: `python -m serve_app.cli ...` is the public command line;
        # any other would run or import an internal module.
        names += [n.value for n in ast.walk(ast.parse(path.read_text()))
                  if isinstance(n, ast.Constant) and isinstance(n.value, str)
                  and MODULE_NAME.match(n.value) and n.value != "serve_app.cli"
                  and not within(n.value, "serve_app.config")]
        found[str(path.relative_to(root))] = names
    return _only_hits(found)


# ---- this repository -----------------------------------------------------------------------------
def test_config_imports_nothing_else_from_serve_app() -> None:
    assert config_violations(ROOT) == {}


def test_gateway_never_reaches_vllm_torch_or_the_engine() -> None:
    assert any(files(ROOT, "serve_app/gateway"))
    assert gateway_violations(ROOT) == {}


def test_gateway_packages_import_only_downward() -> None:
    assert gateway_layer_violations(ROOT) == {}


def test_state_imports_none_of_its_users() -> None:
    assert any(files(ROOT, "serve_app/state"))
    assert state_violations(ROOT) == {}


def test_batch_imports_nothing_http_outside_its_routes() -> None:
    assert (ROOT / "serve_app/batch/runner.py").exists()
    assert batch_violations(ROOT) == {}


def test_engine_never_imports_the_gateway() -> None:
    assert engine_violations(ROOT) == {}


def test_loadtests_use_only_the_config_and_public_commands() -> None:
    assert any(files(ROOT, "loadtests"))
    assert loadtests_violations(ROOT) == {}


# ---- the checker catches what it should -----------------------------------------------------------
def _tree(root: Path, sources: dict[str, str]) -> Path:
    for name, text in sources.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_checker_sees_relative_lazy_and_indirect_imports(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "serve_app/__init__.py": "",
        "serve_app/protocol.py": "def f():\n    import torch.nn as nn\n",  # lazy, in a helper
        "serve_app/config/__init__.py": "from .. import errors\n",
        "serve_app/errors.py": "",
        "serve_app/gateway/__init__.py": "",
        "serve_app/gateway/a.py": "from ..engine.server import X\nfrom serve_app import protocol\n",
        "serve_app/gateway/b.py": "from serve_app.config import AppConfig\n",
        "serve_app/engine/__init__.py": "",
        "serve_app/engine/server.py": "from serve_app.gateway import a\n",
        "loadtests/ok.py": ("from serve_app.config import load_app_config\n"
                            "from serve_app.local.ports import free_port\nCLI = ['-m', 'serve_app.cli']\n"),
        "loadtests/bad.py": "from serve_app import gateway\nM = 'serve_app.engine.sources'\n",
    })
    assert config_violations(root) == {"serve_app/config/__init__.py": ["serve_app", "serve_app.errors"]}
    gateway = gateway_violations(root)
    assert set(gateway) == {"serve_app.gateway.a"}
    assert "serve_app.engine.server (imported by serve_app.gateway.a)" in gateway["serve_app.gateway.a"]
    assert "torch (imported by serve_app.protocol)" in gateway["serve_app.gateway.a"]
    assert engine_violations(root) == {"serve_app/engine/server.py": ["serve_app.gateway",
                                                                      "serve_app.gateway.a"]}
    assert loadtests_violations(root) == {"loadtests/bad.py": ["serve_app.engine.sources",
                                                               "serve_app.gateway"]}


def test_layer_checker_sees_an_import_that_reaches_up(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "serve_app/__init__.py": "",
        "serve_app/gateway/__init__.py": "",
        "serve_app/gateway/http/__init__.py": "",
        "serve_app/gateway/http/api.py": "from serve_app.gateway.admission import flow\n",
        "serve_app/gateway/admission/__init__.py": "",
        "serve_app/gateway/admission/flow.py": "def f():\n    from serve_app.gateway.http import api\n",
        "serve_app/gateway/stray.py": "",
        "serve_app/state/__init__.py": "from serve_app.gateway.keys import store\n",
        "serve_app/batch/runner.py": "from starlette.responses import Response\n",
        "serve_app/batch/routes.py": "from fastapi import APIRouter\n",
    })
    assert gateway_layer_violations(root) == {
        "serve_app.gateway.admission.flow": ["serve_app.gateway.http", "serve_app.gateway.http.api"],
        "serve_app.gateway.stray": ["(in no layer: add it to GATEWAY_LAYERS)"],
    }
    assert state_violations(root) == {"serve_app/state/__init__.py": [
        "serve_app.gateway.keys", "serve_app.gateway.keys.store"]}
    assert batch_violations(root) == {"serve_app/batch/runner.py": [
        "starlette.responses", "starlette.responses.Response"]}


def test_the_port_finder_that_loadtests_share_imports_nothing_of_the_app() -> None:
    # The loadtests exception holds only while serve_app.local.ports (and its package's
    # __init__) stay free of the app.
    for path in (ROOT / "serve_app/local/ports.py", ROOT / "serve_app/local/__init__.py"):
        assert not [n for n in imports_of(path, ROOT) if within(n, "serve_app")], path
