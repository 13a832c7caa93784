"""Locking clocks through zeusd where NVML denies permission, against a fake zeusd.

``FakeZeusd`` is a real HTTP server on a Unix socket, in a thread, that answers the routes
as zeusd 0.5 (Zeus 0.16) serves them (zeusd/src/routes/gpu.rs) and applies them to the GPUs
of a fake NVML driver, as the privileged daemon would; it records every request.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import pytest
from fake_pynvml import LOCK, REPO, RESET, TESTS, FakeNvml, controller, opened
from test_clock_owner import dead_pid, write_record

from kareus.devices.errors import (
    ClockControlError,
    ClockPermissionError,
    ClockResetError,
    ZeusdDiedError,
    ZeusdRefusedError,
    ZeusdUnreachableError,
)
from kareus.devices.nvml import ownership
from kareus.devices.nvml.clock import NvmlClockController, no_event
from kareus.devices.nvml.gpu import NvmlGPU
from kareus.devices.nvml.ownership import HeldClockLocks
from kareus.devices.nvml.zeusd import (
    LOCK_ROUTE,
    RESET_ROUTE,
    ZEUSD_SOCK_ENV,
    ZEUSD_TOKEN_ENV,
)
from kareus.passes.ops import DEFAULT_CLOCK_MHZ

TIMEOUT_S = 0.3
"""Every controller here gives zeusd this long per request: a dead daemon costs no more."""

WRITE_FIELDS = {LOCK_ROUTE: ("min_clock_mhz", "max_clock_mhz"), RESET_ROUTE: ()}
"""zeusd's write routes and their fields beside ``gpu_ids`` and ``block`` (its query structs
deny unknown fields)."""


@dataclass(frozen=True)
class ZeusdRequest:
    method: str
    route: str
    params: dict[str, str]
    body: bytes
    authorization: str | None


LOCK_1200 = ("POST", LOCK_ROUTE, {
    "gpu_ids": "0", "min_clock_mhz": "1200", "max_clock_mhz": "1200", "block": "true",
})
RESET_0 = ("POST", RESET_ROUTE, {"gpu_ids": "0", "block": "true"})


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    zeusd: FakeZeusd


class _Handler(BaseHTTPRequestHandler):
    server: _UnixHTTPServer

    def do_POST(self) -> None:
        self.server.zeusd.answer(self)

    def do_GET(self) -> None:
        self.server.zeusd.answer(self)

    def log_message(self, *args: object) -> None:
        pass  # a Unix client has no address to log


class FakeZeusd:
    """zeusd serving ``path``, acting on ``nvml``'s GPUs whatever their permission says.

    ``refusal`` (status, body), while set, is the answer to every request.
    """

    def __init__(self, path: Path, nvml: FakeNvml) -> None:
        self.path = path
        self.nvml = nvml
        self.requests: list[ZeusdRequest] = []
        self.refusal: tuple[int, bytes] | None = None
        self._server = _UnixHTTPServer(str(path), _Handler)
        self._server.zeusd = self
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
        )
        self._thread.start()

    def calls(self) -> list[tuple[str, str, dict[str, str]]]:
        return [(r.method, r.route, r.params) for r in self.requests]

    def stop(self) -> None:
        """The daemon exits: no one listens, and its socket file is gone."""
        self._server.shutdown()
        self._server.server_close()
        self.path.unlink(missing_ok=True)

    def answer(self, handler: BaseHTTPRequestHandler) -> None:
        url = urlsplit(handler.path)
        body = handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
        params = dict(parse_qsl(url.query))
        self.requests.append(ZeusdRequest(
            handler.command, url.path, params, body, handler.headers.get("Authorization")
        ))
        status, payload = self.refusal or self._apply(handler.command, url.path, params)
        handler.send_response(status)
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        if payload:  # the client may have read an empty answer and gone already
            handler.wfile.write(payload)

    def _apply(self, method: str, route: str, params: dict[str, str]) -> tuple[int, bytes]:
        if method != "POST" or route not in WRITE_FIELDS:
            return 404, b""
        fields = WRITE_FIELDS[route]
        if set(params) != {"gpu_ids", "block", *fields}:
            return 400, f"Query deserialize error: {sorted(params)}".encode()
        for gpu_id in params["gpu_ids"].split(","):
            if int(gpu_id) >= len(self.nvml.gpus):
                return 400, f"GPU index {gpu_id} does not exist.".encode()
            locked = tuple(int(params[f]) for f in fields) or None
            self.nvml.gpus[int(gpu_id)].locked = locked  # type: ignore[assignment]
        return 200, b""


@pytest.fixture(autouse=True)
def no_zeusd_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ZEUSD_SOCK_ENV, raising=False)
    monkeypatch.delenv(ZEUSD_TOKEN_ENV, raising=False)


@pytest.fixture
def denied() -> FakeNvml:
    """A fake driver that denies this process clock changes (NVML_ERROR_NO_PERMISSION)."""
    return FakeNvml(can_set_clocks=False)


@pytest.fixture
def zeusd(tmp_path: Path, denied: FakeNvml) -> Iterator[FakeZeusd]:
    daemon = FakeZeusd(tmp_path / "zeusd.sock", denied)
    yield daemon
    if daemon.path.exists():
        daemon.stop()


def through_zeusd(fake: FakeNvml, zeusd: FakeZeusd, **kwargs: object):
    """GPU 0's controller, probed: it found NVML unwilling and zeusd willing."""
    _fake, handle = opened(fake)
    ctl = controller(fake, handle, zeusd_socket=zeusd.path, zeusd_timeout_s=TIMEOUT_S, **kwargs)
    assert ctl.probe_permission() is True
    return ctl


