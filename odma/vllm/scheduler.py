"""vLLM's scheduler with odma's memory and order: `--scheduler-cls odma.vllm.Scheduler`.

On top of vLLM's own scheduler (everything it does stays: chunked prefill, preemption, prefix caching, async
scheduling):
- every new request is tagged by odma's length predictor, all arrivals since the last step in one batch;
- its KV blocks are one run of consecutive ids sized by its predicted bucket (odma.vllm.pool, odma.vllm.runs); a
  run that cannot grow in place moves whole, its KV copied by the worker;
- the waiting queue is served shortest predicted first with aging, or adaptively (odma.vllm.order);
- finished requests teach the bucket bounds their realized lengths;
- the metrics (share of requests whose KV stayed one run, growths in place / moved / appended, predictor error) go to
  the log and, when asked, to a JSON file.

vLLM picks the async or the plain scheduler from its config; `Scheduler` builds the matching one.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from pathlib import Path

import vllm
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler
from vllm.v1.core.sched.request_queue import RequestQueue, SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.request import RequestStatus

from odma.errors import ConfigError
from odma.vllm import plugin
from odma.vllm.config import PluginConfig
from odma.vllm.order import ShortestFirstQueue
from odma.vllm.pool import announce_moves, steer
from odma.vllm.tagging import LengthTags, Tag, remaining, user_text

log = logging.getLogger("vllm.odma")  # under vLLM's logger: its handlers and format

def require_known_vllm(version: str = vllm.__version__) -> None:
    """The plugin's version check, also for a scheduler named by --scheduler-cls without the plugin's switch."""
    plugin.require_known_vllm(version)


class OrderedRequestQueue(ShortestFirstQueue, RequestQueue):
    """odma's order behind vLLM's queue interface."""


class _OdmaScheduling:
    """The plugin's part; mixed in front of vLLM's Scheduler or AsyncScheduler."""

    def __init__(self, *args, **kwargs) -> None:
        require_known_vllm()
        super().__init__(*args, **kwargs)
        config = PluginConfig.from_sources(self.vllm_config.additional_config)
        self.odma_config = config
        self.odma_tags: dict[str, Tag] = {}
        self._odma_new: list = []  # requests queued since the last step, not tagged yet
        self.odma_finished = {"stopped": 0, "length": 0, "aborted": 0, "other": 0, "preemptions": 0}
        model_config = self.vllm_config.model_config
        self.odma_pool = None
        if config.runs:
            moves = config.moves and not self.scheduler_config.async_scheduling
            if config.moves and not moves:
                log.info("odma.vllm: async scheduling: runs that cannot grow in place append blocks (no moves)")
            placement = config.placement if config.placement != "auto" else "best-fit" if moves else "halving"
            self.odma_pool, self._odma_manager = steer(self.kv_cache_manager, moves=moves, placement=placement,
                                                       cache_keep=config.cache_keep)
        if config.order != "fcfs":
            if self.policy == SchedulingPolicy.PRIORITY:
                raise ConfigError("odma.vllm: order 'sjf'/'adaptive' replaces vLLM's priority queue; use "
                                  "--scheduling-policy fcfs, or odma order 'fcfs' to keep request priorities")
            depth = self.max_num_running_reqs if config.order == "adaptive" else 0
            self.waiting = OrderedRequestQueue(self._odma_remaining, config.aging_rounds, depth)
        from odma.engine.length_predictor import load_engine_predictor
        from odma.models.weights import model_name

        # the predictor runs between vLLM's steps, on the scheduler's thread: one thread, so that no idle
        # onnxruntime worker spins on the cores vLLM computes on
        os.environ.setdefault("ODMA_PREDICTOR_THREADS", "1")
        loaded = load_engine_predictor(config.predictor)
        generator = config.generator or model_name(model_config.model)
        self.odma_lengths = LengthTags(loaded, max_tokens_cap=self.max_model_len, generator=generator,
                                       calibrated=config.claim == "calibrated")
        self._odma_tokenizer = _load_tokenizer(model_config)
        self._odma_stats_at = time.monotonic()
        log.info("odma.vllm on vLLM %s: %s; predictor %s%s", vllm.__version__, json.dumps(config.as_dict()),
                 loaded.name, f" (fallback: {loaded.fallback_reason})" if loaded.fallback_reason else "")

    # -- vLLM's hooks ------------------------------------------------------------------------------------

    def add_request(self, request) -> None:
        known = request.request_id in self.requests
        super().add_request(request)
        if not known and request.request_id in self.requests:
            self._odma_new.append(request)

    def schedule(self, *args, **kwargs):
        self._odma_tag_new()
        waiting_before = len(self.waiting)
        output = super().schedule(*args, **kwargs)
        if self.odma_pool is not None and self.odma_pool.odma_moved:
            announce_moves(self.odma_pool, self.kv_cache_manager, output)
        if isinstance(self.waiting, ShortestFirstQueue) and output.scheduled_new_reqs \
                and waiting_before > len(output.scheduled_new_reqs):
            self.waiting.new_round()
        if self.odma_config.check_every_step:
            self.odma_check()
        return output

    def update_from_output(self, *args, **kwargs):
        outputs = super().update_from_output(*args, **kwargs)
        # every stats_every_s, and when the last request has finished (an idle engine schedules nothing more)
        if self.odma_config.stats_file and (time.monotonic() - self._odma_stats_at >= self.odma_config.stats_every_s
                                            or not (self.running or self.waiting)):
            self.odma_write_stats()
        return outputs

    def _free_request(self, request, *args, **kwargs):
        rid = request.request_id
        tag = self.odma_tags.pop(rid, None)
        status = request.status
        self.odma_finished["preemptions"] += getattr(request, "num_preemptions", 0)
        if status == RequestStatus.FINISHED_ABORTED:
            self.odma_finished["aborted"] += 1
        else:
            self.odma_finished["stopped" if status == RequestStatus.FINISHED_STOPPED else
                               "length" if status == RequestStatus.FINISHED_LENGTH_CAPPED else "other"] += 1
            self.odma_lengths.observe(tag, request.num_output_tokens)
        if isinstance(self.waiting, ShortestFirstQueue):
            self.waiting.forget(request)
        try:
            return super()._free_request(request, *args, **kwargs)
        finally:
            if self.odma_pool is not None:
                self.odma_pool.odma_claims.pop(rid, None)

    def shutdown(self) -> None:
        try:
            if self.odma_config.stats_file:
                self.odma_write_stats()
            log.info("odma.vllm: %s", json.dumps(self.odma_stats()))
        finally:
            super().shutdown()

    # -- odma's part -------------------------------------------------------------------------------------

    def _odma_remaining(self, request) -> float:
        return remaining(self.odma_tags.get(request.request_id), request.num_output_tokens)

    def _odma_tag_new(self) -> None:
        if not self._odma_new:
            return
        batch = [r for r in self._odma_new if r.request_id in self.requests and not r.is_finished()]
        self._odma_new = []
        if not batch:
            return
        texts = [user_text(t) for t in self._odma_decode([r.prompt_token_ids or [] for r in batch])]
        caps = [max(1, min(_max_tokens(r), self.max_model_len - r.num_prompt_tokens)) for r in batch]
        temperatures = [float(getattr(r.sampling_params, "temperature", 1.0) or 0.0) for r in batch]
        tags = self.odma_lengths.tag(texts, [r.num_prompt_tokens for r in batch], caps, temperatures)
        for request, tag in zip(batch, tags):
            self.odma_tags[request.request_id] = tag
            if self.odma_pool is not None:
                tokens = min(self.max_model_len, request.num_prompt_tokens + tag.reserved_output)
                self.odma_pool.odma_claims[request.request_id] = math.ceil(tokens / self.block_size)

    def _odma_decode(self, ids: list[list[int]]) -> list[str]:
        if self._odma_tokenizer is None:
            return [""] * len(ids)
        try:
            return self._odma_tokenizer.batch_decode(ids, skip_special_tokens=False)
        except Exception:  # noqa: BLE001 - a prompt the tokenizer cannot decode is predicted from no text
            log.exception("odma.vllm: could not decode prompts for the length predictor")
            return [""] * len(ids)

    def odma_stats(self) -> dict:
        out = {"vllm": vllm.__version__, "config": self.odma_config.as_dict(), "finished": dict(self.odma_finished),
               "predictor": {"name": self.odma_lengths.predictor.name, **self.odma_lengths.stats.as_dict(),
                             "bucket_bounds": list(getattr(self.odma_lengths.policy, "buckets").bounds)}}
        if self.odma_pool is not None:
            runs = self.odma_pool.odma_runs.stats
            done = runs.finished
            out["runs"] = {**runs.as_dict(), "placement": self.odma_pool.odma_runs.placement,
                           "moves": self.odma_pool.odma_moves, "num_blocks": self.odma_pool.num_gpu_blocks - 1,
                           "block_tokens": self.block_size,
                           "one_run_share": runs.finished_one_run / done if done else None,
                           "one_run_share_with_room": (done - runs.finished_split_with_room) / done if done else None}
        if isinstance(self.waiting, ShortestFirstQueue):
            out["order"] = {"rounds": self.waiting.round, "reordered": self.waiting.reordered}
        return out

    def odma_write_stats(self) -> None:
        self._odma_stats_at = time.monotonic()
        path = Path(self.odma_config.stats_file)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
            with os.fdopen(fd, "w") as f:
                json.dump(self.odma_stats(), f, indent=1)
            os.replace(tmp, path)
        except OSError as exc:  # metrics must never stop serving
            log.warning("odma.vllm: could not write %s: %s", path, exc)

    def odma_check(self) -> None:
        """The runs against vLLM's own state (tests; O(blocks)): the mirror equals vLLM's free queue, runs are
        disjoint and inside the pool, a request's latest piece is exactly its last blocks, and only live requests
        hold runs."""
        pool = self.odma_pool
        if pool is None:
            return
        runs = pool.odma_runs
        runs.check(pool.free_ids())
        held = self._odma_manager.req_to_blocks
        for rid, owner in runs.owners.items():
            blocks = held.get(rid)
            assert blocks, f"request {rid} holds a run but no blocks"
            r = owner.run
            tail = [b.block_id for b in blocks[len(blocks) - r.used:]]
            assert tail == list(range(r.start, r.start + r.used)), (rid, tail, r)
        counts: dict[int, int] = {}
        for rid, blocks in held.items():
            for b in blocks:
                if not b.is_null:
                    assert 0 < b.block_id < pool.num_gpu_blocks, (rid, b.block_id)
                    counts[b.block_id] = counts.get(b.block_id, 0) + 1
        for bid, n in counts.items():
            assert pool.blocks[bid].ref_cnt >= n, f"block {bid} held {n} times with ref_cnt {pool.blocks[bid].ref_cnt}"


def _max_tokens(request) -> int:
    params = request.sampling_params
    value = getattr(params, "max_tokens", None) if params is not None else None
    return int(value) if value else 1 << 30


def _load_tokenizer(model_config):
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_config.tokenizer, trust_remote_code=model_config.trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - without text the predictor still sees lengths and parameters
        log.warning("odma.vllm: no tokenizer for %s (%s); the predictor sees no prompt text", model_config.tokenizer,
                    exc)
        return None


class SyncScheduler(_OdmaScheduling, VllmScheduler):
    pass


class AsyncScheduler(_OdmaScheduling, VllmAsyncScheduler):
    pass


class Scheduler:
    """What `--scheduler-cls odma.vllm.Scheduler` names: builds odma's async or plain scheduler, whichever vLLM's
    config asks for (vLLM decides async scheduling before it builds the scheduler)."""

    def __new__(cls, *args, **kwargs):
        vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        chosen = AsyncScheduler if vllm_config.scheduler_config.async_scheduling else SyncScheduler
        return chosen(*args, **kwargs)
