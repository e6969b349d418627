"""Tokenizers: bytes for the presets, `tokenizer.json` (HF `tokenizers`) for real checkpoints."""

from __future__ import annotations

import os

from .config import InklingConfig


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255 (the presets' vocab is at least 256). Ids >= 256 are
    dropped when decoding; invalid byte sequences decode to replacement characters."""

    def __init__(self, cfg: InklingConfig):
        if cfg.unpadded_vocab_size < 256:
            raise ValueError(f"ByteTokenizer needs a vocab of at least 256, got {cfg.unpadded_vocab_size}")
        self.eos_token_id = cfg.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class JsonTokenizer:
    """A model directory's tokenizer.json through the `tokenizers` package."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def tokenizer_for(model: str, cfg: InklingConfig):
    if os.path.isdir(model) and os.path.exists(os.path.join(model, "tokenizer.json")):
        return JsonTokenizer(model)
    return ByteTokenizer(cfg)
