"""Tokenizer built from GGUF metadata or an HF `tokenizer.json`, chat templates, and streaming decode.

Both sources end in one `tokenizers.Tokenizer`, so encoding behaves the same whichever way a model
was loaded; chat templates render in a sandbox because they come with downloaded models.
"""

from __future__ import annotations

import json
import threading
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from kvflash import KVFlashError

if TYPE_CHECKING:
    from kvflash.models.gguf_loader import GGUFMeta

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>")

GIL_FREE_CHARS = 2048
"""User text this long or longer is encoded with the interpreter released (`Tokenizer._plain`)."""

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Split patterns of the Llama 3 and Qwen2 tokenizers; they differ only in how digits group.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


class Tokenizer:
    """Encode/decode plus what generation needs: BOS policy, stop ids and the chat template."""

    def __init__(
        self,
        hf: HFTokenizer,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        chat_template: str | None,
    ):
        self.hf = hf
        self.bos_id = bos_id
        self.add_bos = add_bos and bos_id is not None
        self.chat_template = chat_template or CHATML_TEMPLATE
        ends = {eos_id} | {hf.token_to_id(t) for t in END_TOKENS}
        self.eos_ids: frozenset[int] = frozenset(i for i in ends if i is not None)
        self._bos_token = hf.id_to_token(bos_id) if bos_id is not None else ""
        self._eos_token = hf.id_to_token(eos_id) if eos_id is not None else ""
        self._plain_copy: HFTokenizer | None = None
        self._plain_lock = threading.Lock()
        self._preparing: threading.Thread | None = None

    @classmethod
    def from_gguf(cls, meta: GGUFMeta) -> Tokenizer:
        """Byte-level BPE from the GGUF's vocab and merges, with the pre-tokenizer its `pre` name implies."""
        if meta.tokenizer_model != "gpt2":
            raise KVFlashError(
                f"GGUF tokenizer model {meta.tokenizer_model!r} is not supported (only byte-level BPE); "
                "load the model from an HF directory with tokenizer.json instead"
            )
        vocab = {tok: i for i, tok in enumerate(meta.tokens)}
        if bad := next(
            (i for i in (meta.bos_id, meta.eos_id) if i is not None and not 0 <= i < len(vocab)), None
        ):
            raise KVFlashError(f"GGUF tokenizer: special token id {bad} outside its {len(vocab)} tokens")
        if not all(isinstance(m, str) and " " in m for m in meta.merges):
            raise KVFlashError("GGUF tokenizer: merges are not pairs of tokens ('a b' strings)")
        merges = [tuple(m.split(" ", 1)) for m in meta.merges]
        try:
            hf = HFTokenizer(models.BPE(vocab, merges, ignore_merges=meta.pre == "llama-bpe"))
        except Exception as e:  # tokenizers raises a bare Exception (a merge of unknown tokens)
            raise KVFlashError(f"GGUF tokenizer: {e}") from e
        _set_pretokenizer(hf, meta.pre)
        hf.decoder = decoders.ByteLevel()
        typed = list(zip(meta.tokens, meta.token_types, strict=True))
        hf.add_special_tokens([_added(t, True) for t, ty in typed if t and ty == TOKEN_TYPE_CONTROL])
        hf.add_tokens([_added(t, False) for t, ty in typed if t and ty == TOKEN_TYPE_USER_DEFINED])
        return cls(hf, meta.bos_id, meta.eos_id, meta.add_bos, meta.chat_template)

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        """`tokenizer.json` plus `tokenizer_config.json` (and `chat_template.jinja` if present)."""
        path = Path(path)
        try:
            hf = HFTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception on missing or malformed files
            raise KVFlashError(f"cannot read {path / 'tokenizer.json'}: {e}") from e
        config_file = path / "tokenizer_config.json"
        try:
            config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
            if not isinstance(config, dict):
                raise ValueError(f"a JSON {type(config).__name__}, not an object")
            template_file = path / "chat_template.jinja"
            template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
            template = template or _config_template(config)
        except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise KVFlashError(f"cannot read {path}'s tokenizer config: {e}") from e
        bos_id = _config_token_id(hf, config.get("bos_token"))
        eos_id = _config_token_id(hf, config.get("eos_token"))
        # tokenizer.json's post-processor is the model's own statement of whether it wants a BOS.
        add_bos = bos_id is not None and hf.encode("a").ids[:1] == [bos_id]
        return cls(hf, bos_id, eos_id, add_bos, template)

    def encode(self, text: str) -> list[int]:
        """Token ids; special-token text such as `<|im_start|>` maps to its single id.

        A BOS is prepended when the model asks for one and the text (e.g. a rendered chat template)
        does not already start with it.
        """
        ids = self.hf.encode(text, add_special_tokens=False).ids
        if self.add_bos and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of user text: special-token strings in it stay text, never control tokens."""
        return self._plain(text).ids

    def offsets_plain(self, text: str) -> list[tuple[int, int]]:
        """The character span of each token `encode_plain` gives."""
        return self._plain(text).offsets

    def prepare(self) -> None:
        """Builds the plain copy (`_plain_tokenizer`) on a thread, so that it overlaps the weights'
        loading and the engine's warm-up instead of the first turn's prompt: its parse holds the
        interpreter all along. Idempotent."""
        if self._preparing is None:
            self._preparing = threading.Thread(target=self._plain_tokenizer, name="kvflash-tokenizer")
            self._preparing.daemon = True
            self._preparing.start()

    def _plain_tokenizer(self) -> HFTokenizer:
        """The same tokenizer with special-token strings encoded as text, for user text: a
        tokenizer of its own, since the setting is the tokenizer's and prompts are encoded on
        several threads at once (one flipping it would change another's template encoding). Made
        once, by `prepare` (`load_model` calls it) or else at the first use; a second caller waits
        for the first."""
        with self._plain_lock:
            if self._plain_copy is None:
                plain = HFTokenizer.from_str(self.hf.to_str())
                plain.encode_special_tokens = True
                self._plain_copy = plain
            return self._plain_copy

    def _plain(self, text: str):
        # `encode` holds the GIL for all of a long text and `encode_batch` does not: a server's
        # scheduler runs its steps meanwhile.
        if len(text) < GIL_FREE_CHARS:
            return self._plain_tokenizer().encode(text, add_special_tokens=False)
        return self._plain_tokenizer().encode_batch([text], add_special_tokens=False)[0]

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_token,
                eos_token=self._eos_token,
            )
        except Exception as e:  # the template is the model file's code: whatever it raises is its fault
            raise KVFlashError(f"chat template failed: {type(e).__name__}: {e}") from e

    @cached_property
    def _template(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        try:
            return env.from_string(self.chat_template)
        except jinja2.TemplateError as e:
            raise KVFlashError(f"chat template does not parse: {e}") from e


class StreamDecoder:
    """Turns ids arriving one at a time into text, holding back incomplete UTF-8 (shown as U+FFFD).

    It decodes a short window (the previous piece plus the new ids) rather than the whole output, so
    cost stays flat; the previous piece gives decoders that strip a leading space their context.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the window: the ids of the last emitted piece
        self._read = 0  # ids before this were emitted

    def push(self, token_id: int) -> str:
        """The text completed by this id ("" while a character is still incomplete)."""
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """Whatever is held back, incomplete characters included; call once generation ends."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        before = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(self._ids[self._prefix :])
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before) :]


def _set_pretokenizer(hf: HFTokenizer, pre: str | None) -> None:
    """Matches the `tokenizer.json` of the model family that llama.cpp's `pre` name stands for."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "gpt2":
        hf.pre_tokenizer = byte_level
    elif pre == "smollm":
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in ("llama-bpe", "qwen2"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT if pre == "llama-bpe" else _QWEN2_SPLIT), "isolated")
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        if pre == "qwen2":
            hf.normalizer = normalizers.NFC()
    else:
        raise KVFlashError(
            f"GGUF pre-tokenizer {pre!r} is not supported (supported: gpt2, smollm, llama-bpe, qwen2); "
            "load the model from an HF directory with tokenizer.json instead"
        )


def _added(token: str, special: bool) -> AddedToken:
    """Matched verbatim in input text, so a template's `<|im_start|>` becomes one id."""
    return AddedToken(token, special=special, normalized=False)


def _config_template(config: dict[str, Any]) -> str | None:
    """tokenizer_config.json holds one template, or a list of named ones of which we take 'default'."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"chat_template is a {type(template).__name__}, not a template")
    return template


def _config_token_id(hf: HFTokenizer, token: str | dict[str, Any] | None) -> int | None:
    """tokenizer_config.json spells a token as a string or as an AddedToken dict."""
    if isinstance(token, dict):
        token = token.get("content")
    return hf.token_to_id(token) if token else None


def _raise_exception(message: str) -> None:
    raise KVFlashError(f"chat template: {message}")
