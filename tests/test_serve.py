"""`triforce serve`: the OpenAI-compatible server, tested live on 127.0.0.1 (a random free port, uvicorn on a
thread) with the real `openai` client, and with raw HTTP (httpx) for what the client would refuse to send.

The model is the tiny random target with a word-level tokenizer and chat template of helpers.chat_model: a prompt
is words w0..w31, an answer too. Servers whose pipeline records what it was asked, waits at a gate or runs slowly
test the queue: the order requests are served in, the 503 of a full queue, a client that goes away.
"""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import ALPHABET, PROMPT, chat_model, tiny_loaded
from typer.testing import CliRunner

from triforce_cli.cli import serve as serve_command
from triforce_cli.cli.app import app as cli_app
from triforce_cli.cli.serve import is_loopback
from triforce_cli.decoding.chat import shared_length
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.pipeline import Pipeline
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.decoding.setup import LoadOptions
from triforce_cli.runtime.prompts import encode_messages

for extra in ("openai", "httpx", "fastapi", "uvicorn"):  # the web stack and the test extra's clients
    pytest.importorskip(extra, reason=f"`{extra}` is not installed (`pip install -e .[test]`)")
import httpx
import openai
import uvicorn

from triforce_cli.serve import app as serve_app
from triforce_cli.serve.app import create_app
from triforce_cli.serve.worker import TextSoFar

ROOT = Path(__file__).resolve().parents[1]
MODEL = "chat"  # the tiny target's name, which the server serves it as
DOCUMENT = " ".join(f"w{(7 * i) % 19}" for i in range(96))  # a "long" document: several prefill chunks of 16
NEW_TOKENS = 16
GREEDY = SamplingConfig(temperature=0)


def config(**changes) -> EngineConfig:
    """TriForce on the tiny model (the target drafts for itself on a 24-token StreamingLLM window), prefilling in
    chunks of 16 so that a 100-token prompt has whole chunks to reuse; every tier drafts its gamma (at the costed
    default's prices a target drafting for itself never pays, so it would not draft)."""
    settings = {
        "chunk_size": 8,
        "draft_window": 24,
        "sink_tokens": 4,
        "max_new_tokens": NEW_TOKENS,
        "prefill_block": 16,
        "gamma_policy": "fixed",
    }
    return EngineConfig(**{**settings, **changes})


def pipeline(cls: type[Pipeline] = Pipeline, **changes) -> Pipeline:
    target = chat_model()
    return cls(target, None, Engine(target, config(**changes)))


def reference_text(prompt: str, chat: bool, max_new_tokens: int = NEW_TOKENS, mode: str = "triforce") -> str:
    """What greedy Pipeline.generate (as `triforce generate` runs it) writes for prompt, on a pipeline of its own."""
    pipe = pipeline(max_new_tokens=max_new_tokens, sampling=GREEDY, mode=mode)
    return pipe.generate(prompt, chat=chat).text


class LiveServer:
    """uvicorn serving app on 127.0.0.1 at a free port, on a thread, until close()."""

    def __init__(self, app):
        self.app = app
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)

    def client(self, api_key: str = "none", **options) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, **{"max_retries": 0, **options})

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def live():
    server = LiveServer(create_app(pipeline=pipeline()))
    yield server
    server.close()


def question(words: str) -> list[dict]:
    return [{"role": "user", "content": f"{DOCUMENT} {words}"}]


# ------------------------------------------------------------------------------------------------ the engine hook
def test_should_stop_ends_a_generation_at_a_verification_with_what_it_had():
    target = chat_model()
    prompt = target.tokenizer(DOCUMENT).input_ids
    whole = Engine(target, config(sampling=GREEDY)).generate(prompt)
    asked = []
    stopped = Engine(target, config(sampling=GREEDY)).generate(
        prompt, should_stop=lambda: asked.append(1) or len(asked) > 2
    )
    assert stopped.stats.stop_reason == "cancelled"
    assert 1 <= len(stopped.token_ids) < len(whole.token_ids)
    assert stopped.token_ids == whole.token_ids[: len(stopped.token_ids)]
    assert len(stopped.stats.round_tokens) == 2  # two verifications ran, the third was not started


def test_text_so_far_holds_back_a_possible_stop_string_and_cuts_at_one():
    tokenizer = chat_model().tokenizer
    text = TextSoFar(tokenizer, ("w3 w4",), live=True)
    ids = tokenizer("w1 w2 w3 w4 w5").input_ids
    pieces = [text.add([i]) for i in ids]
    assert text.stopped and text.text == "w1 w2 "
    assert "".join(pieces) == "w1 w2 " and "w3" not in "".join(pieces)


# ------------------------------------------------------------------------------------------------ the happy paths
def test_models_and_health(live):
    assert [m.id for m in live.client().models.list().data] == [MODEL]
    assert live.client().models.retrieve(MODEL).id == MODEL
    assert httpx.get(f"{live.url}/health").json() == {"status": "ok"}


def test_chat_greedy_is_the_pipelines_output_with_usage_and_tier_counts(live):
    messages = question("w3 w5")
    response = live.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=NEW_TOKENS, temperature=0, user="someone"
    )
    choice = response.choices[0]
    assert choice.message.content == reference_text(messages[0]["content"], chat=True)
    assert choice.message.role == "assistant" and choice.finish_reason == "length"  # the tiny model has no EOS
    usage = response.usage
    assert usage.completion_tokens == NEW_TOKENS
    assert usage.total_tokens == usage.prompt_tokens + NEW_TOKENS > 96
    tiers = usage.triforce["tiers"]
    assert {(t["proposer"], t["verifier"]) for t in tiers} >= {("retrieval", "target"), ("drafter", "retrieval")}
    assert all(0 <= t["accepted"] <= t["proposed"] for t in tiers) and sum(t["proposed"] for t in tiers) > 0


