"""Reading prompt files and turning prompt text into token ids."""

import sys
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from triforce_cli.errors import PromptError


def read_prompt(source: str) -> str:
    """Text of a prompt file, or of standard input for '-'; one clear PromptError for anything unusable."""
    if source == "-":
        data = sys.stdin.buffer.read()
        where = "standard input"
    else:
        path = Path(source).expanduser()
        where = f"prompt file {source}"
        if not path.exists():
            raise PromptError(f"{where} does not exist")
        if path.is_dir():
            raise PromptError(f"{where} is a folder, not a file")
        try:
            data = path.read_bytes()
        except OSError as err:
            raise PromptError(f"cannot read {where}: {err.strerror}") from None
    if b"\x00" in data:
        raise PromptError(f"{where} looks binary (it contains NUL bytes), not text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise PromptError(f"{where} is not UTF-8 text") from None
    if not text.strip():
        raise PromptError(f"{where} is empty")
    return text


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str, chat: bool) -> list[int]:
    """Token ids of the prompt; with chat, wrapped as one user turn by the model's chat template."""
    if not chat:
        return tokenizer(text).input_ids
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError("--chat needs a chat template, and this model's tokenizer has none")
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(rendered, add_special_tokens=False).input_ids
