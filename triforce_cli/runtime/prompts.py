"""Reading prompt files and turning prompt text into token ids."""

import sys
from pathlib import Path

from jinja2 import TemplateError
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
    return encode_messages(tokenizer, [{"role": "user", "content": text}])


def encode_messages(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation as the model's chat template renders it, with the prompt for the model's answer.

    Args:
        tokenizer: the target's; a PromptError where it has no chat template.
        messages: {"role", "content"} dicts, oldest first.
    Returns:
        The ids of the rendered text, tokenized without adding special tokens (the template writes its own).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError("`chat` needs a chat template, and this model's tokenizer has none")
    return tokenizer(render_chat(tokenizer, messages), add_special_tokens=False).input_ids


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> str:
    """The chat template's text of messages with the prompt for the model's answer; a PromptError where the template
    refuses them (roles it does not take, turns out of order), fails or does not parse."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError as error:
        raise PromptError(f"the model's chat template refuses the conversation: {error}") from None


DOCUMENT_PLACEHOLDER = "<<triforce-document>>"  # stands for the document while the chat template is rendered


def document_question(question: str) -> dict[str, str]:
    """The user message that asks about a document: the document (its placeholder), a blank line, the question."""
    return {"role": "user", "content": f"{DOCUMENT_PLACEHOLDER}\n\n{question}"}


def around_document(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> tuple[str, str]:
    """The chat template's rendering of messages, with the prompt for the model's answer, cut where
    DOCUMENT_PLACEHOLDER stands in one of them for a document: the text before the document and the text after it.

    Tokenized apart, the two keep the document's own token ids the same in every prompt made of it, and a
    rendering never runs the template over the document (however long it is). One PromptError where the tokenizer
    has no chat template, or where its template changes the message so that the placeholder is not there once.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError("a chat turn needs a chat template, and this model's tokenizer has none")
    rendered = render_chat(tokenizer, messages)
    if rendered.count(DOCUMENT_PLACEHOLDER) != 1:
        raise PromptError("the chat template changes the message it is given, so the document cannot be cut in it")
    before, after = rendered.split(DOCUMENT_PLACEHOLDER)
    return before, after


def cut_prompt(tokenizer: PreTrainedTokenizerBase, document: str, request: str | None, length: int) -> list[int]:
    """Token ids of a benchmark prompt, exactly length of them: a bench compares modes at a context length, so the
    prompt must be that long whatever its kind.

    request None: the document as raw text (encode_prompt without chat), its first length tokens. Otherwise one
    user turn of the model's chat template, the document, a blank line and the request, with the generation prompt,
    as `generate --chat` makes it. The template's text before the document and the text after it (the request, the
    end of the turn and the generation prompt) are tokenized apart from the document and kept whole; only the
    document's tokens are cut, so a shorter context drops the end of the document, never the request.
    One PromptError where that cannot be done: no chat template, a context too short for the template and the
    request, a document too short for the context.
    """
    if request is None:
        ids = encode_prompt(tokenizer, document, chat=False)
        if len(ids) < length:
            raise PromptError(f"the text has {len(ids)} tokens, fewer than the context {length}")
        return ids[:length]
    before, after = (
        tokenizer(part, add_special_tokens=False).input_ids
        for part in around_document(tokenizer, [document_question(request)])
    )
    room = length - len(before) - len(after)
    if room < 1:
        raise PromptError(
            f"the context {length} leaves no room for the document: the chat template and the request take "
            f"{len(before) + len(after)} tokens"
        )
    ids = tokenizer(document, add_special_tokens=False).input_ids
    if len(ids) < room:
        raise PromptError(
            f"the document has {len(ids)} tokens, fewer than the {room} the context {length} leaves it beside the "
            "chat template and the request"
        )
    return before + ids[:room] + after


def cut_document(tokenizer: PreTrainedTokenizerBase, document: str, request: str, length: int) -> str:
    """The document's text cut as cut_prompt cuts it for a chat turn of the document and request: the first
    question of a conversation about it then makes a prompt of about length tokens (the cut text tokenized anew
    may differ by a token or two where the cut falls inside a word). The same PromptErrors as cut_prompt."""
    ids = cut_prompt(tokenizer, document, request, length)
    before, after = around_document(tokenizer, [document_question(request)])
    skip = len(tokenizer(before, add_special_tokens=False).input_ids)
    keep = len(ids) - skip - len(tokenizer(after, add_special_tokens=False).input_ids)
    return tokenizer.decode(ids[skip : skip + keep])
