"""One generation at a time: a thread of its own owns the Pipeline and serves jobs in arrival order from a bounded
queue; the event loop that submitted a job reads its text and its end as events.

One model, batch 1, as the engine is built (its caches are allocated once and its last prefill is kept for the next
prompt to reuse, decoding/engine.py): so the worker is the only caller of the pipeline once the server runs, and the
HTTP side never waits on the model. A job withdrawn while it waits (its client went away) frees its place at once;
a running one is stopped by Engine.generate's should_stop before its next verification, and a stop string stops it
the same way, or between two prefill chunks (Pipeline.generate_ids' on_prefill).
"""

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from triforce_cli.decoding.pipeline import Pipeline
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.decoding.stats import GenerationStats
from triforce_cli.errors import ConfigError, TriforceError
from triforce_cli.serve.metrics import Metrics
from triforce_cli.serve.prefix_states import DEFAULT_BUDGET, PrefixStates
from triforce_cli.serve.schemas import ApiError

log = logging.getLogger("triforce.serve")

REPLACEMENT = "\ufffd"  # what a decoder shows for the first bytes of a character whose last bytes are still to come


@dataclass(frozen=True)
class GenerationRequest:
    """What one HTTP request asks the model for, checked already: the prompt's token ids, at most max_tokens new
    tokens, the sampling, the stop strings, and whether its text is wanted piece by piece (stream)."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingConfig
    stop: tuple[str, ...] = ()
    stream: bool = False


@dataclass(frozen=True)
class Finished:
    """A generation's end: its text (cut before a stop string), OpenAI's finish_reason (stop: an end-of-sequence
    token or a stop string; length: max_tokens), the token ids generated and the engine's measurements."""

    text: str
    finish_reason: str
    token_ids: list[int]
    stats: GenerationStats


class QueueFull(Exception):
    """The queue holds --queue-size waiting jobs already (or the server is stopping)."""


class Stopped(Exception):
    """Raised from a prefill callback: the job was cancelled or ran past its deadline while its prompt was read."""


def timed_out_error(timeout: float) -> ApiError:
    message = f"the request took longer than the server's {timeout:g} s limit (--request-timeout)"
    return ApiError(504, message, kind="server_error", code="timeout")


class Job:
    """One request's generation. The worker puts its events on `events`, through the loop that made the job:
    ("started", None) and ("prefill", (tokens done, tokens in all)) for a streamed job, ("text", piece) as the tiers
    accept tokens (streamed jobs only), then ("done", Finished) or ("error", ApiError); the HTTP side adds ("gone",
    None) when the client has gone. A job given a timeout (seconds) is stopped once it has waited and run that
    long."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop, timeout: float | None = None):
        self.request, self.timeout = request, timeout
        self.events: asyncio.Queue[tuple[str, object]] = asyncio.Queue()
        self.cancelled = threading.Event()
        self._loop = loop
        self._deadline = None if timeout is None else time.monotonic() + timeout

    @property
    def timed_out(self) -> bool:
        return self._deadline is not None and time.monotonic() > self._deadline

    def should_stop(self) -> bool:
        return self.cancelled.is_set() or self.timed_out

    def cancel(self) -> None:
        """Stop the generation before its next verification (or skip it, if it has not started)."""
        self.cancelled.set()

    def emit(self, kind: str, value: object) -> None:
        """An event for the reader, from the worker's thread; dropped once the loop has closed (server stopped)."""
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:
            pass


