"""Learned routers (CITER, R2R, Co-LLM): architectures, file format, features.

Every learned router is a small torch module over features of the **SLM's**
(model 0's) step, evaluated in the SLM's subserver after each forward step:

* hidden state ``h``: the last decoder layer's output after the final norm,
  float32 ``[H]`` (what the LM head multiplies; SGLang ``CaptureHiddenMode.LAST``,
  the engine's ``capture_hidden``);
* token embedding ``e``: row of the input-embedding matrix for the sampled
  token, float32 ``[H]``;
* top-k logits: the k largest next-token logits, sorted descending, float32
  ``[k]`` (R2R: k = 100).

Architectures (``kind`` in the file):

``citer``  :class:`MLPHead` on ``h`` -> sigmoid = confidence that the SLM's
           token is good enough (CITER, Zheng et al. 2025, "CITER:
           Collaborative Inference for Efficient Large Language Model Decoding
           with Token-Level Routing": an MLP router on the SLM hidden state).
``r2r``    :class:`MLPHead` on ``[h, e, topk]`` -> sigmoid = probability that the
           token is *critical* (R2R, Fu et al. 2025, "R2R: Efficiently
           Navigating Divergent Reasoning Paths with Small-Large Model Token
           Routing": 6-layer, 1024-wide MLP, BCE, threshold for 0.95 recall).
``colm``   :class:`LinearHead` on ``h`` -> sigmoid = deferral probability
           (Co-LLM, Shen et al. 2024, "Learning to Decode Collaboratively with
           Multiple Language Models": a linear head on the base model's hidden
           state).
``dv``     :class:`MLPHead` on :func:`dv_features` -> sigmoid = probability that a
           drafted token is *critical*, scored from the **LLM's** verification pass
           (draft-verify's ``router`` rule, :mod:`.draft_verify`; unlike the three
           above it reads model 1's logits at the drafted position, not model 0's step).

File format (``torch.save`` of a plain dict, loadable with
``torch.load(weights_only=True)``)::

    {"format": "tokenrouter-router/1", "kind": "citer"|"r2r"|"colm"|"dv",
     "arch": {"in_dim": int, "width": int, "depth": int, "hidden_size": int, "topk": int},
                                               # (dv: in_dim, width, depth)
     "state_dict": {name: float16 tensor},     # includes the input standardisation
     "threshold": float | None,                # R2R: the recall-picked threshold
     "meta": {...}}                            # how it was trained (train_routers.py)

Routers are loaded once per process (:func:`load_router`, cached by absolute
path and modification time) and evaluated in float32 under ``torch.no_grad``.
"""

from __future__ import annotations

import math
import os
import threading
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

__all__ = ["FORMAT", "ROUTERS_DIR", "MLPHead", "LinearHead", "build_router", "load_router", "save_router", "shipped_routers",
           "resolve_router_path", "RouterFile", "r2r_features", "embedding_matrix", "AUTO", "find_router",
           "DV_FEATURES", "dv_features"]

FORMAT = "tokenrouter-router/1"
#: shipped routers (the ``router`` parameter's relative paths resolve here first)
ROUTERS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "routers")


class MLPHead(nn.Module):
    """Standardise -> ``depth`` × (Linear, GELU) with residuals from layer 2 on -> Linear(·, 1).

    Args:
        in_dim: feature size D.
        width: hidden width W (R2R published: 1024).
        depth: hidden layers (R2R published: 6).

    Input float32 ``[N, D]``; output logits float32 ``[N]`` (apply sigmoid).
    """

    def __init__(self, in_dim: int, width: int, depth: int):
        super().__init__()
        if depth < 1 or width < 1 or in_dim < 1:
            raise ValueError("MLPHead needs in_dim, width, depth >= 1")
        self.register_buffer("mean", torch.zeros(in_dim))
        self.register_buffer("std", torch.ones(in_dim))
        self.inp = nn.Linear(in_dim, width)
        self.hidden = nn.ModuleList(nn.Linear(width, width) for _ in range(depth - 1))
        self.out = nn.Linear(width, 1)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (x - self.mean) / self.std
        y = self.act(self.inp(x))
        for layer in self.hidden:
            y = y + self.act(layer(y))
        return self.out(y).squeeze(-1)


class LinearHead(nn.Module):
    """Co-LLM's deferral head: ``w·h + b`` (logit; apply sigmoid).  Input ``[N, H]`` -> ``[N]``."""

    def __init__(self, in_dim: int):
        super().__init__()
        self.lin = nn.Linear(in_dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).squeeze(-1)


