"""Benchmarks: `xlserve bench NAME [args]` runs `xlserve.server.bench.<name>.main(args)`.

Each benchmark writes its results as JSON (and a plot where it has one) under bench-results/
unless told otherwise, and prints a table. Benchmarks run alone: on a small machine a
second torch-heavy process slows both and makes the numbers meaningless. docs/benchmarks.md
describes each one and holds the latest numbers.

Their third-party packages beyond the server's own are the `bench` extra of pyproject.toml
(`make bench`, or `.venv/bin/pip install -c constraints.txt -e ".[bench]"` in the checkout): a
server installed without it serves as before, and `xlserve bench` says what to install instead
of failing on an import half-way through a run.
"""

from importlib.util import find_spec

BENCHMARKS = {
    # name on the command line -> module under server.bench
    "continuation": "continuation",
    "vs-hf": "vs_hf",
    "sessions": "sessions",
    "throughput": "throughput",
    "vs-hf-xlnet": "vs_hf_xlnet",
    "vs-hf-reformer": "vs_hf_reformer",
    "vs-hf-mamba": "vs_hf_mamba",  # its reference runs in another process (transformers with Mamba)
    "eval-speed": "eval_speed",
    "memory-quality": "memory_quality",
    "soak": "soak",
    "models": "models",
    "multi-turn": "multi_turn",
    "fairness": "fairness",
    "real-size": "real_size",
    "structured": "structured",
}

# what each benchmark imports beyond the server's dependencies (pyproject.toml's `bench` extra)
PLOTS = ("matplotlib",)
EXTRA_PACKAGES = {name: PLOTS for name in BENCHMARKS}
EXTRA_PACKAGES.update({name: (*PLOTS, "transformers") for name in ("vs-hf", "vs-hf-xlnet", "vs-hf-reformer", "real-size")})


def missing_packages(name: str) -> list[str]:
    """The packages benchmark `name` needs that are not installed here."""
    return [package for package in EXTRA_PACKAGES[name] if find_spec(package) is None]
