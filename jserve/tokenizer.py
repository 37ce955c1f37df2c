"""Tokenizers: a built-in byte tokenizer for the default model and HF ``tokenizer.json`` files.

The engine only needs ids in, text out, the special ids that start and stop generation, and
chat-template rendering, so both implementations share the small :class:`Tokenizer` protocol.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jserve.fields import FieldError

# Files that make up a tokenizer directory; copied along when a checkpoint is converted.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "chat_template.jinja")


@runtime_checkable
class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 plus <bos>/<eos>/<pad>: needs no files, so the default model runs
    anywhere."""

    BOS, EOS, PAD = 256, 257, 258
    MARKER_FILE = "jserve_byte_tokenizer.json"  # how a checkpoint says "use the byte tokenizer"

    def save(self, model_dir: str | Path) -> None:
        (Path(model_dir) / self.MARKER_FILE).write_text('{"type": "byte"}\n')

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        names = {self.BOS: b"<bos>", self.EOS: b"<eos>", self.PAD: b"<pad>"}
        out = bytearray()
        for i in ids:
            if i < 256:
                out.append(i)
            elif i in names and not skip_special_tokens:
                out += names[i]
        return out.decode("utf-8", errors="replace")

    @property
    def vocab_size(self) -> int:
        return 259

    @property
    def bos_token_id(self) -> int | None:
        return self.BOS

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.EOS,)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        return simple_chat_prompt(messages, add_generation_prompt, tools)


TOOL_CALL_INSTRUCTION = ('To call a function, answer with {"name": <its name>, "parameters": '
                         '<its arguments as a JSON object>} and nothing else.')


def simple_chat_prompt(messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                       tools: list[dict[str, Any]] | None = None) -> str:
    """The chat format of tokenizers that bring none: ``<|role|>\\ncontent\\n`` per message,
    then ``<|assistant|>\\n``. With tools, a ``<|tools|>`` section first (one function's JSON
    per line, then how to call one, Llama 3.1's JSON format); an assistant's tool calls are
    written in that format, ``; `` between calls (what ``jserve.serving.tool_calls`` reads)."""
    text = ""
    if tools:
        text = "<|tools|>\n" + "".join(json.dumps(t) + "\n" for t in tools) + \
            TOOL_CALL_INSTRUCTION + "\n"
    for m in messages:
        content = m.get("content") or ""
        if m.get("tool_calls"):
            calls = "; ".join(json.dumps({"name": c["function"]["name"],
                                          "parameters": c["function"]["arguments"]})
                              for c in m["tool_calls"])
            content = f"{content}\n{calls}" if content else calls
        text += f"<|{m['role']}|>\n{content}\n"
    return text + "<|assistant|>\n" if add_generation_prompt else text


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None, *,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    template_kwargs: dict[str, Any] | None = None,
                    add_special_tokens: bool | None = None) -> list[int]:
    """A chat's prompt ids as transformers' ``apply_chat_template(tokenize=True)`` gives them:
    a checkpoint's template writes its own special tokens (BOS included), so its text is
    encoded without adding any (else Llama prompts start with two BOS); a tokenizer with no
    template gets ``simple_chat_prompt`` with the tokenizer's usual specials
    (``add_special_tokens`` given: as told). ``tools`` (the API's function list) go to the
    template as transformers passes them, ``template_kwargs`` as extra template variables
    (vLLM's ``chat_template_kwargs``; the built-in format has none). Without
    ``add_generation_prompt`` no assistant header follows the messages;
    ``continue_final_message``: the text ends where the last message's content does (no
    end of turn after it), so a reply continues it (``continued``)."""
    templated = getattr(tokenizer, "has_chat_template", False)
    if templated:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             tools=tools, **(template_kwargs or {}))
    else:
        text = simple_chat_prompt(messages, add_generation_prompt, tools)
    if continue_final_message:
        text = continued(text, messages[-1])
    if add_special_tokens is None:
        add_special_tokens = not templated
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def continued(text: str, message: dict[str, Any]) -> str:
    """A rendered chat cut right after ``message``'s content (its last occurrence), as
    transformers' ``continue_final_message`` does (the content stripped if the template
    trimmed it); ``FieldError`` if the template did not write it."""
    content = message.get("content") or ""
    for c in (content, content.strip()):
        at = text.rfind(c) if c else -1
        if at >= 0:
            return text[:at + len(c)]
    raise FieldError("continue_final_message", "continue_final_message: the chat template does "
                     "not write the final message's content as given, so the reply cannot "
                     "continue it")


def _token_content(token: str | dict[str, Any] | None) -> str | None:
    """tokenizer_config.json writes special tokens as plain strings or AddedToken dicts."""
    return token.get("content") if isinstance(token, dict) else token