class GatedEvent:
    """A CUDA event stand-in that completes when the test says the GPU got there."""

    def __init__(self) -> None:
        self.reached = threading.Event()

    def synchronize(self) -> None:
        assert self.reached.wait(5), "event never completed"


def flush_within(ctl: NvmlClockController, seconds: float) -> BaseException | None:
    """What ``ctl.flush()`` raised, failing the test if it has not returned in ``seconds``."""
    outcome: list[BaseException | None] = []

    def flush() -> None:
        try:
            ctl.flush()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=flush, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"flush() hung for {seconds} s"
    return outcome[0]


def test_clocks_are_locked_through_zeusd_where_nvml_denies_permission(
    denied: FakeNvml, zeusd: FakeZeusd, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ZEUSD_TOKEN_ENV, "secret")
    caplog.set_level(logging.INFO, logger="kareus")
    event = GatedEvent()
    ctl = through_zeusd(denied, zeusd, event_factory=lambda: event)
    assert ctl.owns_clocks and ctl.clock_route == "zeusd"
    assert zeusd.calls() == [RESET_0]  # the probe's reset, which NVML denied
    ctl.set_clock("fwd", 1200)
    assert len(zeusd.requests) == 1  # queued for the controller thread, behind the event
    event.reached.set()
    ctl.flush()
    assert zeusd.calls() == [RESET_0, LOCK_1200] and denied.gpus[0].locked == (1200, 1200)
    assert {(r.body, r.authorization) for r in zeusd.requests} == {(b"", "Bearer secret")}
    assert denied.setter_calls() == [(RESET, 0)]  # NVML is not asked again once zeusd answered
    assert [(s.graph, s.mhz) for s in ctl.switches] == [("fwd", 1200)]
    routes = [r.getMessage() for r in caplog.records if "setting SM clocks" in r.getMessage()]
    said = (
        f"GPU 0: setting SM clocks through zeusd at {zeusd.path} (NVML denies this process "
        "clock changes: NVML_ERROR_NO_PERMISSION)"
    )
    assert routes == [said]
    ctl.close()


def test_an_unprobed_controller_turns_to_zeusd_at_the_first_lock_nvml_denies(
    denied: FakeNvml, zeusd: FakeZeusd, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ZEUSD_SOCK_ENV, str(zeusd.path))  # found in the environment
    fake, handle = opened(denied)
    with controller(fake, handle) as ctl:
        ctl.set_clock("fwd", 1200)
        ctl.flush()
        assert zeusd.calls() == [LOCK_1200] and ctl.clock_route == "zeusd"
    assert zeusd.calls() == [LOCK_1200, RESET_0] and denied.gpus[0].locked is None


def test_nvml_is_used_where_it_allows_and_zeusd_is_left_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kareus")
    fake = FakeNvml()
    daemon = FakeZeusd(tmp_path / "zeusd.sock", fake)
    fake, handle = opened(fake)
    with controller(fake, handle, zeusd_socket=daemon.path) as ctl:
        assert ctl.probe_permission() is True
        ctl.set_clock("fwd", 1200)
        ctl.flush()
        assert ctl.clock_route == "nvml"
    daemon.stop()
    assert daemon.requests == [] and fake.gpus[0].locked is None
    assert [r.getMessage() for r in caplog.records if "setting SM clocks" in r.getMessage()] == [
        "GPU 0: setting SM clocks through NVML"
    ]


def test_close_resets_through_zeusd_and_releases_ownership(
    denied: FakeNvml, zeusd: FakeZeusd, tmp_path: Path
) -> None:
    ctl = through_zeusd(denied, zeusd)
    ctl.set_clock("fwd", 1200)
    ctl.flush()
    assert json.loads(ctl.lock_path.read_text())["locked_mhz"] == 1200
    ctl.close()
    assert zeusd.calls() == [RESET_0, LOCK_1200, RESET_0] and denied.gpus[0].locked is None
    assert ctl.lock_path.read_text() == ""  # released clean: the clocks are reset


