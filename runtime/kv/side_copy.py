"""Host-to-device copies outside XLA's queue: on a CUDA stream of our own, beside the programs queued (issue 33).

PJRT's GPU client makes every `device_put` wait for the programs queued on the device before it: it allocates the
copy's destination, and its allocation model (`kComputeSynchronized`) orders the copy after the compute stream
(benchmarks/copy_overlap.py, H200: 1 GiB copied after an 86 ms program is ready at 106 ms, before it at 23 ms).
A restored turn's pages then cross only after the dispatch under way. This copies into device buffers allocated
once (when the host tier is made, so nothing queued can still be using their memory) through the CUDA driver API on a non-blocking
stream of our own, so the copy runs at once, beside whatever the device computes. The caller orders the reader: it
waits for the copy's event on the host before dispatching a program that reads the buffer, and does not write a
buffer again until every program that read it has run.

Only the driver library (libcuda.so.1, part of the GPU driver) is used, through ctypes (each call releases the GIL).
On a CPU device (whose memory is host memory) a copy is a memmove, done when `copy` returns: the same bookkeeping
runs in CI. `available()` is False elsewhere (TPU, a GPU without the driver library): callers keep `device_put`."""

from __future__ import annotations

import collections
import ctypes
import functools
import threading

import jax

CU_STREAM_NON_BLOCKING = 0x1  # no implicit ordering with the legacy default stream
CU_EVENT_DISABLE_TIMING = 0x2  # cheapest events: we only ask whether they passed
CUDA_ERROR_NOT_READY = 600


class CudaError(RuntimeError):
    pass


@functools.cache
def _driver() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    u64, vp, sz = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t
    lib.cuMemcpyHtoDAsync_v2.argtypes = [u64, vp, sz, vp]
    lib.cuStreamCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
    lib.cuEventCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
    lib.cuEventRecord.argtypes = [vp, vp]
    lib.cuEventQuery.argtypes = [vp]
    lib.cuEventSynchronize.argtypes = [vp]
    lib.cuEventDestroy_v2.argtypes = [vp]
    lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(vp), ctypes.c_int]
    lib.cuCtxSetCurrent.argtypes = [vp]
    lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        text = ctypes.c_char_p()
        _driver().cuGetErrorString(status, ctypes.byref(text))  # type: ignore[union-attr]
        raise CudaError(f"{what}: CUDA error {status} ({(text.value or b'?').decode()})")


def _nbytes(a: jax.Array) -> int:
    return a.size * a.dtype.itemsize


def _is_cuda(device: jax.Device) -> bool:
    return device.platform == "gpu" and "cuda" in device.client.platform_version.lower()


def available(device: jax.Device) -> bool:
    """Whether copies to this device can go outside XLA's queue (an NVIDIA GPU with its driver library, or a CPU)."""
    return device.platform == "cpu" or (_is_cuda(device) and _driver() is not None)


class CopyEvent:
    """The end of copies queued on a stream: `done()` asks, `wait()` blocks the calling thread (not the GIL)."""

    def __init__(self, stream: SideStream):
        self._stream = stream
        handle = ctypes.c_void_p()
        stream.enter()
        _check(_driver().cuEventCreate(ctypes.byref(handle), CU_EVENT_DISABLE_TIMING), "cuEventCreate")  # type: ignore[union-attr]
        self._handle = handle
        _check(_driver().cuEventRecord(handle, stream.handle), "cuEventRecord")  # type: ignore[union-attr]

    def done(self) -> bool:
        self._stream.enter()
        status = _driver().cuEventQuery(self._handle)  # type: ignore[union-attr]
        if status == CUDA_ERROR_NOT_READY:
            return False
        _check(status, "cuEventQuery")
        return True

    def wait(self) -> None:
        self._stream.enter()
        _check(_driver().cuEventSynchronize(self._handle), "cuEventSynchronize")  # type: ignore[union-attr]

    def __del__(self):
        lib = _driver()
        if lib is not None and self._handle:
            self._stream.enter()
            lib.cuEventDestroy_v2(self._handle)


