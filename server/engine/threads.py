"""How many torch threads the engine process uses, and where (engine process only).

Each engine's worker thread runs the model on intra-op threads of its own: `threads` for most
forwards, `prompt_threads` for big prompt batches, and a single one for decode steps too small to
gain from more (`ForwardThreads`); a model on the CPU whose decode steps read LARGE_MODEL_BYTES of
weights or more runs every forward on `prompt_threads`. Every other thread of the engine process
that runs torch (loading, session operations) runs it on one (`own_torch_threads(1)`).

Why so few. On a small machine the API process needs a core of its own to turn every step's
tokens into SSE and websocket frames, so by default an engine takes the cores less one. A
second thread barely speeds up a decode step of a few rows, and between its parallel ops it
spins on the core the API process needs; a big forward is mostly matrix products that more
threads do speed up, and it comes when prompts arrive, not while tokens stream, so it may use
every core. With torch's OpenMP (libgomp) every thread that starts a parallel region gets a team
of helper threads of its own, and once a process holds more OpenMP threads than there are
cores, libgomp stops spinning between regions and every parallel op waits for its helpers to be
woken: so the threads that are not an engine's worker keep to one, and the engines share the
cores among themselves instead of each taking them all.

None of that holds for a model of hundreds of MB. Each of its decode steps streams every weight
from memory, which one core reads at about half the rate of two (14 against 27 GB/s here): a
transfo-xl-wt103-shaped session with its memory full decoded at 151 ms a token over HTTP on one
thread and at 85 ms on two; beside such a step the API process's work for its tokens is a
fraction of a percent. So a CPU model whose decode step reads LARGE_MODEL_BYTES of weights or more
(`weight_bytes_per_step`: input embedding tables, of which a step reads a row, do not count) runs
every forward, decode steps included, on `prompt_threads` (every core by default; set
XLSERVE_PROMPT_THREADS to keep a core for the API process). (Measurements: docs/benchmarks.md.)
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from xlserve.models.torch_threads import own_torch_threads  # noqa: F401  (the engine's threads use it)

PARALLEL_MIN_TOKENS = 8  # forwards of fewer tokens (a decode step of a few rows) run on one thread
PROMPT_PARALLEL_TOKENS = 256  # forwards of at least this many tokens (prompts, batched) run on `prompt_threads`
# a decode step reading at least this many bytes of weights (16 M float32 parameters, beyond a
# core's own caches) makes every forward of a CPU model a big one: it runs on `prompt_threads`
LARGE_MODEL_BYTES = 64 << 20


CGROUP_ROOT = Path("/sys/fs/cgroup")


def cpu_quota_cores(root: Path | None = None) -> int | None:
    """The CPU limit of the container this process runs in, in cores rounded up, or None where
    it has none: cgroup v2's `cpu.max` ("400000 100000"; "max" for none) or v1's
    `cpu.cfs_quota_us` over `cpu.cfs_period_us` (-1 for none), as a container sees its own
    cgroup at /sys/fs/cgroup. A pod's `limits.cpu: 4` (or `docker run --cpus 4`) sets it, while
    torch counts every core of the node the affinity mask allows: 64 threads in a 4-core quota
    spend most of each period throttled."""
    root = CGROUP_ROOT if root is None else root
    readings = []
    try:
        readings.append((root / "cpu.max").read_text().split()[:2])
    except OSError:
        pass
    for directory in ("cpu", "cpu,cpuacct"):
        try:
            readings.append([(root / directory / name).read_text().strip()
                             for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us")])
        except OSError:
            pass
    limits = []
    for reading in readings:
        try:
            quota, period = (int(value) for value in reading)
        except ValueError:  # "max", or something this reading does not know
            continue
        if quota > 0 and period > 0:
            limits.append(max(1, math.ceil(quota / period)))
    return min(limits, default=None)


def available_cores() -> int:
    """The cores this process may use: those torch sees (the affinity mask's), at most the
    container's CPU limit (`cpu_quota_cores`)."""
    cores = torch.get_num_threads()
    quota = cpu_quota_cores()
    return cores if quota is None else max(1, min(cores, quota))


def threads_per_engine(torch_threads: int, prompt_threads: int, engines: int) -> tuple[int, int]:
    """(threads, prompt_threads) of each of `engines` engines, from the server's settings (0:
    the default, the cores this process may use less one, and every such core), shared out among
    the engines."""

    def shared(cores: int) -> int:
        return max(1, cores // max(1, engines))

    cores = available_cores()
    return shared(torch_threads or max(1, cores - 1)), shared(prompt_threads or cores)


class ForwardThreads:
    """The thread counts of one engine's worker thread: `threads` (0: the count the thread
    finds) and `prompt_threads` (0: `threads`), settled by `take` in the worker thread itself,
    like llama.cpp's --threads and --threads-batch. `weight_bytes`: what a decode step of the
    model reads of its weights on the CPU (0 on a GPU); from LARGE_MODEL_BYTES on, every forward
    runs on `prompt_threads`."""

    def __init__(self, threads: int = 0, prompt_threads: int = 0, weight_bytes: int = 0):
        self.threads = threads
        self.prompt_threads = prompt_threads
        self.large_model = weight_bytes >= LARGE_MODEL_BYTES
        self.current = 0  # the count the worker thread runs on now

    def take(self) -> None:
        """In the worker thread, before its first forward: make its count its own."""
        self.threads = self.current = own_torch_threads(self.threads)
        self.prompt_threads = self.prompt_threads or self.threads

    def use_for(self, tokens: int) -> None:
        """Set the worker thread's count for a forward of `tokens` tokens: one below
        PARALLEL_MIN_TOKENS, `prompt_threads` from PROMPT_PARALLEL_TOKENS, else `threads`; for a
        large model `prompt_threads` whatever the tokens."""
        if self.large_model or tokens >= PROMPT_PARALLEL_TOKENS:
            wanted = self.prompt_threads
        elif tokens < PARALLEL_MIN_TOKENS:
            wanted = 1
        else:
            wanted = self.threads
        if wanted != self.current:  # a cheap call, but only made when the count changes
            torch.set_num_threads(wanted)
            self.current = wanted
