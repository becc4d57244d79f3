"""`triforce serve`: an OpenAI-compatible HTTP server (triforce_cli/serve/) over one loaded target and drafter."""

import ipaddress

from triforce_cli.cli import options as o
from triforce_cli.cli.console import command_console, print_note
from triforce_cli.cli.settings import engine_config, load_pipeline
from triforce_cli.decoding.prompt_state import check_writable


def is_loopback(host: str) -> bool:
    """Whether host is an address only this machine reaches (127.0.0.1, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@o.takes(*o.MODELS, *o.ENGINE, "max_new_tokens", *o.SAMPLING, *o.MACHINE, "prompt_cache", after="served_model_name")
def serve(
    host: o.Host = "127.0.0.1",
    port: o.Port = 8000,
    api_key: o.ApiKey = None,
    queue_size: o.QueueSize = 16,
    served_model_name: o.ServedModelName = None,
    **settings,
) -> None:
    """Serve the target over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, ...)."""
    # imported here: the web stack loads only for this command
    import uvicorn

    from triforce_cli.serve.app import create_app

    prompt_cache = settings["prompt_cache"]
    with command_console(settings["threads"]) as err:
        config = engine_config(settings)
        if prompt_cache is not None:
            check_writable(prompt_cache)
        pipe = load_pipeline(settings, config, lambda message: print_note(err, message))
        app = create_app(
            pipeline=pipe,
            model_name=served_model_name,
            api_key=api_key,
            queue_size=queue_size,
            prompt_cache=prompt_cache,
        )
        if api_key is None and not is_loopback(host):
            print_note(err, f"listening on {host} without --api-key: anyone who reaches it can use the model")
        name = served_model_name or pipe.target.name
        print_note(err, f"serving {name} at http://{host}:{port}/v1 (Ctrl-C stops)")
        uvicorn.run(app, host=host, port=port, log_level="warning")