def build_router(kind: str, arch: Dict[str, int]) -> nn.Module:
    """The module of a router ``kind`` with architecture ``arch`` (see module docstring)."""
    if kind in ("citer", "r2r", "dv"):
        return MLPHead(int(arch["in_dim"]), int(arch["width"]), int(arch["depth"]))
    if kind == "colm":
        return LinearHead(int(arch["in_dim"]))
    raise ValueError(f"unknown router kind {kind!r}; expected citer, r2r, colm or dv")


class RouterFile:
    """A loaded router: ``module`` (float32, eval), ``kind``, ``arch``, ``threshold``, ``meta``, ``path``."""

    def __init__(self, path: str, kind: str, arch: Dict[str, int], module: nn.Module,
                 threshold: Optional[float], meta: Dict[str, Any]):
        self.path, self.kind, self.arch, self.module = path, kind, arch, module
        self.threshold, self.meta = threshold, meta

    @torch.no_grad()
    def prob(self, x: torch.Tensor) -> torch.Tensor:
        """sigmoid(module(x)): float32 ``[N]`` in [0, 1] for features ``[N, D]`` (or ``[D]`` -> ``[1]``)."""
        if x.dim() == 1:
            x = x.unsqueeze(0)
        return torch.sigmoid(self.module(x.float()))


_CACHE: Dict[Tuple[str, float], RouterFile] = {}
_LOCK = threading.Lock()


def shipped_routers(kind: str = "") -> List[str]:
    """The router files under :data:`ROUTERS_DIR` (``<kind>_<name>.pt``; all kinds when ``kind`` is
    empty), sorted by name; none when the folder is missing."""
    if not os.path.isdir(ROUTERS_DIR):
        return []
    return sorted(f for f in os.listdir(ROUTERS_DIR) if f.startswith(f"{kind}_" if kind else "") and f.endswith(".pt"))


def resolve_router_path(path: str, kind: str = "") -> str:
    """Absolute router file: ``path`` if absolute, else under :data:`ROUTERS_DIR`, else relative to cwd.

    Args:
        path: the ``router`` parameter.
        kind: the algorithm's router kind, so that the error lists only the shipped files of that
            kind ("": all).

    Raises:
        ValueError: no such file (the message names both places looked at and the shipped files).
    """
    cands = [path] if os.path.isabs(path) else [os.path.join(ROUTERS_DIR, path), os.path.abspath(path)]
    for c in cands:
        if os.path.isfile(c):
            return os.path.abspath(c)
    what = f"shipped {kind} routers" if kind else "shipped"
    raise ValueError(f"router file {path!r} not found (looked at {cands}; {what}: {shipped_routers(kind)}); train "
                     f"one with `python -m tokenrouter.tools.train_routers` (docs/algorithms/)")


#: the ``router`` parameter's default: the shipped router of this kind trained for the served SLM
AUTO = "auto"


def find_router(kind: str, model_path: str, key: str = "slm") -> str:
    """The shipped router file of ``kind`` trained for the model at ``model_path`` (the ``router=auto`` default).

    A file matches when its ``meta[key]`` (train_routers.py writes the checkpoints' folder names:
    ``slm`` for model 0, ``llm`` for model 1) equals ``basename(model_path)``; files are
    ``<kind>_<name>.pt`` under :data:`ROUTERS_DIR`.  CITER, R2R and Co-LLM look up model 0's
    checkpoint (``key="slm"``); draft-verify's router, which model 1 evaluates, model 1's (``"llm"``).

    Returns:
        the absolute path of the matching file (the first in name order).
    Raises:
        ValueError: no shipped router of that kind matches (the message lists what is shipped and
            how to train one).
    """
    want = os.path.basename(os.path.normpath(model_path))
    shipped = shipped_routers(kind)
    for f in shipped:
        if load_router(f, kind).meta.get(key) == want:
            return os.path.join(ROUTERS_DIR, f)
    role = "model 0" if key == "slm" else "model 1"
    raise ValueError(f"no shipped {kind} router was trained for {role} {want!r} (shipped: {shipped}); "
                     f"train one with `python -m tokenrouter.tools.train_routers` and set the 'router' "
                     f"parameter to its file (docs/algorithms/training.md)")


