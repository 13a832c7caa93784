"""Locking SM clocks through zeusd, Zeus's privileged daemon, for a process NVML denies it.

Changing GPU clocks needs root or CAP_SYS_ADMIN. Zeus (github.com/ml-energy/zeus) runs
one privileged daemon per node, zeusd, that changes them for unprivileged processes; it
serves HTTP over a Unix domain socket whose path Zeus's clients read from
``ZEUSD_SOCK_PATH``. kareus speaks the two requests it needs itself, as Zeus's client
sends them since Zeus 0.14 / zeusd 0.3 (``ZeusdClient`` in zeus/utils/zeusd.py; the routes
in zeusd/src/routes/gpu.rs, errors in zeusd/src/error.rs)::

    POST /gpu/set_gpu_locked_clocks?gpu_ids=0&min_clock_mhz=1200&max_clock_mhz=1200&block=true
    POST /gpu/reset_gpu_locked_clocks?gpu_ids=0&block=true

both with an empty body. ``block=true`` makes zeusd answer once NVML applied the change:
200 with an empty body, else an error status with a body saying why (``{"errors": {"0":
"NVML error: ..."}}`` per GPU, ``{"error": "..."}`` for a malformed request or failed
authentication, plain text for others). zeusd numbers GPUs by NVML index, as the clock
controller does. Where ``ZEUSD_TOKEN`` is set (a daemon started with a signing key wants
one), requests carry it as a bearer token.

Each request opens its own connection, and the socket times out on connect and every read,
so a daemon that dies or hangs costs at most ``timeout_s`` per request, never a hung exit.
A request zeusd does not answer is ``ZeusdUnreachableError`` while it has never answered
this client, ``ZeusdDiedError`` after; an HTTP error is ``ZeusdRefusedError``.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
from collections.abc import Mapping
from urllib.parse import urlencode

from kareus.devices.errors import ZeusdDiedError, ZeusdRefusedError, ZeusdUnreachableError

ZEUSD_SOCK_ENV = "ZEUSD_SOCK_PATH"
ZEUSD_TOKEN_ENV = "ZEUSD_TOKEN"
DEFAULT_TIMEOUT_S = 5.0
"""Per request (connect, then each read). zeusd answers a blocking clock request once NVML
has applied it, in 10-100 ms; a daemon silent for this long is taken for dead."""

LOCK_ROUTE = "/gpu/set_gpu_locked_clocks"
RESET_ROUTE = "/gpu/reset_gpu_locked_clocks"


def zeusd_socket_path(
    explicit: str | os.PathLike[str] | None = None, env: Mapping[str, str] = os.environ
) -> str | None:
    """The socket given, else ``$ZEUSD_SOCK_PATH``, else None: zeusd is not to be used."""
    if explicit is not None:
        return os.fspath(explicit)
    return env.get(ZEUSD_SOCK_ENV) or None


class _UnixConnection(http.client.HTTPConnection):
    """HTTP/1.1 over a Unix domain socket, with the timeout on connect and every read."""

    def __init__(self, socket_path: str, timeout_s: float) -> None:
        super().__init__("localhost", timeout=timeout_s)
        self._socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._socket_path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class ZeusdClient:
    """Locks and resets the SM clocks of GPUs through zeusd listening at ``socket_path``."""

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        token: str | None = None,
    ) -> None:
        self.socket_path = os.fspath(socket_path)
        self.timeout_s = timeout_s
        self._token = token if token is not None else os.environ.get(ZEUSD_TOKEN_ENV)
        self._answered = False

    def lock_gpu_clocks(self, index: int, mhz: int) -> None:
        """Lock GPU ``index``'s SM clock at ``mhz`` (min = max); returns once it is applied."""
        self._post(
            LOCK_ROUTE,
            index,
            f"lock the SM clock of GPU {index} at {mhz} MHz",
            min_clock_mhz=mhz,
            max_clock_mhz=mhz,
        )

    def reset_gpu_clocks(self, index: int) -> None:
        """Unlock GPU ``index``'s SM clock (back to its default); returns once it is reset."""
        self._post(RESET_ROUTE, index, f"reset the SM clock of GPU {index}")

    def _post(self, route: str, index: int, request: str, **params: int) -> None:
        query = urlencode({"gpu_ids": index, **params, "block": "true"})
        status, body = self._exchange("POST", f"{route}?{query}", index, request)
        if status != 200:
            raise ZeusdRefusedError(self.socket_path, request, status, daemon_message(body, index))

    def _exchange(self, method: str, target: str, index: int, request: str) -> tuple[int, bytes]:
        connection = _UnixConnection(self.socket_path, self.timeout_s)
        try:
            connection.request(method, target, headers=self._headers())
            response = connection.getresponse()
            body = response.read()
        except (OSError, http.client.HTTPException) as exc:  # timeouts are OSErrors
            if self._answered:
                raise ZeusdDiedError(self.socket_path, request, index, exc) from exc
            raise ZeusdUnreachableError(self.socket_path, request, exc) from exc
        finally:
            connection.close()
        self._answered = True
        return response.status, body

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._token}"} if self._token else {}


def daemon_message(body: bytes, index: int) -> str:
    """What zeusd's error body says: GPU ``index``'s entry of ``{"errors": {...}}`` (else
    all of them), ``{"error": ...}``, or the text itself."""
    text = body.decode(errors="replace").strip()
    try:
        payload = json.loads(text)
    except ValueError:
        return text or "(no message)"
    if isinstance(payload, dict) and isinstance(payload.get("errors"), dict):
        errors = payload["errors"]
        if str(index) in errors:
            return str(errors[str(index)])
        return "; ".join(f"GPU {gpu}: {message}" for gpu, message in errors.items())
    if isinstance(payload, dict) and "error" in payload:
        return str(payload["error"])
    return text
