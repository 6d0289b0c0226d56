"""The Rust block pool against a plain Python model of the same pool.

The model keys the prefix cache by the whole token prefix (a tuple), with no
hashing at all, so it is an independent reference for the Rust pool's
chained-hash cache: every lookup must return exactly what the model returns.
"""

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from fastllm._core import BlockPool

TOKENS = st.integers(0, 1)  # a tiny alphabet, so prefixes are shared often


class PoolModel:
    """What the pool should do, in plain Python."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.n = num_blocks
        self.bs = block_size
        self.caching = caching
        self.ref = [0] * num_blocks
        self.free = set(range(num_blocks))  # unreferenced, nothing cached
        self.lru: list[int] = []  # unreferenced cached blocks, least recent first
        self.key: dict[int, tuple[int, ...]] = {}  # registered block -> whole prefix
        self.cache: dict[tuple[int, ...], int] = {}  # whole prefix -> cached block
        self.hits = self.queries = self.evictions = 0

    def valid(self, block_id: int) -> bool:
        return 0 <= block_id < self.n

    def cached(self, block_id: int) -> bool:
        return block_id in self.key and self.cache.get(self.key[block_id]) == block_id

    def available(self) -> int:
        return len(self.free) + len(self.lru)

    def take(self, got: int) -> None:
        """Checks that `got` is the block `allocate` had to return, and takes it."""
        if self.free:
            assert got in self.free, f"allocate returned {got}, not a free block {self.free}"
            self.free.remove(got)
        else:
            assert got == self.lru[0], f"allocate evicted {got}, LRU order is {self.lru}"
            self.lru.pop(0)
            del self.cache[self.key.pop(got)]
            self.evictions += 1
        self.ref[got] = 1

    def incref_ok(self, block_id: int) -> bool:
        return self.valid(block_id) and (self.ref[block_id] > 0 or self.cached(block_id))

    def incref(self, block_id: int) -> None:
        if self.ref[block_id] == 0:
            self.lru.remove(block_id)
        self.ref[block_id] += 1

    def decref(self, block_id: int) -> None:
        self.ref[block_id] -= 1
        if self.ref[block_id] == 0:
            if self.cached(block_id):
                self.lru.append(block_id)
            else:
                self.key.pop(block_id, None)
                self.free.add(block_id)

    def register_error(self, block_id: int, parent: int | None, tokens: tuple) -> bool:
        if not self.valid(block_id) or (parent is not None and not self.valid(parent)):
            return True
        if len(tokens) != self.bs:
            return True
        if not self.caching:
            return False
        if self.ref[block_id] == 0 or (parent is not None and parent not in self.key):
            return True
        prefix = (() if parent is None else self.key[parent]) + tokens
        return block_id in self.key and self.key[block_id] != prefix

    def register(self, block_id: int, parent: int | None, tokens: tuple) -> None:
        if not self.caching:
            return
        prefix = (() if parent is None else self.key[parent]) + tokens
        self.key[block_id] = prefix
        self.cache.setdefault(prefix, block_id)

    def match(self, tokens: list[int]) -> list[int]:
        if not self.caching:
            return []
        out = []
        full = len(tokens) // self.bs
        for i in range(full):
            block_id = self.cache.get(tuple(tokens[: (i + 1) * self.bs]))
            if block_id is None:
                break
            out.append(block_id)
        self.queries += full
        self.hits += len(out)
        return out

    def reset(self) -> bool:
        if any(self.ref[b] > 0 for b in self.cache.values()):
            return False
        for b in self.lru:
            del self.key[b]
            self.free.add(b)
        self.lru = []
        self.cache = {}
        return True


class BlockPoolMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(1, 8),
        block_size=st.integers(1, 3),
        caching=st.sampled_from([True, True, True, False]),
    )
    def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.pool = BlockPool(num_blocks, block_size, caching)
        self.model = PoolModel(num_blocks, block_size, caching)
        self.held: list[int] = []  # one entry per reference this test owns
        self.prompts: list[list[int]] = []  # token sequences served so far

    # -- allocation ---------------------------------------------------------

    @rule()
    def allocate(self) -> None:
        if self.model.available() == 0:
            with pytest.raises(MemoryError, match="all .* blocks are referenced"):
                self.pool.allocate()
            return
        got = self.pool.allocate()
        self.model.take(got)
        self.held.append(got)

    @rule(n=st.integers(0, 6))
    def allocate_many(self, n: int) -> None:
        if n > self.model.available():
            with pytest.raises(MemoryError, match=f"cannot allocate {n} KV-cache blocks"):
                self.pool.allocate_many(n)
            return
        got = self.pool.allocate_many(n)
        assert len(got) == n
        for block_id in got:
            self.model.take(block_id)
        self.held.extend(got)

    @rule(data=st.data())
    def incref(self, data: st.DataObject) -> None:
        block_id = data.draw(st.integers(-1, self.model.n))
        if not self.model.incref_ok(block_id):
            with pytest.raises(ValueError):
                self.pool.incref(block_id)
            return
        self.pool.incref(block_id)
        self.model.incref(block_id)
        self.held.append(block_id)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_held(self, data: st.DataObject) -> None:
        block_id = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.pool.free(block_id)
        self.model.decref(block_id)

    @rule(data=st.data())
    def free_unowned(self, data: st.DataObject) -> None:
        """Freeing a block this test holds no reference to is always an error."""
        block_id = data.draw(st.integers(-1, self.model.n))
        if block_id in self.held:
            return
        with pytest.raises(ValueError, match="double free|unknown block id"):
            self.pool.free(block_id)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def copy_on_write(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.held) - 1))
        block_id = self.held[index]
        if self.model.ref[block_id] == 1:
            assert self.pool.copy_on_write(block_id) == block_id
            return
        if self.model.available() == 0:
            with pytest.raises(MemoryError):
                self.pool.copy_on_write(block_id)
            return
        new = self.pool.copy_on_write(block_id)
        self.model.take(new)
        self.model.decref(block_id)
        self.held[index] = new

    # -- prefix cache -------------------------------------------------------

    @rule(data=st.data())
    def register(self, data: st.DataObject) -> None:
        """Registers any block after any parent, valid or not."""
        m = self.model
        candidates = sorted(set(self.held)) or [0]
        block_id = data.draw(st.sampled_from([*candidates, -1, m.n]))
        registered = sorted(m.key)
        parent = data.draw(st.sampled_from([None, *registered, *range(-1, m.n + 1)]))
        size = data.draw(st.sampled_from([m.bs, m.bs, m.bs, m.bs + 1, m.bs - 1]))
        tokens = tuple(data.draw(st.lists(TOKENS, min_size=size, max_size=size)))
        if m.register_error(block_id, parent, tokens):
            with pytest.raises(ValueError):
                self.pool.register_full_block(block_id, parent, list(tokens))
            return
        self.pool.register_full_block(block_id, parent, list(tokens))
        m.register(block_id, parent, tokens)

    @rule(tokens=st.lists(TOKENS, max_size=10))
    def serve_prompt(self, tokens: list[int]) -> None:
        """What the engine does: reuse the cached prefix, allocate and register the rest."""
        m, bs = self.model, self.model.bs
        table = self.match(tokens)
        for block_id in table:
            self.pool.incref(block_id)
            m.incref(block_id)
            self.held.append(block_id)
        for i in range(len(table), len(tokens) // bs):
            if m.available() == 0:
                break
            block_id = self.pool.allocate()
            m.take(block_id)
            self.held.append(block_id)
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            parent = table[-1] if table else None
            self.pool.register_full_block(block_id, parent, list(chunk))
            m.register(block_id, parent, chunk)
            table.append(block_id)
        self.prompts.append(tokens)

    @rule(data=st.data())
    def match_prefix(self, data: st.DataObject) -> None:
        base = data.draw(st.sampled_from(self.prompts)) if self.prompts else []
        cut = data.draw(st.integers(0, len(base)))
        tail = data.draw(st.lists(TOKENS, max_size=4))
        self.match(base[:cut] + tail)

    def match(self, tokens: list[int]) -> list[int]:
        got = self.pool.match_prefix(tokens)
        expected = self.model.match(tokens)
        bs = self.model.bs
        for i, block_id in enumerate(got):
            # Every hit holds exactly the query's tokens, after exactly its prefix.
            assert self.model.key.get(block_id) == tuple(tokens[: (i + 1) * bs])
        assert got == expected, f"match_prefix({tokens}) = {got}, the model says {expected}"
        return got

    @rule()
    def reset(self) -> None:
        assert self.pool.reset_prefix_cache() == self.model.reset()

    # -- invariants ---------------------------------------------------------

    @invariant()
    def agrees_with_model(self) -> None:
        m = self.model
        counts = Counter(self.held)
        for block_id in range(m.n):
            assert self.pool.ref_count(block_id) == m.ref[block_id] == counts[block_id]
            assert self.pool.is_cached(block_id) == m.cached(block_id)
        referenced = {b for b in range(m.n) if m.ref[b] > 0}
        lru = set(m.lru)
        assert len(lru) == len(m.lru)
        assert not (m.free & lru) and not (m.free & referenced) and not (lru & referenced)
        assert m.free | lru | referenced == set(range(m.n)), "a block was leaked"
        assert all(m.cached(b) for b in m.lru)
        assert self.pool.num_free_blocks() == m.available()
        assert self.pool.stats() == {
            "free_blocks": m.available(),
            "cached_blocks": len(m.cache),
            "hits": m.hits,
            "queries": m.queries,
            "evictions": m.evictions,
        }


BlockPoolMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockPool = BlockPoolMachine.TestCase


# -- error messages ----------------------------------------------------------


def test_double_free_is_an_error() -> None:
    pool = BlockPool(2, 4)
    block = pool.allocate()
    pool.free(block)
    with pytest.raises(ValueError, match=f"double free of block {block}"):
        pool.free(block)
    assert pool.num_free_blocks() == 2


@pytest.mark.parametrize("block_id", [-1, 2, 2**40])
def test_unknown_block_id_is_an_error(block_id: int) -> None:
    pool = BlockPool(2, 4)
    message = f"unknown block id {block_id}: the pool has 2 blocks"
    for call in (pool.free, pool.incref, pool.ref_count, pool.is_cached, pool.copy_on_write):
        with pytest.raises(ValueError, match=message):
            call(block_id)
    with pytest.raises(ValueError, match=message):
        pool.register_full_block(block_id, None, [1, 2, 3, 4])
    assert pool.num_free_blocks() == 2


def test_exhaustion_raises_memory_error_and_keeps_state() -> None:
    pool = BlockPool(3, 4)
    held = pool.allocate_many(2)
    with pytest.raises(MemoryError, match="cannot allocate 2 KV-cache blocks: only 1 of 3"):
        pool.allocate_many(2)
    assert pool.num_free_blocks() == 1
    pool.allocate()
    with pytest.raises(MemoryError, match="no free KV-cache block: all 3 blocks are referenced"):
        pool.allocate()
    assert [pool.ref_count(b) for b in held] == [1, 1]


def test_register_errors_name_the_problem() -> None:
    pool = BlockPool(3, 2)
    a, b = pool.allocate_many(2)
    with pytest.raises(ValueError, match="token_ids: a full block has 2 token ids, got 3"):
        pool.register_full_block(a, None, [1, 2, 3])
    with pytest.raises(ValueError, match=f"parent block {a} is not registered"):
        pool.register_full_block(b, a, [1, 2])
    with pytest.raises(ValueError, match="token_ids\\[1\\]: token id -5 is out of range"):
        pool.register_full_block(a, None, [1, -5])
    pool.free(b)
    with pytest.raises(ValueError, match=f"cannot register block {b}: it is not referenced"):
        pool.register_full_block(b, None, [1, 2])
    with pytest.raises(ValueError, match="is free and holds no cached content"):
        pool.incref(b)


def test_properties_and_constructor_errors() -> None:
    pool = BlockPool(5, 16, enable_prefix_caching=False)
    assert (pool.num_blocks, pool.block_size) == (5, 16)
    with pytest.raises(AttributeError):
        pool.num_blocks = 3  # type: ignore[misc]
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(4, 0)
