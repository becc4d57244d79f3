"""`triforce serve`: the OpenAI-compatible server, tested live on 127.0.0.1 (a random free port, uvicorn on a
thread) with the real `openai` client, and with raw HTTP (httpx) for what the client would refuse to send.

The model is the tiny random target with a word-level tokenizer and chat template of helpers.chat_model: a prompt
is words w0..w31, an answer too. Servers whose pipeline records what it was asked, waits at a gate or runs slowly
test the queue: the order requests are served in, the 503 of a full queue, a client that goes away.
"""

import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import ALPHABET, PROMPT, chat_model, tiny_loaded
from typer.testing import CliRunner

from triforce_cli.cli.app import app as cli_app
from triforce_cli.cli import serve as serve_command
from triforce_cli.cli.serve import is_loopback
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.pipeline import Pipeline
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.decoding.setup import LoadOptions

for extra in ("openai", "httpx", "fastapi", "uvicorn"):  # the web stack and the test extra's clients
    pytest.importorskip(extra, reason=f"`{extra}` is not installed (`pip install -e .[test]`)")
import httpx
import openai
import uvicorn

from triforce_cli.serve.app import create_app
from triforce_cli.serve.worker import TextSoFar

ROOT = Path(__file__).resolve().parents[1]
MODEL = "chat"  # the tiny target's name, which the server serves it as
DOCUMENT = " ".join(f"w{(7 * i) % 19}" for i in range(96))  # a "long" document: several prefill chunks of 16
NEW_TOKENS = 16
GREEDY = SamplingConfig(temperature=0)


def config(**changes) -> EngineConfig:
    """TriForce on the tiny model (the target drafts for itself on a 24-token StreamingLLM window), prefilling in
    chunks of 16 so that a 100-token prompt has whole chunks to reuse."""
    settings = {
        "chunk_size": 8,
        "draft_window": 24,
        "sink_tokens": 4,
        "max_new_tokens": NEW_TOKENS,
        "prefill_chunk": 16,
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
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, **options)

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


def test_a_second_question_about_the_document_reuses_its_prefill(live):
    client = live.client()
    client.chat.completions.create(model=MODEL, messages=question("w1"), max_tokens=4, temperature=0)
    second = client.chat.completions.create(model=MODEL, messages=question("w2 w6"), max_tokens=4, temperature=0)
    reused = second.usage.triforce["prefix_tokens_reused"]
    assert reused >= 80  # the document's whole chunks of 16 (96 words after the template's 2)
    assert second.usage.prompt_tokens_details.cached_tokens == reused
    metrics = httpx.get(f"{live.url}/metrics").text
    assert float(metric(metrics, "triforce_prefix_tokens_reused_total")) >= reused


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
        (chat_body(top_p=0), 400, "top_p", "greater than 0"),
        (chat_body(seed=-1), 400, "seed", "greater than or equal to 0"),
        (chat_body(seed=True), 400, "seed", "integer"),
        (chat_body(n=2), 400, "n", "one choice"),
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
            None,
            "",
        ),
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

        result = super().generate_ids(prompt_ids, on_prefill, slowly, prompt_cache, should_stop)
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
