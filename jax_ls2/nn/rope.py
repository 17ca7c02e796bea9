"""`RotaryConfig`: the rotary position embedding of an attention module (a config field)."""
from __future__ import annotations

import dataclasses

from jax_ls2.ops.rotary import RotaryScaling


@dataclasses.dataclass(frozen=True)
class RotaryConfig:
    """Rotary embedding on q and k before attention (`jax_ls2.ops.rotary`).

    Attributes:
      theta: the frequency base (LLaMA 2 10000, LLaMA 3 500000).
      rotary_dim: the rotated leading dims of each head (even; None: the whole head).
      scaling: None or a `jax_ls2.ops.RotaryScaling` (linear, NTK, LLaMA 3.1).
      interleaved: rotate (even, odd) pairs rather than the two halves.
    """
    theta: float = 10000.0
    rotary_dim: int | None = None
    scaling: RotaryScaling | None = None
    interleaved: bool = False

    def check(self, owner: str, head_dim: int) -> int:
        """The rotated width, checked against ``head_dim``; raises ValueError naming ``owner``."""
        rd = head_dim if self.rotary_dim is None else self.rotary_dim
        if isinstance(rd, bool) or not isinstance(rd, int) or rd < 2 or rd % 2 or rd > head_dim:
            raise ValueError(f"{owner}: rotary_dim must be an even int from 2 to head_dim ({head_dim}), "
                             f"got {self.rotary_dim!r}")
        return rd
