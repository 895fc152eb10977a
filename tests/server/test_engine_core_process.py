"""`capstan serve` as processes: the engine core is a child process; `--api-server-count 2` serves the openai client
from both frontends; `--data-parallel-size 2` runs two engine cores behind one endpoint; an engine core killed with SIGKILL fails /health within 5 s and ends every open stream with an
error event; the main process killed outright takes its children with it. (SIGTERM with 64 streams in flight, and
no process left behind: test_storm_and_drain.py.)"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest
from servers import ENGINE_FLAGS, MODEL, ServeProcess, alive, child_processes

from capstan.runtime.server.metric_names import E2E_REQUEST_LATENCY

pytestmark = pytest.mark.slow
CORE = "capstan.runtime.engine.core_process"
FRONTEND = "capstan.runtime.server.frontend_process"
E2E_COUNT = E2E_REQUEST_LATENCY + "_count"


def core_pid(server: ServeProcess) -> int:
    children = child_processes(server.process.pid)
    cores = [pid for pid, command in children.items() if CORE in command]
    assert len(cores) == 1, children
    return cores[0]


def test_two_frontends_serve_the_openai_client_from_one_engine_core():
    with ServeProcess("--api-server-count=2") as server:
        children = child_processes(server.process.pid)
        assert sorted(CORE in c for c in children.values()) == [False, True], children
        assert sum(FRONTEND in c for c in children.values()) == 1, children
        texts = []
        for i in range(24):  # a new connection each: the kernel spreads them over the two listening processes
            with httpx.Client() as http:
                client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", http_client=http)
                if i % 2:
                    stream = client.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": "hi"}],
                        max_tokens=4,
                        temperature=0,
                        stream=True,
                    )
                    texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
                else:
                    texts.append(
                        client.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0)
                        .choices[0]
                        .text
                    )
        assert all(texts), texts
        assert len({t for i, t in enumerate(texts) if i % 2 == 0}) == 1  # greedy: the same text from either
        deadline = time.monotonic() + 10
        while len(finished := [line for line in "".join(server.output).splitlines() if "finished:" in line]) < 24:
            assert time.monotonic() < deadline, finished  # the log's last lines may still be on their way
            time.sleep(0.05)
        by_second = [line for line in finished if "[frontend 1]" in line]
        assert 0 < len(by_second) < len(finished) == 24, "both frontends should have served requests"
        for _ in range(6):  # whichever frontend answers the scrape adds up both frontends' histograms
            with httpx.Client() as http:
                scrape = http.get(f"{server.url}/metrics").text
            count = next(line for line in scrape.splitlines() if line.startswith(E2E_COUNT))
            assert float(count.split()[-1]) == 24, count
            assert "capstan_kv_pages_total" in scrape  # the engine core's gauges, from its stats


def test_two_data_parallel_engine_cores_serve_one_endpoint():
    # streams of 2,000 tokens: 400 took ~0.5 s on an idle machine, so under CI's load (2 cores shared with the cluster
    # tests and the Go builds) one core's 6 could end before the other's began ("at most 6.0 / 7.0 ran at once")
    with ServeProcess("--data-parallel-size=2", engine_flags={**ENGINE_FLAGS, "max_model_len": 2048}) as server:
        children = child_processes(server.process.pid)
        assert sum(CORE in c for c in children.values()) == 2, children

        async def scenario():
            seen = {"running": 0.0, "pages": 0.0}
            done = asyncio.Event()

            async def watch():  # from before the streams open: a fast machine may end them before they all started
                async with httpx.AsyncClient(timeout=30) as scraper:
                    deadline = time.monotonic() + 150
                    while not done.is_set() and seen["running"] <= 8 and time.monotonic() < deadline:
                        scrape = (await scraper.get(f"{server.url}/metrics")).text
                        seen["running"] = max(seen["running"], _gauge(scrape, "capstan_requests_running"))
                        seen["pages"] = _gauge(scrape, "capstan_kv_pages_total")
                        await asyncio.sleep(0.05)

            watcher = asyncio.ensure_future(watch())
            tasks, client = await _open_streams(server.url, 12, max_tokens=2000)  # more than one core's 8 rows
            streams = await asyncio.wait_for(asyncio.gather(*tasks), timeout=240)
            done.set()
            await asyncio.wait_for(watcher, timeout=60)
            await client.aclose()
            return seen["running"], seen["pages"], streams

        running, pages, streams = asyncio.run(scenario())
        assert running > 8, f"at most {running} requests ran at once: one core's rows"
        assert all(events[-1] == "[DONE]" and '"length"' in events[-2] for events in streams)
        assert pages > 0 and pages % 2 == 0  # two cores' equal pools, added up


def _gauge(scrape: str, name: str) -> float:
    return float(next(line for line in scrape.splitlines() if line.startswith(name + " ")).split()[-1])


async def _open_streams(url: str, count: int, max_tokens: int = 400) -> tuple[list[asyncio.Task], httpx.AsyncClient]:
    """`count` long streams, each read until its first event; returns the tasks that read the rest."""
    client = httpx.AsyncClient(timeout=60)
    body = {"model": MODEL, "prompt": "keep going", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    first = [asyncio.get_running_loop().create_future() for _ in range(count)]

    async def read(i: int) -> list[str]:
        events = []
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if not first[i].done():
                        first[i].set_result(None)
        return events

    tasks = [asyncio.ensure_future(read(i)) for i in range(count)]
    await asyncio.wait_for(asyncio.gather(*first), timeout=60)
    return tasks, client


def test_engine_core_killed_fails_health_and_ends_every_stream_with_an_error():
    with ServeProcess() as server:
        core = core_pid(server)

        async def scenario():
            tasks, client = await _open_streams(server.url, 3)
            os.kill(core, signal.SIGKILL)
            killed = time.monotonic()
            deadline = killed + 5
            while (await client.get(f"{server.url}/health")).status_code != 503:
                assert time.monotonic() < deadline, "/health still 200 5 s after the engine core died"
                await asyncio.sleep(0.05)
            unhealthy_after = time.monotonic() - killed
            streams = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
            await client.aclose()
            return unhealthy_after, streams

        unhealthy_after, streams = asyncio.run(scenario())
        for events in streams:
            assert events[-1] == "[DONE]", events[-3:]
            error = json.loads(events[-2])["error"]
            assert error["code"] == "engine_dead", error
        ready = httpx.get(f"{server.url}/ready", timeout=5)
        assert ready.status_code == 503
        print(f"/health answered 503 {unhealthy_after:.2f} s after SIGKILL of the engine core")


def test_main_process_killed_takes_engine_core_and_frontends_with_it():
    with ServeProcess("--api-server-count=2") as server:
        children = child_processes(server.process.pid)
        assert len(children) == 2, children
        server.process.send_signal(signal.SIGKILL)  # the main process alone, not its process group
        server.wait(timeout=10)
        deadline = time.monotonic() + 10
        while [pid for pid in children if alive(pid)]:
            assert time.monotonic() < deadline, f"orphans: {[c for p, c in children.items() if alive(p)]}"
            time.sleep(0.05)
