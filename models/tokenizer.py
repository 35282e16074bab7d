"""Tokenizer and chat template reconstructed from GGUF metadata.

Building the tokenizer from the GGUF file itself keeps a model self-contained:
no HF hub download or separate tokenizer.json is needed to serve it.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import gguf
import jinja2
import jinja2.sandbox
import numpy as np
from tokenizers import AddedToken, decoders, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from jserve.models.gguf_loader import GGUFSource, open_gguf

# llama.cpp's `llama_token_type` value marking control tokens such as <|im_end|>.
_CONTROL_TOKEN_TYPE = 3

# The Unicode replacement character that byte-level decoding emits for an
# incomplete UTF-8 sequence.
_REPLACEMENT_CHAR = "\ufffd"

# A UTF-8 character spans at most four bytes, hence at most four tokens.
_MAX_UTF8_BYTES = 4


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """Pre-tokenizer matching llama.cpp's named pre-tokenization scheme."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # SmolLM splits every digit on its own before the GPT-2 regex.
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    if pre in ("gpt2", "default"):
        return byte_level
    raise ValueError(f"Unsupported GGUF pre-tokenizer {pre!r}")


def _raise_template_error(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _metadata(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    return None if field is None else field.contents()


class Tokenizer:
    """Byte-level BPE tokenizer plus the model's chat template."""

    def __init__(
        self,
        backend: HFTokenizer,
        special_ids: frozenset[int],
        bos_token_id: int,
        eos_token_id: int,
        chat_template: str | None,
    ) -> None:
        self._backend = backend
        self._special_ids = special_ids
        self._bos_token_id = bos_token_id
        self._eos_token_id = eos_token_id
        self._chat_template_source = chat_template
        # Sandboxed because chat templates ship inside model files; the
        # whitespace options and `raise_exception` mirror HF transformers so
        # templates written for it render identically.
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        self._chat_template = None if chat_template is None else env.from_string(chat_template)

    @classmethod
    def from_gguf(cls, path: GGUFSource) -> Tokenizer:
        reader = open_gguf(path)
        kind = _metadata(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"Unsupported GGUF tokenizer model {kind!r}; only 'gpt2' BPE is supported")
        tokens: list[str] = _metadata(reader, "tokenizer.ggml.tokens")
        merges: list[str] = _metadata(reader, "tokenizer.ggml.merges")
        token_types = np.asarray(_metadata(reader, "tokenizer.ggml.token_type"))

        vocab = {token: i for i, token in enumerate(tokens)}
        merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
        backend = HFTokenizer(BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False))
        backend.pre_tokenizer = _pre_tokenizer(_metadata(reader, "tokenizer.ggml.pre") or "gpt2")
        backend.decoder = decoders.ByteLevel()

        special_ids = frozenset(int(i) for i in np.flatnonzero(token_types == _CONTROL_TOKEN_TYPE))
        backend.add_special_tokens(
            [AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special_ids)]
        )
        return cls(
            backend=backend,
            special_ids=special_ids,
            bos_token_id=int(_metadata(reader, "tokenizer.ggml.bos_token_id")),
            eos_token_id=int(_metadata(reader, "tokenizer.ggml.eos_token_id")),
            chat_template=_metadata(reader, "tokenizer.chat_template"),
        )

    @classmethod
    def from_pretrained_dir(cls, path: str | pathlib.Path, bos_token_id: int,
                            eos_token_id: int) -> Tokenizer:
        """A Hugging Face checkpoint's tokenizer: tokenizer.json, with the chat template and
        the BOS / EOS tokens its tokenizer_config.json names (a separate chat_template.jinja
        too, as newer transformers save it). `bos_token_id` / `eos_token_id`: the model's,
        for tokens the config does not name."""
        path = pathlib.Path(path)
        backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}

        def token_id(key: str, default: int) -> int:
            token = config.get(key)
            token = token.get("content") if isinstance(token, dict) else token
            found = None if token is None else backend.token_to_id(token)
            return default if found is None else found

        template = config.get("chat_template")
        if isinstance(template, list):  # several, by name: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        special = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        return cls(backend=backend, special_ids=special,
                   bos_token_id=token_id("bos_token", bos_token_id),
                   eos_token_id=token_id("eos_token", eos_token_id), chat_template=template)

    @property
    def bos_token_id(self) -> int:
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int:
        return self._eos_token_id

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def encode(self, text: str) -> list[int]:
        """Token ids for `text`; special-token markers in the text map to their ids, no BOS is added.

        Through `encode_batch`, which releases the GIL (`encode` holds it): a server
        tokenizing a long prompt in a worker thread keeps answering meanwhile."""
        return self._backend.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        if self._chat_template is None:
            raise ValueError("This model has no chat template")
        return self._chat_template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._backend.id_to_token(self._bos_token_id),
            eos_token=self._backend.id_to_token(self._eos_token_id),
        )

    def token_strings(self, ids: list[int]) -> list[str]:
        """The vocabulary's strings for `ids` (byte-level: `Ġ` for a space), as Hugging Face's
        `convert_ids_to_tokens` gives them (vLLM's `/tokenize` `token_strs`)."""
        return [self._backend.id_to_token(i) for i in ids]

    # ------------------------------------------------------------ export (Hugging Face)
    def hf_json(self) -> str:
        """The tokenizer as Hugging Face `tokenizers` serialises it (`tokenizer.json`): what
        `export_hf` writes and what a grammar library builds its token table from."""
        return self._backend.to_str()

    def hf_tokenizer_config(self, model_max_length: int) -> dict[str, Any]:
        """What a Hugging Face `tokenizer_config.json` says of this tokenizer: its special
        tokens, chat template and context, for clients that load a tokenizer by folder
        (`transformers.AutoTokenizer`) and for vLLM's `/tokenizer_info`. The end-of-turn
        token doubles as padding, as the model's own GGUF file says for SmolLM2."""
        token = self._backend.id_to_token
        eos = token(self._eos_token_id)
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": token(self._bos_token_id),
            "eos_token": eos,
            "pad_token": eos,
            "add_bos_token": False,  # `encode` adds none; the chat template writes its own
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": model_max_length,
            "added_tokens_decoder": {
                str(i): {"content": token(i), "lstrip": False, "normalized": False, "rstrip": False,
                         "single_word": False, "special": True}
                for i in sorted(self._special_ids)},
        }
        if self._chat_template_source is not None:
            config["chat_template"] = self._chat_template_source
        return config

    def export_hf(self, directory: str | pathlib.Path, model_max_length: int) -> list[pathlib.Path]:
        """Write this tokenizer as a Hugging Face tokenizer folder (`tokenizer.json`,
        `tokenizer_config.json`, `special_tokens_map.json`), which
        `AutoTokenizer.from_pretrained(directory)` loads to the same ids, text and chat
        template. Returns the files written."""
        out = pathlib.Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        config = self.hf_tokenizer_config(model_max_length)
        files = {
            "tokenizer.json": self._backend.to_str(pretty=True),
            "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False),
            "special_tokens_map.json": json.dumps(
                {k: config[k] for k in ("bos_token", "eos_token", "pad_token")}, indent=2),
        }
        for name, text in files.items():
            (out / name).write_text(text + "\n", encoding="utf-8")
        return [out / name for name in files]


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text deltas.

    Byte-level BPE can split one UTF-8 character across several tokens, so
    text ending in U+FFFD is held back until the character completes. Pending
    tokens are decoded together, and dropped once emitted, so each push costs
    O(1) rather than re-decoding the whole sequence.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._pending: list[int] = []

    def push(self, token_id: int) -> str:
        """Feed one token; return the text it completes (possibly empty)."""
        self._pending.append(token_id)
        text = self._tokenizer.decode(self._pending, self._skip_special_tokens)
        # After enough tokens a trailing U+FFFD can no longer be a partial
        # character: it is either genuine or invalid bytes, so emit it.
        if text.endswith(_REPLACEMENT_CHAR) and len(self._pending) < _MAX_UTF8_BYTES:
            return ""
        self._pending.clear()
        return text

    def flush(self) -> str:
        """Return whatever is still held back, e.g. when the stream ends."""
        text = self._tokenizer.decode(self._pending, self._skip_special_tokens)
        self._pending.clear()
        return text


