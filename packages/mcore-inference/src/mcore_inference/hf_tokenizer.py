"""The tokenizer of a Hugging Face checkpoint directory, without transformers.

:class:`HFTokenizer` reads ``tokenizer.json`` with the ``tokenizers`` package, the special tokens
and the chat template from ``tokenizer_config.json`` (or ``chat_template.jinja``), and the
end-of-sequence and padding ids from ``generation_config.json`` / ``config.json``. The chat
template is rendered with jinja2 in a sandbox set up like transformers' ``apply_chat_template``
(``trim_blocks``, ``lstrip_blocks``, loop controls, a ``tojson`` that keeps non-ASCII text,
``raise_exception``, ``strftime_now``, the special tokens as template variables), so that a
prompt renders to the same text. Both packages come with the ``hf`` extra of mcore-inference.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from mcore_inference.errors import TokenizerUnavailableError

__all__ = ["HFTokenizer", "SPECIAL_TOKEN_NAMES"]

SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""Named special tokens of ``tokenizer_config.json``; a chat template sees each as a variable."""

_CLEAN_UPS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)
"""Replacements of ``clean_up_tokenization_spaces`` (the ones transformers applies)."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise TokenizerUnavailableError(f"{path} is not valid JSON: {exc}") from None
    return value if isinstance(value, dict) else {}


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json spells a special token as a string or an AddedToken dict.
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _id_list(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    file = directory / "chat_template.jinja"
    if file.is_file():
        return file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        # Several named templates: transformers uses the one named "default".
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    if template is None:
        file = directory / "chat_template.json"
        template = _read_json(file).get("chat_template") if file.is_file() else None
    return template if isinstance(template, str) else None


def _compile_template(source: str) -> Any:
    try:
        import jinja2
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # pragma: no cover - depends on the installed extras
        raise TokenizerUnavailableError(
            "rendering a chat template needs jinja2; install mcore-inference[hf]"
        ) from None

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body (transformers uses the
        block to find assistant tokens; rendering does not depend on it)."""

        tags = {"generation"}  # noqa: RUF012 - the attribute jinja2 reads

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(
                self.call_method("_render_body"), [], [], body
            ).set_lineno(lineno)

        def _render_body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationBlock, jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    try:
        return environment.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise TokenizerUnavailableError(f"the chat template does not parse: {exc}") from None