class TextSoFar:
    """The text of the tokens generated so far, cut at the first stop string, handed out in pieces that will not
    change: a piece holds back a character whose bytes are not all there yet and text that may be the start of a
    stop string. The ids are decoded again as a whole each time, only where pieces or stop strings are wanted."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stops: tuple[str, ...], live: bool):
        self.tokenizer, self.stops, self.live = tokenizer, stops, live or bool(stops)
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of text handed out
        self.stopped = False  # a stop string was found: the generation is to end

    def add(self, ids: list[int]) -> str:
        """Take the next token ids; return the text that can be handed out now ('' for none)."""
        if self.stopped:
            return ""
        self.ids += ids
        if not self.live:
            return ""
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        found = [at for at in (self.text.find(stop) for stop in self.stops) if at >= 0]
        if found:
            self.text, self.stopped = self.text[: min(found)], True
            return self.finish()
        safe = len(self.text) - self._held_back()
        piece = self.text[self.sent : safe]
        self.sent = max(self.sent, safe)
        return piece

    def _held_back(self) -> int:
        """Characters at the end of text not to hand out yet: unfinished characters, and the longest end that
        starts a stop string."""
        whole = self.text.rstrip(REPLACEMENT)
        held = len(self.text) - len(whole)
        starts = [k for stop in self.stops for k in range(1, len(stop)) if whole.endswith(stop[:k])]
        return held + max(starts, default=0)

    def finish(self) -> str:
        """The rest of the text, once no more tokens come."""
        if not self.live:
            self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        piece = self.text[self.sent :]
        self.sent = len(self.text)
        return piece


class Worker:
    """The thread that runs every generation, one at a time, in the order the jobs arrived."""

    def __init__(
        self,
        *,
        pipeline: Pipeline,
        queue_size: int,
        metrics: Metrics,
        prompt_cache: Path | None = None,
        prefix_memory: int = DEFAULT_BUDGET,
    ):
        """Args:
        pipeline: the loaded models; only this worker uses them once it has started.
        queue_size: jobs that may wait beside the one running; submit refuses more (QueueFull).
        metrics: where each generation's counts go.
        prompt_cache: a folder of saved prefills (Pipeline.generate_ids), or None.
        prefix_memory: bytes of host memory for the prefix states kept between requests (PrefixStates); 0: only
            the one the full cache holds.
        """
        self.pipeline, self.queue_size, self.metrics, self.prompt_cache = pipeline, queue_size, metrics, prompt_cache
        self.prefix_states = PrefixStates(prefix_memory)
        self.mode = pipeline.config.mode  # the server's; a short prompt may run without the retrieval tier (mode_for)
        self._waiting: deque[Job] = deque()
        self._changed = threading.Condition()
        self._running: Job | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="triforce-worker", daemon=True)
        self._grace: threading.Timer | None = None

    def mode_for(self, prompt_tokens: int) -> str:
        """The server's mode, or, for a prompt too short for the retrieval cache's budget (a question of a few
        tokens, shorter than one chunk), the same tiers without the retrieval one: every mode's output is the
        target's, so the answer is the same, where the engine would refuse the prompt."""
        config = replace(self.pipeline.config, mode=self.mode)
        if not config.uses_retrieval:
            return self.mode
        try:
            config.budget_for(prompt_tokens)
        except ConfigError:
            return "streaming" if config.uses_drafter else "autoregressive"
        return self.mode

    def start(self) -> None:
        self._thread.start()

    def drain(self, grace: float) -> None:
        """The server is stopping: refuse new jobs, answer those waiting with 503, and let the running one go on
        for at most grace seconds before it is cancelled."""
        with self._changed:
            self._closed = True
            for job in self._waiting:
                job.cancel()
                job.emit("error", ApiError(503, "the server is shutting down", kind="server_error"))
            self._waiting.clear()
            self._changed.notify_all()
            if self._grace is None:
                self._grace = threading.Timer(grace, self._cancel_running)
                self._grace.daemon = True
                self._grace.start()

    def _cancel_running(self) -> None:
        with self._changed:
            if self._running is not None:
                self._running.cancel()

    def close(self) -> None:
        """Refuse new jobs, stop the running one at its next verification, drop those waiting; wait for the
        thread."""
        self.drain(0)
        self._cancel_running()
        if self._thread.is_alive():
            self._thread.join()
        if self._grace is not None:
            self._grace.cancel()

    @property
    def alive(self) -> bool:
        """Whether the worker thread runs (or has yet to start)."""
        return self._thread.is_alive() or (self._thread.ident is None and not self._closed)

    @property
    def closed(self) -> bool:
        return self._closed

    def has_room(self) -> bool:
        """Whether submit would take one more job now."""
        return not self._closed and len(self._waiting) < self.queue_size

    def submit(self, job: Job) -> None:
        """Queue job behind those waiting; QueueFull where queue_size jobs wait already."""
        with self._changed:
            if not self.has_room():
                raise QueueFull
            self._waiting.append(job)
            self._changed.notify_all()

    def withdraw(self, job: Job) -> None:
        """The job's client went away: cancel it, and free its place in the queue if it was still waiting."""
        job.cancel()
        with self._changed:
            if job in self._waiting:
                self._waiting.remove(job)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        return self._running is not None

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._waiting and not self._closed:
                    self._changed.wait()
                if self._closed:
                    return
                job = self._running = self._waiting.popleft()
            try:
                if job.timed_out:
                    job.emit("error", timed_out_error(job.timeout))
                elif not job.cancelled.is_set():
                    self._serve(job)
            except Exception:  # whatever a job does, the worker goes on with the next one
                log.exception("a job failed outside its generation")
                job.emit("error", ApiError(500, "the server failed; its log has the details", kind="server_error"))
            finally:
                with self._changed:
                    self._running = None

    def _serve(self, job: Job) -> None:
        """Run one job's generation and tell its reader how it went; an error in it ends the job, not the worker."""
        request, pipeline = job.request, self.pipeline
        text = TextSoFar(pipeline.target.tokenizer, request.stop, request.stream)

        def on_tokens(ids: list[int], origins: list[str]) -> None:
            piece = text.add(ids)
            if piece and request.stream:
                job.emit("text", piece)

        def on_prefill(name: str, done: int, total: int) -> None:
            if job.should_stop():
                raise Stopped
            if request.stream:
                job.emit("prefill", (done, total))

        if request.stream:
            job.emit("started", None)
        try:
            settings = {
                "mode": self.mode_for(len(request.prompt_ids)),
                "max_new_tokens": request.max_tokens,
                "sampling": request.sampling,
            }
            if any(getattr(pipeline.config, name) != value for name, value in settings.items()):
                pipeline.reconfigure(**settings)
            self.prefix_states.prepare(pipeline.engine, request.prompt_ids)
            try:
                result = pipeline.generate_ids(
                    request.prompt_ids,
                    on_prefill=on_prefill,
                    on_tokens=on_tokens,
                    prompt_cache=self.prompt_cache,
                    should_stop=lambda: job.should_stop() or text.stopped,
                )
            finally:
                self.prefix_states.keep(pipeline.engine)
        except Stopped:
            if job.timed_out:
                job.emit("error", timed_out_error(job.timeout))
            return
        except TriforceError as error:
            job.emit("error", ApiError(400, str(error)))
            return
        except Exception:  # the server keeps serving; the log has the traceback, the client a plain message
            log.exception("generation failed")
            message = "the generation failed; the server's log has the details"
            job.emit("error", ApiError(500, message, kind="server_error"))
            return
        if result.stats.stop_reason == "cancelled" and not text.stopped and job.timed_out:
            job.emit("error", timed_out_error(job.timeout))
            return
        rest = text.finish()
        if rest and request.stream:
            job.emit("text", rest)
        self.metrics.generation(result.stats)
        stop = text.stopped or result.stats.stop_reason == "eos"
        job.emit("done", Finished(text.text, "stop" if stop else "length", result.token_ids, result.stats))
