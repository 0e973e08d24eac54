"""vLLM's block pool steered into contiguous runs (odma.vllm.runs decides, this applies it to vLLM's objects).

vLLM 0.32's allocator has no supported hook for which block ids a request gets, so the plugin adjusts the one
pool object the scheduler built, before any block is handed out:
- the pool's class becomes `RunBlockPool`, a subclass whose `get_new_blocks` takes the ids BlockRuns chooses
  out of vLLM's free queue (the same bookkeeping vLLM does: reuse watchers, prefix-cache eviction, ref counts),
  and whose free / touch / unpin keep the mirror in step;
- the full-attention manager's `allocate_new_blocks`, `free` and `pop_blocks_for_free` are wrapped on that one
  instance to say whose blocks are being allocated, and when a request lets go of its run.

A run that cannot grow in place moves (`move_run`), through two things vLLM 0.32 itself has: the block copies a
scheduler step carries to the worker (`kv_cache_block_copies`, the path of vLLM's prefix copy-on-write: both ends
stay referenced until the step that copies has run) and the block-table replacement the worker does for a request
resumed after preemption (`resumed_req_ids`: the scheduler marks the moved request resumed with its whole new
block list, `announce_moves`). Under async scheduling the worker would rebuild a resumed request from tokens the
scheduler does not have yet, so there growth that cannot stay in place appends blocks, counted.
"""

from __future__ import annotations

from vllm.utils.math_utils import cdiv
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

from odma.errors import ConfigError
from odma.vllm.runs import BlockRuns


class RunBlockPool(BlockPool):
    odma_runs: BlockRuns
    odma_owner: str | None
    odma_claims: dict[str, int]
    odma_moves: bool  # move runs that cannot grow in place (plain scheduler only)
    odma_moved: list[str]  # requests moved during this step, for announce_moves

    def get_new_blocks(self, num_blocks: int):
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        owner = self.odma_owner
        runs = self.odma_runs
        if owner is None:
            ids = runs.take(num_blocks)
        elif runs.pieces(owner) is None:
            ids = runs.place(owner, num_blocks, self.odma_claims.get(owner, num_blocks))
        else:
            ids = runs.grow(owner, num_blocks)
        return self.hand_out(ids)

    def hand_out(self, ids: list[int]):
        """These free blocks, out of vLLM's free queue with vLLM's own bookkeeping (reuse watchers, prefix-cache
        eviction, ref counts, metrics)."""
        blocks = [self.blocks[i] for i in ids]
        queue = self.free_block_queue
        for block in blocks:
            queue.remove(block)
        if self._reuse_watchers:
            self._notify_reuse(blocks)
        for block in blocks:
            if self.enable_caching:
                self._maybe_evict_cached_block(block)
            assert block.ref_cnt == 0, f"block {block.block_id} handed out while in use"
            block.ref_cnt += 1
            if self.metrics_collector:
                self.metrics_collector.on_block_allocated(block)
        return blocks

    def free_blocks(self, ordered_blocks) -> None:
        ordered = list(ordered_blocks)
        super().free_blocks(ordered)
        freed = {b.block_id: None for b in ordered if b.ref_cnt == 0 and not b.is_null and b.pool in (None, self)}
        self.odma_runs.give_back(list(freed), _cached(ordered))

    def touch(self, blocks) -> None:
        leaving = [b.block_id for b in blocks if b.ref_cnt == 0 and not b.is_null]
        super().touch(blocks)
        if leaving:
            self.odma_runs.taken_elsewhere(leaving)

    def unpin_blocks(self, blocks, on_reuse) -> None:
        blocks = list(blocks)
        super().unpin_blocks(blocks, on_reuse)
        freed = {b.block_id: None for b in blocks if b.ref_cnt == 0 and not b.is_null}
        self.odma_runs.give_back(list(freed), _cached(blocks))

    def free_ids(self) -> set[int]:
        """The ids in vLLM's own free queue (for checks)."""
        ids = set()
        block = self.free_block_queue.fake_free_list_head.next_free_block
        tail = self.free_block_queue.fake_free_list_tail
        while block is not None and block is not tail:
            ids.add(block.block_id)
            block = block.next_free_block
        return ids


def _cached(blocks) -> set[int]:
    """Ids of these blocks that still hold a prefix-cache entry (vLLM keeps a freed full block's hash)."""
    return {b.block_id for b in blocks if b.block_hash is not None}