class HFTokenizer:
    """The tokenizer, special tokens and chat template of a Hugging Face checkpoint directory.

    Args:
        directory: Checkpoint directory holding ``tokenizer.json`` (and usually
            ``tokenizer_config.json``, ``generation_config.json``, ``config.json``).

    Raises:
        TokenizerUnavailableError: If ``tokenizers`` is not installed, the directory holds no
            ``tokenizer.json``, or a JSON file does not parse.
    """

    def __init__(self, directory: str | Path) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:  # pragma: no cover - depends on the installed extras
            raise TokenizerUnavailableError(
                "loading a Hugging Face tokenizer needs the tokenizers package; install "
                "mcore-inference[hf]"
            ) from None
        self.directory = Path(directory)
        file = self.directory / "tokenizer.json"
        if not file.is_file():
            raise TokenizerUnavailableError(
                f"directory={str(directory)!r} holds no tokenizer.json (a Hugging Face fast "
                "tokenizer is expected)"
            )
        self.tokenizer = Tokenizer.from_file(str(file))
        """The underlying ``tokenizers.Tokenizer``."""
        config = _read_json(self.directory / "tokenizer_config.json")
        self.special_tokens: dict[str, str] = {}
        """Named special tokens (``eos_token`` ...) as text, as the chat template sees them."""
        for name in SPECIAL_TOKEN_NAMES:
            text = _token_text(config.get(name))
            if text is not None:
                self.special_tokens[name] = text
        self.chat_template: str | None = _chat_template(self.directory, config)
        """The jinja2 chat template, or None when the checkpoint has none."""
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        """Whether :meth:`decode` removes the spaces before punctuation (as transformers does)."""
        self._template: Any = None
        generation = _read_json(self.directory / "generation_config.json")
        model = _read_json(self.directory / "config.json")
        eos = self._token_id("eos_token")
        ids = [eos] if eos is not None else []
        ids += _id_list(generation.get("eos_token_id")) or _id_list(model.get("eos_token_id"))
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))
        """Ids that end a completion: the tokenizer's eos token, then those of
        ``generation_config.json`` (or ``config.json``)."""
        self.bos_id: int | None = self._token_id("bos_token")
        """Id of the beginning-of-sequence token, or None."""
        if self.bos_id is None:
            bos = _id_list(generation.get("bos_token_id")) or _id_list(model.get("bos_token_id"))
            self.bos_id = bos[0] if bos else None
        pad = self._token_id("pad_token")
        if pad is None:
            found = _id_list(generation.get("pad_token_id")) or _id_list(model.get("pad_token_id"))
            pad = found[0] if found else None
        if pad is None and self.eos_token_ids:
            pad = self.eos_token_ids[0]
        self.pad_id: int = 0 if pad is None else pad
        """Id used for padding: the pad token, else the checkpoint's ``pad_token_id``, else eos."""

    def _token_id(self, name: str) -> int | None:
        text = self.special_tokens.get(name)
        return None if text is None else self.tokenizer.token_to_id(text)

    @property
    def eos_id(self) -> int:
        """The first end-of-sequence id.

        Returns:
            The id.

        Raises:
            TokenizerUnavailableError: If the checkpoint names no end-of-sequence token.
        """
        if not self.eos_token_ids:
            raise TokenizerUnavailableError(
                f"{self.directory} names no eos token (tokenizer_config.json eos_token, "
                "generation_config.json or config.json eos_token_id)"
            )
        return self.eos_token_ids[0]

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included.

        Returns:
            The size.
        """
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Encodes text.

        Args:
            text: The text.
            add_special_tokens: Whether the tokenizer's post-processor adds its tokens (e.g. a
                Llama bos); a rendered chat template already holds them, so encode it with False.

        Returns:
            The token ids.
        """
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Decodes ids; ids the tokenizer does not know (a model's padded vocabulary) are dropped.

        Args:
            ids: Token ids.
            skip_special_tokens: Whether special tokens are left out of the text.

        Returns:
            The text.
        """
        size = self.vocab_size
        known = [int(i) for i in ids if 0 <= int(i) < size]
        text = str(self.tokenizer.decode(known, skip_special_tokens=skip_special_tokens))
        if self.clean_up_tokenization_spaces:
            for before, after in _CLEAN_UPS:
                text = text.replace(before, after)
        return text

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        **variables: Any,
    ) -> str | list[int]:
        """Renders a conversation with the checkpoint's chat template.

        Args:
            messages: ``{"role": ..., "content": ...}`` dicts.
            add_generation_prompt: Whether to end with the header of an assistant turn.
            tokenize: Return token ids (encoded without added special tokens) instead of text.
            **variables: Extra template variables (they override the special tokens).

        Returns:
            The rendered text, or its ids when ``tokenize`` is set.

        Raises:
            TokenizerUnavailableError: If the checkpoint has no chat template or it fails to
                render.
        """
        if self.chat_template is None:
            raise TokenizerUnavailableError(
                f"{self.directory} has no chat template (tokenizer_config.json chat_template or "
                "chat_template.jinja)"
            )
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        import jinja2

        context: dict[str, Any] = {"tools": None, "documents": None}
        context.update(self.special_tokens)
        context.update(variables)
        try:
            text = self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise TokenizerUnavailableError(f"the chat template failed to render: {exc}") from None
        return self.encode(text, add_special_tokens=False) if tokenize else str(text)

    def render_prompt(self, prompt: str, *, system_prompt: str | None = None) -> str:
        """Renders one user turn as a generation prompt.

        With a chat template: ``[system?, user]`` rendered with ``add_generation_prompt``.
        Without one: the system prompt and the prompt joined by a blank line.

        Args:
            prompt: The user's text.
            system_prompt: An optional system message.

        Returns:
            The prompt text.
        """
        if self.chat_template is None:
            return prompt if system_prompt is None else f"{system_prompt}\n\n{prompt}"
        messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
        messages.append({"role": "user", "content": prompt})
        return str(self.apply_chat_template(messages, add_generation_prompt=True))

    def encode_prompt(self, prompt: str, *, system_prompt: str | None = None) -> list[int]:
        """Renders (see :meth:`render_prompt`) and encodes a generation prompt.

        A rendered chat template holds its own special tokens, so it is encoded without the
        post-processor's; a plain prompt gets them (e.g. a Llama bos).

        Args:
            prompt: The user's text.
            system_prompt: An optional system message.

        Returns:
            The prompt's token ids.
        """
        text = self.render_prompt(prompt, system_prompt=system_prompt)
        return self.encode(text, add_special_tokens=self.chat_template is None)
