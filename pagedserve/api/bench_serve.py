"""`pagedserve bench serve`: drive an OpenAI-compatible server with Poisson arrivals (like
`vllm bench serve`) and report request throughput, output tokens/s, TTFT, TPOT and ITL.

Requests are streamed `/v1/completions` calls with token-id prompts from the seeded synthetic
workload (`bench.random_workload`) and `ignore_eos`, so each produces exactly its output length.
Every event that carries a choice is one inter-token arrival, as `vllm bench serve` counts them
(a server that merges the deltas of a stream that fell behind sends one event for several
tokens: one arrival); TPOT is (last arrival - first) / (output tokens - 1), the output token
count from the stream's final usage chunk. Arrival gaps are exponential with mean
1 / request_rate (seeded); rate `inf` sends all at once.

The client is `sse_client` (raw HTTP/1.1, events split with `bytes.find`) and each event is
decoded by msgspec into only the two fields it needs: one process can then follow 1,000
streams at tens of thousands of events per second without becoming what it measures.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

import anyio
import msgspec

from pagedserve.api.bench import Workload
from pagedserve.api.sse_client import HTTPStatusError, stream_events


class Usage(msgspec.Struct):
    completion_tokens: int = 0


class StreamChunk(msgspec.Struct):
    """The fields of a completion stream's chunk the benchmark reads (the rest is skipped)."""

    choices: list[msgspec.Raw] = []
    usage: Usage | None = None


CHUNK_DECODER = msgspec.json.Decoder(StreamChunk)


@dataclass
class RequestTiming:
    start: float
    stamps: list[float] = field(default_factory=list)  # arrival of each token-bearing chunk
    num_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.stamps[0] - self.start

    @property
    def e2e(self) -> float:
        return self.stamps[-1] - self.start

    @property
    def tpot(self) -> float | None:
        if self.num_tokens < 2:
            return None
        return (self.stamps[-1] - self.stamps[0]) / (self.num_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]


async def stream_one(url: str, model: str, prompt: list[int], max_tokens: int) -> RequestTiming:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
    }
    encoded = msgspec.json.encode(body)
    timing = RequestTiming(start=time.perf_counter())
    try:
        await stream_events(url, encoded, lambda events: record_events(timing, events))
    except (HTTPStatusError, OSError, ValueError, msgspec.DecodeError) as exc:
        timing.error = str(exc) or type(exc).__name__
    return timing


def record_events(timing: RequestTiming, events: list[bytes]) -> None:
    for data in events:
        if data != b"[DONE]":
            record(timing, CHUNK_DECODER.decode(data))


def record(timing: RequestTiming, chunk: StreamChunk) -> None:
    """An event arrived: an arrival when it carries a choice, the token count from usage."""
    if chunk.choices:
        timing.stamps.append(time.perf_counter())
    if chunk.usage is not None:
        timing.num_tokens = chunk.usage.completion_tokens


async def run(
    base_url: str, model: str, workload: Workload, request_rate: float, seed: int = 0
) -> dict:
    rng = random.Random(seed)
    timings: list[RequestTiming] = []
    url = base_url.rstrip("/") + "/v1/completions"
    start = time.perf_counter()

    async def one(prompt: list[int], max_tokens: int) -> None:
        timings.append(await stream_one(url, model, prompt, max_tokens))

    async with anyio.create_task_group() as tg:
        for prompt, max_tokens in workload:
            tg.start_soon(one, prompt, max_tokens)
            if request_rate != float("inf"):
                await anyio.sleep(rng.expovariate(request_rate))
    elapsed = time.perf_counter() - start
    return summarize(timings, elapsed)


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean_ms": 0.0, "median_ms": 0.0, "p99_ms": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {
        "mean_ms": statistics.fmean(values) * 1e3,
        "median_ms": statistics.median(values) * 1e3,
        "p99_ms": p99 * 1e3,
    }


def summarize(timings: list[RequestTiming], elapsed: float) -> dict:
    done = [t for t in timings if t.error is None and t.stamps]
    output_tokens = sum(t.num_tokens for t in done)
    return {
        "completed": len(done),
        "failed": len(timings) - len(done),
        "duration_s": elapsed,
        "request_throughput": len(done) / elapsed,
        "output_throughput": output_tokens / elapsed,
        "total_output_tokens": output_tokens,
        "total_events": sum(len(t.stamps) for t in done),
        "ttft": _stats([t.ttft for t in done]),
        "tpot": _stats([t.tpot for t in done if t.tpot is not None]),
        "itl": _stats([gap for t in done for gap in t.itls]),
        "e2el": _stats([t.e2e for t in done]),
    }
