"""Vision Transformer for image classification (pre-LN, GELU, CLS token), HF
``ViTForImageClassification`` layout."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from flax_models.configs import Config


class ViT(nnx.Module):
    """``__call__(images)``: float (B, image_size, image_size, channels) -> logits
    (B, num_classes). Patches are flattened in (row, col, channel) order into ``patch``
    (nnx.Linear, patch_size**2 * channels -> hidden). ``loss(batch)``: {"images", "labels"}."""

    def __init__(self, cfg: Config, lib, *, dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        if cfg.image_size % cfg.patch_size:
            raise ValueError(f"ViT: image_size {cfg.image_size} must be a multiple of "
                             f"patch_size {cfg.patch_size}")
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        h, p = cfg.hidden_size, cfg.patch_size
        self.cfg, self.dtype = cfg, dtype
        self.num_patches = (cfg.image_size // p) ** 2
        self.patch = nnx.Linear(p * p * cfg.channels, h, **kw)
        self.cls = nnx.Param(jnp.zeros((1, 1, h), param_dtype))
        self.pos = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(),
                                                           (1, self.num_patches + 1, h),
                                                           param_dtype))
        self.drop = lib.Dropout(cfg.hidden_dropout, rngs=rngs)
        self.encoder = lib.TransformerEncoder(
            cfg.num_layers, final_layer_norm=True,
            **cfg.layer_options(pre_layer_norm=True, activation="gelu"), **kw)
        self.head = nnx.Linear(h, cfg.num_classes, **kw)
        self.criterion = lib.CrossEntropyCriterion()

    def patches(self, images):
        b, hh, ww, c = images.shape
        p, s = self.cfg.patch_size, self.cfg.image_size
        if (hh, ww, c) != (s, s, self.cfg.channels):
            raise ValueError(f"ViT: images must have shape (batch, {s}, {s}, "
                             f"{self.cfg.channels}), got {tuple(images.shape)}")
        x = images.reshape(b, hh // p, p, ww // p, p, c).transpose(0, 1, 3, 2, 4, 5)
        return x.reshape(b, self.num_patches, p * p * c)

    def __call__(self, images):
        x = self.patch(self.patches(images))
        cls = jnp.broadcast_to(self.cls[...].astype(x.dtype), (x.shape[0], 1, x.shape[-1]))
        x = jnp.concatenate([cls, x], axis=1) + self.pos[...].astype(x.dtype)
        x = self.encoder(self.drop(x))
        return self.head(x[:, 0])

    def loss(self, batch):
        loss, count = self.criterion(self(batch["images"]), batch["labels"])
        return loss, {"images": count}
