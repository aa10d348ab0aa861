"""The training methods `train/distill.py` runs, registered by name.

Each method is a module of `train/` holding its config section (a dataclass whose fields are the YAML keys under
`<method>:`) and its `run`; it registers both here at import (`register_method`), and `train.distill_config`
imports the modules. `train/distill.py` looks the job's method up and runs it: no list of methods elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

# run(cfg, accelerator, target, records, eval_prompts) -> the drafter directory, or None when stopped early
# (stop_at_step); eval_prompts: the held-out prompts' ids (empty on processes other than the main one)
Run = Callable[..., Any]


@dataclass(frozen=True)
class Method:
    name: str
    run: Run
    section: type | None = None  # its config dataclass (the YAML section `<name>:`); None: it has none
    check: Callable[[Any], None] | None = None  # (the job's config) -> None: checks across the common fields
    # distill.py builds the held-out prompts' ids (costing target generation for self:N) and passes them to run;
    # False: run gets none (it measures on held-out records, or builds them itself)
    measures: bool = True
    # (cfg, target) -> the distill.feature_capture.FeatureStaging the teacher generation stages the target's hidden
    # states in as it computes them (no second pass of the target over the teacher data); None: it reads none
    staging: Callable[[Any, Any], Any] | None = None
    deepspeed_stages: tuple[int, ...] = ()  # the ZeRO stages it runs under (checked at start)
    budgeted: bool = False  # its loop sizes its steps to max_minutes (train.step_budget)
    cpu_bf16: bool = False  # mixed_precision auto trains it under bf16 autocast on a CPU with native bf16 GEMMs


_METHODS: dict[str, Method] = {}


def register_method(method: Method) -> Method:
    if method.name in _METHODS and _METHODS[method.name] != method:
        raise ValueError(f"training method {method.name!r} is registered twice")
    _METHODS[method.name] = method
    return method


def method_named(name: str) -> Method:
    if name not in _METHODS:
        raise ValueError(f"method: {name!r} is not one of {method_names()}")
    return _METHODS[name]


def method_names() -> tuple[str, ...]:
    return tuple(_METHODS)


def methods() -> tuple[Method, ...]:
    return tuple(_METHODS.values())
