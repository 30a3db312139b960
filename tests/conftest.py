import os

# CPU for arrays (interpret mode); libtpu is still loaded for deviceless compiles.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# ------------------------------------------------------------------------------ test tiers
# Every test module belongs to one tier, applied as a marker (``pytest -m unit`` runs one
# tier; the default suite, ``bash scripts/test.sh``, runs every tier but ``slow`` tests):
#   unit      no compile, no interpreter: the tuner's logic, the CLI's contract, tables, docs
#   compile   deviceless compiles for TPU generations (libtpu, no TPU): VMEM verdicts, estimates
#   interpret the kernel in the Pallas interpreter against the NumPy reference
#   data      gates on committed data: the shipped tables against their results, the
#             tracked tree's size, a built wheel
#   bench     the benchmark scripts' tooling (their parsing and merging, not their figures)
TIERS = {
    "unit": ("test_cli_bad_input", "test_device_model", "test_device_path", "test_coverage_plan", "test_distributed", "test_docs", "test_imports",
             "test_kernel_metrics", "test_kernel_validation", "test_modelled_export", "test_report_html", "test_tables_export",
             "test_tables_lookup", "test_tune_cli", "test_tune_engine", "test_tune_search", "test_tune_space",
             "test_tune_store", "test_tune_workloads", "test_vllm_server"),
    "compile": ("test_check", "test_estimator", "test_estimator_calibration", "test_estimator_public", "test_fingerprint",
                "test_kernel_deviceless", "test_kernel_v3_estimates", "test_modelled_compile", "test_precompile", "test_program_cache", "test_public_backend",
                "test_sglang_jax", "test_tune_evaluators", "test_tuned_kernels", "test_vmem_limits"),
    "interpret": ("test_calibrate", "test_conformance_v3", "test_kernel_interpret", "test_kernel_v3_compat", "test_selftest", "test_tpu_backend_fake"),
    "data": ("test_data_gates", "test_tables_shipped", "test_wheel"),
    "bench": ("test_coverage_check", "test_critical_path", "test_fidelity", "test_vs_public_tables"),
}
TIER_OF = {module: tier for tier, modules in TIERS.items() for module in modules}


def pytest_collection_modifyitems(config, items):
    import pytest
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if item.module else ""
        tier = TIER_OF.get(module)
        if tier is None:
            raise pytest.UsageError(f"{module} is in no test tier: add it to TIERS in tests/conftest.py")
        item.add_marker(getattr(pytest.mark, tier))
