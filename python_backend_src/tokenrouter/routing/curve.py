"""CURVE authentication and encryption of the inter-model channel over TCP.

A model whose subserver binds a ``tcp://`` ``peer_endpoint`` is a CurveZMQ
*server*: it holds a secret key and accepts only clients (routers) whose public
key is in an authorised-keys folder (a ZAP handler, ``zmq.auth``'s
``ThreadAuthenticator``).  A router is a CurveZMQ *client*: it holds its own
secret key and, per remote model, the model's public key.  A connection with
any other key fails its handshake: it is logged on the model (see
:class:`HandshakeLog`) and never reaches the model's command loop.  ``ipc://``
and ``inproc://`` endpoints (one host, file permissions) stay unauthenticated.

Key files are ZeroMQ certificate files (``zmq.auth.create_certificates``): a
``NAME.key`` file holds a public key, a ``NAME.key_secret`` file the public
and the secret key.  :func:`make_keys` writes the set a deployment needs::

    DIR/server.key, DIR/server.key_secret     the models' key pair
    DIR/router.key, DIR/router.key_secret     the routers' key pair
    DIR/authorized_keys/router.key            public keys the models accept

(``python -m tokenrouter.tools.admin keys DIR`` or ``deploy/serve --keys DIR``.)

Config parameters (declared, with their defaults, on :class:`CurveSettings`)

* model: ``curve`` (``on``/``off``), ``curve_secret_key_file``
  (``DIR/server.key_secret``), ``curve_authorized_keys_dir``
  (``DIR/authorized_keys``);
* router: ``curve`` (``on``/``off``), ``curve_secret_key_file``
  (``DIR/router.key_secret``), ``curve_server_public_keys``: one public key file
  for every remote model (``DIR/server.key``), a folder holding ``<model>.key``
  (else ``server.key``), or a JSON object ``{"llm": "path/llm.key"}``.

``curve: off`` turns authentication off on trusted networks (a warning is logged
when a TCP endpoint is used so).  The Triton models read these parameters into
:class:`CurveSettings` (:mod:`tokenrouter.triton.settings`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple

import zmq

from ..engine.parameters import documented, param

logger = logging.getLogger(__name__)

__all__ = ["curve_enabled", "is_tcp", "make_keys", "CurveSettings", "CurveServer", "CurveClient", "HandshakeLog"]

#: handshake failures a socket monitor reports (wrong or unknown key, no CURVE, garbage)
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def curve_enabled(value: object) -> bool:
    """The ``curve`` switch: ``on`` (default: empty), ``off``; also true/false, yes/no, 1/0.

    Raises:
        ValueError: any other value.
    """
    v = str(value if value is not None else "").strip().lower()
    if v in ("", "on", "true", "yes", "1"):
        return True
    if v in ("off", "false", "no", "0"):
        return False
    raise ValueError(f"config parameter 'curve' must be on or off, got {value!r}")


@documented
@dataclass(frozen=True)
class CurveSettings:
    """CURVE settings of one side of the channel (the config parameters of the module docstring).

    Each is declared here once (:func:`~tokenrouter.engine.parameters.param`); a model reads
    ``curve_authorized_keys_dir``, a router ``curve_server_public_keys``, both the other two
    (:mod:`tokenrouter.triton.settings`).  ``curve`` is read by :func:`curve_enabled`.
    """

    enabled: bool = param(True, key="curve", shown="`on`", doc=(
        "CURVE on TCP endpoints: ``on`` or ``off`` (:func:`curve_enabled`; off only on trusted networks)"))
    secret_key_file: str = param("", key="curve_secret_key_file", shown="none", doc=(
        "this side's ``.key_secret`` certificate file (a model's ``DIR/server.key_secret``, a "
        "router's ``DIR/router.key_secret``)"))
    authorized_keys_dir: str = param("", key="curve_authorized_keys_dir", shown="none", doc=(
        "models: folder of the routers' public keys the model accepts (``DIR/authorized_keys``)"))
    server_public_keys: str = param("", key="curve_server_public_keys", shown="none", doc=(
        "routers: the remote models' public keys: one file for all (``DIR/server.key``), a folder "
        "of ``<model>.key`` (else ``server.key``), or JSON ``{\"llm\": \"path\"}`` (:class:`CurveClient`)"))


def is_tcp(endpoint: str) -> bool:
    """True for a ``tcp://`` endpoint (the only transport CURVE applies to)."""
    return str(endpoint).startswith("tcp://")


