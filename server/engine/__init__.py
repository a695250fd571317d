"""The engine: scheduling, batching and sampling of requests on the loaded models.

Everything here runs in the engine process (process.py is its main) except client.py, which is
the API process's side of it; types.py, wire.py and errors.py are used on both sides and never
import torch.

    process.py    the engine process: models, engines, session cache, the socket to the API
    scheduler.py  Engine: admission and the step loop (prefill, sample, forward, events)
    request.py    EngineRequest, the one way into an engine, and the Row of each choice
    batch.py      how decoding rows are laid out in batches from step to step
    threads.py    how many torch threads each forward runs on
    sampling.py   choosing the next token; stop strings
    local.py      using an engine from asyncio code in the same process (tests, benchmarks)
    client.py     EngineClient: the API process's side of the engine process
    types.py      SamplingParams, the events, Submission (a request as its consumer sees it)
    wire.py       frames and the event and error codec between the two processes
    errors.py     the engine's exceptions
"""
