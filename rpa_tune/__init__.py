"""rpa-tune: the autotuner of the Ragged Paged Attention kernel's block sizes.

Modules: ``cli`` (the ``rpa-tune`` command), ``presets`` (model shapes), ``space``
(declarative search spaces), ``workloads`` (workload generators and files),
``prefilter`` (analytic VMEM pre-filter), ``evaluators`` (compile / interpret / tpu),
``worker`` + ``engine`` (isolated evaluation with timeouts), ``search`` (grid / random /
TPE), ``store`` (the append-only Parquet results dataset), ``provenance``.
"""
__version__ = "0.1.0"
