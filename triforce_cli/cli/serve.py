"""`triforce serve`: an OpenAI-compatible HTTP server (triforce_cli/serve/) over one loaded target and drafter."""

import copy
import ipaddress
import socket
from types import FrameType
from typing import Annotated

import typer

from triforce_cli.cli import options as o
from triforce_cli.cli.console import command_console, print_note
from triforce_cli.cli.settings import check_draft_used, engine_config, load_pipeline
from triforce_cli.decoding.prompt_state import check_writable
from triforce_cli.errors import ConfigError
from triforce_cli.runtime.store import parse_size

Host = Annotated[str, typer.Option(metavar="ADDRESS", help="Address to listen on; 0.0.0.0 serves other machines too.")]
Port = Annotated[int, typer.Option(min=0, max=65535, metavar="PORT", help="TCP port to listen on.")]
ApiKey = Annotated[
    str | None,
    typer.Option(
        envvar="TRIFORCE_API_KEY",
        metavar="KEY",
        help="Require 'Authorization: Bearer KEY' on every route but /health.",
        show_default=False,
    ),
]
QueueSize = Annotated[
    int, typer.Option(min=1, max=4096, metavar="N", help="Requests that may wait for the model; more get 503.")
]
ServedModelName = Annotated[
    str | None, typer.Option(metavar="NAME", help="The model id clients send [default: the target's name].")
]
MaxTokensLimit = Annotated[
    int | None,
    typer.Option(
        min=1,
        metavar="N",
        help="The most new tokens one request may ask for; more is a 400 [default: what the context holds].",
        show_default=False,
    ),
]
RequestTimeout = Annotated[
    float | None,
    typer.Option(
        min=0.001,
        metavar="SECONDS",
        help="A request still waiting or generating after this long ends with a 504 [default: none].",
        show_default=False,
    ),
]
MaxBodyBytes = Annotated[
    int, typer.Option(min=1024, metavar="BYTES", help="The largest request body accepted; larger ones get 413.")
]
CorsOrigin = Annotated[
    list[str] | None,
    typer.Option(
        metavar="ORIGIN",
        help="A browser origin allowed to call the API (CORS), e.g. http://localhost:3000; '*' for any; repeatable.",
        show_default=False,
    ),
]
ShutdownGrace = Annotated[
    float,
    typer.Option(
        min=0,
        metavar="SECONDS",
        help="On SIGINT/SIGTERM, how long the running request may go on before it is cancelled.",
    ),
]
PrefixMemory = Annotated[
    str,
    typer.Option(
        metavar="SIZE",
        help="Host memory for the prompt prefixes kept between requests (e.g. 2GiB, 500M; 0: only the last one):"
        " each request reuses the longest it shares, the least recently used going first.",
    ),
]


