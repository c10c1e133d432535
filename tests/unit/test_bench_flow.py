"""The flow benchmark's arithmetic and report (loadtests.bench.flow), without a stack."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from loadtests.bench import flow, loadgen, sla
from loadtests.bench.loadgen import Sample
from loadtests.harness.stack import ROOT, copy_config, read_config


def test_jain_is_one_when_equal_and_one_over_n_when_one_has_all() -> None:
    assert flow.jain([3.0, 3.0]) == pytest.approx(1.0)
    assert flow.jain([5.0, 0.0]) == pytest.approx(0.5)
    assert flow.jain([]) is None


def test_fair_share_gives_a_small_demand_all_it_asks() -> None:
    # The quiet key asks for 100 tok/s alone; 1000 in total: its fair share is its demand.
    shares = flow.fair_shares({"quiet": 100.0, "noisy": 900.0}, {"quiet": 100.0})
    assert shares == {"quiet": 100.0, "noisy": 900.0}
    assert flow.fair_jain({"quiet": 100.0, "noisy": 900.0}, {"quiet": 100.0}) == pytest.approx(1.0)
    # Starved to a tenth of its demand: unfair.
    assert flow.fair_jain({"quiet": 10.0, "noisy": 990.0}, {"quiet": 100.0}) < 0.7


def test_summarise_counts_rejections_ttft_and_goodput() -> None:
    samples = [Sample("a", "premium", 0.0, 1.0, 200, 100.0, 10),
               Sample("a", "premium", 0.0, 2.0, 200, 3000.0, 10),
               Sample("a", "premium", 1.0, 1.1, 503)]
    s = flow.summarise(samples, {"premium": 1000.0})["premium"]
    assert (s["requests"], s["ok"], s["rejected"]) == (3, 2, 1)
    assert s["output_tok_s"] == 10.0 and s["goodput_tok_s"] == 5.0  # 20 and 10 tokens over 2 s


def test_the_edit_turns_only_tiny_chats_queue_on(tmp_path: Path) -> None:
    cfg = copy_config(ROOT / "configs/local.yaml", tmp_path / "serve.yaml", port=1234,
                      keys_file=tmp_path / "keys.yaml", edit=flow.flow_edit(True))
    models = {m.id: m.flow.enabled for m in read_config(cfg).models}
    assert models == {"tiny-chat": True, "minilm-embed": False}


def _doc() -> dict[str, Any]:
    tiers = {"premium": {"ttft_p95_ms": 800.0, "rejected": 0, "requests": 50},
             "batch": {"ttft_p95_ms": 9000.0, "rejected": 4, "requests": 150}}
    lv = {"users": 24, "tiers": tiers, "total_output_tok_s": 900.0}
    alone = {"ttft_p95_ms": 200.0, "front_door_ttft_p95_ms": 40.0}
    keys = {"quiet": {"ttft_p95_ms": 300.0, "front_door_ttft_p95_ms": 100.0, "goodput_tok_s": 50.0},
            "noisy": {"goodput_tok_s": 800.0}}
    fair = {"solo": alone, "keys": keys,
            "quiet_ttft_vs_solo": flow.quiet_vs_solo(alone, keys, "ttft_p95_ms"),
            "quiet_door_ttft_vs_solo": flow.quiet_vs_solo(alone, keys, "front_door_ttft_p95_ms"),
            "jain_fair_share": 0.98, "jain_raw": 0.56}
    mode = {"base_users": 12, "levels": {"2": lv, "4": lv}, "fairness": fair}
    return {"command": "python -m loadtests.bench.flow", "timestamp": "t", "config": "configs/local.yaml",
            "base_users": 12, "premium_share": 0.25, "max_tokens": 64, "duration_s": 60.0,
            "noisy": 32, "quiet": 2, "fair_tier": "standard",
            "objectives_ms": {"premium": 1000.0, "batch": 15000.0, "standard": 2500.0},
            "modes": {"off": {**mode, "search": [{"users": 12, "tiers": tiers}]}, "on": mode}}


def test_markdown_and_png(tmp_path: Path) -> None:
    doc = _doc()
    md = flow.markdown(doc)
    assert "| 2x (24 users) | on | 800 / – ms | 0 of 50 | 9,000 / – ms | 4 of 150 | 900 |" in md
    assert "| on | 200 ms | 300 ms | 1.50 | 40 / 100 ms, 2.50 | 50 / 800 | 0.980 | 0.560 |" in md
    assert "| 4x | 900 | 900 | 1.00 |" in md
    assert "A/A run" not in md and "A/A run" in flow.markdown({**doc, "aa": True})
    assert flow.plot(doc, tmp_path / "flow.png").stat().st_size > 1000
    # An A/A run's chart does not call its second "off" the queue on.
    assert flow.mode_names(doc) == {"off": "queue off", "on": "queue on"}
    assert flow.mode_names({**doc, "aa": True}) == {"off": "queue off (A)", "on": "queue off (B)"}
    assert flow.plot({**doc, "aa": True}, tmp_path / "aa.png").stat().st_size > 1000


def test_bench_keys_have_their_limits_lifted_or_kept(tmp_path: Path) -> None:
    import yaml

    keys_file = tmp_path / "keys.yaml"
    assert flow.make_key(keys_file, "lifted", "batch", "lifted").startswith("sk-")
    flow.make_key(keys_file, "kept", "batch", "tier")
    rows = {k["id"]: k for k in yaml.safe_load(keys_file.read_text())["keys"]}
    assert rows["lifted"]["limits"]["rpm"] == flow.LIFTED["rpm"]
    assert rows["lifted"]["limits"]["max_concurrent"] == flow.LIFTED["max-concurrent"]
    assert not rows["kept"].get("limits")


def test_server_timing_is_read_and_the_tail_shows_where_it_waited() -> None:
    assert sla.parse_server_timing("front_door;dur=1.5, queue;dur=300.0, bad, x;y=1, total;dur=320") == {
        "front_door": 1.5, "queue": 300.0, "total": 320.0}
    fast = [Sample("p", "premium", 0, 1, 200, ttft_ms=50, stages={"queue": 0.0, "total": 40.0}, head_ms=45)
            for _ in range(19)]
    slow = Sample("p", "premium", 0, 1, 200, ttft_ms=900, stages={"queue": 700.0, "total": 800.0}, head_ms=880)
    tail = flow.tail_stages([*fast, slow])
    assert tail == {"queue": 700.0, "total": 800.0, "client_head": 880.0, "beyond_total": 80.0}
    assert flow.tail_stages([]) == {}


def test_users_are_dealt_round_robin_so_each_worker_holds_every_group() -> None:
    quiet = loadgen.Users("quiet", "sk-q", "standard", 2)
    noisy = loadgen.Users("noisy", "sk-n", "standard", 5)
    shares = loadgen.deal([quiet, noisy], 3)
    assert [len(s) for s in shares] == [3, 2, 2]
    assert sorted(i for s in shares for _, i in s) == list(range(7))  # every user once
    assert {u.key for u, _ in shares[0]} == {"quiet", "noisy"}
    assert len(loadgen.deal([quiet], 8)) == 2  # no empty workers


def test_the_generator_reads_ttft_tokens_and_server_timing_from_a_stream() -> None:
    """Two worker processes against a local SSE endpoint shaped like the gateway's."""
    import asyncio
    import threading

    from aiohttp import web

    from loadtests.prompts import Prompt

    async def chat(request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != "Bearer sk-ok":
            return web.json_response({"error": {"message": "no"}}, status=401)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Server-Timing": "queue;dur=2.5, total;dur=7"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n')
        await resp.write(b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n')
        await resp.write(b'data: {"choices":[],"usage":{"completion_tokens":3}}\n\ndata: [DONE]\n\n')
        return resp

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        prompts = [Prompt(text="hello", max_tokens=8)]
        users = [loadgen.Users("ok", "sk-ok", "premium", 2), loadgen.Users("bad", "sk-no", "batch", 1)]
        with loadgen.LoadGen(2) as gen:
            samples = gen.run(f"http://127.0.0.1:{port}/v1", "m", users, 1.0, prompts, 8, backoff_s=0.2)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
    ok = [s for s in samples if s.key == "ok"]
    bad = [s for s in samples if s.key == "bad"]
    assert ok and all(s.status == 200 and s.tokens == 3 and s.ttft_ms is not None for s in ok)
    assert ok[0].stages == {"queue": 2.5, "total": 7.0}
    assert bad and all(s.status == 401 and s.ttft_ms is None and s.reason == "no" for s in bad)
    assert len(bad) <= 6  # it backed off 0.2 s after each refusal


def test_a_refusal_groups_by_its_message_without_the_numbers() -> None:
    body = b'{"error": {"message": "model \'m\' is busy: the request waited 3 s at the gateway"}}'
    assert loadgen.refusal_reason(body) == "model 'm' is busy: the request waited"
    assert loadgen.refusal_reason(b"<html>bad gateway</html>") == "<html>bad gateway</html>"


def test_repeats_are_merged_by_median_and_each_ratio_is_listed(tmp_path: Path) -> None:
    runs = []
    for off_tok, on_tok, order in ((1000.0, 900.0, ["off", "on"]), (1000.0, 1100.0, ["on", "off"]),
                                   (800.0, 840.0, ["off", "on"])):
        doc = _doc()
        doc["modes"]["off"]["levels"] = {k: {**v, "total_output_tok_s": off_tok}
                                         for k, v in doc["modes"]["off"]["levels"].items()}
        doc["modes"]["on"]["levels"] = {k: {**v, "total_output_tok_s": on_tok}
                                        for k, v in doc["modes"]["on"]["levels"].items()}
        runs.append({"order": order, "modes": doc["modes"]})
    merged = flow.median_tree([r["modes"] for r in runs])
    assert merged["off"]["levels"]["2"]["total_output_tok_s"] == 1000.0
    assert merged["on"]["levels"]["2"]["total_output_tok_s"] == 900.0
    assert merged["on"]["levels"]["2"]["tiers"]["premium"]["requests"] == 50  # ints stay ints
    assert flow.median_tree([{"a": 1}, {"a": 2}]) == {"a": 2}  # round(1.5): an int still
    assert [round(x, 2) for x in flow.ratios(runs, "2")] == [0.9, 1.1, 1.05]
    doc = {**_doc(), "modes": merged, "runs": runs, "repeats": 3}
    md = flow.markdown(doc)
    # The ratio is the median of each repeat's own (1.05), not median on / median off (0.90).
    assert "| 2x | 1,000 | 900 | 1.05 |" in md
    assert "- 2: on, off; 1.10, 1.10; 1.50 / 1.50, 2.50 / 2.50; 0.980 / 0.980" in md
    assert "median of 3 repeat(s)" in md
    # The queue's run first (repeat 2: 1.10) and second (repeats 1 and 3: 0.90, 1.05) apart.
    assert "| 2x, the queue's run first / second | | | 1.10 / 0.9" in md
    assert flow.plot(doc, tmp_path / "flow.png").stat().st_size > 1000


def test_render_writes_an_earlier_runs_report_again_with_the_figures_added_since(tmp_path: Path) -> None:
    import json

    doc = _doc()
    mode = doc.pop("modes")["on"]
    del mode["fairness"]["quiet_door_ttft_vs_solo"]  # a run written before the figure existed
    doc["runs"] = [{"order": order, "modes": {"off": mode, "on": mode}}
                   for order in (["off", "on"], ["on", "off"])]
    doc["runs"].append({"order": ["off", "on"], "modes": {"off": mode}})  # stopped during its "on"
    path = tmp_path / "flow-t.json"
    path.write_text(json.dumps(doc))
    assert flow.main(["--render", str(path)]) == 0
    md = (tmp_path / "flow-t.md").read_text()
    assert "| on | 200 ms | 300 ms | 1.50 | 40 / 100 ms, 2.50 | 50 / 800 | 0.980 | 0.560 |" in md
    assert "- 1: off, on; 1.00, 1.00; 1.50 / 1.50, 2.50 / 2.50; 0.980 / 0.980" in md
    assert json.loads(path.read_text())["repeats"] == 2 and "- 3:" not in md
    assert (tmp_path / "flow-t.png").stat().st_size > 1000