def load_router(path: str, kind: Optional[str] = None) -> RouterFile:
    """Load (once per process) the router file at ``path``.

    Args:
        path: absolute, or relative to :data:`ROUTERS_DIR`.
        kind: expected kind; a file of another kind is an error.

    Raises:
        ValueError: missing file, not a router file, wrong kind or bad weights.
    """
    full = resolve_router_path(path, kind or "")
    key = (full, os.path.getmtime(full))
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is None:
            try:
                blob = torch.load(full, map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - any unpickling failure
                raise ValueError(f"router file {full!r} cannot be read: {e}") from None
            if not isinstance(blob, dict) or blob.get("format") != FORMAT:
                raise ValueError(f"router file {full!r} is not a {FORMAT} file")
            module = build_router(blob["kind"], blob["arch"])
            try:
                module.load_state_dict({k: v.float() for k, v in blob["state_dict"].items()})
            except RuntimeError as e:
                raise ValueError(f"router file {full!r}: weights do not match its architecture: {e}") from None
            module.eval()
            thr = blob.get("threshold")
            hit = RouterFile(full, blob["kind"], dict(blob["arch"]), module,
                             None if thr is None else float(thr), dict(blob.get("meta") or {}))
            _CACHE[key] = hit
    if kind is not None and hit.kind != kind:
        raise ValueError(f"router file {full!r} holds a {hit.kind!r} router, algorithm needs {kind!r}")
    return hit


def save_router(path: str, kind: str, arch: Dict[str, int], module: nn.Module,
                threshold: Optional[float], meta: Dict[str, Any]) -> None:
    """Write ``module``'s weights (float16) in the router file format."""
    sd = {k: v.detach().to(torch.float16).contiguous() for k, v in module.state_dict().items()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.save({"format": FORMAT, "kind": kind, "arch": dict(arch), "state_dict": sd,
                "threshold": threshold, "meta": meta}, path)


_EMB: Dict[int, torch.Tensor] = {}


def embedding_matrix(engine) -> torch.Tensor:
    """The engine model's input-embedding matrix, float ``[V, H]`` (cached per engine)."""
    w = _EMB.get(id(engine))
    if w is None:
        w = engine.runner.model.get_input_embeddings().weight.detach()
        _EMB[id(engine)] = w
    return w


def r2r_features(hidden: torch.Tensor, token_emb: torch.Tensor, logits: torch.Tensor, topk: int) -> torch.Tensor:
    """R2R's router input: ``[h, e, top-k logits sorted descending]``.

    Args:
        hidden: float ``[..., H]``; token_emb: float ``[..., H]``; logits: float ``[..., V]``.
        topk: k (R2R: 100).

    Returns:
        float32 ``[..., 2H + k]``.
    """
    top = torch.topk(logits.float(), topk, dim=-1).values
    return torch.cat([hidden.float(), token_emb.float(), top], dim=-1)


#: the draft-verify router's input (:func:`dv_features`), column by column
DV_FEATURES = ("logp", "logp_max", "logp_gap", "norm_entropy", "log_rank", "top2_margin")
#: log-probabilities are floored here (a token the grammar forbids has -inf)
_LOGP_FLOOR = -100.0


def dv_features(logits: torch.Tensor, tokens) -> torch.Tensor:
    """Draft-verify's router input: how the LLM's distribution at a position judges a token there.

    With ``lp = log_softmax(l)`` of the LLM's raw next-token logits ``l`` (temperature 1) at a
    position and ``x`` the drafted token there, the columns (:data:`DV_FEATURES`) are:

    * ``logp``: ``lp(x)`` (what the ``prob`` rule compares with log alpha);
    * ``logp_max``: ``max lp`` (the LLM's confidence in its own token);
    * ``logp_gap``: ``lp(x) - max lp = l(x) - max l`` (the ``ratio`` rule's score; 0 for the argmax);
    * ``norm_entropy``: the entropy of ``softmax(l)`` over ``log V``, in [0, 1] (R-Stitch's score);
    * ``log_rank``: ``log(1 + #{v: l(v) > l(x)})`` (0 for the argmax);
    * ``top2_margin``: ``max lp - second largest lp``.

    Log-probabilities are floored at -100 (a token with probability 0, e.g. masked by a grammar).

    Args:
        logits: float ``[n, V]``, the LLM's raw logits at n positions.
        tokens: int ``[n]`` (tensor or list): the token judged at each position.
    Returns:
        float32 ``[n, 6]``.
    """
    lg = logits.float()
    idx = torch.as_tensor(tokens, dtype=torch.long).view(-1, 1)
    lp = torch.log_softmax(lg, dim=-1)
    lpx = lp.gather(1, idx).view(-1).clamp_min(_LOGP_FLOOR)
    top2 = torch.topk(lp, 2, dim=-1).values.clamp_min(_LOGP_FLOOR)
    ent = torch.special.entr(lp.exp()).sum(-1) / math.log(lg.shape[-1])
    rank = (lg > lg.gather(1, idx)).sum(-1).float()
    return torch.stack([lpx, top2[:, 0], lpx - top2[:, 0], ent, torch.log1p(rank), top2[:, 0] - top2[:, 1]], dim=-1)
