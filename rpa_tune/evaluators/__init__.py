"""Evaluators: one interface (``base.Evaluator``), three backends (compile, interpret, tpu),
and the registry that knows them (here, where the subclasses are known; ``base`` knows
none of them). Backends are imported on first use: the compile backend loads libtpu.
"""
from __future__ import annotations

import importlib
import os

from kernel.config import Case

from .base import (BACKENDS, COMPILE_ERROR, CRASH, EVALUATOR_OVERRIDE_ENV, OK, STATUSES, TIMEOUT, VMEM_OOM,
                   WRONG_RESULT, EvalResult, Evaluator, Task)

# backend name -> "module:class" (relative to this package)
REGISTRY = {
    "compile": ".compile:CompileEvaluator",
    "interpret": ".interpret:InterpretEvaluator",
    "tpu": ".tpu:TpuEvaluator",
}
assert set(REGISTRY) == set(BACKENDS)


def evaluator_class(backend: str) -> type[Evaluator]:
    try:
        module, _, name = REGISTRY[backend].partition(":")
    except KeyError:
        raise ValueError(f"unknown backend {backend!r}; valid: {', '.join(REGISTRY)}") from None
    return getattr(importlib.import_module(module, __name__), name)


def get_evaluator(backend: str) -> Evaluator:
    """A fresh evaluator of ``backend`` (``$RPA_TUNE_EVALUATOR_OVERRIDE``: a test's factory)."""
    override = os.environ.get(EVALUATOR_OVERRIDE_ENV)
    if override:
        mod, _, attr = override.partition(":")
        return getattr(importlib.import_module(mod), attr or "make_evaluator")(backend)
    return evaluator_class(backend)()


def evaluator_version(backend: str, case: str | None = None, generation: str | None = None) -> str:
    """Version string of a backend's evaluator for ``case``'s keys on ``generation`` (part of
    ``config_id``), without instantiating it: the case's own (``Evaluator.case_versions``) or
    the evaluator's, then ``+<generation><n>`` where the generation has its own
    (``Evaluator.generation_versions``), e.g. "compile-6+v5p1", then what the evaluator's
    ``version_tag(case, generation)`` adds, if it has one (the compile backend's modelled
    keys: "compile-7+tpu7x1+modelled1")."""
    override = os.environ.get(EVALUATOR_OVERRIDE_ENV)
    if override:
        return "override:" + override
    cls = evaluator_class(backend)
    version = cls.case_versions.get(Case.parse(case).value, cls.version) if case is not None else cls.version
    gen = cls.generation_versions.get(generation) if generation is not None else None
    tag = getattr(cls, "version_tag", None)
    extra = tag(Case.parse(case).value, generation) if tag and case is not None and generation is not None else ""
    return f"{cls.name}-{version}" + (f"+{generation}{gen}" if gen else "") + extra


__all__ = ["BACKENDS", "COMPILE_ERROR", "CRASH", "OK", "STATUSES", "TIMEOUT", "VMEM_OOM", "WRONG_RESULT",
           "EvalResult", "Evaluator", "REGISTRY", "Task", "evaluator_class", "evaluator_version", "get_evaluator"]