def test_the_exit_guard_resets_through_zeusd(denied: FakeNvml, zeusd: FakeZeusd) -> None:
    held = HeldClockLocks()
    _fake, handle = opened(denied)
    ctl = NvmlClockController(
        denied, handle, gpu="GPU 0", index=0, supported_clocks=handle.graphics_clocks[1215],
        event_factory=no_event, held=held, zeusd_socket=zeusd.path, zeusd_timeout_s=TIMEOUT_S,
    )
    assert held.exit_guard.controllers == (ctl,)
    try:
        ctl.set_clock("fwd", 1200)
        ctl.flush()
        held.exit_guard.at_exit()  # what the interpreter runs at exit
        assert zeusd.calls()[-1] == RESET_0 and denied.gpus[0].locked is None
        assert not ctl.owns_clocks
    finally:
        ctl.close()


CHILD = """
import sys
sys.path[:0] = [{tests!r}, {repo!r}]
from fake_pynvml import FakeNvml
from kareus.devices.nvml.clock import NvmlClockController, no_event
fake = FakeNvml(can_set_clocks=False)
fake.nvmlInit()
gpu = fake.nvmlDeviceGetHandleByIndex(0)
ctl = NvmlClockController(fake, gpu, gpu="GPU 0", index=0,
                          supported_clocks=gpu.graphics_clocks[1215], event_factory=no_event)
ctl.set_clock("fwd", 1200)
ctl.flush()
print(ctl.clock_route, flush=True)
sys.stdin.readline()
"""


def test_sigterm_resets_through_zeusd_in_a_child_process(
    zeusd: FakeZeusd, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ZEUSD_SOCK_ENV, str(zeusd.path))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(tests=str(TESTS), repo=str(REPO))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert child.stdout is not None and child.stderr is not None
    assert child.stdout.readline() == "zeusd\n", child.stderr.read()
    assert zeusd.nvml.gpus[0].locked == (1200, 1200)
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=20) == -signal.SIGTERM
    assert zeusd.calls() == [LOCK_1200, RESET_0] and zeusd.nvml.gpus[0].locked is None


@pytest.mark.parametrize(
    ("status", "body", "says"),
    [
        (400, b"GPU index 0 does not exist.", "GPU index 0 does not exist."),
        (403, b'{"errors": {"0": "NVML error: Insufficient Permissions"}}',
         "NVML error: Insufficient Permissions"),
        (401, b'{"error": "Authentication required."}', "Authentication required."),
    ],
)
def test_a_refusing_daemon_gives_a_typed_error_with_its_message(
    denied: FakeNvml, zeusd: FakeZeusd, status: int, body: bytes, says: str
) -> None:
    ctl = through_zeusd(denied, zeusd)
    zeusd.refusal = (status, body)
    ctl.set_clock("fwd", 1200)
    with pytest.raises(ZeusdRefusedError) as info:
        ctl.flush()
    assert isinstance(info.value, ClockControlError)
    assert (info.value.status, info.value.daemon_message) == (status, says)
    assert str(zeusd.path) in str(info.value) and ctl.applied_mhz == DEFAULT_CLOCK_MHZ
    ctl.close()


def test_a_daemon_refusing_the_probe_leaves_the_default_clock_only(
    denied: FakeNvml, zeusd: FakeZeusd, caplog: pytest.LogCaptureFixture
) -> None:
    zeusd.refusal = (404, b"")  # started without its gpu-control routes
    fake, handle = opened(denied)
    ctl = controller(fake, handle, zeusd_socket=zeusd.path, zeusd_timeout_s=TIMEOUT_S)
    assert ctl.probe_permission() is False and not ctl.owns_clocks
    assert any("--enable gpu-control" in r.getMessage() for r in caplog.records
               if r.levelno == logging.WARNING)
    zeusd.refusal = None
    ctl.set_clock("fwd", 1200)  # it gave up the GPU's clocks: zeusd is not asked again
    with pytest.raises(ClockPermissionError) as info:
        ctl.flush()
    assert not isinstance(info.value, ZeusdRefusedError)
    assert f"zeusd at {zeusd.path} answered HTTP 404" in str(info.value)
    assert zeusd.calls() == [RESET_0]
    ctl.close()


