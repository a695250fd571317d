import os

import pytest

# Tests run beside a possible background job on 2 cores; one thread per test process keeps
# them from fighting over cores (a server subprocess sets its own).
os.environ.setdefault("OMP_NUM_THREADS", "1")


# `make test` hands whole files to two xdist workers in collection order, so a long file collected
# last runs alone at the end. Files are ordered so that the long ones come first (the end-to-end
# files, the benchmark smoke tests, the shipped checkpoints' evaluations) and the many short model
# files last, where they fill both workers until the end. The order within a file is unchanged.
FIRST = ("tests/e2e/", "tests/models/test_shipped_checkpoints.py", "tests/server/test_bench_", "tests/server/",
         "tests/test_")


def file_rank(path: str) -> int:
    return next((rank for rank, prefix in enumerate(FIRST) if path.startswith(prefix)), len(FIRST))


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: file_rank(item.nodeid))  # sort is stable: file and test order kept
    # `make gpu-check` (XLSERVE_DEVICE=cuda) without a CUDA device would skip every test it runs and
    # pass: it stops instead, saying why
    if os.environ.get("XLSERVE_DEVICE") == "cuda" and any(item.get_closest_marker("gpu") for item in items):
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError("XLSERVE_DEVICE=cuda, but torch sees no CUDA device (a CPU build of torch, or no "
                                    "driver): the gpu tests would all be skipped")


def pytest_addoption(parser):
    # here, in the top conftest, so that the option exists however pytest is started
    parser.addoption("--screenshot-dir", default=None,
                     help="save the browser tests' screenshots there (tests/e2e/test_playground.py; "
                          "or $PLAYGROUND_SCREENSHOTS)")