def is_loopback(host: str) -> bool:
    """Whether host is an address only this machine reaches (127.0.0.1, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_listenable(host: str, port: int) -> None:
    """A ConfigError now, before the models load, where host:port cannot be listened on (a name that does not
    resolve, an address not this machine's, a port another program holds); uvicorn binds it the same way later."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, UnicodeError) as error:
        raise ConfigError(f"`host` {host} is not an address to listen on ({error})") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as error:
            raise ConfigError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None


def graceful_server(app, grace: float, **config):
    """A uvicorn server whose first SIGINT or SIGTERM drains the worker (waiting requests answered 503, the running
    one given grace seconds) and then stops as uvicorn does, exiting 0 rather than raising the signal again; a
    second SIGINT stops at once."""
    import uvicorn
    from uvicorn.config import LOGGING_CONFIG

    class Graceful(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if not self.should_exit:
                app.state.worker.drain(grace)
            super().handle_exit(sig, frame)
            self._captured_signals.clear()  # a signal handled here is a normal exit

    logs = copy.deepcopy(LOGGING_CONFIG)  # the server's log beside uvicorn's messages, in their format
    logs["loggers"]["triforce.serve"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return Graceful(uvicorn.Config(app, timeout_graceful_shutdown=grace + 5, log_config=logs, **config))


def serve(
    host: Host = "127.0.0.1",
    port: Port = 8000,
    api_key: ApiKey = None,
    queue_size: QueueSize = 16,
    served_model_name: ServedModelName = None,
    target: o.Target = o.LOAD_DEFAULTS.target,
    draft: o.Draft = o.LOAD_DEFAULTS.draft,
    mode: o.Mode = o.ENGINE_DEFAULTS.mode,
    budget: o.Budget = o.ENGINE_DEFAULTS.budget,
    chunk_size: o.ChunkSize = o.ENGINE_DEFAULTS.chunk_size,
    chunk_score: o.ChunkScore = o.ENGINE_DEFAULTS.chunk_score,
    draft_window: o.DraftWindow = o.ENGINE_DEFAULTS.draft_window,
    sink_tokens: o.SinkTokens = o.ENGINE_DEFAULTS.sink_tokens,
    gamma1: o.Gamma1 = o.ENGINE_DEFAULTS.gamma1,
    gamma2: o.Gamma2 = o.ENGINE_DEFAULTS.gamma2,
    gamma_policy: o.GammaPolicy = o.ENGINE_DEFAULTS.gamma_policy,
    ngram: o.Ngram = o.ENGINE_DEFAULTS.ngram,
    refresh_interval: o.RefreshInterval = o.ENGINE_DEFAULTS.refresh_interval,
    max_new_tokens: o.MaxNewTokens = o.ENGINE_DEFAULTS.max_new_tokens,
    temperature: o.Temperature = o.SAMPLING_DEFAULTS.temperature,
    top_p: o.TopP = o.SAMPLING_DEFAULTS.top_p,
    top_k: o.TopK = o.SAMPLING_DEFAULTS.top_k,
    seed: o.Seed = o.SAMPLING_DEFAULTS.seed,
    dtype: o.Dtype = o.LOAD_DEFAULTS.dtype,
    device: o.Device = o.LOAD_DEFAULTS.device,
    threads: o.Threads = o.LOAD_DEFAULTS.threads,
    weights: o.Weights = o.LOAD_DEFAULTS.weights,
    attention: o.Attention = o.LOAD_DEFAULTS.attention,
    steps: o.Steps = o.LOAD_DEFAULTS.steps,
    compile_steps: o.Compile = None,
    offload: o.Offload = o.ENGINE_DEFAULTS.offload,
    on_chip_layers: o.OnChipLayers = o.ENGINE_DEFAULTS.on_chip_layers,
    context_window: o.ContextWindow = o.LOAD_DEFAULTS.context_window,
    prompt_cache: o.PromptCache = None,
    max_tokens_limit: MaxTokensLimit = None,
    request_timeout: RequestTimeout = None,
    max_body_bytes: MaxBodyBytes = 16 * 2**20,
    cors_origin: CorsOrigin = None,
    shutdown_grace: ShutdownGrace = 30.0,
    prefix_memory: PrefixMemory = "2GiB",
) -> None:
    """Serve the target over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, ...)."""
    settings = locals()  # cli/settings.py picks the library's settings from them by name
    # imported here: the web stack loads only for this command
    from triforce_cli.serve.app import create_app

    with command_console(threads) as err:
        config = engine_config(settings)
        check_draft_used(draft, config.uses_drafter, f"`mode` {config.mode}")
        try:
            prefix_bytes = parse_size(prefix_memory)
        except ConfigError:
            raise ConfigError(
                f"`prefix_memory` takes a size such as 2GiB or 500M (0: only the last prefix), not '{prefix_memory}'"
            ) from None
        if prompt_cache is not None:
            check_writable(prompt_cache)
        check_listenable(host, port)
        pipe = load_pipeline(settings, config, lambda message: print_note(err, message))
        app = create_app(
            pipeline=pipe,
            model_name=served_model_name,
            api_key=api_key,
            queue_size=queue_size,
            prompt_cache=prompt_cache,
            prefix_memory=prefix_bytes,
            max_tokens_limit=max_tokens_limit,
            request_timeout=request_timeout,
            max_body_bytes=max_body_bytes,
            cors_origins=cors_origin,
        )
        if api_key is None and not is_loopback(host):
            print_note(err, f"listening on {host} without --api-key: anyone who reaches it can use the model")
        name = served_model_name or pipe.target.name
        print_note(err, f"serving {name} at http://{host}:{port}/v1 (Ctrl-C stops)")
        graceful_server(app, shutdown_grace, host=host, port=port, log_level="info").run()