class SideStream:
    """A non-blocking CUDA stream on one device, in the device's primary context (the one XLA uses)."""

    def __init__(self, device: jax.Device):
        lib = _driver()
        if lib is None:
            raise CudaError("libcuda.so.1 is not loadable: no CUDA driver on this host")
        ordinal = ctypes.c_int()
        _check(lib.cuDeviceGet(ctypes.byref(ordinal), device.local_hardware_id), "cuDeviceGet")
        self._context = ctypes.c_void_p()
        _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(self._context), ordinal.value), "cuDevicePrimaryCtxRetain")
        self._entered = threading.local()
        self.enter()
        self.handle = ctypes.c_void_p()
        _check(lib.cuStreamCreate(ctypes.byref(self.handle), CU_STREAM_NON_BLOCKING), "cuStreamCreate")

    def enter(self) -> None:
        """Makes the device's context current on the calling thread (once a thread)."""
        if getattr(self._entered, "yes", False):
            return
        _check(_driver().cuCtxSetCurrent(self._context), "cuCtxSetCurrent")  # type: ignore[union-attr]
        self._entered.yes = True

    def copy_to_device(self, pairs: list[tuple[jax.Array, jax.Array]]) -> CopyEvent:
        """Queues (pinned host array -> device array) copies, single-device arrays of the same byte size (checked by
        SideCopies), and returns the event that passes once all have landed."""
        lib = _driver()
        self.enter()
        for host, dest in pairs:
            _check(
                lib.cuMemcpyHtoDAsync_v2(  # type: ignore[union-attr]
                    dest.unsafe_buffer_pointer(), host.unsafe_buffer_pointer(), _nbytes(host), self.handle
                ),
                "cuMemcpyHtoDAsync",
            )
        return CopyEvent(self)


class Landing:
    """The end of one batch of side copies, on every device they went to."""

    def __init__(self, events: list[CopyEvent]):
        self._events = events

    def done(self) -> bool:
        self._events = [e for e in self._events if not e.done()]
        return not self._events

    def wait(self) -> None:
        for e in self._events:
            e.wait()
        self._events = []


class _Memmove:
    """A CPU device's "stream": the copy is done when it returns."""

    def copy_to_device(self, pairs: list[tuple[jax.Array, jax.Array]]) -> None:
        for host, dest in pairs:
            ctypes.memmove(dest.unsafe_buffer_pointer(), host.unsafe_buffer_pointer(), _nbytes(host))


class SideCopies:
    """Side streams on a set of devices: copies host arrays into device arrays of the same sharding, each device its
    own shards (tensor parallel: its own KV heads)."""

    def __init__(self, devices):
        self._streams = {d: _Memmove() if d.platform == "cpu" else SideStream(d) for d in devices}

    def copy(self, pairs: list[tuple[jax.Array, jax.Array]]) -> Landing:
        """Queues each (pinned host array, device array) pair's copy, shard by shard; the host arrays must be ready
        (their bytes written: `is_ready()`) and the device arrays must not be read by anything queued meanwhile."""
        by_device: dict[jax.Device, list[tuple[jax.Array, jax.Array]]] = collections.defaultdict(list)
        for host, dest in pairs:
            if _nbytes(dest) != _nbytes(host):
                raise ValueError(f"copy: {_nbytes(host)} bytes into a buffer of {_nbytes(dest)}")
            hs = sorted(host.addressable_shards, key=lambda s: (s.device.id, str(s.index)))
            ds = sorted(dest.addressable_shards, key=lambda s: (s.device.id, str(s.index)))
            for h, d in zip(hs, ds, strict=True):
                if h.device != d.device or h.index != d.index:
                    raise ValueError("copy: the host and device arrays are not split the same way")
                by_device[d.device].append((h.data, d.data))
        events = [self._streams[dev].copy_to_device(p) for dev, p in by_device.items()]
        return Landing([e for e in events if e is not None])
