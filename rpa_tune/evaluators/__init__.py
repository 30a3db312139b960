"""Evaluators: one interface (``base.Evaluator``), three backends (compile, interpret, tpu)."""
from .base import (BACKENDS, COMPILE_ERROR, CRASH, OK, STATUSES, TIMEOUT, VMEM_OOM, WRONG_RESULT, EvalResult,
                   Evaluator, Task, get_evaluator)

__all__ = ["BACKENDS", "COMPILE_ERROR", "CRASH", "OK", "STATUSES", "TIMEOUT", "VMEM_OOM", "WRONG_RESULT",
           "EvalResult", "Evaluator", "Task", "get_evaluator"]
