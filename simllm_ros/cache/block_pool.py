"""Which block holds what: allocation, prefix hashing and reference counts.

A full block is identified by a hash chained over every token before it and
the cache scope, so two entries with the same scope and token prefix share the
same physical blocks, and a block can never be found from another scope. A
partial last block is private to its entry but still indexed under its parent
so a later request can reuse the part of it that matches, token by token.
Eviction policy lives elsewhere (eviction.py); this module only keeps books.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence


def root_hash(scope: str) -> int:
    return hash(("simllm-root", scope))


def chain_hash(parent: int, tokens: Sequence[int]) -> int:
    return hash((parent, tuple(tokens)))


@dataclasses.dataclass
class BlockInfo:
    block_id: int
    parent_hash: int
    tokens: tuple[int, ...]
    full: bool
    hash: int | None  # None for a partial block
    refcount: int = 0


class BlockPool:
    def __init__(self, num_blocks: int, block_tokens: int):
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.blocks: dict[int, BlockInfo] = {}
        self._by_hash: dict[int, int] = {}
        self._children: dict[int, set[int]] = {}

    # ---- queries -------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self.blocks)

    def longest_prefix(self, scope: str, tokens: Sequence[int]) -> tuple[list[int], int]:
        """Blocks holding the longest cached prefix of `tokens` in `scope`, and how many tokens of them match."""
        T = self.block_tokens
        h = root_hash(scope)
        ids: list[int] = []
        pos = 0
        while pos + T <= len(tokens):
            chunk = tuple(tokens[pos:pos + T])
            nxt = chain_hash(h, chunk)
            bid = self._by_hash.get(nxt)
            if bid is None or self.blocks[bid].tokens != chunk:  # the token check guards against hash collisions
                break
            ids.append(bid)
            h = nxt
            pos += T
        # Past the last full match, any child block (full or partial) may still share some tokens.
        best_bid, best_n = None, 0
        rest = tokens[pos:pos + T]
        for bid in self._children.get(h, ()):
            n = common_prefix(self.blocks[bid].tokens, rest)
            if n > best_n:
                best_bid, best_n = bid, n
        if best_bid is not None:
            ids.append(best_bid)
            pos += best_n
        return ids, pos

    # ---- changes -------------------------------------------------------
    def acquire_chain(self, scope: str, tokens: Sequence[int], write) -> tuple[list[int], int]:
        """Block table for `tokens`: existing full blocks are shared, the rest allocated and filled by
        write(block_id, start, end). Returns (block ids, number of newly written blocks).
        Raises MemoryError if there are not enough free blocks, and re-raises what write raises; either
        way after releasing what it took."""
        T = self.block_tokens
        h = root_hash(scope)
        ids: list[int] = []
        new = 0
        try:
            for start in range(0, len(tokens), T):
                chunk = tuple(tokens[start:start + T])
                full = len(chunk) == T
                hb = chain_hash(h, chunk) if full else None
                bid = self._by_hash.get(hb) if hb is not None else None  # hb is None exactly for a partial block
                if bid is None:
                    if not self._free:
                        raise MemoryError("no free KV block")
                    bid = self._free.pop()
                    try:
                        write(bid, start, start + len(chunk))
                    except BaseException:
                        self._free.append(bid)  # not registered yet: give it back before releasing the rest
                        raise
                    self.blocks[bid] = BlockInfo(bid, h, chunk, full, hb)
                    self._children.setdefault(h, set()).add(bid)
                    if hb is not None:
                        self._by_hash[hb] = bid
                    new += 1
                self.blocks[bid].refcount += 1
                ids.append(bid)
                if hb is not None:
                    h = hb
        except BaseException:  # MemoryError, or a failing write (e.g. a bad snapshot row): leave the books as they were
            self.release(ids)
            raise
        return ids, new

    def release(self, block_ids: Sequence[int]) -> int:
        """Drop one reference from each block; returns how many blocks became free."""
        freed = 0
        for bid in block_ids:
            info = self.blocks[bid]
            info.refcount -= 1
            if info.refcount == 0:
                del self.blocks[bid]
                kids = self._children.get(info.parent_hash)
                if kids is not None:
                    kids.discard(bid)
                    if not kids:
                        del self._children[info.parent_hash]
                if info.hash is not None and self._by_hash.get(info.hash) == bid:
                    del self._by_hash[info.hash]
                self._free.append(bid)
                freed += 1
        return freed

    def check_consistency(self) -> None:
        """Raise AssertionError if the books do not add up (used by tests and after loads)."""
        assert len(self.blocks) + len(self._free) == self.num_blocks, "blocks lost or doubled"
        assert not (set(self.blocks) & set(self._free)), "a block is both used and free"
        for bid, info in self.blocks.items():
            assert info.refcount > 0, f"block {bid} is used with refcount {info.refcount}"
            if info.full:
                assert info.hash is not None and self._by_hash.get(info.hash) == bid, \
                    f"full block {bid} missing from the hash index"


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
