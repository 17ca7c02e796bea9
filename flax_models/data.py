"""Training data that needs no download: the Python standard library's own source text.

* Text (BERT, GPT): the bytes of the stdlib's ``*.py`` files (sorted, concatenated),
  one token per byte: ``id = byte + 4``; 0 = pad, 1 = bos, 2 = eos, 3 = mask (vocab 260).
* Images (ViT): ``image_size**2 * channels`` consecutive source bytes shaped into an
  image (scaled to [-1, 1]); the label is which of ``num_classes`` source files it was
  cut from (file ``i`` of the sorted list has class ``i % num_classes``).
* Translation (Transformer): a generated task: reverse a random token sequence and map
  each token ``t -> 4 + (3 * (t - 4) + 1) % (vocab - 4)``.

Every batch is a function of (seed, step) only, so a resumed run sees the same data.
"""
from __future__ import annotations

import functools
import os
import sysconfig

import numpy as np

PAD, BOS, EOS, MASK, OFFSET = 0, 1, 2, 3, 4
TEXT_VOCAB = 256 + OFFSET


@functools.lru_cache(maxsize=1)
def source_files(max_bytes: int = 16 << 20) -> tuple:
    """(path, bytes) of the stdlib's .py files in sorted order, up to ``max_bytes`` in all."""
    root = sysconfig.get_paths()["stdlib"]
    out, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                data = f.read()
            if len(data) < 4096:
                continue
            out.append((os.path.relpath(path, root), data))
            total += len(data)
            if total >= max_bytes:
                return tuple(out)
    if not out:
        raise RuntimeError(f"data: no Python source files found under {root}")
    return tuple(out)


@functools.lru_cache(maxsize=1)
def text_tokens() -> np.ndarray:
    """All source bytes as int32 token ids (byte + 4)."""
    return np.frombuffer(b"".join(d for _, d in source_files()), np.uint8).astype(np.int32) + OFFSET


def _rng(seed: int, step: int):
    return np.random.default_rng([seed, step])


def gpt_batch(seed, step, batch, seq):
    tok = text_tokens()
    starts = _rng(seed, step).integers(0, tok.size - seq - 1, batch)
    win = np.stack([tok[s:s + seq + 1] for s in starts])
    return {"input_ids": win[:, :-1], "labels": win[:, 1:]}


def bert_batch(seed, step, batch, seq, mask_rate=0.15, max_predictions=0):
    """Masked-LM batch: each token masked with probability mask_rate, and with
    max_predictions > 0 at most that many per sequence (the first ones)."""
    tok = text_tokens()
    rng = _rng(seed, step)
    starts = rng.integers(0, tok.size - seq, batch)
    ids = np.stack([tok[s:s + seq] for s in starts])
    masked = rng.random(ids.shape) < mask_rate
    if max_predictions > 0:
        masked &= np.cumsum(masked, axis=-1) <= max_predictions
    labels = np.where(masked, ids, -100).astype(np.int32)
    return {"input_ids": np.where(masked, MASK, ids).astype(np.int32), "labels": labels}


def translation_batch(seed, step, batch, seq, vocab):
    rng = _rng(seed, step)
    lens = rng.integers(max(2, seq // 4), seq, batch)  # leaves room for bos/eos
    src = np.full((batch, seq), PAD, np.int32)
    tgt_in = np.full((batch, seq), PAD, np.int32)
    tgt_out = np.full((batch, seq), PAD, np.int32)
    for i, n in enumerate(lens):
        s = rng.integers(OFFSET, vocab, n)
        t = OFFSET + (3 * (s[::-1] - OFFSET) + 1) % (vocab - OFFSET)
        src[i, :n] = s
        tgt_in[i, 0], tgt_in[i, 1:n + 1] = BOS, t
        tgt_out[i, :n], tgt_out[i, n] = t, EOS
    return {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out}


def image_batch(seed, step, batch, image_size, channels, num_classes):
    files = source_files()
    rng = _rng(seed, step)
    n = image_size * image_size * channels
    idx = rng.integers(0, len(files), batch)
    images = np.empty((batch, image_size, image_size, channels), np.float32)
    for i, j in enumerate(idx):
        data = np.frombuffer(files[j][1], np.uint8)
        start = rng.integers(0, data.size)
        chunk = np.take(data, np.arange(start, start + n), mode="wrap")
        images[i] = chunk.reshape(image_size, image_size, channels) / 127.5 - 1.0
    return {"images": images, "labels": (idx % num_classes).astype(np.int32)}


def make_batch(cfg, seed: int, step: int, batch: int, seq: int) -> dict:
    """The batch of ``step`` for ``cfg.family`` (numpy arrays)."""
    if cfg.family in ("bert", "gpt"):
        if cfg.vocab_size < TEXT_VOCAB:
            raise ValueError(f"data: text needs vocab_size >= {TEXT_VOCAB}, got {cfg.vocab_size}")
        if seq > cfg.max_len:
            raise ValueError(f"data: seq {seq} exceeds the model's max_len {cfg.max_len}")
        if cfg.family == "gpt":
            return gpt_batch(seed, step, batch, seq)
        return bert_batch(seed, step, batch, seq, max_predictions=cfg.mlm_max_predictions)
    if cfg.family == "transformer":
        return translation_batch(seed, step, batch, seq, cfg.vocab_size)
    if cfg.family == "vit":
        return image_batch(seed, step, batch, cfg.image_size, cfg.channels, cfg.num_classes)
    raise ValueError(f"data: unknown family {cfg.family!r}")


def tokens_in(cfg, batch: dict) -> int:
    """Throughput unit per batch: tokens (source tokens for the Transformer) or images."""
    if cfg.family == "vit":
        return int(batch["images"].shape[0])
    key = "src" if cfg.family == "transformer" else "input_ids"
    return int(np.prod(batch[key].shape))
