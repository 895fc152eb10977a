"""`capstan picker` as a subprocess on free ports (tests/gateway/processes.py's Process: own process group, log file,
killed on the way out), ready once its gRPC health service says SERVING for readiness."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).parents[1] / "gateway"))

from processes import Process, free_port  # noqa: E402

START_TIMEOUT = 60.0  # seconds: imports and the first probe round on a busy 2-core machine


class PickerProcess(Process):
    def __init__(self, flags: list[str]):
        self.grpc_port, self.health_port, self.metrics_port = free_port(), free_port(), free_port()
        args = ["picker", "--host", "127.0.0.1", "--grpc-port", str(self.grpc_port)]
        args += ["--grpc-health-port", str(self.health_port), "--metrics-port", str(self.metrics_port)]
        super().__init__([*args, "--poll-interval", "0.25", "--log-level", "debug", *flags], self.grpc_port)
        self.target = f"127.0.0.1:{self.grpc_port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}"

    def health(self, service: str) -> int:
        with grpc.insecure_channel(f"127.0.0.1:{self.health_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status

    def wait_ready(self, timeout: float = START_TIMEOUT) -> PickerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"exited with {self.process.returncode} before it was ready:\n{self.output()}")
            try:
                if self.health("readiness") == health_pb2.HealthCheckResponse.SERVING:
                    return self
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"picker not ready within {timeout} s:\n{self.output()}")


def start_picker(*flags: str) -> PickerProcess:
    return PickerProcess(list(flags))
