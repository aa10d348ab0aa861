"""Names that moved between the transformers versions pyproject.toml allows (>= 5.23, < 6).

transformers 5.24 renamed the models' `past_key_values` argument and output field to `cache`; the old
argument name is deprecated and goes in 5.40, and passing it costs a rename and a warning on every
call. `cache_argument` passes the cache under whichever name the model's forward declares.
"""

from __future__ import annotations

import functools
import inspect

import torch

__all__ = ["cache_argument", "output_cache"]


def cache_argument(module: torch.nn.Module, cache) -> dict:
    """{name: cache} for `module(**inputs, **cache_argument(module, cache))`."""
    return {_cache_name(type(module)): cache}


@functools.lru_cache(maxsize=None)
def _cache_name(module_type: type) -> str:
    parameters = inspect.signature(module_type.forward).parameters  # follows the decorators' __wrapped__
    return "cache" if "cache" in parameters else "past_key_values"


def output_cache(output):
    """The cache a forward returned, under either field name."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values