def test_completions_greedy_streamed_and_not_are_the_pipelines_output(live):
    prompt = f"{DOCUMENT} w1 w2"
    client = live.client()
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
    expected = reference_text(prompt, chat=False)
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "length"
    chunks = list(
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"
    ids = chat_model().tokenizer(prompt).input_ids
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=NEW_TOKENS, temperature=0)
    assert by_ids.choices[0].text == expected


def test_chat_streaming_ends_with_usage_and_done(live):
    messages = question("w2 w9")
    stream = live.client().chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=NEW_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference_text(messages[0]["content"], chat=True)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == NEW_TOKENS
    raw = httpx.post(
        f"{live.url}/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 4, "stream": True},
    )
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.rstrip().endswith("data: [DONE]")


def test_seeded_sampling_repeats(live):
    client = live.client()

    def sampled(seed: int) -> str:
        response = client.chat.completions.create(
            model=MODEL, messages=question("w4"), max_tokens=NEW_TOKENS, temperature=1.0, top_p=0.95, seed=seed
        )
        return response.choices[0].message.content

    first = sampled(7)
    assert sampled(7) == first
    assert any(sampled(seed) != first for seed in (8, 9, 10))


def test_a_second_question_about_the_document_prefills_only_its_new_tokens(live):
    client = live.client()
    client.chat.completions.create(model=MODEL, messages=question("w1"), max_tokens=4, temperature=0)
    second = client.chat.completions.create(model=MODEL, messages=question("w12 w6"), max_tokens=4, temperature=0)
    tokenizer = chat_model().tokenizer
    first_ids, second_ids = (encode_messages(tokenizer, question(words)) for words in ("w1", "w12 w6"))
    shared = shared_length(first_ids, second_ids)
    reused = second.usage.triforce["prefix_tokens_reused"]
    assert reused == shared > 96  # the template's start and the whole document, not only its whole prefill chunks
    assert second.usage.prompt_tokens - reused == len(second_ids) - shared
    assert second.usage.prompt_tokens_details.cached_tokens == reused
    metrics = httpx.get(f"{live.url}/metrics").text
    assert float(metric(metrics, "triforce_prefix_tokens_reused_total")) >= reused


def test_a_follow_up_holding_the_answer_prefills_only_the_end_of_turn_and_the_question(live):
    """The answer's keys and values stay in the full cache: a request that sends the conversation back with it
    (its text tokenized as the template renders it, the same ids here) keeps the last prompt and the answer but its
    last token, whose keys no forward wrote yet."""
    client = live.client()
    first = client.chat.completions.create(model=MODEL, messages=question("w3"), max_tokens=6, temperature=0)
    answer = first.choices[0].message.content
    follow_up = [*question("w3"), {"role": "assistant", "content": answer}, {"role": "user", "content": "w4 w5"}]
    second = client.chat.completions.create(model=MODEL, messages=follow_up, max_tokens=4, temperature=0)
    tokenizer = chat_model().tokenizer
    held = encode_messages(tokenizer, question("w3")) + tokenizer(answer, add_special_tokens=False).input_ids
    assert encode_messages(tokenizer, follow_up)[: len(held)] == held
    assert second.usage.triforce["prefix_tokens_reused"] == len(held) - 1


def test_a_stop_string_cuts_the_text_and_finishes_with_stop(live):
    prompt = f"{DOCUMENT} w8"
    expected = reference_text(prompt, chat=False)
    words = expected.split()
    stop = " ".join(words[3:5])
    cut = expected[: expected.index(stop)]
    client = live.client()
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, stop=[stop])
    assert response.choices[0].text == cut and response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens < NEW_TOKENS or response.usage.triforce["stop_reason"] == "cancelled"
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == cut and chunks[-1].choices[0].finish_reason == "stop"


def metric(text: str, name: str, labels: str = "") -> str:
    """The value of one sample of the Prometheus text."""
    return next(line.split()[-1] for line in text.splitlines() if line.startswith(f"{name}{labels} "))


