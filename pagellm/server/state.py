"""The server's shared state: the engine loop, the tokenizer thread, limits, names, and
handing requests to the engine and their outputs back (one per route family uses it)."""
from __future__ import annotations

import asyncio
import copy
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request

from pagellm.lora import LoRARequest
from pagellm.chat_template import check_continuation, render_chat
from pagellm.server.reasoning import PARSERS
from pagellm.engine.async_engine import AsyncEngine, RequestError, RequestSlot
from pagellm.infill import FimTokens, fim_tokens, infill_prompt, require_fim
from pagellm.metrics import ServerMetrics
from pagellm.outputs import RequestOutput
from pagellm.server.limits import Limits
from pagellm.server.errors import APIError, sampling_error
from pagellm.server.tools import prompt_messages, template_knows_tools, tool_dicts
from pagellm.structured import StructuredOutputError


class ResponseStore:
    """The newest responses of /v1/responses (store: true), each with the chat it ended
    (server/openai_responses.py): a later request goes on from one by previous_response_id.
    At most `capacity` of them and about `max_bytes` of their JSON (a response's body and its
    whole chat, though a chain's earlier messages are shared, not copied: an over-count); the
    oldest go first, and one past max_bytes alone is not kept. In memory, so a restart
    forgets them."""

    def __init__(self, capacity: int = 1024, max_bytes: int = 256 * 2**20):
        self.capacity, self.max_bytes = capacity, max_bytes
        self._items: OrderedDict[str, tuple[dict, list[dict], int]] = OrderedDict()
        self.num_bytes = 0

    def put(self, response_id: str, response: dict, messages: list[dict], nbytes: int) -> None:
        self.delete(response_id)
        if nbytes > self.max_bytes:  # it alone would empty the store: not kept
            return
        self._items[response_id] = (response, messages, nbytes)
        self.num_bytes += nbytes
        while self._items and (len(self._items) > self.capacity
                               or self.num_bytes > self.max_bytes):
            self.num_bytes -= self._items.popitem(last=False)[1][2]

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        item = self._items.get(response_id)
        return None if item is None else item[:2]

    def delete(self, response_id: str) -> bool:
        item = self._items.pop(response_id, None)
        if item is not None:
            self.num_bytes -= item[2]
        return item is not None


