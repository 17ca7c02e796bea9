"""Keywords that were renamed keep working under their old spelling for a while: the old
name warns once (a DeprecationWarning naming the new keyword) and is passed on as the new
one. Giving both spellings raises a TypeError.

Used as a decorator, ``@renamed_keywords("layer_norm", eps="epsilon")``, or, where the
keywords arrive as a dict (``**options`` gathered by a constructor), as
``options = renamed("TransformerEncoderLayer", options, layer_norm_eps="epsilon")``.
"""
from __future__ import annotations

import functools
import warnings

# (owner, old keyword) pairs already warned about: each warns once per process.
_warned: set = set()


def renamed(owner: str, kwargs: dict, *, stacklevel: int = 3, **renames: str) -> dict:
    """`kwargs` with each old keyword of `renames` (``old="new"``) moved to its new name."""
    if not any(old in kwargs for old in renames):
        return kwargs
    kwargs = dict(kwargs)
    for old, new in renames.items():
        if old not in kwargs:
            continue
        if new in kwargs:
            raise TypeError(f"{owner}: got both {old}= (the old spelling) and {new}=; pass {new}= only")
        kwargs[new] = kwargs.pop(old)
        if (owner, old) not in _warned:
            _warned.add((owner, old))
            warnings.warn(f"{owner}: the keyword {old}= is deprecated, renamed {new}=; pass {new}= instead "
                          f"(the old spelling will be removed)", DeprecationWarning, stacklevel=stacklevel)
    return kwargs


def renamed_keywords(owner: str, **renames: str):
    """Decorator: the function takes each old keyword of `renames` as its new one."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            return fn(*args, **renamed(owner, kwargs, stacklevel=3, **renames))
        return inner
    return wrap
