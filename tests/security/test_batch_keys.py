"""Work that outlives its request re-checks its key at every unit (issue 36): a batch whose key is
revoked, expires or changes tier stops or changes at its next line; a spent budget ends the batch
with records, not retries; no line is lost at the expiry; a deleted input file does not wedge the
runner. The runner, its stores and its files are real; the pipeline is a stand-in that answers."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from serve_app import errors
from serve_app.config import KeyRecord
from serve_app.protocol import Answer, Endpoint
from tests.unit.test_batch import CFG, KEY, FakePipeline, _results, _setup, line

IDS = [f"r{i}" for i in range(40)]
DATA = b"\n".join(line(i) for i in IDS)


class Keys:
    """The key store's ``by_id`` as the runner calls it, which the test changes meanwhile."""

    def __init__(self) -> None:
        self.key: KeyRecord | None = KEY

    def __call__(self, key_id: str) -> KeyRecord | None:
        return self.key


def _records(runner: Any, got: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return _results(runner, got["output_file_id"]), _results(runner, got["error_file_id"])


def test_a_key_revoked_mid_batch_starts_none_of_its_remaining_lines(tmp_path: Path) -> None:
    pipeline = FakePipeline(delay_s=0.05)
    runner, service, batch_id = _setup(tmp_path, DATA, pipeline)
    keys = runner.keys = Keys()

    async def go() -> int:
        task = asyncio.create_task(runner.run_batch(batch_id))
        while len(pipeline.calls) < 5:
            await asyncio.sleep(0.01)
        keys.key = None  # DELETE /admin/v1/keys/{id}: by_id answers no active key
        started = len(pipeline.calls)
        await asyncio.wait_for(task, 10)
        return started

    started = asyncio.run(go())
    # At most the lines already in flight (one per worker) start after the revocation.
    assert len(pipeline.calls) <= started + runner.bcfg.concurrency
    got = asyncio.run(service.get_batch(KEY, batch_id))
    assert got["status"] == "cancelled"
    assert got["errors"]["data"][0]["code"] == "key_revoked"
    out, err = _records(runner, got)
    assert sorted(r["custom_id"] for r in out + err) == sorted(IDS)  # every line has a record
    assert {r["error"]["code"] for r in err} == {"key_revoked"}


def test_an_expired_key_stops_its_batch_too(tmp_path: Path) -> None:
    pipeline = FakePipeline()
    runner, service, batch_id = _setup(tmp_path, DATA, pipeline)
    keys = runner.keys = Keys()
    keys.key = KEY.model_copy(update={"expires_at": "2000-01-01T00:00:00Z"})
    asyncio.run(runner.run_batch(batch_id))
    got = asyncio.run(service.get_batch(KEY, batch_id))
    assert got["status"] == "cancelled" and pipeline.calls == []


def test_a_tier_change_mid_batch_applies_to_the_next_line(tmp_path: Path) -> None:
    pipeline = FakePipeline(delay_s=0.02)
    cfg = CFG.model_copy(update={"tiers": {**CFG.tiers, "low": CFG.tiers["batch"].model_copy(
        update={"priority": 20})}})
    runner, service, batch_id = _setup(tmp_path, DATA, pipeline, cfg)
    runner.bcfg = runner.bcfg.model_copy(update={"concurrency": 1})
    keys = runner.keys = Keys()
    keys.key = KEY.model_copy(update={"tier": "batch"})

    async def go() -> None:
        task = asyncio.create_task(runner.run_batch(batch_id))
        while len(pipeline.calls) < 3:
            await asyncio.sleep(0.005)
        keys.key = KEY.model_copy(update={"tier": "low"})  # a tier that runs after the batch tier
        await asyncio.wait_for(task, 10)

    asyncio.run(go())
    tiers = [tier for _, tier in pipeline.calls]
    assert tiers[0] == "batch" and tiers[-1] == "low"


class SpentBudget(FakePipeline):
    async def __call__(self, key: KeyRecord, endpoint: Endpoint, body: dict[str, Any],
                       size: int, arrival: float) -> Answer:
        self.calls.append((body["messages"][0]["content"], key.tier))
        raise errors.QuotaExceeded("You exceeded the token budget of this key.")


def test_a_spent_budget_ends_the_batch_with_records_not_retries(tmp_path: Path) -> None:
    pipeline = SpentBudget()
    runner, service, batch_id = _setup(tmp_path, DATA, pipeline)
    t0 = time.monotonic()
    asyncio.run(asyncio.wait_for(runner.run_batch(batch_id), 20))
    assert time.monotonic() - t0 < 10  # no back-off loop until the batch expires
    assert len(pipeline.calls) == len(IDS)  # each line tried once
    got = asyncio.run(service.get_batch(KEY, batch_id))
    assert got["status"] == "completed"
    out, err = _records(runner, got)
    assert out == [] and len(err) == len(IDS)
    assert {r["response"]["status_code"] for r in err} == {429}
    assert {r["response"]["body"]["error"]["code"] for r in err} == {"insufficient_quota"}


def test_lines_in_flight_and_in_back_off_at_the_expiry_get_records(tmp_path: Path) -> None:
    pipeline = FakePipeline(refuse_first=10_000)  # every line in a back-off
    runner, service, batch_id = _setup(tmp_path, DATA, pipeline)

    async def go() -> None:
        b = await runner.store.load(batch_id)
        assert b is not None
        task = asyncio.create_task(runner.run_batch(batch_id))
        await asyncio.sleep(0.3)
        b = await runner.store.load(batch_id)
        assert b is not None
        runner.clock = lambda: b.expires_at + 1  # the 24 h pass
        await asyncio.wait_for(task, 10)

    asyncio.run(go())
    got = asyncio.run(service.get_batch(KEY, batch_id))
    assert got["status"] == "expired"
    out, err = _records(runner, got)
    assert sorted(r["custom_id"] for r in out + err) == sorted(IDS)
    assert {r["error"]["code"] for r in err} == {"batch_expired"}


def test_an_input_file_deleted_under_a_running_batch_ends_it_once(tmp_path: Path) -> None:
    runner, service, batch_id = _setup(tmp_path, DATA, FakePipeline())

    async def go() -> None:
        b = await runner.store.load(batch_id)
        assert b is not None
        b.move("in_progress", time.time())
        b.total = len(IDS)
        await runner.store.save(b)
        runner.files.data_path(b.input_file_id).unlink()  # deleted; then a restart picks it up
        await runner.run_batch(batch_id)

    asyncio.run(go())
    got = asyncio.run(service.get_batch(KEY, batch_id))
    assert got["status"] == "cancelled"
    assert got["errors"]["data"][0]["code"] == "input_file_missing"
    asyncio.run(runner.run_batch(batch_id))  # a later poll: nothing left to do, no error
