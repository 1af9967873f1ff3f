"""Token streams: every file as ``<bos> tokens <eos>``, concatenated; training windows drawn at
random offsets, held-out windows laid end to end so that every held-out token is scored once."""
from __future__ import annotations

import torch


def encode_files(raw_tokenizer, texts: list[str], bos: int, eos: int) -> torch.Tensor:
    """One int64 stream of ``[bos] + ids + [eos]`` per text (``raw_tokenizer``: a
    ``tokenizers.Tokenizer``, encoding in parallel)."""
    encodings = raw_tokenizer.encode_batch(texts, add_special_tokens=False)
    parts = []
    for enc in encodings:
        parts += [bos, *enc.ids, eos]
    return torch.tensor(parts, dtype=torch.int64)


class WindowSampler:
    """Random windows of ``seq_len + 1`` tokens (inputs and next-token targets) from a stream.

    The start offsets are drawn on the CPU ``CHUNK`` batches at a time and moved to the device
    together: a copy from pageable host memory waits for the device's queue, so one per batch
    would stall the GPU between training steps."""

    CHUNK = 64

    def __init__(self, stream: torch.Tensor, seq_len: int, batch_size: int, seed: int, device):
        if stream.numel() < seq_len + 2:
            raise ValueError(f"the training stream has {stream.numel()} tokens, fewer than a window ({seq_len + 1})")
        self.stream = stream.to(device)
        self.seq_len, self.batch_size = seq_len, batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.offsets = torch.arange(seq_len + 1, device=device)
        self._starts: list[torch.Tensor] = []

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._starts:
            starts = torch.randint(0, self.stream.numel() - self.seq_len - 1, (self.CHUNK, self.batch_size),
                                   generator=self.generator)
            self._starts = list(starts.to(self.stream.device).unbind(0))[::-1]
        window = self.stream[self._starts.pop()[:, None] + self.offsets]
        return window[:, :-1], window[:, 1:]

    def __iter__(self):
        return self


def heldout_windows(stream: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs [W, seq_len], targets [W, seq_len]) tiling the stream: targets are stream[1:], each
    exactly once; the last window is padded with target -1 (not scored)."""
    n = stream.numel() - 1
    windows = -(-n // seq_len)
    inputs = torch.zeros(windows * seq_len, dtype=torch.int64)
    targets = torch.full((windows * seq_len,), -1, dtype=torch.int64)
    inputs[:n], targets[:n] = stream[:-1], stream[1:]
    return inputs.view(windows, seq_len), targets.view(windows, seq_len)


def prompt_windows(stream: torch.Tensor, length: int, count: int, seed: int) -> torch.Tensor:
    """``count`` prompts of ``length`` tokens at random offsets of ``stream`` [count, length]."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - length, (count,), generator=g)
    return stream[starts[:, None] + torch.arange(length)]


__all__ = ["encode_files", "WindowSampler", "heldout_windows", "prompt_windows"]
