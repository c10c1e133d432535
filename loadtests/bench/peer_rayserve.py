"""Run Ray Serve LLM for the benchmark: ``<peer venv>/bin/python -m loadtests.bench.peer_rayserve SPEC``.

SPEC is a JSON file ``{"port", "ready_file", "llm_config"}`` written by loadtests.bench.peers. Starts
a local Ray cluster (loopback, dashboard off, 8 logical CPUs), serves
``ray.serve.llm.build_openai_app`` with that one ``LLMConfig`` on 127.0.0.1:port, writes the ready
file once the app runs, and shuts Ray down on SIGINT/SIGTERM. Runs under the peer's venv, so it
imports nothing from serve_app.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    import ray
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app

    stop = threading.Event()

    def _stop(*_: Any) -> None:
        stop.set()

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": int(spec["port"])})
        app = build_openai_app({"llm_configs": [LLMConfig(**spec["llm_config"])]})
        serve.run(app, blocking=False, name="rayserve-llm", route_prefix="/")
        t0 = time.monotonic()
        while not stop.is_set():
            status = serve.status().applications.get("rayserve-llm")
            state = str(getattr(status, "status", ""))
            if state.endswith("RUNNING"):
                break
            if state.endswith(("DEPLOY_FAILED", "UNHEALTHY")):
                print(f"Ray Serve LLM failed: {getattr(status, 'message', '')[-2000:]}", flush=True)
                return 1
            stop.wait(2.0)
        if not stop.is_set():
            print(f"Ray Serve LLM ready in {time.monotonic() - t0:.0f} s", flush=True)
            Path(spec["ready_file"]).write_text(json.dumps({"port": spec["port"]}))
        stop.wait()
    finally:
        try:
            serve.shutdown()  # type: ignore[no-untyped-call]  # untyped in Ray
        finally:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
