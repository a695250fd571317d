import os

# Tests run beside a possible background job on 2 cores; one thread per test process keeps
# them from fighting over cores (a server subprocess sets its own).
os.environ.setdefault("OMP_NUM_THREADS", "1")