def _chat_environment() -> ImmutableSandboxedEnvironment:
    """A sandbox set up like transformers' so Hub templates render identically.

    Templates are untrusted code from the checkpoint, hence the immutable sandbox.
    """
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        # jinja's own tojson HTML-escapes, which chat templates do not expect.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def compile_chat_template(text: str) -> jinja2.Template:
    """A chat template's text compiled in the sandbox; jinja2.TemplateSyntaxError if it is
    not a template."""
    return _chat_environment().from_string(text)


class HFTokenizer:
    """A Hugging Face fast-tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json``)."""

    def __init__(self, model_dir: str | Path, weights_dir: str | Path | None = None) -> None:
        """``weights_dir``: the model's directory when the tokenizer's is another (its
        generation_config.json's EOS ids count too)."""
        model_dir = Path(model_dir)
        self._tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self._special_tokens = {
            name: content for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (content := _token_content(config.get(name))) is not None}

        bos = self._special_tokens.get("bos_token")
        self._bos_id = self._tok.token_to_id(bos) if bos is not None else None
        eos: list[int] = []
        if (eos_tok := self._special_tokens.get("eos_token")) is not None:
            if (eos_id := self._tok.token_to_id(eos_tok)) is not None:
                eos.append(eos_id)
        # Instruct models stop on several ids (e.g. Llama 3's <|eot_id|>) listed only here.
        for d in dict.fromkeys([model_dir, *([Path(weights_dir)] if weights_dir else [])]):
            if not (gen_path := d / "generation_config.json").exists():
                continue
            gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
            listed = gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos]
            for i in listed:
                if int(i) not in eos:
                    eos.append(int(i))
        self._eos_ids = tuple(eos)

        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_path = model_dir / "chat_template.jinja"
        if template is None and jinja_path.exists():
            template = jinja_path.read_text()
        self._set_template(template or None)

    def set_chat_template(self, template: str) -> None:
        """Replaces the directory's chat template (``jserve serve --chat-template``)."""
        self._set_template(template)

    def _set_template(self, source: str | None) -> None:
        self._template_source = source  # (kept: a compiled template does not pickle)
        self._template = compile_chat_template(source) if source is not None else None

    def __getstate__(self) -> dict:
        """An engine core in another process sends its tokenizer to the front end."""
        return {k: v for k, v in self.__dict__.items() if k != "_template"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._set_template(state["_template_source"])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The tokenizer.json post-processor decides what specials to add (Llama: BOS).
        # encode_batch, not encode: only it releases the GIL (tokenizers 0.23), and a server
        # tokenizes on intake threads beside the engine thread and the event loop; a 5 MB
        # prompt through encode() stopped every stream for the whole 5 to 10 s it took.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_pair(self, first: str, second: str) -> list[int]:
        """A text pair's ids as the post-processor joins pairs (a cross-encoder's input, as
        transformers' ``tokenizer(first, second)``)."""
        return self._tok.encode_batch([(first, second)])[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            **template_kwargs: Any) -> str:
        """The template rendered; ``template_kwargs`` are extra variables (over the special
        tokens' names, as transformers lets them)."""
        if self._template is None:
            raise ValueError("this tokenizer has no chat template; send a plain prompt instead")
        return self._template.render(**{**self._special_tokens, **template_kwargs},
                                     messages=messages, tools=tools,
                                     add_generation_prompt=add_generation_prompt)


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """The directory's HF tokenizer, or None: a bare checkpoint still serves token-id prompts."""
    if (Path(model_dir) / "tokenizer.json").exists():
        return HFTokenizer(model_dir)
    if (Path(model_dir) / ByteTokenizer.MARKER_FILE).exists():
        return ByteTokenizer()
    return None


def load_tokenizer_dir(tokenizer_dir: str | Path, vocab_size: int,
                       model_dir: str | Path | None = None) -> HFTokenizer:
    """A tokenizer from a directory other than the model's (vLLM's ``--tokenizer``):
    tokenizer.json, tokenizer_config.json and the chat template there. ValueError if there is
    none, or if its vocabulary has more tokens than the model's ``vocab_size`` embedding rows
    (ids past them would index nothing)."""
    d = Path(tokenizer_dir)
    if not (d / "tokenizer.json").is_file():
        raise ValueError(f"tokenizer {tokenizer_dir}: no tokenizer.json there (jserve reads a "
                         "fast tokenizer's tokenizer.json and tokenizer_config.json)")
    tok = HFTokenizer(d, model_dir)
    if tok.vocab_size > vocab_size:
        raise ValueError(f"tokenizer {tokenizer_dir}: its vocabulary has {tok.vocab_size} "
                         f"tokens, more than the model's {vocab_size} embedding rows")
    return tok
