"""A real Kubernetes node beside the control plane: containerd and runc from Debian, CNI's bridge plugin,
a kubelet and kube-proxy built from the same Kubernetes module, all inside the node's network namespace.

The kubelet runs on this machine's cgroup v1 with cgroupfs and without per-QoS cgroups; images come from
OCI archives imported into containerd (no registry is reachable), including the pod sandbox's `pause`.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Any

import yaml
from binaries import ClusterBinaries
from control_plane import ControlPlane, wait_for
from node_network import NodeNetwork

PAUSE_IMAGE = "localhost/capstan-pause:1"
CNI_PLUGINS = Path("/usr/lib/cni")  # Debian's containernetworking-plugins
START_TIMEOUT = 120.0
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # runc and iptables live in sbin


def shared_containerd_root() -> tuple[Path, object] | None:
    """containerd's image store, kept between runs: importing and unpacking the image takes ~40 s and deleting
    it minutes (discards on this machine's disk). One run at a time holds it; others get one of their own."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "capstan" / "realnode"
    base.mkdir(parents=True, exist_ok=True)
    lock = (base / "containerd.lock").open("w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return None
    return base / "containerd-root", lock


def pause_image(binaries: ClusterBinaries, folder: Path) -> Path:
    """An OCI archive holding only the `pause` binary, packed by umoci next to the binaries it came from."""
    archive = binaries.folder / "pause.oci.tar"
    if archive.exists():
        return archive
    layout, bundle = folder / "pause-oci", folder / "pause-bundle"
    for args in (
        ["init", "--layout", str(layout)],
        ["new", "--image", f"{layout}:1"],
        ["unpack", "--image", f"{layout}:1", str(bundle)],
    ):
        subprocess.run(["umoci", *args], check=True, timeout=60)
    shutil.copy(binaries["pause"], bundle / "rootfs" / "pause")
    subprocess.run(["umoci", "repack", "--image", f"{layout}:1", str(bundle)], check=True, timeout=60)
    subprocess.run(
        ["umoci", "config", "--image", f"{layout}:1", "--config.entrypoint=/pause", "--config.user=65535:65535"],
        check=True,
        timeout=60,
    )
    partial = archive.with_suffix(".partial")
    subprocess.run(
        ["skopeo", "copy", "--quiet", f"oci:{layout}:1", f"oci-archive:{partial}:{PAUSE_IMAGE}"], check=True, timeout=60
    )
    partial.replace(archive)
    return archive


class RealNode:
    def __init__(
        self,
        binaries: ClusterBinaries,
        cluster: ControlPlane,
        network: NodeNetwork,
        workdir: Path,
        name: str = "capstan-node",
    ):
        self.binaries, self.cluster, self.network, self.workdir, self.name = binaries, cluster, network, workdir, name
        self.processes: list[tuple[str, subprocess.Popen]] = []
        self.socket = workdir / "containerd" / "containerd.sock"
        shared = shared_containerd_root()
        self._root_lock: Any
        self.containerd_root, self._root_lock = shared or (workdir / "containerd" / "root", None)

    # -- processes --------------------------------------------------------------------------------------------
    def _start(self, name: str, args: list[str]) -> Path:
        log = self.workdir / f"{name}.log"
        process = subprocess.Popen(
            [*self.network.enter(), *args],
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "PATH": SYSTEM_PATH},
        )
        self.processes.append((name, process))
        return log

    def _check_alive(self) -> None:
        for name, process in self.processes:
            if process.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with {process.returncode}:\n" + (self.workdir / f"{name}.log").read_text()[-3000:]
                )

    def ctr(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ctr", f"--address={self.socket}", "--namespace=k8s.io", *args],
            capture_output=True,
            text=True,
            check=True,
            timeout=timeout,
        )

    # -- start ------------------------------------------------------------------------------------------------
    def start(self, images: list[Path]) -> RealNode:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._start_containerd()
        for archive in [pause_image(self.binaries, self.workdir), *images]:
            self._import(archive)
        self._write_cni_config()
        self._start_kubelet()
        wait_for(
            "the real node Ready", self._ready, START_TIMEOUT, interval=1, process_log=self.workdir / "kubelet.log"
        )
        self._start(
            "kube-proxy",
            [
                str(self.binaries["kube-proxy"]),
                f"--kubeconfig={self.cluster.kubeconfig}",
                f"--hostname-override={self.name}",
                f"--cluster-cidr={self.network.pod_cidr}",
                "--proxy-mode=iptables",
                "--conntrack-max-per-core=0",  # the namespace's conntrack table is the host's: leave its size alone
                "--metrics-bind-address=127.0.0.1:10249",
            ],
        )
        wait_for(
            "the kubernetes Service routed by kube-proxy",
            self._service_routed,
            START_TIMEOUT,
            interval=1,
            process_log=self.workdir / "kube-proxy.log",
        )
        return self

    def _start_containerd(self) -> None:
        folder = self.workdir / "containerd"
        folder.mkdir(exist_ok=True)
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        (folder / "config.toml").write_text(
            "\n".join(
                [
                    "version = 2",
                    f'root = "{self.containerd_root}"',
                    f'state = "{folder / "state"}"',
                    "[grpc]",
                    f'  address = "{self.socket}"',
                    f"[{cri}]",
                    f'  sandbox_image = "{PAUSE_IMAGE}"',
                    "  restrict_oom_score_adj = true",  # no CAP_SYS_RESOURCE here: runc may not lower oom_score_adj
                    f"[{cri}.cni]",
                    f'  bin_dir = "{CNI_PLUGINS}"',
                    f'  conf_dir = "{self.workdir / "cni"}"',
                    f"[{cri}.containerd.runtimes.runc]",
                    '  runtime_type = "io.containerd.runc.v2"',
                    "",
                ]
            )
        )
        log = self._start("containerd", ["containerd", f"--config={folder / 'config.toml'}"])

        def answers() -> subprocess.CompletedProcess:
            self._check_alive()  # a containerd that exited fails at once, with its log
            return self.ctr("version", timeout=5)

        wait_for("containerd", answers, START_TIMEOUT, process_log=log)

    def _import(self, archive: Path) -> None:
        """Import the archive unless the store holds it already; other builds of its name go."""
        reference, digest = archive_manifest(archive)
        stored = {line.split()[0]: line.split()[2] for line in self.ctr("images", "ls").stdout.splitlines()[1:]}
        if stored.get(reference) == digest:
            return
        repository = reference.rsplit(":", 1)[0]
        stale = [name for name in stored if name.rsplit(":", 1)[0] == repository]
        if stale:
            self.ctr("images", "rm", *stale)  # containerd's garbage collector frees their layers
        started = time.monotonic()
        self.ctr("images", "import", str(archive))
        print(f"[real node] imported {archive.name} in {time.monotonic() - started:.0f}s", flush=True)

    def _write_cni_config(self) -> None:
        (self.workdir / "cni").mkdir(exist_ok=True)
        config = {
            "cniVersion": "1.0.0",
            "name": "capstan",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": "cni0",
                    "isGateway": True,
                    "ipMasq": True,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "dataDir": str(self.workdir / "cni-ipam"),
                        "ranges": [[{"subnet": self.network.pod_cidr}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }
        (self.workdir / "cni" / "10-capstan.conflist").write_text(json.dumps(config, indent=1))

    def _start_kubelet(self) -> None:
        folder = self.workdir / "kubelet"
        folder.mkdir(exist_ok=True)
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            # What this machine needs: cgroup v1 through cgroupfs, no QoS or allocatable cgroups, swap tolerated.
            "cgroupDriver": "cgroupfs",
            "failCgroupV1": False,
            "failSwapOn": False,
            "cgroupsPerQOS": False,
            "enforceNodeAllocatable": [],
            "address": self.network.node_ip,
            "readOnlyPort": 0,
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},  # `kubectl logs` from the API server, in a throwaway cluster
            "podLogsDir": str(self.workdir / "pod-logs"),
            # A shared machine's disk may be full-ish: never evict the test's pods or its imported images.
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "registerNode": True,
            "maxPods": 30,
            "syncFrequency": "10s",
            "fileCheckFrequency": "10s",
            "resolvConf": "/etc/resolv.conf",
        }
        (folder / "config.yaml").write_text(yaml.safe_dump(config))
        self._start(
            "kubelet",
            [
                str(self.binaries["kubelet"]),
                f"--config={folder / 'config.yaml'}",
                f"--kubeconfig={self.cluster.kubeconfig}",
                f"--root-dir={folder / 'root'}",
                f"--hostname-override={self.name}",
                f"--node-ip={self.network.node_ip}",
                "--node-labels=capstan.dev/real-node=true",
                "--v=1",
            ],
        )

    def _ready(self) -> bool:
        self._check_alive()
        node = self.cluster.get_json("node", self.name)
        return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions", []))

    def _service_routed(self) -> bool:
        self._check_alive()
        service_ip = self.cluster.get_json("service", "kubernetes", "-n", "default")["spec"]["clusterIP"]
        with socket.create_connection((service_ip, 443), timeout=2):
            return True

    # -- stop -------------------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Pods first (the kubelet tears down their sandboxes and networks), then every process, then mounts."""
        if self._running("kubelet"):
            self.cluster.kubectl(
                "delete", "pods", "--all", "--all-namespaces", "--grace-period=1", "--wait=false", check=False
            )
            try:
                wait_for("the real node's containers to stop", self._no_tasks, 60, interval=1)
            except TimeoutError as error:
                print(f"[real node] {error}", flush=True)
        for name, process in reversed(self.processes):
            if name != "containerd" and process.poll() is None:
                process.terminate()
                self._wait(process)
        if self._running("containerd"):
            self._kill_tasks()
        for _, process in self.processes:
            if process.poll() is None:
                process.terminate()
                self._wait(process)
        self.processes.clear()
        self._unmount_all()
        if self._root_lock is not None:
            self._root_lock.close()  # the next run reuses the store

    def _running(self, name: str) -> bool:
        return any(n == name and p.poll() is None for n, p in self.processes)

    @staticmethod
    def _wait(process: subprocess.Popen) -> None:
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)

    def _no_tasks(self) -> bool:
        return not self.ctr("tasks", "list", "--quiet", timeout=10).stdout.strip()

    def _kill_tasks(self) -> None:
        try:
            for task in self.ctr("tasks", "list", "--quiet", timeout=10).stdout.split():
                self.ctr("tasks", "kill", "--signal=SIGKILL", task, timeout=10)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not self._no_tasks():
                time.sleep(0.5)
            for task in self.ctr("tasks", "list", "--quiet", timeout=10).stdout.split():
                subprocess.run(
                    ["ctr", f"--address={self.socket}", "-n", "k8s.io", "tasks", "delete", task],
                    capture_output=True,
                    timeout=10,
                )
        except (subprocess.SubprocessError, OSError) as error:
            print(f"[real node] could not stop every container: {error}", flush=True)

    def _unmount_all(self) -> None:
        """Volumes, rootfs overlays and pod network namespaces left under the workdir, deepest first."""
        mounts = subprocess.run(["findmnt", "-rn", "-o", "TARGET"], capture_output=True, text=True).stdout.split()
        for target in sorted((m for m in mounts if m.startswith(str(self.workdir))), key=len, reverse=True):
            subprocess.run(["umount", "-l", target], capture_output=True, timeout=10)


def archive_manifest(archive: Path) -> tuple[str, str]:
    """The image name an OCI archive carries (skopeo writes it as the index's ref.name annotation), and the
    digest of its manifest."""
    with tarfile.open(archive) as tar:
        index = tar.extractfile("index.json")
        assert index is not None, f"{archive}: no index.json"
        manifest = json.load(index)["manifests"][0]
    return manifest["annotations"]["org.opencontainers.image.ref.name"], manifest["digest"]
