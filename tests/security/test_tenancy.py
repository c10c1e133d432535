"""API1 (broken object-level authorization) across tenants: a tenant and a key never share a name,
so a key cannot reach another's files, batches, budget or prefix cache by naming itself after it.

Before (issue 36): a key with ``tenant: acme`` read every file of the key whose id is ``acme``
(owners were ``tenant or id``), drew on tenant ``acme``'s budget, and shared its cache salt."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from serve_app.config import KeyRecord
from serve_app.gateway.keys.ops import KeyOps
from tests.keys import run
from tests.unit.test_admin_api import Admin

DIGEST = "sha256:" + "0" * 64
LINE = (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", '
        b'"body": {"model": "tiny", "messages": []}}')


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Admin]:
    a = Admin(tmp_path, gateway={"accounting": {"tenant_budgets": {
        "acme": {"tokens": 1000, "period": "day"}}}})
    with a.client:
        yield a


def _sdk(env: Admin, secret: str) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=secret, http_client=env.client,
                         max_retries=0)


def test_a_key_named_like_a_tenant_and_that_tenant_see_nothing_of_each_other(env: Admin) -> None:
    ops = KeyOps(env.deps.keys)
    lone = _sdk(env, run(ops.create("acme")).secret)  # a key of no tenant, whose id is "acme"
    member = _sdk(env, run(ops.create("team-1", tenant="acme")).secret)  # a key of tenant acme
    mine = lone.files.create(file=("a.jsonl", LINE), purpose="batch")
    theirs = member.files.create(file=("b.jsonl", LINE), purpose="batch")
    assert [f.id for f in lone.files.list()] == [mine.id]
    assert [f.id for f in member.files.list()] == [theirs.id]
    for client, other in ((member, mine.id), (lone, theirs.id)):
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(other)
        with pytest.raises(openai.NotFoundError):
            client.files.content(other)
        with pytest.raises(openai.NotFoundError):
            client.files.delete(other)
        with pytest.raises(openai.NotFoundError):  # nor start a batch on it
            client.batches.create(input_file_id=other, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    batch = lone.batches.create(input_file_id=mine.id, endpoint="/v1/chat/completions",
                                completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        member.batches.retrieve(batch.id)
    assert [b.id for b in member.batches.list()] == []


def test_a_tenants_budget_binds_its_keys_only() -> None:
    from serve_app.config import Budget
    from serve_app.gateway.admission.budgets import Budgets
    from serve_app.state.budgets import MemoryBudgets

    budgets = Budgets(MemoryBudgets(), {"acme": Budget(tokens=1000, period="day")}, lambda: 0.0)
    lone = KeyRecord(id="acme", digest=DIGEST)
    member = KeyRecord(id="team-1", digest=DIGEST, tenant="acme")
    assert [c.scope for c in budgets.counters(member)] == ["tenant"]
    assert budgets.counters(lone) == []


def test_owners_and_cache_salts_never_collide() -> None:
    lone = KeyRecord(id="acme", digest=DIGEST)
    member = KeyRecord(id="team-1", digest=DIGEST, tenant="acme")
    other = KeyRecord(id="team-2", digest=DIGEST, tenant="acme")
    assert lone.owner != member.owner and member.owner == other.owner
