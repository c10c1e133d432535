"""OpenAI's Batch API (``gateway.batch``)."""

from __future__ import annotations

from pydantic import Field, PositiveFloat, PositiveInt

from serve_app.config.base import _Strict


class BatchConfig(_Strict):
    """OpenAI's Batch API (``/v1/files``, ``/v1/batches``): where its files live and how its runner
    feeds the lines through the gateway's own admission, at the batch tier's priority."""

    files_dir: str | None = Field(
        default=None,
        description="Folder of uploaded and result files and, without gateway.state.redis_url, of "
        "the batches' state; None: a 'batch' folder beside gateway.keys.file (the local stack's "
        ".local/). Several gateway nodes need it on shared storage.",
    )
    max_file_bytes: PositiveInt = Field(
        default=64 * 1024 * 1024, description="Largest file upload (purpose batch)."
    )
    max_lines: PositiveInt = Field(default=50_000, description="Most requests in one batch.")
    tier: str | None = Field(
        default=None,
        description="The tier whose priority and limits batch lines run at (charged to the "
        "creator's key); None: 'batch' if configured, else the lowest-priority tier. A key whose "
        "own tier is lower still keeps it.",
    )
    concurrency: PositiveInt = Field(
        default=4, description="Lines of one batch in flight at once, per gateway replica."
    )
    max_active: PositiveInt = Field(
        default=1, description="Batches one gateway replica's runner runs at once."
    )
    lease_s: PositiveFloat = Field(
        default=30.0,
        description="A runner holds a batch by a lease it renews every third of this; a runner "
        "that dies leaves it to another replica (or its restart) after this long.",
    )
    poll_s: PositiveFloat = Field(default=2.0, description="How often a runner looks for batches.")
    backoff_max_s: PositiveFloat = Field(
        default=30.0, description="Longest wait before a line refused with 429 or 503 is retried."
    )
    max_open_batches_per_key: PositiveInt = Field(
        default=10, description="Unfinished batches one key may have at once; one more is "
        "refused (429) until one ends.",
    )
    max_open_batches_per_owner: PositiveInt = Field(
        default=50, description="Unfinished batches one owner (a tenant, or a key of no tenant) "
        "may have at once, over all its keys.",
    )
    max_files_per_owner: PositiveInt = Field(
        default=1000, description="Files one owner (a tenant, or a key of no tenant) may keep, "
        "results of its batches included; an upload past it is refused (429) until files are "
        "deleted.",
    )