def test_metrics_count_requests_tokens_and_acceptance(live):
    live.client().completions.create(model=MODEL, prompt=f"{DOCUMENT} w5", max_tokens=4, temperature=0)
    response = httpx.get(f"{live.url}/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert int(metric(text, "triforce_requests_total", '{route="/v1/completions",outcome="ok"}')) >= 1
    assert int(metric(text, "triforce_generation_tokens_total")) >= 4
    assert float(metric(text, "triforce_prefill_seconds_total")) > 0
    assert int(metric(text, "triforce_proposed_tokens_total", '{proposer="retrieval",verifier="target"}')) > 0
    assert 0 <= float(metric(text, "triforce_acceptance_ratio", '{proposer="retrieval",verifier="target"}')) <= 1
    assert metric(text, "triforce_queue_waiting") == "0"
    assert "# TYPE triforce_requests_total counter" in text


# ------------------------------------------------------------------------------------------------ bad input
def post(live, body, route: str = "chat/completions", **options) -> httpx.Response:
    return httpx.post(
        f"{live.url}/v1/{route}", **({"content": body} if isinstance(body, (str, bytes)) else {"json": body}), **options
    )


def chat_body(**fields) -> dict:
    return {"model": MODEL, "messages": question("w1"), "max_tokens": 2, **fields}


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        ('{"model": "chat", "messages": [', 400, None, "not valid JSON"),
        ("[1, 2]", 400, None, "JSON object"),
        (chat_body(max_tokens="5"), 400, "max_tokens", "integer"),
        (chat_body(max_tokens=-3), 400, "max_tokens", "greater than or equal to 1"),
        (chat_body(max_tokens=10**12), 400, "max_tokens", "context"),
        (chat_body(max_tokens=2, max_completion_tokens=3), 400, "max_tokens", "differ"),
        (chat_body(temperature=-1), 400, "temperature", "greater than or equal to 0"),
        (chat_body(temperature=1e9), 400, "temperature", "less than or equal to 2"),
        (chat_body(top_p=-0.1), 400, "top_p", "greater than or equal to 0"),
        (chat_body(stream="yes"), 400, "stream", "boolean"),
        (chat_body(seed=-1), 400, "seed", "greater than or equal to 0"),
        (chat_body(seed=True), 400, "seed", "integer"),
        (
            chat_body(n=2),
            400,
            "n",
            "'n' 2 is not supported: one choice per request is generated (one model, batch 1) (accepted: null, 1)",
        ),
        (chat_body(logprobs=True), 400, "logprobs", "not returned"),
        (chat_body(presence_penalty=0.5), 400, "presence_penalty", "exact"),
        (chat_body(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools", "not supported"),
        (chat_body(response_format={"type": "json_object"}), 400, "response_format", "plain text"),
        (chat_body(guided_json={"type": "object"}), 400, "guided_json", "constrained decoding"),
        (chat_body(repetition_penalty=1.2), 400, "repetition_penalty", "exact"),
        (chat_body(frequency_penalty=0.3), 400, "frequency_penalty", "exact"),
        (chat_body(logit_bias={"5": 10}), 400, "logit_bias", "exact"),
        (chat_body(top_logprobs=3), 400, "top_logprobs", "not returned"),
        (chat_body(top_k=-2), 400, "top_k", "greater than or equal to -1"),
        (chat_body(min_p=1.5), 400, "min_p", "less than or equal to 1"),
        (
            chat_body(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}]),
            400,
            "messages.0.tool_calls",
            "not supported",
        ),
        (chat_body(stop=[""]), 400, "stop", "1 to"),
        (chat_body(stop=[f"w{i}" for i in range(20)]), 400, "stop", "at most"),
        (chat_body(stream_options={"include_usage": True}), 400, "stream_options", "stream"),
        (chat_body(messages=[]), 400, "messages", "at least 1"),
        (chat_body(messages=[{"role": "robot", "content": "w1"}]), 400, "messages.0.role", "user"),
        (
            chat_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            400,
            "messages.0.content.0",
            "'image_url' is not supported",
        ),
        (chat_body(messages=[{"role": "user", "content": [{"type": "text"}]}]), 400, "messages.0.content.0", "text"),
        (chat_body(messages=[{"role": "user", "content": " ".join(["w2"] * 600)}]), 400, "messages", "context"),
        ({"messages": question("w1")}, 400, "model", "required"),
        (chat_body(model="gpt-4o"), 404, "model", "does not exist"),
    ],
)
def test_bad_requests_get_an_openai_error_and_the_server_goes_on(live, body, status, param, words):
    response = post(live, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    assert post(live, chat_body()).status_code == 200


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"prompt": ["w1 w2", "w3 w4"]}, "prompt", "one per request"),
        ({"prompt": [5, 99]}, "prompt", "vocabulary"),
        ({"prompt": ""}, "prompt", "empty"),
        ({"prompt": "w1 w2", "echo": True}, "echo", "echoed"),
        ({"prompt": "w1 w2", "best_of": 3}, "best_of", "one choice"),
    ],
)
def test_bad_completion_requests(live, fields, param, words):
    response = post(live, {"model": MODEL, "max_tokens": 2, **fields}, route="completions")
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param and words in response.json()["error"]["message"]


def test_a_prompt_shorter_than_a_retrieval_chunk_runs_without_that_tier(live):
    response = live.client().completions.create(model=MODEL, prompt="w1 w2", max_tokens=4, temperature=0)
    assert response.usage.triforce["mode"] == "streaming"  # 2 tokens: no whole chunk of 8 to retrieve
    assert response.choices[0].text == reference_text("w1 w2", chat=False, max_new_tokens=4, mode="autoregressive")


def test_chat_without_a_chat_template_is_a_400_and_unknown_routes_a_404():
    target = tiny_loaded("plain", seed=0, pieces=list(ALPHABET))  # a character tokenizer without a chat template
    server = LiveServer(create_app(pipeline=Pipeline(target, None, Engine(target, config()))))
    try:
        response = post(server, {"model": "plain", "messages": [{"role": "user", "content": "hello there"}]})
        assert response.status_code == 400 and "chat template" in response.json()["error"]["message"]
        text = server.client().completions.create(model="plain", prompt=PROMPT, max_tokens=3, temperature=0)
        assert len(text.choices[0].text) == 3
        missing = httpx.get(f"{server.url}/v1/files")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"
    finally:
        server.close()


# ------------------------------------------------------------------------------------------------ the queue
@dataclass
class Recorder:
    """What a test pipeline was asked: each prompt's ids in the order generation started, and the results."""

    prompts: list[list[int]] = field(default_factory=list)
    results: list = field(default_factory=list)
    gate: threading.Event = field(default_factory=threading.Event)
    pause: float = 0.0  # seconds to wait after each verification's tokens
    fail: bool = False  # raise instead of generating
    prefilled: list[tuple[int, int]] = field(default_factory=list)  # (tokens done, in all) after each prefill chunk


class RecordingPipeline(Pipeline):
    """A pipeline that records its prompts and results, holds its first generation at a gate and may run slowly."""

    recorder: Recorder

    def generate_ids(self, prompt_ids, on_prefill=None, on_tokens=None, prompt_cache=None, should_stop=None):
        recorder = self.recorder
        recorder.prompts.append(prompt_ids)
        assert recorder.gate.wait(30)
        if recorder.fail:
            raise RuntimeError("the model broke")

        def slowly(ids, origins):
            on_tokens(ids, origins)
            time.sleep(recorder.pause)

        def counted(name, done, total):
            recorder.prefilled.append((done, total))
            if on_prefill is not None:
                on_prefill(name, done, total)

        result = super().generate_ids(prompt_ids, counted, slowly, prompt_cache, should_stop)
        recorder.results.append(result)
        return result