def make_keys(directory: str, force: bool = False) -> Dict[str, str]:
    """Write a deployment's key files into ``directory`` (created if missing).

    Args:
        directory: destination folder (mode 0700).
        force: replace existing keys; otherwise existing complete key sets are kept.

    Returns:
        ``{"server_public", "server_secret", "router_public", "router_secret",
        "authorized_keys_dir"}`` paths.

    Raises:
        FileExistsError: part of a key set exists but not all of it (and not ``force``).
    """
    import zmq.auth

    os.makedirs(directory, mode=0o700, exist_ok=True)
    auth_dir = os.path.join(directory, "authorized_keys")
    paths = {"server_public": os.path.join(directory, "server.key"),
             "server_secret": os.path.join(directory, "server.key_secret"),
             "router_public": os.path.join(directory, "router.key"),
             "router_secret": os.path.join(directory, "router.key_secret"),
             "authorized_keys_dir": auth_dir}
    for name in ("server", "router"):
        pub, sec = paths[f"{name}_public"], paths[f"{name}_secret"]
        have = [os.path.exists(pub), os.path.exists(sec)]
        if all(have) and not force:
            continue
        if any(have) and not force:
            raise FileExistsError(f"{directory}: only part of the {name} key pair exists; "
                                  "remove it or pass force to write a new one")
        zmq.auth.create_certificates(directory, name)
        os.chmod(sec, 0o600)
    os.makedirs(auth_dir, mode=0o700, exist_ok=True)
    authorized = os.path.join(auth_dir, "router.key")
    if force or not os.path.exists(authorized):
        shutil.copyfile(paths["router_public"], authorized)
    return paths


def _load_pair(path: str, what: str) -> Tuple[bytes, bytes]:
    """(public, secret) from a ``.key_secret`` certificate file.

    Raises:
        ValueError: the file is missing or holds no secret key.
    """
    import zmq.auth

    if not path:
        raise ValueError(f"{what} is required")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{what} {path!r}: {e}") from None
    if not secret:
        raise ValueError(f"{what} {path!r} holds no secret key (give the .key_secret file)")
    return public, secret


def _load_public(path: str, what: str) -> bytes:
    import zmq.auth

    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{what} {path!r}: {e}") from None
    return public