def test_clocks_a_dead_owner_left_locked_are_reset_through_zeusd(
    denied: FakeNvml, zeusd: FakeZeusd, caplog: pytest.LogCaptureFixture
) -> None:
    denied.gpus[0].locked = (1200, 1200)
    stale = write_record(ownership.lock_dir(None), dead_pid(), locked_mhz=1200)
    fake, handle = opened(denied)
    with controller(fake, handle, zeusd_socket=zeusd.path, zeusd_timeout_s=TIMEOUT_S) as ctl:
        assert zeusd.calls() == [RESET_0] and denied.gpus[0].locked is None
        assert ctl.owns_clocks and ctl.lock_path == stale
    assert any("may have been left locked" in r.getMessage() for r in caplog.records)


def test_a_daemon_that_dies_mid_run_gives_a_typed_error_without_hanging(
    denied: FakeNvml, zeusd: FakeZeusd, caplog: pytest.LogCaptureFixture
) -> None:
    ctl = through_zeusd(denied, zeusd)
    ctl.set_clock("fwd", 1200)
    ctl.flush()
    zeusd.stop()
    start = time.monotonic()
    ctl.set_clock("bwd", 1110)
    died = flush_within(ctl, 2 * TIMEOUT_S)
    assert isinstance(died, ZeusdDiedError) and isinstance(died, ClockControlError)
    assert died.socket_path == str(zeusd.path) and "sudo nvidia-smi -i 0 -rgc" in str(died)
    with pytest.raises(ClockResetError) as reset:  # the reset at close cannot reach it either
        ctl.close()
    assert isinstance(reset.value.__cause__, ZeusdDiedError)
    assert time.monotonic() - start < 2 * TIMEOUT_S
    assert any(r.levelno == logging.CRITICAL for r in caplog.records)
    assert json.loads(ctl.lock_path.read_text())["locked_mhz"] == 1200  # left for the next owner


def test_a_daemon_that_stops_answering_times_out(denied: FakeNvml, zeusd: FakeZeusd) -> None:
    ctl = through_zeusd(denied, zeusd)
    zeusd.stop()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:  # accepts, never answers
        silent.bind(str(zeusd.path))
        silent.listen()
        start = time.monotonic()
        ctl.set_clock("fwd", 1200)
        died = flush_within(ctl, 3 * TIMEOUT_S)
        assert isinstance(died, ZeusdDiedError) and "timed out" in str(died)
        assert time.monotonic() - start >= TIMEOUT_S
    zeusd.path.unlink()
    ctl.close()  # the lock counts as not applied (as a failed NVML call): nothing to reset


def test_an_unreachable_daemon_is_a_permission_error_that_names_it(
    denied: FakeNvml, tmp_path: Path
) -> None:
    missing = tmp_path / "no-zeusd.sock"
    fake, handle = opened(denied)
    ctl = controller(fake, handle, zeusd_socket=missing, zeusd_timeout_s=TIMEOUT_S)
    ctl.set_clock("fwd", 1200)
    with pytest.raises(ZeusdUnreachableError) as info:
        ctl.flush()
    assert isinstance(info.value, ClockPermissionError)
    assert f"--socket-path {missing}" in str(info.value) and ZEUSD_SOCK_ENV in str(info.value)
    ctl.close()


def test_without_zeusd_sock_path_permission_errors_say_how_to_use_zeusd(
    denied: FakeNvml, zeusd: FakeZeusd
) -> None:
    fake, handle = opened(denied)
    ctl = controller(fake, handle)
    assert ctl.probe_permission() is False
    ctl.set_clock("fwd", 1200)
    with pytest.raises(ClockPermissionError) as info:
        ctl.flush()
    assert type(info.value) is ClockPermissionError
    assert f"set {ZEUSD_SOCK_ENV} to its socket" in str(info.value)
    assert zeusd.requests == [] and fake.setter_calls() == [(RESET, 0), (LOCK, 0, 1200, 1200)]
    ctl.close()


def test_the_nvml_device_threads_the_socket_to_its_controller(
    denied: FakeNvml, zeusd: FakeZeusd
) -> None:
    with NvmlGPU(nvml_module=denied, cuda=False, zeusd_socket=zeusd.path) as gpu:
        assert gpu.clock_limitation is None and len(gpu.search_clocks()) == 18
        assert gpu.clock_controller().clock_route == "zeusd"
    assert zeusd.calls() == [RESET_0]


def test_the_backends_zeusd_socket_option_reaches_the_controller(
    denied: FakeNvml, zeusd: FakeZeusd, monkeypatch: pytest.MonkeyPatch, fresh_runtime
) -> None:
    from kareus import KareusBackend

    monkeypatch.setitem(sys.modules, "pynvml", denied)
    backend = KareusBackend({"device": "nvml", "zeusd_socket": str(zeusd.path),
                             "nanobatches": 1, "profile": "off"})
    gpu = backend.device
    try:
        assert gpu.clock_controller().clock_route == "zeusd"
    finally:
        gpu.close()
    assert zeusd.calls()[0] == RESET_0
