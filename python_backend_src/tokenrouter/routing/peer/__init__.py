"""ZeroMQ inter-model channel: the router's handoffs without Triton round trips.

Paper §Design, "Three decoupled loops": the inter-model loop forwards a
handing-off model's PeerReq to the peer over ZeroMQ.  Here each model
subserver listens on its own endpoint (:class:`PeerServer`, a ROUTER socket
inside the model's Triton stub process) and the router drives requests through
a :class:`PeerClient` — the *transport* of :func:`tokenrouter.routing.router_core.drive`.

Endpoints: ``ipc://`` (default: a fresh path in the temporary directory; the
router finds it through the model's advert file or a BLS call) for models in
the router's tritonserver, ``tcp://`` for models served by other servers (the
router's ``remote_models``; CURVE-authenticated and encrypted by default, see
:mod:`tokenrouter.routing.curve`).

Connections: the router connects one DEALER socket per model replica; every
answer comes back on the connection its command went out on, so only the
router dials (no connection from a model to a router: NAT and Kubernetes
services are fine).

Wire format (multipart messages; the model's ROUTER socket adds/strips the
connection identity frame), the values of :mod:`tokenrouter.protocol`'s codec
(the model's Triton interface carries the same ones as tensors):

* command, router → model: ``[envelope JSON, op, request id, payload, tokens]``,
  the envelope ``{"seg": int, "router_pid", "router_start"}``, then an
  :class:`~tokenrouter.protocol.OpWire` (``payload``: the PeerReq header JSON of
  a ``run``, an argument's JSON; tokens: the int64 little-endian token suffix the
  model has not seen, ``run`` only);
* response, model → router: ``[seg, event JSON, tokens]``, the event one of
  :mod:`tokenrouter.protocol` (``{"kind": "tokens"|"handoff"|"finished"|
  "cancelled"|"error", …}`` in a segment, an op's answer otherwise) and tokens the
  committed token ids of this chunk.

On the model the ops go to its :class:`~tokenrouter.engine.op_dispatch.OpDispatcher`,
the one its Triton requests go to as well.  ``seg`` identifies one visit of a
request to a model (a *segment*) or one call; responses of a segment the router
has already closed are dropped.  ``seg`` 0 is the router's heartbeat (``ping``;
see :class:`PeerClient`) and its releases (fire and forget).

Threading: a ZeroMQ socket is not thread-safe, so each is used under a lock
(:class:`~tokenrouter.routing.peer.wire.SharedSocket`): the threads that produce messages
(the model's decode loop, the router's request workers) send them themselves; one I/O thread
per side waits on the sockets' file descriptors and receives.

Modules: :mod:`.adverts` (endpoints and the advert files that find them), :mod:`.wire`
(framing, the shared socket), :mod:`.server` (:class:`PeerServer`), :mod:`.client`
(:class:`PeerClient`, ``remote_models``); this package exports their public names.
"""

from ..segments import PeerChannelError, PeerDownError
from .adverts import advert_path, dead_routers, default_endpoint, read_advert, remove_advert, write_advert
from .client import PeerClient, parse_remote_models
from .server import PeerServer

__all__ = ["PeerServer", "PeerClient", "PeerChannelError", "PeerDownError", "default_endpoint", "advert_path",
           "write_advert", "read_advert", "remove_advert", "dead_routers", "parse_remote_models"]