class CurveServer:
    """A model's CURVE server settings: its key pair and the folder of keys it accepts.

    Args:
        secret_key_file: the model's ``.key_secret`` certificate file.
        authorized_keys_dir: folder of ``*.key`` public keys of the routers allowed in.

    Raises:
        ValueError: a file is missing or unreadable, or the folder holds no ``*.key``.
    """

    def __init__(self, secret_key_file: str, authorized_keys_dir: str):
        import glob

        self.public, self.secret = _load_pair(secret_key_file, "curve_secret_key_file")
        if not authorized_keys_dir or not os.path.isdir(authorized_keys_dir):
            raise ValueError(f"curve_authorized_keys_dir {authorized_keys_dir!r} is not a folder")
        if not glob.glob(os.path.join(authorized_keys_dir, "*.key")):
            raise ValueError(f"curve_authorized_keys_dir {authorized_keys_dir!r} holds no *.key public key")
        self.authorized_keys_dir = authorized_keys_dir
        self._auth = None

    @classmethod
    def from_settings(cls, settings: CurveSettings, endpoint: str, model: str) -> Optional["CurveServer"]:
        """The server for a model binding ``endpoint``; None for ``ipc://``/``inproc://`` or ``curve: off``.

        Raises:
            ValueError: a TCP endpoint with CURVE on but key files missing or bad.
        """
        if not is_tcp(endpoint):
            return None
        if not settings.enabled:
            logger.warning("model %s: peer_endpoint %s is UNAUTHENTICATED and unencrypted (curve: off); "
                           "use it on trusted networks only", model, endpoint)
            return None
        key, auth = settings.secret_key_file, settings.authorized_keys_dir
        if not key or not auth:
            raise ValueError(f"model {model}: peer_endpoint {endpoint} is TCP, so CURVE authentication is on: "
                             "set curve_secret_key_file and curve_authorized_keys_dir (make keys with "
                             "`python -m tokenrouter.tools.admin keys DIR`), or set curve to off on a trusted network")
        return cls(key, auth)

    def secure(self, ctx: "zmq.Context", sock: "zmq.Socket") -> None:
        """Start the ZAP handler of ``ctx`` and make ``sock`` a CURVE server (before ``bind``)."""
        from zmq.auth.thread import ThreadAuthenticator

        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("tokenrouter.routing.curve.zap"))
        self._auth.start()
        self._auth.configure_curve(domain="*", location=self.authorized_keys_dir)
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def stop(self) -> None:
        """Stop the ZAP handler (at close)."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


class CurveClient:
    """A router's CURVE client settings: its key pair and each remote model's public key.

    Args:
        secret_key_file: the router's ``.key_secret`` certificate file.
        server_public_keys: a public key file for every model, a folder holding
            ``<model>.key`` (else ``server.key``), or a JSON object ``{model: path}``.

    Raises:
        ValueError: a file is missing or unreadable, or the JSON is malformed.
    """

    def __init__(self, secret_key_file: str, server_public_keys: str):
        self.public, self.secret = _load_pair(secret_key_file, "curve_secret_key_file")
        spec = str(server_public_keys or "").strip()
        if not spec:
            raise ValueError("curve_server_public_keys is required")
        self._per_model: Dict[str, str] = {}
        self._dir = self._file = ""
        if spec.startswith("{"):
            try:
                m = json.loads(spec)
            except ValueError as e:
                raise ValueError(f"curve_server_public_keys is not valid JSON: {e}") from None
            if not isinstance(m, dict) or not all(isinstance(v, str) for v in m.values()):
                raise ValueError("curve_server_public_keys JSON must map model names to key file paths")
            self._per_model = dict(m)
        elif os.path.isdir(spec):
            self._dir = spec
        else:
            self._file = spec
            _load_public(spec, "curve_server_public_keys")
        self._cache: Dict[str, bytes] = {}

    @classmethod
    def from_settings(cls, settings: CurveSettings, endpoints: Mapping[str, list]) -> Optional["CurveClient"]:
        """The client for a router reaching ``endpoints`` (``{model: [endpoint, …]}``); None when
        no endpoint is TCP or ``curve: off``.

        Raises:
            ValueError: CURVE on, a TCP endpoint, and the key parameters missing or bad.
        """
        tcp = sorted(m for m, eps in endpoints.items() if any(is_tcp(e) for e in eps))
        if not tcp:
            return None
        if not settings.enabled:
            logger.warning("router: remote models %s are reached UNAUTHENTICATED and unencrypted (curve: off)",
                           ", ".join(tcp))
            return None
        key, servers = settings.secret_key_file, settings.server_public_keys
        if not key or not servers:
            raise ValueError(f"remote models {', '.join(tcp)} are reached over TCP, so CURVE authentication is "
                             "on: set curve_secret_key_file and curve_server_public_keys (make keys with "
                             "`python -m tokenrouter.tools.admin keys DIR`), or set curve to off on a trusted network")
        client = cls(key, servers)
        for m in tcp:
            client.server_key(m)  # a missing key fails the load, not the first request
        return client

    def server_key(self, model: str) -> bytes:
        """The public key of ``model``'s server.

        Raises:
            ValueError: no key for ``model``, or its file is unreadable.
        """
        if model not in self._cache:
            if self._per_model:
                if model not in self._per_model:
                    raise ValueError(f"curve_server_public_keys has no key for model {model!r}")
                path = self._per_model[model]
            elif self._dir:
                path = os.path.join(self._dir, f"{model}.key")
                if not os.path.exists(path):
                    path = os.path.join(self._dir, "server.key")
            else:
                path = self._file
            self._cache[model] = _load_public(path, f"curve_server_public_keys ({model})")
        return self._cache[model]

    def secure(self, sock: "zmq.Socket", model: str) -> None:
        """Make ``sock`` a CURVE client of ``model``'s server (before ``connect``)."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.server_key(model)


class HandshakeLog:
    """Logs failed handshakes (wrong or unknown CURVE key, a client without CURVE) that a socket
    monitor reports, at most one line per ``interval_s`` seconds (with the count in between).

    The owner polls :attr:`socket` (a PAIR socket from ``get_monitor_socket``) with its other
    sockets and calls :meth:`handle` when it is readable.

    Args:
        sock: the monitored socket (its owner thread creates this object).
        what: how log lines name the socket (e.g. "model llm at tcp://0.0.0.0:5555").
        interval_s: minimum seconds between two log lines.
    """

    def __init__(self, sock: "zmq.Socket", what: str, interval_s: float = 10.0):
        self._sock = sock
        self.socket = sock.get_monitor_socket(HANDSHAKE_FAILED)
        self.what = what
        self.interval_s = float(interval_s)
        self._last = 0.0
        self._suppressed = 0
        self.refused = 0

    def handle(self) -> None:
        """Read one monitor event and log it (rate-limited)."""
        from zmq.utils.monitor import recv_monitor_message

        ev = recv_monitor_message(self.socket, zmq.NOBLOCK)
        self.refused += 1
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._suppressed += 1
            return
        more = f" ({self._suppressed} more since the last report)" if self._suppressed else ""
        kind = {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "key not authorised",
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "CURVE handshake failed (wrong key or no CURVE)",
                }.get(ev.get("event"), "handshake failed")
        logger.warning("%s: connection refused (%s)%s", self.what, kind, more)
        self._last, self._suppressed = now, 0

    def close(self) -> None:
        """Stop monitoring and close the monitor socket."""
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.socket.close(0)
