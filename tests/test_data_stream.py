"""`ChunkStream`: the vLLM generation worker's scheduler, driven by a fake engine (no vLLM needed).

The fake engine runs up to `capacity` requests per step; a request finishes after as many steps as its prompt's
first token says. It records how many requests it ran at each step, which is what the stream must keep full.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from distill.vllm_worker import generate
from distill.vllm_worker.generate import ChunkStream


@dataclass
class Output:
    request_id: str
    finished: bool
    outputs: list[Any]


class FakeEngine:
    def __init__(self, clock: list[float], capacity: int = 1000) -> None:
        self.clock, self.capacity = clock, capacity
        self.active: dict[str, int] = {}  # request id -> steps left
        self.prompts: dict[str, Any] = {}
        self.running_per_step: list[int] = []
        self.step_count = 0

    def add_request(self, request_id: str, prompt: Any, params: Any) -> None:
        assert request_id not in self.active, "request ids must be unique"
        self.active[request_id] = prompt["steps"]
        self.prompts[request_id] = prompt

    def step(self) -> list[Output]:
        self.step_count += 1
        self.clock[0] += 1.0  # one second per engine step
        running = list(self.active)[: self.capacity]
        self.running_per_step.append(len(running))
        done = []
        for rid in running:
            self.active[rid] -= 1
            if self.active[rid] == 0:
                del self.active[rid]
                done.append(Output(rid, True, [self.prompts[rid]["id"]]))
        return done


def _chunks(lengths: list[list[int]]) -> list[dict[str, Any]]:
    return [
        {"out": f"chunk{c}", "prompts": [{"prompt_id": f"{c}.{i}", "steps": n} for i, n in enumerate(ls)]}
        for c, ls in enumerate(lengths)
    ]


def _request(p: dict[str, Any]) -> tuple[dict[str, Any], None]:
    return {"id": p["prompt_id"], "steps": p["steps"]}, None


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(generate.time, "perf_counter", lambda: now[0])
    return now


def _run(chunks, max_in_flight, clock, keep_going=lambda: True):
    engine = FakeEngine(clock)
    written: list[tuple[str, list[str], float, int]] = []

    def write(chunk, outputs, gen_s):
        written.append((chunk["out"], [o.outputs[0] for o in outputs], gen_s, engine.step_count))

    stream = ChunkStream(engine, chunks, max_in_flight, _request, write)
    return stream, stream.run(keep_going), engine, written


def test_every_chunk_is_written_once_with_its_responses_in_prompt_order(clock):
    lengths = [[5, 1, 3], [2, 2, 9], [1], [4, 4]]
    stream, done, _, written = _run(_chunks(lengths), 3, clock)
    assert done == 4 == stream.chunks_written
    assert sorted(w[0] for w in written) == ["chunk0", "chunk1", "chunk2", "chunk3"]
    by_chunk = {w[0]: w[1] for w in written}
    for c, ls in enumerate(lengths):
        assert by_chunk[f"chunk{c}"] == [f"{c}.{i}" for i in range(len(ls))]
    assert not stream.in_flight and not stream.queue


def test_the_batch_stays_full_across_chunk_boundaries(clock):
    """Per-chunk generate calls would drain to 1 running request at each chunk's end (the 9-step request);
    the stream refills finished slots from the next chunk at once."""
    lengths = [[9, 1, 1, 1], [1, 1, 1, 1], [9, 2, 3, 1], [1, 1, 1, 1]]
    max_in_flight = 4
    engine = FakeEngine(clock)
    stream = ChunkStream(engine, _chunks(lengths), max_in_flight, _request, lambda c, o, g: None)
    queued_per_step = []
    step = engine.step
    engine.step = lambda: (queued_per_step.append(len(stream.queue)), step())[1]  # type: ignore[method-assign]
    assert stream.run() == 4
    assert max(engine.running_per_step) == max_in_flight  # never more than asked for
    full = [
        n == max_in_flight
        for n, queued in zip(engine.running_per_step, queued_per_step, strict=True)
        if queued
    ]
    assert full and all(full)  # every step with prompts still waiting ran a full batch
    # One generate call per chunk (across_chunks=False): 9 + 1 + 9 + 1 = 20 steps, draining to 1 running
    # request at the ends of chunks 0 and 2. Streamed, the two 9-step requests overlap the rest: 11.
    per_chunk = FakeEngine(clock)
    written = []
    ChunkStream(
        per_chunk,
        _chunks(lengths),
        max_in_flight,
        _request,
        lambda c, o, g: written.append(c["out"]),
        across_chunks=False,
    ).run()
    assert per_chunk.step_count == 20 and engine.step_count == 11
    assert per_chunk.running_per_step == [4, *[1] * 8, 4, 4, 3, 2, *[1] * 6, 4]
    assert written == ["chunk0", "chunk1", "chunk2", "chunk3"]


def test_a_chunk_is_written_in_the_step_its_last_request_finishes(clock):
    # chunk0 waits on its 9-step request; chunk1 (all short) completes first and must not wait for chunk0.
    lengths = [[9, 1], [1, 1]]
    _, _, _, written = _run(_chunks(lengths), 4, clock)
    assert [(w[0], w[3]) for w in written] == [("chunk1", 1), ("chunk0", 9)]


def test_gen_s_partitions_the_generation_wall_time(clock):
    lengths = [[3, 1], [5], [2, 2]]
    _, _, engine, written = _run(_chunks(lengths), 2, clock)
    assert all(w[2] > 0 for w in written)
    assert sum(w[2] for w in written) == pytest.approx(engine.step_count)  # one clock second per step


def test_stopping_writes_no_partial_chunk(clock):
    lengths = [[1, 1], [1, 50], [1, 1]]
    steps = iter(range(1000))
    stream, done, _, written = _run(_chunks(lengths), 6, clock, keep_going=lambda: next(steps) < 5)
    assert [w[0] for w in written] == ["chunk0", "chunk2"] and done == 2
    assert "distill-1-1" in stream.in_flight  # chunk1's long request was still running: chunk1 not written


def test_outputs_of_other_requests_are_ignored(clock):
    class Noisy(FakeEngine):
        def step(self):
            return [Output("7", True, ["foreign"]), *super().step()]

    engine = Noisy(clock)
    written = []
    stream = ChunkStream(engine, _chunks([[2, 1]]), 2, _request, lambda c, o, g: written.append(o))
    assert stream.run() == 1
    assert [o.outputs[0] for o in written[0]] == ["0.0", "0.1"]
