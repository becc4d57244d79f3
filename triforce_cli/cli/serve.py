"""`triforce serve`: an OpenAI-compatible HTTP server (triforce_cli/serve/) over one loaded target and drafter."""

import copy
import ipaddress
from types import FrameType
from typing import Annotated

import typer

from triforce_cli.cli import options as o
from triforce_cli.cli.console import command_console, print_note
from triforce_cli.cli.settings import engine_config, load_pipeline
from triforce_cli.decoding.prompt_state import check_writable
from triforce_cli.errors import ConfigError
from triforce_cli.runtime.store import parse_size

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


@o.takes(*o.MODELS, *o.ENGINE, "max_new_tokens", *o.SAMPLING, *o.MACHINE, "prompt_cache", after="served_model_name")
def serve(
    host: o.Host = "127.0.0.1",
    port: o.Port = 8000,
    api_key: o.ApiKey = None,
    queue_size: o.QueueSize = 16,
    served_model_name: o.ServedModelName = None,
    max_tokens_limit: o.MaxTokensLimit = None,
    request_timeout: o.RequestTimeout = None,
    max_body_bytes: o.MaxBodyBytes = 16 * 2**20,
    cors_origin: o.CorsOrigin = None,
    shutdown_grace: o.ShutdownGrace = 30.0,
    prefix_memory: PrefixMemory = "2GiB",
    **settings,
) -> None:
    """Serve the target over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, ...)."""
    # imported here: the web stack loads only for this command
    from triforce_cli.serve.app import create_app

    prompt_cache = settings["prompt_cache"]
    with command_console(settings["threads"]) as err:
        config = engine_config(settings)
        try:
            prefix_bytes = parse_size(prefix_memory)
        except ConfigError:
            raise ConfigError(
                f"`prefix_memory` takes a size such as 2GiB or 500M (0: only the last prefix), not '{prefix_memory}'"
            ) from None
        if prompt_cache is not None:
            check_writable(prompt_cache)
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
