"""The KV block pool: free queue, reference counts, hash-chained prefix cache, LRU eviction.

Every block is in exactly one of two places: referenced by >= 1 block tables (ref_cnt > 0), or in
the free queue (ref_cnt == 0). A free block may still hold a cached full block of tokens; it stays
findable by its hash until it is popped from the free queue for new tokens (least recently freed
first), at which point its stale hash entry is dropped.

Prefix cache: the hash of full block i is hash((hash of block i-1, its tokens, cache salt)).
A hit is confirmed by comparing the tokens and the parent block, so a hash collision can cost
a cache miss but never serves wrong KV.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pagellm.sequence import Sequence


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # contents, kept to confirm hash hits
    parent: tuple[int, int] | None = None  # (block_id, generation) of the previous block
    generation: int = 0  # bumped whenever the block is reused for other tokens


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...],
               salt: str | tuple | None) -> int:
    """salt: a request's cache_salt, or (LoRA adapter id, cache_salt) for an adapter's
    requests, a tuple no client's string salt can equal."""
    return hash((parent_hash, token_ids, salt))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        # Per-sequence bookkeeping: hashes of its full blocks, and how many of its table's
        # blocks are registered in the cache.
        self._seq_hashes: dict[int, list[int]] = {}
        self._seq_num_cached: dict[int, int] = {}
        # Copy-on-write copies (src block, dst block) the model runner must do before the step.
        self.pending_copies: list[tuple[int, int]] = []
        # Blocks registered in the cache by this step's allocations: the forward about to run
        # writes their KV (later admissions of the same step already share them). Kept until
        # the step commits, so a failed step can take them out again.
        self._uncommitted: list[int] = []
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens served from it
        self.peak_used_blocks = 0  # most blocks referenced at once (benchmarks report it)

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------------------
    def _block_hashes(self, seq: Sequence) -> list[int]:
        """Hashes of the sequence's full blocks of real (non-speculative) tokens, extended lazily."""
        hashes = self._seq_hashes.setdefault(seq.seq_id, [])
        num_full = seq.num_tokens // self.block_size
        bs = self.block_size
        while len(hashes) < num_full:
            i = len(hashes)
            tokens = tuple(seq.tokens_slice(i * bs, (i + 1) * bs))
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens, seq.cache_salt))
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of a new sequence's tokens.

        At most (num_tokens - 1) tokens are served, so that the last token is always computed
        and yields the logits for the next one (a fully cached prompt still runs a forward).
        """
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []  # (prompt log-probabilities need every prompt token's logits)
        hashes = self._block_hashes(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hit: list[int] = []
        parent: tuple[int, int] | None = None
        for i, h in enumerate(hashes[:max_blocks]):
            block_id = self.cached.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            tokens = tuple(seq.tokens_slice(i * self.block_size, (i + 1) * self.block_size))
            if block.token_ids != tokens or block.parent != parent:
                break  # hash collision: a miss, never wrong KV
            hit.append(block_id)
            parent = (block_id, block.generation)
        # Counted in allocate_slots, not here: the scheduler repeats this lookup every step
        # while the head of the queue waits for blocks, which inflated both counters.
        return hit

    def _register_full_blocks(self, seq: Sequence, num_computed_after: int) -> None:
        """Put the sequence's newly full blocks of real tokens into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(num_computed_after, seq.num_tokens) // self.block_size
        start = self._seq_num_cached.get(seq.seq_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(seq)
        bs = self.block_size
        for i in range(start, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None and hashes[i] not in self.cached:
                block.block_hash = hashes[i]
                block.token_ids = tuple(seq.tokens_slice(i * bs, (i + 1) * bs))
                prev = self.blocks[seq.block_table[i - 1]] if i > 0 else None
                block.parent = (prev.block_id, prev.generation) if prev else None
                self.cached[hashes[i]] = block.block_id
                self._uncommitted.append(block.block_id)
        self._seq_num_cached[seq.seq_id] = num_full

    def commit(self) -> None:
        """The step's forward wrote the KV of every block registered since the last commit."""
        self._uncommitted.clear()

    def drop_uncommitted(self) -> set[int]:
        """The step failed before its forward wrote them: take the blocks registered since
        the last commit out of the prefix cache (a later request with that prefix would read
        KV never written). Returns their ids: a sequence holding one as a cache hit must
        recompute."""
        dropped = set(self._uncommitted)
        for block_id in self._uncommitted:
            block = self.blocks[block_id]
            if block.block_hash is not None and self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
            block.token_ids = None
            block.parent = None
            block.generation += 1  # blocks chained after it no longer match
        self._uncommitted.clear()
        return dropped

    # ---- allocation ----------------------------------------------------------------------
    def _pop_free_block(self) -> KVBlock:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict: its old contents are about to be overwritten
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
            block.token_ids = None
            block.parent = None
            block.generation += 1
        block.ref_cnt = 1
        return block

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       cached_blocks: list[int] | None = None) -> bool:
        """Make seq's block table cover num_computed_tokens + num_new_tokens tokens.

        cached_blocks: prefix-cache hits for a sequence being admitted (its table is empty).
        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        cached_blocks = cached_blocks or []
        total = seq.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        num_new_blocks = self.blocks_needed(total) - len(seq.block_table) - len(cached_blocks)
        # Cache hits that sit in the free queue are taken out of it, so they count too.
        num_free_hits = sum(1 for b in cached_blocks if self.blocks[b].ref_cnt == 0)
        cow = self._needs_copy_on_write(seq, num_new_tokens)
        if max(num_new_blocks, 0) + num_free_hits + cow > self.num_free_blocks:
            return False
        if self.enable_prefix_caching and not seq.block_table and seq.num_computed_tokens == 0:
            # Admission (new, or again after preemption): one prefix-cache lookup, counted once.
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += len(cached_blocks) * self.block_size
        if cow:
            self._copy_on_write(seq)
        for block_id in cached_blocks:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self.free_queue[block_id]
            block.ref_cnt += 1
            seq.block_table.append(block_id)
        if cached_blocks:
            self._seq_num_cached[seq.seq_id] = len(cached_blocks)
            seq.num_computed_tokens += len(cached_blocks) * self.block_size
            seq.num_cached_tokens = len(cached_blocks) * self.block_size
        for _ in range(max(num_new_blocks, 0)):
            seq.block_table.append(self._pop_free_block().block_id)
        self._register_full_blocks(seq, total)
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)
        return True

    def _needs_copy_on_write(self, seq: Sequence, num_new_tokens: int) -> bool:
        """seq is about to write into a partly filled block that another sequence shares."""
        if num_new_tokens <= 0 or seq.num_computed_tokens % self.block_size == 0:
            return False
        block_id = seq.block_table[seq.num_computed_tokens // self.block_size]
        return self.blocks[block_id].ref_cnt > 1

    def _copy_on_write(self, seq: Sequence) -> None:
        i = seq.num_computed_tokens // self.block_size
        old = seq.block_table[i]
        new = self._pop_free_block().block_id
        self.pending_copies.append((old, new))
        self._release(old)
        seq.block_table[i] = new

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares every block of parent (n > 1 samples of one prompt); a shared partly
        filled block is copied when either writes into it."""
        for block_id in parent.block_table:
            self.blocks[block_id].ref_cnt += 1
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        self._seq_hashes[child.seq_id] = list(self._seq_hashes.get(parent.seq_id, []))
        self._seq_num_cached[child.seq_id] = self._seq_num_cached.get(parent.seq_id, 0)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def free(self, seq: Sequence) -> None:
        """Return all of seq's blocks. Tail first, so that eviction takes a prefix's end first."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        self._seq_num_cached.pop(seq.seq_id, None)

    def forget(self, seq: Sequence) -> None:
        """The sequence is gone for good: drop its hash list too."""
        self.free(seq)
        self._seq_hashes.pop(seq.seq_id, None)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Roll the table back to cover only num_tokens (rejected speculative tokens)."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())
        cached = self._seq_num_cached.get(seq.seq_id, 0)
        self._seq_num_cached[seq.seq_id] = min(cached, keep)

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_cnt > 0, f"double free of block {block_id}"
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self.free_queue[block_id] = None

    def check_invariants(self, tables: list[list[int]]) -> None:
        """Every block free or referenced; ref counts equal the number of tables holding it."""
        counts = [0] * self.num_blocks
        for table in tables:
            for b in table:
                counts[b] += 1
        for block in self.blocks:
            assert block.ref_cnt == counts[block.block_id], (block, counts[block.block_id])
            assert (block.ref_cnt == 0) == (block.block_id in self.free_queue), block
        for h, b in self.cached.items():
            assert self.blocks[b].block_hash == h
