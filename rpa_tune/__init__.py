"""rpa-tune: the autotuner of the Ragged Paged Attention kernel's block sizes.

Modules: ``cli`` (the ``rpa-tune`` command), ``presets`` (model shapes), ``space``
(declarative search spaces), ``workloads`` (workload generators and files),
``prefilter`` (analytic VMEM pre-filter), ``evaluators`` (compile / interpret / tpu),
``worker`` + ``engine`` (isolated evaluation with timeouts), ``search`` (grid / random /
TPE), ``store`` (the append-only Parquet results dataset), ``provenance``.
"""
__version__ = "0.1.0"


def user_cache_dir(*parts: str) -> str:
    """``rpa-tune/<parts>`` in the user's cache directory (``$XDG_CACHE_HOME``, else
    ``~/.cache``): where the tuner's regenerable caches live, never in git."""
    import os
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "rpa-tune", *parts)