@pytest.fixture
def gated():
    """A live server (queue of 3) whose generations wait at a gate: recorder.gate.set() lets them run."""
    pipe = pipeline(RecordingPipeline)
    pipe.recorder = Recorder()
    server = LiveServer(create_app(pipeline=pipe, queue_size=3))
    yield server, pipe.recorder
    pipe.recorder.gate.set()
    server.close()


def wait_for(condition, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_burst_of_clients_is_answered_in_arrival_order_and_a_full_queue_is_a_503(gated):
    server, recorder = gated
    worker = server.app.state.worker
    answers: dict[int, str] = {}
    prompts = [f"{DOCUMENT} w{i + 1}" for i in range(4)]

    def ask(i: int) -> None:
        response = server.client().completions.create(model=MODEL, prompt=prompts[i], max_tokens=6, temperature=0)
        answers[i] = response.choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    threads[0].start()
    wait_for(lambda: len(recorder.prompts) == 1)  # the first is generating (held at the gate)
    for i, thread in enumerate(threads[1:], start=1):
        thread.start()
        wait_for(lambda i=i: worker.waiting == i)  # queued behind the ones before it
    full = post(server, {"model": MODEL, "prompt": prompts[0], "max_tokens": 2}, route="completions")
    assert full.status_code == 503 and full.headers["retry-after"] == "1"
    assert full.json()["error"]["code"] == "queue_full"
    assert 'outcome="rejected"' in httpx.get(f"{server.url}/metrics").text
    recorder.gate.set()
    for thread in threads:
        thread.join(timeout=60)
    tokenizer = chat_model().tokenizer
    assert recorder.prompts == [tokenizer(prompt).input_ids for prompt in prompts]  # served in arrival order
    assert answers == {i: reference_text(prompts[i], chat=False, max_new_tokens=6) for i in range(4)}


def test_a_client_that_goes_away_stops_its_generation_and_the_next_is_served(gated):
    server, recorder = gated
    recorder.gate.set()
    recorder.pause = 0.05
    body = {"model": MODEL, "prompt": f"{DOCUMENT} w3", "max_tokens": 300, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # the first token arrived; then hang up
    wait_for(lambda: len(recorder.results) == 1)
    stopped = recorder.results[0]
    assert stopped.stats.stop_reason == "cancelled" and len(stopped.token_ids) < 100
    recorder.pause = 0.0
    after = server.client().completions.create(model=MODEL, prompt=f"{DOCUMENT} w4", max_tokens=4, temperature=0)
    assert after.choices[0].text == reference_text(f"{DOCUMENT} w4", chat=False, max_new_tokens=4)
    assert 'outcome="cancelled"' in httpx.get(f"{server.url}/metrics").text


def test_a_client_gone_while_queued_frees_its_place(gated):
    server, recorder = gated
    worker = server.app.state.worker
    first = threading.Thread(
        target=lambda: post(
            server, {"model": MODEL, "prompt": f"{DOCUMENT} w1", "max_tokens": 2}, route="completions", timeout=60
        )
    )
    first.start()
    wait_for(lambda: len(recorder.prompts) == 1)
    with pytest.raises(httpx.ReadTimeout):  # waits in the queue, then its client gives up
        post(server, {"model": MODEL, "prompt": f"{DOCUMENT} w2", "max_tokens": 2}, route="completions", timeout=0.5)
    wait_for(lambda: worker.waiting == 0)
    recorder.gate.set()
    first.join(timeout=60)
    assert len(recorder.prompts) == 1  # the withdrawn request never ran


def test_a_failing_generation_is_a_500_without_its_exception_and_the_server_goes_on(gated, caplog):
    server, recorder = gated
    recorder.gate.set()
    recorder.fail = True
    body = {"model": MODEL, "prompt": f"{DOCUMENT} w1", "max_tokens": 2}
    with caplog.at_level("ERROR", logger="triforce.serve"):
        failed = post(server, body, route="completions")
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
    assert "broke" not in failed.text and "RuntimeError" not in failed.text and "log" in failed.text
    assert "the model broke" in caplog.text  # the log has it
    recorder.fail = False
    assert post(server, body, route="completions").status_code == 200


# ------------------------------------------------------------------------------------------------ the API key
def test_the_api_key_guards_every_route_but_health():
    server = LiveServer(create_app(pipeline=pipeline(), api_key="sekret"))
    try:
        assert httpx.get(f"{server.url}/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            response = httpx.get(f"{server.url}/v1/models", headers=headers)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{server.url}/metrics").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            server.client(api_key="wrong").models.list()
        answer = server.client(api_key="sekret").chat.completions.create(
            model=MODEL, messages=question("w1"), max_tokens=2, temperature=0
        )
        assert answer.usage.completion_tokens == 2
    finally:
        server.close()


# ------------------------------------------------------------------------------------------------ prefix states
def test_title_and_tag_requests_between_questions_leave_the_document_prefilled_once():
    """A chat client's title and tag requests between two questions about a document: the second question keeps
    the document from the kept prefix state, where a server keeping only the last state reads it again; every answer
    is a reuse-free pipeline's."""
    tokenizer = chat_model().tokenizer
    asked = [
        question("w1"),
        [{"role": "user", "content": "w5 w9 w2 title"}],
        [{"role": "user", "content": "w8 w3 tags"}],
        question("w2 w6"),
    ]
    cached = {}
    for memory in (0, 2**30):
        server = LiveServer(create_app(pipeline=pipeline(), prefix_memory=memory))
        try:
            client = server.client()
            answers = [
                client.chat.completions.create(model=MODEL, messages=m, max_tokens=6, temperature=0) for m in asked
            ]
        finally:
            server.close()
        cached[memory] = answers[-1].usage.prompt_tokens_details.cached_tokens
        for messages, answer in zip(asked, answers, strict=True):
            reference = reference_text(messages[0]["content"], chat=True, max_new_tokens=6, mode="autoregressive")
            assert answer.choices[0].message.content == reference
    first_ids, last_ids = (encode_messages(tokenizer, m) for m in (asked[0], asked[-1]))
    assert cached[2**30] == shared_length(first_ids, last_ids) > 96  # the document read once
    assert cached[0] < 16  # the tag request's state replaced it: the template's start alone is kept


def test_the_least_recently_used_prefix_state_goes_first_past_the_budget():
    """Three conversations, each about a document of its own, within a budget of about two documents' states: the
    one left longest unused is read again, the others go on from their state."""
    app = create_app(pipeline=pipeline())
    states = app.state.worker.prefix_states
    server = LiveServer(app)
    conversations = {name: [] for name in "abc"}

    def ask(name: str, words: str) -> int:
        """Ask the next question of conversation name; the prompt tokens it kept."""
        messages = conversations[name]
        shift = "abc".index(name) + 1
        document = " ".join(f"w{(5 * i + shift) % 23}" for i in range(96))
        messages.append({"role": "user", "content": f"{document} {words}" if not messages else words})
        answer = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
        return answer.usage.prompt_tokens_details.cached_tokens

    try:
        assert ask("a", "w1") < 16
        states.budget = int(2.5 * states.held_bytes)  # two conversations' states, not three
        assert ask("b", "w1") < 16
        assert ask("a", "w2") > 96  # a kept, and now used more recently than b
        assert ask("c", "w1") < 16  # c in: b, the least recently used, goes
        assert states.held_bytes <= states.budget and len(states.held_ids) == 2
        assert ask("a", "w3") > 96
        assert ask("b", "w2") < 16
    finally:
        server.close()


# ------------------------------------------------------------------------------------------------ prompt cache
def test_the_prompt_cache_keeps_prefills_across_restarts(tmp_path):
    messages = question("w6")
    answers = []
    for _ in range(2):  # two servers, one after the other: a restart
        server = LiveServer(create_app(pipeline=pipeline(), prompt_cache=tmp_path))
        try:
            answers.append(
                server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
            )
        finally:
            server.close()
    assert not answers[0].usage.triforce["prompt_cached"] and answers[1].usage.triforce["prompt_cached"]
    assert answers[1].usage.prompt_tokens_details.cached_tokens == answers[1].usage.prompt_tokens
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content


# ------------------------------------------------------------------------------------------------ the command
def test_the_serve_command_loads_the_models_and_runs_uvicorn(tiny, monkeypatch, tmp_path):
    ran = {}

    class Ran:
        def __init__(self, app, grace, host, port, log_level):
            ran.update(app=app, host=host, port=port, grace=grace)

        def run(self):
            pass

    monkeypatch.setattr(serve_command, "graceful_server", Ran)
    monkeypatch.setenv("TRIFORCE_API_KEY", "from-env")
    result = CliRunner().invoke(
        cli_app, ["serve", "--target", "chat", "--port", "8123", "--max-new-tokens", "8", "--temperature", "0"]
    )
    assert result.exit_code == 0, result.output
    assert ran["host"] == "127.0.0.1" and ran["port"] == 8123
    assert "serving chat at http://127.0.0.1:8123/v1" in result.stderr
    server = LiveServer(ran["app"])
    try:
        assert httpx.get(f"{server.url}/v1/models").status_code == 401  # the key came from TRIFORCE_API_KEY
        models = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer from-env"}).json()
        assert models["data"][0]["id"] == "chat" and models["data"][0]["max_model_len"] == 512
    finally:
        server.close()


def test_the_serve_command_takes_the_prefix_memory_as_a_size(tiny, monkeypatch):
    ran = {}

    class Ran:
        def __init__(self, app, grace, **config):
            ran["app"] = app

        def run(self):
            pass

    monkeypatch.setattr(serve_command, "graceful_server", Ran)
    ran_ok = CliRunner().invoke(cli_app, ["serve", "--target", "chat", "--prefix-memory", "3MiB"])
    assert ran_ok.exit_code == 0, ran_ok.output
    assert ran["app"].state.worker.prefix_states.budget == 3 * 2**20
    bad = CliRunner().invoke(cli_app, ["serve", "--target", "chat", "--prefix-memory", "lots"])
    assert bad.exit_code == 1 and "Traceback" not in bad.output
    assert bad.stderr.strip().splitlines()[-1] == (
        "error: `prefix_memory` takes a size such as 2GiB or 500M (0: only the last prefix), not 'lots'"
    )


# ------------------------------------------------------------------------------------------------ the real model
@pytest.mark.embedded
def test_the_embedded_model_answers_through_the_server_as_the_pipeline_does():
    """On SmolLM2 with its drafter: greedy chat equals Pipeline.generate, and a second question about the same
    document reuses its first prefill chunk."""
    pipe = Pipeline.load(LoadOptions(), config=EngineConfig(max_new_tokens=24, sampling=GREEDY))
    document = (ROOT / "triforce_cli" / "runtime" / "embedded.py").read_text()
    first, second = (f"{document}\n\n{q}" for q in ("What does this module do?", "What is the name of the model?"))
    expected = pipe.generate(first, chat=True).text
    pipe.generate("an unrelated prompt that shares nothing with the document", chat=True)  # forget its prefill
    server = LiveServer(create_app(pipeline=pipe))
    try:
        client = server.client()
        name = client.models.list().data[0].id

        def ask(content: str):
            messages = [{"role": "user", "content": content}]
            return client.chat.completions.create(model=name, messages=messages, max_tokens=24, temperature=0)

        answer = ask(first)
        assert answer.choices[0].message.content == expected
        assert answer.usage.prompt_tokens_details.cached_tokens == 0
        assert ask(second).usage.triforce["prefix_tokens_reused"] >= 256
    finally:
        server.close()


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("localhost", True), ("0.0.0.0", False), ("a.b", False)],
)
def test_only_loopback_addresses_count_as_private(host, loopback):
    assert is_loopback(host) == loopback