class TokenTexts:
    """Each token's share of a decoded text, for log-probability listings, whose token
    strings must join back into the text and whose `text_offset`s count characters of it.

    Byte-level BPE can split one character over several tokens, so a token decoded on its
    own is not its share (a lone half of `日` decodes to U+FFFD). As vLLM's incremental
    detokenizer does, a window from the last character boundary is decoded: a token that
    leaves a character unfinished gets the empty string and the token that finishes it
    gets the whole character. Decoding windows, never single tokens, keeps any decoder's
    context (a leading-space marker, say) right, not only byte-level ones.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the window: the text before it is settled
        self._read = 0  # end of the settled part of the window

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def _piece(self, window: list[int]) -> str | None:
        """The text `window` adds after the settled part, or None while it ends inside a
        character."""
        settled = self._decode(window[: self._read - self._prefix])
        text = self._decode(window)
        if len(text) > len(settled) and not text.endswith(_REPLACEMENT_CHAR):
            return text[len(settled):]
        return None

    def push(self, token_id: int) -> str:
        """Token `token_id`'s share of the text (empty while it leaves a character open)."""
        self._ids.append(token_id)
        piece = self._piece(self._ids[self._prefix:])
        if piece is None:
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return piece

    def peek(self, token_id: int) -> str:
        """What `push(token_id)` would return, without pushing: an alternative's share."""
        return self._piece([*self._ids[self._prefix:], token_id]) or ""

    def flush(self) -> str:
        """What the pushed tokens left unsettled (an unfinished character: U+FFFD), which
        belongs to the last token once no more follow."""
        rest = self._decode(self._ids[self._prefix:])[len(self._decode(self._ids[self._prefix:self._read])):]
        self._prefix = self._read = len(self._ids)
        return rest
