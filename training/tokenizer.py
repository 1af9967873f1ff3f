"""Byte-level BPE trained on the corpus with ``tokenizers``, saved as transformers'
``PreTrainedTokenizerFast`` (``tokenizer.json`` + ``tokenizer_config.json``), so
``AutoTokenizer.from_pretrained(dir)`` loads it.

Byte level: every byte has a token, so any text round-trips exactly and each token stands for a
fixed byte string (:func:`token_byte_lengths`, which bits per byte divides by).  No normaliser
and no prefix space: source code keeps its exact whitespace.  The four specials come first
(ids 0-3); nothing is added to an encoding automatically: the pipeline puts ``<bos>`` before and
``<eos>`` after each file itself.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

SPECIALS = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "mask_token": "<mask>"}


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``vocab_size`` tokens (specials included) trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def as_transformers(tok, model_max_length: int):
    """The ``tokenizers.Tokenizer`` wrapped as ``PreTrainedTokenizerFast`` with its specials named."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=model_max_length,
                                   clean_up_tokenization_spaces=False, **SPECIALS)


def special_ids(tokenizer) -> dict[str, int]:
    """{"pad": id, "bos": id, "eos": id, "mask": id} of a transformers tokenizer."""
    return {name.removesuffix("_token"): tokenizer.convert_tokens_to_ids(tok) for name, tok in SPECIALS.items()}


def _byte_decoder() -> dict[str, int]:
    """The byte-level alphabet's character -> byte (GPT-2's printable remapping of 0-255)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(tokenizer) -> list[bytes]:
    """The byte string each token id stands for (b"" for the specials)."""
    decode = _byte_decoder()
    specials = set(SPECIALS.values())
    out = [b""] * len(tokenizer)
    for token, i in tokenizer.get_vocab().items():
        out[i] = b"" if token in specials else bytes(decode[c] for c in token)
    return out


def token_byte_lengths(tokenizer) -> list[int]:
    return [len(b) for b in token_bytes(tokenizer)]


def save(tokenizer, directory: str | Path) -> None:
    tokenizer.save_pretrained(str(directory))


__all__ = ["SPECIALS", "train_tokenizer", "as_transformers", "special_ids", "token_bytes", "token_byte_lengths",
           "save"]