# ------------------------------------------------------------------------------------------------ what clients send
def test_fields_that_cannot_change_the_output_are_ignored_and_logged_once(live, caplog):
    messages = question("w3 w5")
    expected = reference_text(messages[0]["content"], chat=True)
    named = [{**messages[0], "name": "alice"}]
    extra = {"reasoning_effort": "low", "repetition_penalty": 1.0, "n": 1, "some_client_field": {"x": 1}}
    with caplog.at_level("INFO", logger="triforce.serve"):
        for _ in range(2):
            response = live.client().chat.completions.create(
                model=MODEL, messages=named, max_tokens=NEW_TOKENS, temperature=0, extra_body=extra
            )
            assert response.choices[0].message.content == expected
    logged = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert sorted(logged) == sorted(
        f"ignoring the request field '{name}': it does not change this server's output"
        for name in ("reasoning_effort", "some_client_field", "messages[].name")
    )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 2}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"presence_penalty": 1.0}, "presence_penalty"),
        ({"logit_bias": {"3": 5}}, "logit_bias"),
        ({"extra_body": {"repetition_penalty": 1.3}}, "repetition_penalty"),
    ],
)
def test_the_openai_client_gets_a_400_naming_what_would_change_the_output(live, fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        live.client(max_retries=2).chat.completions.create(
            model=MODEL, messages=question("w1"), max_tokens=2, temperature=0, **fields
        )
    assert refused.value.status_code == 400 and refused.value.body["param"] == param


def test_top_k_and_min_p_are_served_per_request(live):
    """At temperature 1, top_k 1 or min_p 1 keep the likeliest token alone: the greedy answer, whatever the seed;
    without them the sampled answers differ."""
    messages = question("w4")
    greedy = reference_text(messages[0]["content"], chat=True)
    client = live.client()

    def sampled(seed: int, **extra) -> str:
        response = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=NEW_TOKENS, temperature=1.0, seed=seed, extra_body=extra
        )
        return response.choices[0].message.content

    assert {sampled(seed, top_k=1) for seed in (1, 2)} == {greedy}
    assert {sampled(seed, min_p=1.0) for seed in (1, 2)} == {greedy}
    assert any(sampled(seed, top_k=0, min_p=0.0) != greedy for seed in (1, 2, 3))
    raw = post(live, chat_body(messages=messages, temperature=1.0, seed=1, top_k=-1, max_tokens=NEW_TOKENS))
    assert raw.status_code == 200 and raw.json()["choices"][0]["message"]["content"] == sampled(1)


