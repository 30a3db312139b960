import os

# CPU for arrays (interpret mode); libtpu is still loaded for deviceless compiles.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


# The suite runs on two workers (pytest-xdist, scripts/test.sh). A module whose tests share an
# expensive module-scoped fixture (a sweep, a wheel build, a report) keeps its tests on one
# worker (--dist loadgroup) so that fixture is built once; every other test goes wherever a
# worker is free.
_ONE_WORKER_MODULES = {"test_distributed", "test_report_html", "test_tune_cli", "test_wheel"}


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        name = item.module.__name__.rpartition(".")[2] if item.module else ""
        if name in _ONE_WORKER_MODULES:
            item.add_marker(pytest.mark.xdist_group(name))
