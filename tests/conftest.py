import os

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


def pytest_addoption(parser):
    # here, in the top conftest, so that the option exists however pytest is started
    parser.addoption("--screenshot-dir", default=None,
                     help="save the browser tests' screenshots there (tests/e2e/test_playground.py; "
                          "or $PLAYGROUND_SCREENSHOTS)")