# A template that knows system, user and assistant only, and refuses the rest as real templates do.
ROLES_TEMPLATE = (
    "w20 {% for message in messages %}{% if message['role'] == 'system' %}w25{% elif message['role'] == 'user' %}w23"
    "{% elif message['role'] == 'assistant' %}w24{% else %}{{ raise_exception('no role ' + message['role']) }}"
    "{% endif %} {{ message['content'] }} w21 {% endfor %}{% if add_generation_prompt %}w24 {% endif %}"
)


def test_developer_is_system_and_a_template_refusal_is_a_400_the_client_does_not_retry():
    target = chat_model()
    target.tokenizer.chat_template = ROLES_TEMPLATE
    server = LiveServer(create_app(pipeline=Pipeline(target, None, Engine(target, config()))))
    try:
        client = server.client()

        def ask(role: str):
            messages = [{"role": role, "content": "w7 w8"}, *question("w2")]
            return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)

        assert ask("developer").choices[0].message.content == ask("system").choices[0].message.content
        tool = post(server, chat_body(messages=[*question("w2"), {"role": "tool", "content": "w5"}]))
        assert tool.status_code == 400 and "no role tool" in tool.json()["error"]["message"]
        assert tool.json()["error"]["param"] == "messages"
        with pytest.raises(openai.BadRequestError, match="no role tool"):
            server.client(max_retries=2).chat.completions.create(
                model=MODEL, messages=[{"role": "tool", "content": "w5"}], max_tokens=2
            )
    finally:
        server.close()


def test_a_tool_message_goes_to_a_template_that_takes_it(live):
    messages = [*question("w2"), {"role": "assistant", "content": "w3"}, {"role": "tool", "content": "w9"}]
    response = post(live, chat_body(messages=messages))
    assert response.status_code == 200, response.text


# ------------------------------------------------------------------------------------------------ operations
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the SystemExit below
def test_health_reports_a_stopped_worker_and_a_job_failing_outside_generation_leaves_it_running(monkeypatch):
    target = chat_model()
    server = LiveServer(create_app(pipeline=Pipeline(target, None, Engine(target, config()))))
    worker = server.app.state.worker
    try:
        body = {"model": MODEL, "prompt": "w1 w2", "max_tokens": 2}
        with monkeypatch.context() as patch:
            patch.setattr(worker, "_serve", lambda job: 1 / 0)  # a failure outside the generation's own handling
            failed = post(server, body, route="completions")
        assert failed.status_code == 500 and "ZeroDivision" not in failed.text
        assert post(server, body, route="completions").status_code == 200
        assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}

        def killed(job):
            raise SystemExit  # not an Exception: it ends the thread

        monkeypatch.setattr(worker, "_serve", killed)
        with pytest.raises(httpx.ReadTimeout):
            post(server, body, route="completions", timeout=1)
        wait_for(lambda: not worker.alive)
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and health.json() == {"status": "error", "worker": "stopped"}
    finally:
        server.close()


