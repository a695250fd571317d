"""Benchmarks: `xlserve bench NAME [args]` runs `xlserve.server.bench.<name>.main(args)`.

Each benchmark writes its results as JSON (and a plot where it has one) under bench-results/
unless told otherwise, and prints a table. Benchmarks run alone: on a small machine a
second torch-heavy process slows both and makes the numbers meaningless. docs/benchmarks.md
describes each one and holds the latest numbers.
"""

BENCHMARKS = {
    # name on the command line -> module under server.bench
    "continuation": "continuation",
    "vs-hf": "vs_hf",
    "sessions": "sessions",
    "throughput": "throughput",
    "vs-hf-xlnet": "vs_hf_xlnet",
    "vs-hf-reformer": "vs_hf_reformer",
    "eval-speed": "eval_speed",
    "memory-quality": "memory_quality",
    "soak": "soak",
    "models": "models",
    "multi-turn": "multi_turn",
}