def move_run(pool: RunBlockPool, manager: FullAttentionManager, request_id: str, num_tokens: int):
    """Give `request_id` room for `num_tokens` by moving its whole KV into a new run, when its run cannot grow in
    place and a free extent holds the new one: the new blocks past its old ones (what vLLM's allocation returns),
    or None to let the allocation go on as usual.

    The copy rides on vLLM's copy-on-write path: each (old, new) pair goes into the manager's pending copies, the
    new block takes an extra reference and the old one keeps the request's; the scheduler hands the pairs to the
    worker with this step and drops both extra references once that step's copy has run, which returns the old
    blocks to the pool (and to the runs' mirror, through free_blocks)."""
    held = manager.req_to_blocks.get(request_id)
    n = cdiv(num_tokens, manager.block_size) - len(held) if held else 0
    if n <= 0:  # most steps: nothing to allocate, or a first allocation (placed, not moved)
        return None
    runs = pool.odma_runs
    if runs.pieces(request_id) is None or runs.fits_in_place(request_id, n) \
            or request_id in getattr(manager, "_partial_hit_reqs", ()) or any(b.is_null for b in held):
        return None
    ids = runs.move(request_id, len(held), n)
    if ids is None:
        return None
    blocks = pool.hand_out(ids)
    for old, new in zip(held, blocks):
        if old.block_hash is not None:  # the prefix cache follows the live copy
            pool.move_block_hashes(old, new)
        manager._pending_cow_copies.append((old, new))
        new.ref_cnt += 1
    held[:] = blocks
    grown = blocks[len(blocks) - n:]
    if manager.records_new_block_ids:  # copy targets are overwritten whole; only the new blocks need zeroing
        manager.new_block_ids.extend(b.block_id for b in grown)
    pool.odma_moved.append(request_id)
    return grown


def announce_moves(pool: RunBlockPool, kv_cache_manager, output) -> None:
    """Tell the worker the moved requests' whole new block lists: a request listed as resumed gets its block table
    replaced instead of appended to (its tokens and sampling state stay cached in the worker). A request moved and
    then preempted in the same step is not scheduled; its blocks are gone with it."""
    moved, pool.odma_moved = pool.odma_moved, []
    cached = output.scheduled_cached_reqs
    index = {rid: i for i, rid in enumerate(cached.req_ids)}
    for rid in moved:
        i = index.get(rid)
        if i is not None:
            cached.new_block_ids[i] = kv_cache_manager.get_block_ids(rid)
            cached.resumed_req_ids.add(rid)


def steer(kv_cache_manager, moves: bool = False,
          placement: str = "halving", cache_keep: float = 0.5) -> tuple[RunBlockPool, FullAttentionManager]:
    """Turn the scheduler's (still empty) pool into a RunBlockPool. Refused, in words, for KV layouts the runs do
    not cover: more than one KV cache group (hybrid models), or attention other than full attention."""
    coordinator = kv_cache_manager.coordinator
    managers = list(coordinator.single_type_managers)
    if len(managers) != 1 or type(managers[0]) is not FullAttentionManager:
        kinds = ", ".join(type(m).__name__ for m in managers)
        raise ConfigError(f"odma.vllm: contiguous runs need one full-attention KV cache group, this model has "
                          f"[{kinds}]; start with --additional-config '{{\"odma\": {{\"runs\": false}}}}' to keep "
                          f"only odma's order")
    pool = kv_cache_manager.block_pool
    if type(pool) is not BlockPool:
        raise ConfigError(f"odma.vllm: the block pool is a {type(pool).__name__}, not vLLM's BlockPool")
    if pool.get_num_free_blocks() != pool.num_gpu_blocks - 1:
        raise ConfigError("odma.vllm: the block pool already handed out blocks; runs must start from an empty pool")
    pool.__class__ = RunBlockPool
    pool.odma_runs = BlockRuns(pool.num_gpu_blocks, reserved=(pool.null_block.block_id,), placement=placement,
                               keep=cache_keep if pool.enable_caching else 0.0)
    pool.odma_owner = None
    pool.odma_claims = {}
    pool.odma_moves = moves
    pool.odma_moved = []
    manager = managers[0]
    allocate, free, pop = manager.allocate_new_blocks, manager.free, manager.pop_blocks_for_free

    def allocate_new_blocks(request_id, num_tokens, num_tokens_main_model):
        if pool.odma_moves:
            moved = move_run(pool, manager, request_id, num_tokens)
            if moved is not None:
                return moved
        pool.odma_owner = request_id
        try:
            return allocate(request_id, num_tokens, num_tokens_main_model)
        finally:
            pool.odma_owner = None

    # a preempted request keeps its claim for when it is placed again; the scheduler drops it when the request ends
    def free_request(request_id):
        try:
            free(request_id)
        finally:
            pool.odma_runs.drop(request_id)

    def pop_blocks_for_free(request_id):
        blocks = pop(request_id)
        pool.odma_runs.drop(request_id)  # its blocks come back later through free_blocks
        return blocks

    manager.allocate_new_blocks = allocate_new_blocks
    manager.free = free_request
    manager.pop_blocks_for_free = pop_blocks_for_free
    return pool, manager
