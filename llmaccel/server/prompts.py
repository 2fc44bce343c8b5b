"""Request prompts -> token ids: completions' four prompt forms, chat messages through the chat
template (as LLM.chat does, so both give the same ids), and the context-length check."""

from __future__ import annotations

from typing import Any

from llmaccel.server.errors import bad_request
from llmaccel.server.protocol import ChatMessage


def completion_prompts(prompt: str | list, tokenizer: Any) -> list[list[int]]:
    """A string, a list of strings, a list of ids or a list of id lists -> one id list per
    prompt (blocking: run it off the event loop)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        return [list(prompt)]
    if not prompt:
        raise bad_request("prompt is empty", "prompt")
    out = []
    for p in prompt:
        if isinstance(p, str):
            if tokenizer is None:
                raise bad_request("this model has no tokenizer: send the prompt as token ids",
                                  "prompt")
            check_text(p, "prompt")
            out.append(list(tokenizer(p).input_ids))
        else:
            out.append(list(p))
    return out


def check_text(text: str, param: str) -> None:
    """Text a tokenizer can take: JSON may carry lone surrogates ("\\ud800"), which no UTF-8
    encoder accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"{param} is not valid Unicode text: {e.reason} at character "
                          f"{e.start}", param) from None


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the template sees them; text parts are joined, other parts refused."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages[{i}]: only text content parts are supported "
                                      f"(got type '{part.type}')", "messages")
                texts.append(part.text)
            content = "\n".join(texts)
        msg: dict[str, Any] = {"role": m.role, "content": content if content is not None else ""}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def chat_prompt(messages: list[dict[str, Any]], tokenizer: Any, template: str | None,
                add_generation_prompt: bool) -> list[int]:
    """Token ids of a conversation through the chat template (blocking)."""
    if tokenizer is None:
        raise bad_request("this model has no tokenizer, so no chat template: use "
                          "/v1/completions with token ids")
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model's tokenizer has no chat template: use /v1/completions "
                          "(or start the server with --chat-template)")
    try:
        ids = tokenizer.apply_chat_template(messages, chat_template=template,
                                            add_generation_prompt=add_generation_prompt,
                                            tokenize=True)
    except Exception as e:  # a template may raise on purpose (roles out of order)
        raise bad_request(f"the chat template failed on these messages: {e}",
                          "messages") from None
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return [int(t) for t in ids]


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int,
                  what: str) -> None:
    """vLLM's check: prompt plus requested tokens must fit the context."""
    if prompt_len >= max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. "
                          f"However, the input ({what}) has {prompt_len} tokens, which leaves "
                          "no room to generate. Please reduce the length of the input.", what)
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. "
                          f"However, you requested {prompt_len + max_tokens} tokens "
                          f"({prompt_len} in the {what}, {max_tokens} in the completion). "
                          "Please reduce the length of the input or of max_tokens.",
                          "max_tokens")