def test_a_body_over_the_limit_is_a_413_with_or_without_its_length():
    server = LiveServer(create_app(pipeline=pipeline(), max_body_bytes=2048))
    try:
        big = chat_body(messages=[{"role": "user", "content": " ".join(["w2"] * 1000)}])
        response = post(server, big)
        assert response.status_code == 413 and "2048 bytes" in response.json()["error"]["message"]
        chunked = httpx.post(
            f"{server.url}/v1/chat/completions", content=iter([b'{"model": "chat", "x": "', b"w" * 4096, b'"}'])
        )
        assert chunked.status_code == 413
        assert post(server, chat_body()).status_code == 200
    finally:
        server.close()


def test_a_full_queue_is_a_503_before_the_prompt_is_read(gated):
    server, recorder = gated
    worker = server.app.state.worker
    threads = [
        threading.Thread(target=post, args=(server, chat_body()), kwargs={"timeout": 60}, daemon=True) for _ in range(4)
    ]
    for i, thread in enumerate(threads):
        thread.start()
        wait_for(lambda i=i: len(recorder.prompts) == 1 and worker.waiting == i)
    too_long = chat_body(messages=[{"role": "user", "content": " ".join(["w2"] * 600)}])  # a 400 once tokenized
    assert post(server, too_long).status_code == 503
    recorder.gate.set()
    for thread in threads:
        thread.join(timeout=60)
    assert post(server, too_long).status_code == 400


def test_an_operator_caps_max_tokens():
    server = LiveServer(create_app(pipeline=pipeline(max_new_tokens=64), max_tokens_limit=5))
    try:
        over = post(server, chat_body(max_tokens=6))
        assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"
        assert "limit of 5" in over.json()["error"]["message"]
        unasked = server.client().chat.completions.create(model=MODEL, messages=question("w1"), temperature=0)
        assert unasked.usage.completion_tokens == 5 and unasked.choices[0].finish_reason == "length"
    finally:
        server.close()


def test_a_request_past_its_timeout_is_a_504_waiting_or_running():
    pipe = pipeline(RecordingPipeline)
    pipe.recorder = recorder = Recorder()
    server = LiveServer(create_app(pipeline=pipe, request_timeout=0.5))
    try:
        results = {}

        def ask(key: str) -> None:
            results[key] = post(server, {"model": MODEL, "prompt": f"{DOCUMENT} w1", "max_tokens": 8}, "completions")

        threads = [threading.Thread(target=ask, args=(key,)) for key in ("running", "waiting")]
        threads[0].start()
        wait_for(lambda: len(recorder.prompts) == 1)
        threads[1].start()
        wait_for(lambda: server.app.state.worker.waiting == 1)
        time.sleep(1.0)
        recorder.gate.set()
        for thread in threads:
            thread.join(timeout=60)
        for response in results.values():
            assert response.status_code == 504 and response.json()["error"]["code"] == "timeout"
        assert len(recorder.prefilled) == 1 and recorder.results == []  # stopped after its first prefill chunk
        assert len(recorder.prompts) == 1  # the waiting one never ran
        assert post(server, {"model": MODEL, "prompt": "w1 w2", "max_tokens": 2}, "completions").status_code == 200
    finally:
        recorder.gate.set()
        server.close()


