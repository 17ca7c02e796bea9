"""Training data that needs no download: the Python standard library's own source text.

* Text (BERT, GPT): the bytes of the stdlib's ``*.py`` files (sorted, concatenated),
  one token per byte: ``id = byte + 4``; 0 = pad, 1 = bos, 2 = eos, 3 = mask (vocab 260).
* Images (ViT): ``image_size**2 * channels`` consecutive source bytes shaped into an
  image (scaled to [-1, 1]); the label is which of ``num_classes`` source files it was
  cut from (file ``i`` of the sorted list has class ``i % num_classes``).
* Translation (Transformer): a generated task: reverse a random token sequence and map
  each token ``t -> 4 + (3 * (t - 4) + 1) % (vocab - 4)``.

Every batch is a function of (seed, step, split) only, so a resumed run sees the same data.

Held-out data (``split="eval"``): for text, the source files that follow the training
files in the same sorted walk (never in a training batch); for the Transformer, sequences
from a random stream of their own; for ViT, fresh crops from a stream of their own (the
task is recognising the file a crop came from, so the files themselves cannot be held
out, and a crop may overlap one seen in training).
"""
from __future__ import annotations

import functools
import os
import sysconfig

import numpy as np

PAD, BOS, EOS, MASK, OFFSET = 0, 1, 2, 3, 4
TEXT_VOCAB = 256 + OFFSET
SPLITS = ("train", "eval")
TRAIN_BYTES = 16 << 20  # the training text: the first files of the walk up to this size
EVAL_BYTES = 1 << 20  # the held-out text: the files after them up to this size


def _walk_sources():
    """(relative path, bytes) of the stdlib's .py files of at least 4 KiB, in sorted order."""
    root = sysconfig.get_paths()["stdlib"]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                data = f.read()
            if len(data) >= 4096:
                yield os.path.relpath(path, root), data


def _take(files, limit: int) -> list:
    """The next files of the iterator ``files`` up to and including the one that brings
    their total to ``limit`` bytes."""
    out, total = [], 0
    for item in files:
        out.append(item)
        total += len(item[1])
        if total >= limit:
            break
    return out


@functools.lru_cache(maxsize=None)
def source_files(split: str = "train") -> tuple:
    """(path, bytes) of the files of ``split``: "train" the first files of the sorted walk
    up to `TRAIN_BYTES`, "eval" the files after them up to `EVAL_BYTES`."""
    _check_split("source_files", split)
    files = _walk_sources()
    out = _take(files, TRAIN_BYTES)
    if split == "eval":
        out = _take(files, EVAL_BYTES)
    if not out:
        raise RuntimeError(f"data: no Python source files left for the {split!r} split under "
                           f"{sysconfig.get_paths()['stdlib']}")
    return tuple(out)


@functools.lru_cache(maxsize=None)
def text_tokens(split: str = "train") -> np.ndarray:
    """The source bytes of ``split`` as int32 token ids (byte + 4)."""
    return np.frombuffer(b"".join(d for _, d in source_files(split)), np.uint8).astype(np.int32) + OFFSET


def _check_split(fn: str, split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"{fn}: split must be one of {SPLITS}, got {split!r}")


def _rng(seed: int, step: int, split: str = "train"):
    # the training stream is (seed, step) as it always was; held-out batches add a 1
    return np.random.default_rng([seed, step] if split == "train" else [seed, step, 1])


def gpt_batch(seed, step, batch, seq, split="train"):
    tok = text_tokens(split)
    starts = _rng(seed, step, split).integers(0, tok.size - seq - 1, batch)
    win = np.stack([tok[s:s + seq + 1] for s in starts])
    return {"input_ids": win[:, :-1], "labels": win[:, 1:]}


def bert_batch(seed, step, batch, seq, mask_rate=0.15, max_predictions=0, split="train"):
    """Masked-LM batch: each token masked with probability mask_rate, and with
    max_predictions > 0 at most that many per sequence (the first ones)."""
    tok = text_tokens(split)
    rng = _rng(seed, step, split)
    starts = rng.integers(0, tok.size - seq, batch)
    ids = np.stack([tok[s:s + seq] for s in starts])
    masked = rng.random(ids.shape) < mask_rate
    if max_predictions > 0:
        masked &= np.cumsum(masked, axis=-1) <= max_predictions
    labels = np.where(masked, ids, -100).astype(np.int32)
    return {"input_ids": np.where(masked, MASK, ids).astype(np.int32), "labels": labels}


def translation_batch(seed, step, batch, seq, vocab, split="train"):
    rng = _rng(seed, step, split)
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


def image_batch(seed, step, batch, image_size, channels, num_classes, split="train"):
    files = source_files()  # the same files for both splits (see the module docstring)
    rng = _rng(seed, step, split)
    n = image_size * image_size * channels
    idx = rng.integers(0, len(files), batch)
    images = np.empty((batch, image_size, image_size, channels), np.float32)
    for i, j in enumerate(idx):
        data = np.frombuffer(files[j][1], np.uint8)
        start = rng.integers(0, data.size)
        chunk = np.take(data, np.arange(start, start + n), mode="wrap")
        images[i] = chunk.reshape(image_size, image_size, channels) / 127.5 - 1.0
    return {"images": images, "labels": (idx % num_classes).astype(np.int32)}


def make_batch(cfg, seed: int, step: int, batch: int, seq: int, split: str = "train") -> dict:
    """The batch of ``step`` for ``cfg.family`` (numpy arrays) from ``split`` ("train", or
    "eval" for held-out data)."""
    _check_split("make_batch", split)
    if cfg.family in ("bert", "gpt", "llama"):
        if cfg.vocab_size < TEXT_VOCAB:
            raise ValueError(f"data: text needs vocab_size >= {TEXT_VOCAB}, got {cfg.vocab_size}")
        if seq > cfg.max_len:
            raise ValueError(f"data: seq {seq} exceeds the model's max_len {cfg.max_len}")
        if cfg.family in ("gpt", "llama"):
            return gpt_batch(seed, step, batch, seq, split)
        return bert_batch(seed, step, batch, seq, max_predictions=cfg.mlm_max_predictions,
                          split=split)
    if cfg.family == "transformer":
        return translation_batch(seed, step, batch, seq, cfg.vocab_size, split)
    if cfg.family == "vit":
        return image_batch(seed, step, batch, cfg.image_size, cfg.channels, cfg.num_classes,
                           split)
    raise ValueError(f"data: unknown family {cfg.family!r}")


def tokens_in(cfg, batch: dict) -> int:
    """Throughput unit per batch: tokens (source tokens for the Transformer) or images."""
    if cfg.family == "vit":
        return int(batch["images"].shape[0])
    key = "src" if cfg.family == "transformer" else "input_ids"
    return int(np.prod(batch[key].shape))
