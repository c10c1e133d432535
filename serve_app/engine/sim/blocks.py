"""The KV block pool of the simulated engine, with prefix caching as vLLM v1 does it.

vLLM keeps the KV cache in fixed-size blocks. A block that is full gets a hash chained from its
parent's: ``hash(parent hash, the block's token ids, extra keys)``, the extra keys of the first
block holding the request's ``cache_salt``. A later request whose prompt hashes to the same chain
reuses those blocks instead of computing them: a prefix-cache hit. Because the salt is in the first
block and every later hash depends on it, another tenant (another salt) never hits.

A block held by no request goes to the tail of a free queue but keeps its hash; a new allocation
takes the queue's head (the least recently freed block) and only then drops the old hash. So free
cached blocks are evicted in LRU order, and a request frees its blocks last-first, so that its
prefix, shared most, stays longest. The counts follow vLLM's: a prefix-cache query is the request's
tokens, a hit the tokens found cached, and at least one token is always computed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

NONE_HASH = b"\x00" * 16  # the parent of a request's first block


def block_hash(parent: bytes, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """The hash of one full block: its parent's hash, its token ids and its extra keys."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    h.update(extra)
    return h.digest()


def chain_hashes(token_ids: Sequence[int], block_size: int, salt: str = "",
                 start: Sequence[bytes] = ()) -> list[bytes]:
    """The hashes of every full block of ``token_ids``, continuing ``start`` (the hashes known)."""
    hashes = list(start)
    parent = hashes[-1] if hashes else NONE_HASH
    for i in range(len(hashes), len(token_ids) // block_size):
        extra = salt.encode() if i == 0 else b""
        parent = block_hash(parent, token_ids[i * block_size:(i + 1) * block_size], extra)
        hashes.append(parent)
    return hashes


@dataclass
class Block:
    """One KV block: how many requests hold it, and its hash once it was full and cached."""

    id: int
    ref_cnt: int = 0
    hash: bytes | None = None


@dataclass
class CacheStats:
    """Counters since start-up, in tokens as vLLM's ``prefix_cache_queries``/``hits``."""

    queries: int = 0
    hits: int = 0
    evicted_blocks: int = 0


@dataclass
class BlockPool:
    """``num_blocks`` blocks of ``block_size`` tokens; a free queue in LRU order; a hash index."""

    num_blocks: int
    block_size: int = 16
    caching: bool = True
    blocks: list[Block] = field(init=False)
    free: OrderedDict[int, None] = field(init=False)  # head: evicted first
    cached: dict[bytes, int] = field(init=False, default_factory=dict)
    stats: CacheStats = field(init=False, default_factory=CacheStats)

    def __post_init__(self) -> None:
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self.free = OrderedDict.fromkeys(range(self.num_blocks))

    @property
    def num_free(self) -> int:
        """Blocks no request holds (cached or not): what an allocation may take."""
        return len(self.free)

    @property
    def usage(self) -> float:
        """The share of blocks held by requests, as vLLM's ``kv_cache_usage_perc`` (0..1)."""
        return 1.0 - self.num_free / self.num_blocks if self.num_blocks else 0.0

    def longest_hit(self, hashes: Sequence[bytes], max_tokens: int) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes``, at most ``max_tokens`` tokens."""
        found: list[int] = []
        if not self.caching:
            return found
        for h in hashes[:max_tokens // self.block_size]:
            bid = self.cached.get(h)
            if bid is None:
                break
            found.append(bid)
        return found

    def evictable(self, block_ids: Sequence[int]) -> int:
        """How many of ``block_ids`` sit in the free queue (touching them takes them out)."""
        return sum(1 for b in block_ids if self.blocks[b].ref_cnt == 0)

    def touch(self, block_ids: Sequence[int]) -> None:
        """Hold cached blocks for one more request (out of the free queue if nobody held them)."""
        for b in block_ids:
            block = self.blocks[b]
            if block.ref_cnt == 0:
                del self.free[b]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks from the head of the free queue, dropping the hashes they held."""
        if n > len(self.free):
            raise ValueError(f"cannot allocate {n} blocks, {len(self.free)} free")
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            block = self.blocks[b]
            if block.hash is not None:
                if self.cached.get(block.hash) == b:
                    del self.cached[block.hash]
                block.hash = None
                self.stats.evicted_blocks += 1
            block.ref_cnt = 1
            out.append(b)
        return out

    def release(self, block_ids: Sequence[int]) -> None:
        """One request lets go of its blocks, last first, so its tail is evicted before its prefix."""
        for b in reversed(block_ids):
            block = self.blocks[b]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free[b] = None

    def cache(self, block_ids: Sequence[int], hashes: Sequence[bytes]) -> None:
        """Index full blocks by hash (a block whose hash is already indexed stays a duplicate)."""
        if not self.caching:
            return
        for b, h in zip(block_ids, hashes, strict=False):
            block = self.blocks[b]
            if block.hash is None and h not in self.cached:
                block.hash = h
                self.cached[h] = b