def test_cors_answers_a_browser_preflight_without_the_key():
    origin = "http://localhost:3000"
    server = LiveServer(create_app(pipeline=pipeline(), api_key="sekret", cors_origins=[origin]))
    try:
        preflight = httpx.options(
            f"{server.url}/v1/chat/completions",
            headers={
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == origin
        keyed = httpx.get(f"{server.url}/v1/models", headers={"Origin": origin, "Authorization": "Bearer sekret"})
        assert keyed.status_code == 200 and keyed.headers["access-control-allow-origin"] == origin
        assert httpx.get(f"{server.url}/v1/models", headers={"Origin": origin}).status_code == 401
        other = httpx.get(
            f"{server.url}/v1/models", headers={"Origin": "http://evil", "Authorization": "Bearer sekret"}
        )
        assert "access-control-allow-origin" not in other.headers
    finally:
        server.close()


def test_a_stream_starts_at_once_with_comments_and_a_client_gone_in_prefill_stops_it(gated, monkeypatch):
    server, recorder = gated
    worker = server.app.state.worker
    monkeypatch.setattr(serve_app, "KEEPALIVE_SECONDS", 0.05)
    body = {"model": MODEL, "prompt": f"{DOCUMENT} w3", "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=10) as response:
        assert response.status_code == 200  # while the generation is held at the gate
        lines = response.iter_lines()
        assert next(lines) == ": queued"
        comments = [next(line for line in lines if line) for _ in range(3)]
        assert all(line.startswith(": prefill") for line in comments)  # the job started: its prompt is read
    wait_for(lambda: worker._running is not None and worker._running.cancelled.is_set())
    recorder.gate.set()
    wait_for(lambda: not worker.busy)
    assert len(recorder.prefilled) == 1 and recorder.results == []  # one prefill chunk, then it stopped
    text = server.client().completions.create(model=MODEL, prompt=f"{DOCUMENT} w3", max_tokens=4, temperature=0)
    assert text.choices[0].text == reference_text(f"{DOCUMENT} w3", chat=False, max_new_tokens=4)


def test_an_openai_stream_skips_the_comment_lines(gated, monkeypatch):
    server, recorder = gated
    monkeypatch.setattr(serve_app, "KEEPALIVE_SECONDS", 0.05)
    threading.Timer(0.5, recorder.gate.set).start()
    chunks = list(
        server.client().completions.create(
            model=MODEL, prompt=f"{DOCUMENT} w1", max_tokens=NEW_TOKENS, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == reference_text(f"{DOCUMENT} w1", chat=False)


SIGNAL_SERVER = """
import sys, time
from helpers import chat_model
from triforce_cli.cli.serve import graceful_server
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.pipeline import Pipeline
from triforce_cli.serve import app as serve_app
from triforce_cli.serve.app import create_app
from test_serve import config

class Slow(Pipeline):
    def generate_ids(self, prompt_ids, on_prefill=None, on_tokens=None, prompt_cache=None, should_stop=None):
        def slowly(ids, origins):
            on_tokens(ids, origins)
            time.sleep(0.05)
        return super().generate_ids(prompt_ids, on_prefill, slowly, prompt_cache, should_stop)

target = chat_model()
app = create_app(pipeline=Slow(target, None, Engine(target, config(mode="autoregressive"))))
graceful_server(app, float(sys.argv[2]), host="127.0.0.1", port=int(sys.argv[1]), log_level="info").run()
"""


@pytest.mark.parametrize(("sig", "grace", "finished"), [(signal.SIGTERM, 30.0, True), (signal.SIGINT, 0.5, False)])
def test_a_signal_refuses_the_waiting_finishes_or_cancels_the_running_and_exits_0(sig, grace, finished):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    process = subprocess.Popen(
        [sys.executable, "-c", SIGNAL_SERVER, str(port), str(grace)], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        results = {}

        def ask(key: str, tokens: int) -> None:
            body = {"model": MODEL, "prompt": "w1 w2 w3", "max_tokens": tokens, "temperature": 0}
            results[key] = httpx.post(f"{url}/v1/completions", json=body, timeout=120)

        def gauges() -> tuple[str, str]:
            text = httpx.get(f"{url}/metrics").text
            return metric(text, "triforce_generating"), metric(text, "triforce_queue_waiting")

        running = threading.Thread(target=ask, args=("running", 40))
        running.start()
        wait_for(lambda: gauges()[0] == "1", seconds=60)  # generating, a token per 50 ms
        waiting = threading.Thread(target=ask, args=("waiting", 2))
        waiting.start()
        wait_for(lambda: gauges()[1] == "1", seconds=60)
        process.send_signal(sig)
        running.join(timeout=60)
        waiting.join(timeout=60)
        assert process.wait(timeout=60) == 0
        log = process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
    assert results["waiting"].status_code == 503 and "shutting down" in results["waiting"].text
    assert results["running"].status_code == 200
    usage = results["running"].json()["usage"]
    assert (usage["completion_tokens"] == 40) == finished
    assert "Shutting down" in log and "Finished server process" in log  # uvicorn's messages at info level


def test_a_requests_unset_fields_take_the_servers_settings_not_the_last_requests():
    """The worker sets the pipeline to each request's sampling and token limit; a request that sets neither gets
    the server's greedy 16 tokens however the one before it was sampled."""
    server = LiveServer(create_app(pipeline=pipeline(sampling=GREEDY)))
    try:
        client = server.client()
        messages = question("w4")
        sampled = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=3, temperature=1.0, seed=5, extra_body={"top_k": 2}
        )
        assert sampled.usage.completion_tokens == 3
        unset = client.chat.completions.create(model=MODEL, messages=messages)
        assert unset.choices[0].message.content == reference_text(messages[0]["content"], chat=True)
        assert unset.usage.completion_tokens == NEW_TOKENS
    finally:
        server.close()


def test_what_sdks_and_proxies_add_around_the_served_fields_is_taken():
    """A null stream is no stream; stream_options and text parts may carry keys of other servers and clients
    (the SDK's include_obfuscation, vLLM's continuous_usage_stats, a prompt cache's cache_control); top_p 0 keeps
    the likeliest token alone; a monitor may probe /health with HEAD."""
    server = LiveServer(create_app(pipeline=pipeline(sampling=GREEDY)))
    try:
        messages = question("w4")
        greedy = reference_text(messages[0]["content"], chat=True)
        parts = [{**messages[0], "content": [{"type": "text", "text": messages[0]["content"], "cache_control": {}}]}]
        plain = post(server, chat_body(messages=parts, max_tokens=NEW_TOKENS, stream=None))
        assert plain.status_code == 200 and plain.json()["choices"][0]["message"]["content"] == greedy
        nucleus_of_none = post(server, chat_body(messages=messages, max_tokens=NEW_TOKENS, temperature=1.0, top_p=0))
        assert nucleus_of_none.json()["choices"][0]["message"]["content"] == greedy
        options = {"include_usage": True, "include_obfuscation": False, "continuous_usage_stats": True}
        chunks = server.client().chat.completions.create(
            model=MODEL, messages=messages, max_tokens=NEW_TOKENS, stream=True, stream_options=options
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == greedy
        assert httpx.head(f"{server.url}/health").status_code == 200
    finally:
        server.close()


@pytest.mark.parametrize("taken", ["a port another program holds", "an address not this machine's"])
def test_an_address_the_server_cannot_listen_on_is_one_line_before_the_models_load(monkeypatch, taken):
    loaded = []
    monkeypatch.setattr(serve_command, "load_pipeline", lambda *args, **kwargs: loaded.append(1))
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        host, port = ("127.0.0.1", holder.getsockname()[1]) if taken.startswith("a port") else ("192.0.2.1", 8000)
        result = CliRunner().invoke(cli_app, ["serve", "--host", host, "--port", str(port)])
    finally:
        holder.close()
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 1 and not loaded, result.output
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot listen on {host}:{port}")
