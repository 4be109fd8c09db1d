"""AsyncEngine: the LLMEngine's step loop on a background thread, for the asyncio server.

One thread owns the LLMEngine: it applies queued add/abort commands between steps, steps while
there is work and sleeps on a condition otherwise (torch releases the GIL during the forward, so
the event loop keeps serving HTTP meanwhile). Outputs go back to the event loop with
loop.call_soon_threadsafe into one RequestSlot per request.

A slot keeps only the newest RequestOutput: outputs are cumulative (full text and token ids so
far), so a consumer that falls behind gets one bigger delta instead of a backlog. The engine
thread never waits on a consumer and memory per request stays bounded, which is why one slow
client can never stall or bloat the others.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from pagellm.engine.llm_engine import GRAMMAR_DEAD_END, LLMEngine
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import SamplingParams

logger = logging.getLogger("pagellm.async_engine")


class RequestError(Exception):
    """A request ended without a result: engine failure (500) or shutdown (503)."""

    def __init__(self, message: str, status_code: int = 500):
        super().__init__(message)
        self.message = message
        self.status_code = status_code


class RequestSlot:
    """The newest output of one request, read on the event loop.

    `waker` is shared by all slots of one HTTP request (a prompt list or n > 1), so a handler
    waits on a single event for whichever of its requests moved."""

    def __init__(self, request_id: str, waker: asyncio.Event):
        self.request_id = request_id
        self.waker = waker
        self.latest: RequestOutput | None = None
        self.error: RequestError | None = None
        self.done = False  # finished output or error delivered (set on the event loop)
        self.consumed = False  # the consumer has taken the last output or error

    def _put(self, output: RequestOutput) -> None:
        if self.done:
            return
        self.latest = output
        self.done = output.finished
        self.waker.set()

    def _fail(self, error: RequestError) -> None:
        if self.done:
            return
        self.error = error
        self.done = True
        self.waker.set()

    def take(self) -> RequestOutput | None:
        """The output delivered since the last take (None if none); raises the request's error
        once its outputs are taken."""
        out, self.latest = self.latest, None
        if out is None:
            if self.error is not None:
                self.consumed = True
                raise self.error
            return None
        if out.finished:
            self.consumed = True
        elif self.error is not None:
            self.waker.set()  # the error is still to be taken
        return out


_ALL = object()  # abort command target: every request


@dataclass
class _Add:
    slot: RequestSlot
    prompt: list[int]
    params: SamplingParams
    arrival_time: float
    future: asyncio.Future
    cache_salt: str | None = None
    lora_request: object | None = None  # a pagellm.lora.LoRARequest


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics=None):
        """metrics: optional object with observe_finished(RequestOutput) and observe_aborted(),
        called on the engine thread."""
        self.engine = engine
        self.metrics = metrics
        self.loop: asyncio.AbstractEventLoop | None = None
        self._cond = threading.Condition()
        self._commands: deque = deque()  # _Add, or (request_id | _ALL, RequestError | None)
        self._slots: dict[str, RequestSlot] = {}  # requests inside the engine (engine thread)
        self._num_active = 0  # added and not yet finished/aborted
        self._count_lock = threading.Lock()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.num_step_failures = 0

    # ---- lifecycle (event loop) ---------------------------------------------------------------
    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="pagellm-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the step loop; requests still inside are aborted (their blocks freed)."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    @property
    def is_alive(self) -> bool:
        return (self._thread is not None and self._thread.is_alive()
                and self.engine.dead is None)

    @property
    def num_active(self) -> int:
        """Requests accepted and not yet finished or aborted."""
        return self._num_active

    @property
    def num_waiting(self) -> int:
        """Sequences queued for the engine: commands not yet applied plus the scheduler's queue."""
        return sum(isinstance(c, _Add) for c in list(self._commands)) + self.engine.num_waiting

    # ---- requests (event loop) ----------------------------------------------------------------
    async def add_request(self, request_id: str, prompt_token_ids: list[int],
                          params: SamplingParams, waker: asyncio.Event,
                          arrival_time: float | None = None,
                          cache_salt: str | None = None, lora_request=None) -> RequestSlot:
        """Queue a request; returns once the engine has taken it. ValueError if it refused it."""
        if not self.is_alive:
            raise RequestError("the engine is not running", 503)
        slot = RequestSlot(request_id, waker)
        future = self.loop.create_future()
        cmd = _Add(slot, prompt_token_ids, params,
                   arrival_time if arrival_time is not None else time.monotonic(), future,
                   cache_salt, lora_request)
        self._count(+1)
        self._submit(cmd)
        try:
            await future
        except asyncio.CancelledError:
            self.abort(request_id)  # the client left while the request was being added
            raise
        return slot

    def abort(self, request_id: str, error: RequestError | None = None) -> None:
        """Abort a request (thread-safe, returns at once). With `error`, its slot receives it."""
        self._submit((request_id, error))

    def abort_all(self, error: RequestError | None = None) -> None:
        self._submit((_ALL, error))

    def _count(self, delta: int) -> None:
        with self._count_lock:
            self._num_active += delta

    def _submit(self, cmd) -> None:
        with self._cond:
            self._commands.append(cmd)
            self._cond.notify()

    # ---- the step loop (engine thread) --------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._commands or self._stop or self.engine.has_unfinished_requests()):
                    self._cond.wait()
                commands = list(self._commands)
                self._commands.clear()
                stop = self._stop
            try:
                for cmd in commands:
                    self._apply(cmd)
                if stop:
                    self._abort_everything(RequestError("the server is shutting down", 503))
                    return
                if self.engine.has_unfinished_requests():
                    self._step()
            except Exception as e:  # never let the loop die silently: fail what is inside
                logger.exception("engine loop error")
                self._abort_everything(RequestError(f"engine error: {e!r}", 500))

    def _apply(self, cmd) -> None:
        if isinstance(cmd, _Add):
            self._apply_add(cmd)
        elif cmd[0] is _ALL:
            self._abort_everything(cmd[1])
        else:
            self._abort_one(*cmd)

    def _apply_add(self, cmd: _Add) -> None:
        rid = cmd.slot.request_id
        try:
            self.engine.add_request(rid, cmd.prompt, cmd.params, arrival_time=cmd.arrival_time,
                                    cache_salt=cmd.cache_salt,
                                    lora_request=cmd.lora_request)
        except Exception as e:  # ValueError: bad request (400); anything else: engine bug (500)
            self._count(-1)
            if not isinstance(e, ValueError):
                logger.exception("add_request %s failed", rid)
                e = RequestError(f"the engine failed to add the request: {e!r}", 500)
            self._call(_resolve, cmd.future, e)
            return
        self._slots[rid] = cmd.slot
        self._call(_resolve, cmd.future, None)

    def _abort_one(self, request_id: str, error: RequestError | None) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is None:
            return  # finished already, or never added (its add failed)
        try:
            self.engine.abort_request(request_id)
        except Exception:  # the engine is in a bad state; the request is failed regardless
            logger.exception("abort of %s failed", request_id)
        self._count(-1)
        if self.metrics is not None:
            self.metrics.observe_aborted()
        self._call(slot._fail, error or RequestError("request aborted", 499))

    def _abort_everything(self, error: RequestError | None) -> None:
        for rid in list(self._slots):
            self._abort_one(rid, error)
        for rid in list(self.engine.requests):  # defensive: nothing should be left
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("abort of %s failed", rid)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            # LLMEngine.step ends a request that fails inside a step by itself (its output
            # arrives with finish_reason "error", below); it raises only when the engine is
            # lost (a tensor-parallel worker) or its own bookkeeping failed: fail everything
            # inside, free the blocks, and keep serving new requests if it can.
            self.num_step_failures += 1
            logger.exception("engine step failed; failing %d requests", len(self._slots))
            # a lost worker is said as such (engine.dead); any other exception's text stays in
            # the log, not in the responses of every client of the batch
            why = self.engine.dead or "engine step failed (details in the server log)"
            self._abort_everything(RequestError(why, 500))
            return
        deliveries = []
        for out in outputs:
            slot = self._slots.get(out.request_id)
            if slot is None:
                continue
            if out.finished and any(c.finish_reason == "error" for c in out.outputs):
                # The engine failed this request alone (its blocks are already back), or the
                # request's grammar cannot be completed with this model's tokens: a 400, as
                # the request's own constraint is what cannot be met.
                del self._slots[out.request_id]
                self._count(-1)
                grammar = any(c.finish_reason == "error" and c.stop_reason == GRAMMAR_DEAD_END
                              for c in out.outputs)
                self._call(slot._fail, RequestError(
                    "structured output cannot be completed: the grammar allows no further "
                    "token of this model", 400) if grammar
                    else RequestError("the engine failed this request", 500))
                continue
            deliveries.append((slot, out))
            if out.finished:
                del self._slots[out.request_id]
                self._count(-1)
                if self.metrics is not None:
                    self.metrics.observe_finished(out)
        if deliveries:
            self._call(_deliver, deliveries)

    def _call(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _deliver(deliveries: list[tuple[RequestSlot, RequestOutput]]) -> None:
    for slot, out in deliveries:
        slot._put(out)
