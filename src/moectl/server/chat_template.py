"""``moectl serve --chat-template``: a chat template of the server's own, as vLLM's flag takes it.

The value is a file holding a Jinja template, or the template itself: a value naming an existing
file is read, one holding ``{``, ``}`` or a newline is taken as the template (vLLM's rule), and
anything else is refused as a file that does not exist. The template is compiled as transformers
compiles a tokenizer's (its sandboxed Jinja environment), so a syntax error is refused when the
server starts, in one line naming the line of the template; :func:`check_renders` then renders a
one-message conversation with the served tokenizer, so a template that cannot render that is
refused too. The served template replaces the tokenizer's own for ``/v1/chat/completions`` and
``/tokenize`` with messages, and ``/tokenizer_info`` reports it.

Nothing here imports FastAPI (``serve_config.py`` checks the flag before anything loads).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moectl.errors import ConfigError

JINJA_CHARS = "{}\n"  # a value holding one of these is a template, not a path (vLLM's rule)
TRIAL = [{"role": "user", "content": "Hello"}]  # the conversation every served template must render


def load_chat_template(value: str) -> str:
    """The template ``value`` gives (a file's text, or ``value`` itself), compiled once to refuse a
    syntax error: :class:`ConfigError` naming what was wrong, in one line."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"--chat-template {value}: cannot read it ({err})") from None
        where = f"--chat-template {value}"
    elif any(c in value for c in JINJA_CHARS):
        text, where = value, "--chat-template (the template given inline)"
    else:
        raise ConfigError(
            f"--chat-template {value!r}: no such file, and not a template (give a file holding a Jinja "
            "chat template, or the template itself, which holds {{ }} or {% %})"
        )
    if not text.strip():
        raise ConfigError(f"{where} is empty: give a Jinja chat template")
    _compile(text, where)
    return text


def _compile(text: str, where: str) -> None:
    """Compile ``text`` as transformers compiles a chat template; ``ConfigError`` for a syntax error."""
    import jinja2

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template as compile_template
    except ImportError:  # another transformers: the plain sandboxed environment it builds on
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        compile_template = env.from_string
    try:
        compile_template(text)
    except jinja2.TemplateError as err:
        line = getattr(err, "lineno", None)
        at = f" (line {line})" if line else ""
        message = " ".join(str(getattr(err, "message", None) or err).split())
        raise ConfigError(f"{where} is not a valid Jinja template: {message}{at}") from None


def render_chat(tokenizer: Any, messages: list[dict[str, str]], template: str, kwargs: dict[str, Any]) -> str:
    """``messages`` through ``template`` with the generation prompt, as the tokenizer would render its
    own (its special tokens as the template's variables); a tokenizer without
    ``apply_chat_template`` (moectl's byte tokenizer) through transformers' renderer directly."""
    if hasattr(tokenizer, "apply_chat_template"):
        return tokenizer.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=True, tokenize=False, **kwargs
        )
    from transformers.utils.chat_template_utils import render_jinja_template

    special = {
        k: v for k, v in (getattr(tokenizer, "special_tokens_map", None) or {}).items() if isinstance(v, str)
    }
    rendered, _ = render_jinja_template(
        [messages], chat_template=template, add_generation_prompt=True, **special, **kwargs
    )
    return rendered[0]


def check_renders(tokenizer: Any, template: str) -> None:
    """``ConfigError`` unless ``template`` renders a one-message conversation with ``tokenizer``
    into a non-empty prompt (checked when the server starts, not at its first request)."""
    try:
        text = render_chat(tokenizer, TRIAL, template, {})
    except Exception as err:  # a template's own checks and Jinja's runtime errors raise anything
        message = " ".join(str(err).split())
        raise ConfigError(f"--chat-template cannot render a one-message conversation: {message}") from None
    if not str(text).strip():
        raise ConfigError("--chat-template renders a one-message conversation as an empty prompt")