class OpenAIServer:
    """State shared by the routes: the engine loop, tokenizer, names and limits."""

    def __init__(self, engine, model_name: str, api_key: str | None = None,
                 max_waiting: int | None = None, sampling_defaults: dict | None = None,
                 limits: Limits | None = None, reasoning_parser: str | None = None,
                 lora_modules: dict[str, str] | None = None):
        """reasoning_parser: server/reasoning.py's PARSERS, or None (thinking stays in the
        answer's text). lora_modules: adapter name -> PEFT folder or GGUF LoRA file; a request
        whose `model` names one runs with it (each read and checked here, at start)."""
        if reasoning_parser is not None and reasoning_parser not in PARSERS:
            raise ValueError(f"reasoning_parser {reasoning_parser!r}: known are {list(PARSERS)}")
        self.loras: dict[str, LoRARequest] = {}
        for i, (name, path) in enumerate((lora_modules or {}).items(), start=1):
            if name == model_name:
                raise ValueError(f"lora module {name!r}: the base model's name")
            self.loras[name] = LoRARequest(name, i, path)
            engine._adapter(self.loras[name])  # a bad folder fails the start, not a request
        self.reasoning_parser = reasoning_parser
        self.engine = engine
        self.limits = limits or Limits()
        # Values for the sampling fields a request leaves out (the model's generation config
        # or --default-* flags); empty: OpenAI's defaults.
        self.sampling_defaults = dict(sampling_defaults or {})
        self.metrics = ServerMetrics(engine, model_name)
        self.async_engine = AsyncEngine(engine, self.metrics)
        # The engine thread detokenizes with engine.tokenizer; the event loop gets its own copy.
        self.tokenizer = copy.deepcopy(engine.tokenizer) if engine.tokenizer is not None else None
        # Tokenizing and chat templating run here, one at a time (a tokenizer is not safe to
        # share between threads), never on the event loop: a megabyte prompt must not stall
        # every other client's stream.
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="pagellm-tokenize")
        self.model_name = model_name
        self.api_key = api_key
        self.max_waiting = max_waiting
        self.max_model_len = engine.max_model_len
        self.created = int(time.time())
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self._token_strs: dict[int, str] = {}
        self.response_store = ResponseStore()
        self.fim = fim_tokens(self.tokenizer)  # read once: the tokenizer stays on its thread

    # ---- helpers ------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> LoRARequest | None:
        """404 for a model this server does not serve; the adapter a name selects, or None
        (the base model)."""
        if model is not None and model != self.model_name and model not in self.loras:
            served = ", ".join(f"`{n}`" for n in [self.model_name, *self.loras])
            raise APIError(404, f"The model `{model}` does not exist. This server serves "
                           f"{served}.", param="model", code="model_not_found")
        return self.loras.get(model)

    def token_str(self, token_id: int) -> str:
        s = self._token_strs.get(token_id)
        if s is None:
            s = self._token_strs[token_id] = self.tokenizer.decode([token_id])
        return s

    def tag_id(self, text: str) -> int | None:
        """The id of an added token spelled exactly `text` (Qwen2.5's <tool_call>), or None."""
        for tid, added in getattr(self.tokenizer, "added_tokens_decoder", {}).items():
            if added.content == text:
                return tid
        return None

    def need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise APIError(400, f"{what}: this model has no tokenizer; send token ids",
                           param=what)

    async def off_loop(self, fn, *args):
        """fn(*args) on the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    def encode_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            self.need_tokenizer("prompt")
            ids = self.tokenizer.encode(prompt)  # as LLMEngine._tokenize does
        else:
            prompt, ids = None, list(prompt)
        self.limits.check_prompt_tokens(len(ids), "prompt")
        return prompt, ids

    def infill_tokens(self, what: str) -> FimTokens:
        """The model's FIM tokens; 400 naming `what` when it has none."""
        self.need_tokenizer(what)
        try:
            return require_fim(self.fim, what)
        except ValueError as e:
            raise APIError(400, str(e), param=what) from None

    def encode_infill(self, prefix: str | list[int], suffix: str) -> tuple[None, list[int]]:
        """A fill-in-the-middle prompt (pagellm.infill) for OpenAI's `suffix`."""
        ids = infill_prompt(self.tokenizer, self.infill_tokens("suffix"), prefix, suffix)
        self.limits.check_prompt_tokens(len(ids), "prompt")
        return None, ids

    async def chat_prompt_ids(self, messages, tools, add_generation_prompt: bool,
                              template_kwargs: dict | None = None,
                              continue_final_message: bool = False) -> list[int]:
        """The prompt a chat completion with these messages (ChatMessage models) and tools
        (Tool models, or None) gets: chat completions, /tokenize and Anthropic's count_tokens
        build it here alike."""
        tools = tool_dicts(tools)
        native = template_knows_tools(self.tokenizer)
        turns = prompt_messages([m.as_dict() for m in messages], tools, native)
        return await self.off_loop(self.encode_chat, turns, add_generation_prompt,
                                   tools if native else None, template_kwargs,
                                   continue_final_message)

    def encode_chat(self, messages, add_generation_prompt: bool,
                    tools: list[dict] | None = None,
                    template_kwargs: dict | None = None,
                    continue_final_message: bool = False) -> list[int]:
        """messages: ChatMessage models or dicts already in the template's form;
        template_kwargs: the request's chat_template_kwargs; continue_final_message: the
        request's (render_chat's)."""
        try:  # its own field's 400 (render_chat's other ValueErrors name messages)
            check_continuation(add_generation_prompt, continue_final_message)
        except ValueError as e:
            raise APIError(400, str(e), param="continue_final_message") from None
        try:
            ids = render_chat(self.tokenizer,
                              [m if isinstance(m, dict) else m.as_dict() for m in messages],
                              add_generation_prompt, tools, template_kwargs,
                              continue_final_message)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        except Exception as e:  # a template that raises (jinja TemplateError, ...)
            raise APIError(400, f"messages: the chat template failed: {e}",
                           param="messages") from None
        return ids

    def max_tokens(self, num_prompt: int, requested: int | None, what: str,
                   field: str = "max_tokens") -> int:
        """The generation budget; 400 (naming `field`, the request's budget field) when
        prompt + budget exceed the context."""
        limit = self.max_model_len
        if requested is None:
            if num_prompt >= limit:
                raise APIError(400, f"This model's maximum context length is {limit} tokens. "
                               f"However, you requested {num_prompt} tokens in the {what}, "
                               "which leaves no room for the completion. Please reduce the "
                               f"length of the {what}.", param=what,
                               code="context_length_exceeded")
            return limit - num_prompt
        if num_prompt + requested > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, "
                           f"you requested {num_prompt + requested} tokens ({num_prompt} in the "
                           f"{what}, {requested} in the completion). Please reduce the length "
                           f"of the {what} or completion.", param=field,
                           code="context_length_exceeded")
        return requested

    def check_scored_prompt(self, num_prompt: int, what: str) -> None:
        """A prompt scored alone (max_tokens 0 with echo) may fill the context; 400 past it."""
        if num_prompt > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} "
                           f"tokens. However, you requested {num_prompt} tokens in the {what}. "
                           f"Please reduce the length of the {what}.", param=what,
                           code="context_length_exceeded")

    async def add(self, prompts: list[list[int]], params: list, arrival: float,
                  request_id: str, structured_field: str | None = None,
                  cache_salt: str | None = None, lora: LoRARequest | None = None
                  ) -> list[RequestSlot]:
        """Hand the prompts to the engine (one engine request per prompt; n is SamplingParams.n).
        503 when the waiting queue is full; 400 when the engine refuses a prompt (a schema or
        grammar it cannot compile: 400 naming structured_field, the field that sent it)."""
        waiting = self.async_engine.num_waiting
        new = sum(p.n for p in params)  # every sequence of every prompt will wait
        if self.max_waiting is not None and waiting + new > self.max_waiting:
            raise APIError(503, f"The server is overloaded: {waiting} requests are waiting "
                           f"(--max-waiting {self.max_waiting}). Retry later.",
                           code="queue_full", headers={"Retry-After": "1"})
        waker = asyncio.Event()
        slots: list[RequestSlot] = []
        try:
            # Queued together, so the engine thread takes them all between two steps (one
            # await each would add one prompt per step).
            added = await asyncio.gather(*(
                self.async_engine.add_request(f"{request_id}-{i}", ids, p, waker, arrival,
                                              cache_salt, lora)
                for i, (ids, p) in enumerate(zip(prompts, params))), return_exceptions=True)
            slots = [a for a in added if isinstance(a, RequestSlot)]
            for a in added:
                if isinstance(a, BaseException):
                    raise a
        except StructuredOutputError as e:
            self.abort(slots)
            field = structured_field or "structured_outputs"
            raise APIError(400, f"{field}: {e.detail}", param=field) from None
        except ValueError as e:
            self.abort(slots)
            raise sampling_error(e) from None
        except RequestError as e:
            self.abort(slots)
            raise APIError(e.status_code, e.message) from None
        except BaseException:
            self.abort(slots)
            raise
        return slots

    def abort(self, slots: list[RequestSlot]) -> None:
        for slot in slots:
            if not slot.done:
                self.async_engine.abort(slot.request_id)

    async def final_outputs(self, request: Request, slots: list[RequestSlot],
                            until=None) -> list[RequestOutput]:
        """Wait for every slot to finish; abort them if the client goes away meanwhile.
        until(i, output) -> True takes slot i's output as its last (the route's own stop
        condition; the request is aborted once every slot has its last output)."""
        finals: list[RequestOutput | None] = [None] * len(slots)

        async def collect():
            async for i, out in iterate(slots):
                if finals[i] is not None:  # stopped by `until`: it runs on until the others end
                    continue
                if out.finished or (until is not None and until(i, out)):
                    finals[i] = out
                    if all(f is not None for f in finals):
                        return  # the finally below aborts what `until` stopped

        task = asyncio.ensure_future(collect())
        watcher = asyncio.ensure_future(wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            task.cancel()
            self.abort(slots)
        if task not in done:
            raise APIError(499, "client disconnected")
        try:
            task.result()
        except RequestError as e:
            raise APIError(e.status_code, e.message) from None
        return finals


async def iterate(slots: list[RequestSlot]):
    """(slot index, newest output) as outputs arrive, until every slot is finished.
    Raises RequestError if a request failed."""
    waker = slots[0].waker
    while not all(s.consumed for s in slots):
        await waker.wait()
        waker.clear()
        for i, slot in enumerate(slots):
            if not slot.consumed:
                out = slot.take()
                if out is not None:
                    yield i, out


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
