"""One simulated engine served on its own, as plain vLLM's OpenAI server serves a real one.

``serve-app sim-engine`` takes a model of a config (a real one, such as configs/local.yaml's
tiny-chat), puts a simulated engine with the given profile in place of its vLLM engine (the
model's own engine arguments bound the scheduler; its adapters and KV-cache size do not apply) and
serves ``/v1/completions`` and ``/v1/chat/completions`` (streamed or not), ``/v1/models`` and
``/health`` on a loopback port, with no gateway, Ray or keys in front. It exists to compare the
simulated engine with the real one under the same benchmark (``loadtests.bench.sim_validate``):
direct vLLM against this, engine against engine.

Every token is sent as its engine step makes it (``stream_interval_ms`` 0, as plain vLLM does),
and every answer says it is simulated, as through the gateway.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator
from typing import Any, cast

import orjson
from aiohttp import web

from serve_app.config import ModelConfig
from serve_app.engine.sim.engine import NoStats
from serve_app.engine.sim.server import SimServer
from serve_app.protocol import ENDPOINTS, Head, RequestContext

logger = logging.getLogger(__name__)
ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def standalone_model(model: ModelConfig, profile: str, *, time_scale: float = 1.0,
                     num_blocks: int | None = None, engine: dict[str, Any] | None = None) -> ModelConfig:
    """``model`` with a simulated engine of ``profile`` instead of its vLLM engine: its engine
    arguments kept (``engine`` overrides some, e.g. vLLM's platform defaults that the config leaves
    unset), its adapters and ``kv_cache_memory_bytes`` dropped, tokens streamed per step."""
    doc = model.model_dump(exclude_unset=True)
    doc.pop("adapters", None)
    doc.pop("synthetic", None)
    eng = {k: v for k, v in dict(doc.get("engine") or {}).items()
           if k not in ("kv_cache_memory_bytes", "enable_lora", "max_loras", "max_lora_rank",
                        "max_cpu_loras")}
    eng.update(engine or {})
    sim: dict[str, Any] = {"profile": profile, "time_scale": time_scale}
    if num_blocks is not None:
        sim["num_blocks"] = num_blocks
    doc.update(engine=eng, simulated=sim, stream_interval_ms=0.0)
    return ModelConfig.model_validate(doc)


def _context(body: dict[str, Any]) -> RequestContext:
    return RequestContext(request_id=f"sim-{uuid.uuid4().hex}", key_id="standalone", tier="standalone",
                          priority=int(body.get("priority") or 0))


def build_app(server: SimServer) -> web.Application:
    """The aiohttp application of one ``SimServer`` (started and stopped with the app)."""
    cfg = server.cfg

    async def generate(request: web.Request) -> web.StreamResponse:
        endpoint = ENDPOINTS[ROUTES[request.path]]
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return web.json_response({"error": {"message": "body is not JSON", "type": "invalid_request_error"}},
                                     status=400)
        if body.get("model") not in (cfg.id, *cfg.aliases, None):
            return web.json_response({"error": {"message": f"model {body.get('model')!r} does not exist",
                                                "type": "NotFoundError"}}, status=404)
        items = cast(AsyncGenerator[Any, None], server.handle(endpoint, body, _context(body)))
        try:
            item = await anext(items)
            if not isinstance(item, dict) or "status" not in item:
                raise RuntimeError(f"the simulated engine answered {type(item).__name__} first")
            first = cast(Head, item)
            if not first["stream"]:
                rest = [part async for part in items if isinstance(part, bytes)]
                return web.Response(status=first["status"], body=first["body"] + b"".join(rest),
                                    content_type="application/json")
            resp = web.StreamResponse(status=first["status"], headers={
                "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            await resp.write(first["body"])
            async for item in items:
                if isinstance(item, tuple):
                    await resp.write(item[0])
            await resp.write_eof()
            return resp
        finally:
            await items.aclose()

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": cfg.id, "object": "model", "owned_by": "serve-app-simulated"}]})

    async def health(_: web.Request) -> web.Response:
        try:
            await server.check_health()
        except RuntimeError as exc:
            return web.Response(status=503, text=str(exc))
        return web.Response(text="ok")

    async def on_startup(_: web.Application) -> None:
        await server.start()

    async def on_cleanup(_: web.Application) -> None:
        server.shutdown()

    app = web.Application(client_max_size=64 * 2**20)
    for path in ROUTES:
        app.router.add_post(path, generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def serve(model: ModelConfig, host: str, port: int) -> int:
    """Serve ``model`` (with ``simulated`` settings) until interrupted."""
    server = SimServer(model, sink=NoStats())
    sim = model.simulated
    assert sim is not None
    print(f"SIMULATED engine for {model.id}: profile {sim.profile}, time scale {sim.time_scale:g}, "
          f"{sim.num_blocks} KV blocks of {model.engine.block_size or 'default'} tokens, "
          f"max_num_seqs {model.engine.max_num_seqs}, max_num_batched_tokens "
          f"{model.engine.max_num_batched_tokens}; http://{host}:{port}", flush=True)
    try:
        web.run_app(build_app(server), host=host, port=port, print=None, access_log=None,
                    handle_signals=True)
    except (KeyboardInterrupt, asyncio.CancelledError):
        pass
    return 0
