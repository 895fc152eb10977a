"""Multi-host serving on this machine: 2 CPU processes on 127.0.0.1 form one mesh with jax.distributed (gloo
collectives) and give the tokens of one process. Each host runs tests/multihost_run.py, as a pod would."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

RUN = Path(__file__).parent / "multihost_run.py"
TIMEOUT_S = 150


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_hosts(n: int, max_tokens: int = 8) -> dict:
    """The leader's result; every process is killed (SIGKILL: JAX traps SIGTERM) if any outlives TIMEOUT_S."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    procs = []
    try:
        for i in range(n):
            host = (
                dict(env, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(n), JAX_PROCESS_ID=str(i))
                if n > 1
                else env
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(RUN), "llama-s11", str(max_tokens)],
                    env=host,
                    text=True,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                )
            )
        outs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return json.loads(outs[0][0].strip().splitlines()[-1])


def test_two_processes_give_the_tokens_of_one():
    one, two = run_hosts(1), run_hosts(2)
    assert (one["devices"], two["devices"]) == (1, 2)
    assert two["tokens"] == one["tokens"]  # greedy requests and a seeded sampled one


def test_decode_dispatches_queued_ahead_run_in_the_same_order_on_every_host():
    # 40 tokens: runs of 4-step dispatches, each queued on the dispatch thread while the last one's tokens are
    # applied; a host that broadcast the next step's changes while its queued dispatch ran failed in gloo
    one, two = run_hosts(1, max_tokens=40), run_hosts(2, max_tokens=40)
    assert two["tokens"] == one["tokens"]
    assert all(len(t) == 40 for t in one["tokens"].values())
    for rid, lps in one["logprobs"].items():
        np.testing.assert_allclose(two["logprobs"][rid], lps, atol=1e-4, err_msg=rid)


def test_local_device_ids_that_are_not_numbers_are_refused_by_name(monkeypatch):
    import pytest

    from capstan.runtime.parallel.distributed import initialize_from_env

    for name, value in (
        ("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1"),
        ("JAX_NUM_PROCESSES", "2"),
        ("JAX_PROCESS_ID", "0"),
    ):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("JAX_LOCAL_DEVICE_IDS", "0,gpu1")
    with pytest.raises(ValueError, match="JAX_LOCAL_DEVICE_IDS='0,gpu1'"):
        initialize_from_env(timeout_s=1)


def test_the_wire_carries_messages_of_every_length_whole():
    import numpy as np

    from capstan.runtime.engine.lockstep import HEADER, SMALLEST_MESSAGE, LockstepEngine

    rng = np.random.default_rng(0)
    room = SMALLEST_MESSAGE - HEADER
    for size in (0, 1, room - 1, room, room + 1, 5000):  # one broadcast, or the rest in a second
        data = rng.integers(0, 256, size).astype(np.uint8)
        assert LockstepEngine._broadcast(data).tobytes() == data.tobytes()
