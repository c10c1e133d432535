"""Peak memory of each replica of a running stack while a short load runs.

    python -m loadtests.memory --api-key $OPENAI_API_KEY      # against `make run` on :8000

It finds the ``serve-app run`` process, samples the RSS of every Ray Serve replica's process tree
(the replica and its engine subprocesses; shared pages are counted once per process) every 0.5 s,
sends streaming chats and embedding batches through the gateway, and prints the peak per replica.
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor

import psutil
from openai import OpenAI

from loadtests.sweep import MemorySampler
from serve_app.config import APP_NAME


def app_pid() -> int:
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "serve_app.cli run" in cmd or "serve-app run" in cmd:
            return int(p.pid)
    raise SystemExit("no `serve-app run` process found; start the stack first (make run)")


def deployments(root: int) -> list[str]:
    marker = f"ServeReplica:{APP_NAME}:"
    names = set()
    for p in psutil.Process(root).children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if marker in cmd:
            names.add(cmd.split(marker, 1)[1].split()[0])
    return sorted(names)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", required=True)
    p.add_argument("--chat-model", default="tiny-chat")
    p.add_argument("--embed-model", default="minilm-embed")
    p.add_argument("--requests", type=int, default=96, help="streaming chats (and 2/3 as many embedding batches)")
    ns = p.parse_args(argv)

    root = app_pid()
    samplers = {name: MemorySampler(root, name) for name in deployments(root)}
    for s in samplers.values():
        s.start()
    client = OpenAI(base_url=ns.base_url, api_key=ns.api_key, max_retries=5)

    def chat(i: int) -> int:
        stream = client.chat.completions.create(
            model=ns.chat_model, messages=[{"role": "user", "content": f"hello {i} " * 50}],
            max_tokens=128, stream=True)
        return sum(1 for _ in stream)

    def embed(i: int) -> int:
        inputs = [f"text {i} {j} " * 20 for j in range(16)]
        return len(client.embeddings.create(model=ns.embed_model, input=inputs).data)

    with ThreadPoolExecutor(32) as pool:
        list(pool.map(chat, range(ns.requests)))
        list(pool.map(embed, range(ns.requests * 2 // 3)))
    for s in samplers.values():
        s.stop_event.set()
        s.join()
        s.peak = max(s.peak, s.sample())
    for name, s in samplers.items():
        print(f"{name:24s} peak RSS {s.peak / 2**20:7.0f} MiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
