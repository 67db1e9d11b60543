"""The modelled system: M models, a closed population of N requests, L_i, P = [p_ij], C = [c_ij].

Follows the TokenRouter paper's DTMC section (delayed batching, "DTMC for B*"):

* M models (sub-servers), indexed i = 0 … M-1, named by the profile's ``"models"`` list.
* A closed population of N requests (the concurrency): a request that finishes one
  decoding step either stays at its model or is handed to another; finished requests are
  replaced at once, so N is constant.
* Step latency L_i(b) in seconds for a batch of b requests — a constant or a measured table.
* Routing matrix P (M × M, rows sum to 1): after every step of model i each request of the
  batch moves to model j with probability p_ij (p_ii = stays). Run lengths at model i are
  therefore geometric with mean 1 / (1 − p_ii) steps; the simulator also accepts an empirical
  run-length distribution (:attr:`System.run_lengths`).
* Committed tokens C (M × M): a request that moves i → j after a step commits c_ij tokens.
* Delayed batching: an idle model starts a step with all its queued requests (at most
  ``max_batch[i]``) once at least B_i are queued.

Time is discretised by a quantum δ (``quantum_s``): L_i(b) = d_i(b)·δ with
d_i(b) = max(1, round(L_i(b) / δ)) quanta.

Step latency: either a fitted model (PROFILE.json ``step_latency_model``,
:mod:`scheduler_model.latency`: monotone in rows and extend tokens, never flat beyond the data),
which :meth:`System.from_profile` turns into its expected L̄_i(b) for every b = 1 … max batch,
or a number (a constant L_i, the paper's setting) or a table {b: L}. A table is looked up
exactly where b is a key, by linear interpolation between neighbouring keys, with the smallest
key's value below it, and beyond the largest key it grows linearly with slope
max(last segment's slope, mean slope of the table, 1 % of the last value per row): a table
never extrapolates flat (a batch is only free if measurements say so). A single-key table is
a constant, like a number.
"""

from __future__ import annotations

import dataclasses
import math
from functools import reduce
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .errors import ProfileError

DEFAULT_QUANTUM_S = 1e-4


@dataclasses.dataclass(frozen=True)
class Quanta:
    """Step latencies in integer quanta after common-factor reduction.

    Attributes:
        d: list of M int64 arrays; ``d[i][b]`` = latency of a batch of b at model i in quanta of
            ``quantum_s`` (``d[i][0] = 0``), b = 0 … max_batch[i].
        quantum_s: effective quantum in seconds, δ·g where g = gcd of all raw d_i(b); the chain
            with the reduced d is identical to the raw one, only with fewer distinct r values.
        max_rel_error: max_i,b |d_i(b)·quantum_s − L_i(b)| / L_i(b), the discretisation error.
    """

    d: List[np.ndarray]
    quantum_s: float
    max_rel_error: float


@dataclasses.dataclass
class System:
    """The closed multi-model system of the paper's DTMC.

    Attributes:
        models: M model names.
        concurrency: N, number of requests in the closed population (int ≥ 1).
        latency: per model a dict {batch size b (int ≥ 1): L_i(b) in seconds}.
        P: (M, M) float64 routing matrix p_ij, rows sum to 1.
        C: (M, M) float64 committed tokens c_ij (tokens per request moving i → j).
        quantum_s: δ in seconds.
        max_batch: per model the largest batch a step may take (default N).
        run_lengths: optional per model (lengths int64 array ≥ 1, probabilities float64 array):
            empirical distribution of steps a request spends at the model per visit (simulator
            only; the DTMC assumes geometric run lengths, a limit the paper names).
        fixed_thresholds: {model name: B_i} held fixed during the B* search.
        latency_models: per model the fitted :class:`scheduler_model.latency.StepLatencyModel`
            its table came from, or None (a number or a measured table).
    """

    models: Tuple[str, ...]
    concurrency: int
    latency: List[Dict[int, float]]
    P: np.ndarray
    C: np.ndarray
    quantum_s: float = DEFAULT_QUANTUM_S
    max_batch: Optional[Tuple[int, ...]] = None
    run_lengths: Optional[List[Optional[Tuple[np.ndarray, np.ndarray]]]] = None
    fixed_thresholds: Dict[str, int] = dataclasses.field(default_factory=dict)
    latency_models: Optional[List[Any]] = None

    def __post_init__(self) -> None:
        self.models = tuple(str(m) for m in self.models)
        M = len(self.models)
        if M < 1 or len(set(self.models)) != M:
            raise ProfileError(f"models must be a non-empty list of distinct names, got {self.models!r}")
        if not isinstance(self.concurrency, (int, np.integer)) or isinstance(self.concurrency, bool) \
                or self.concurrency < 1:
            raise ProfileError(f"concurrency must be an integer >= 1, got {self.concurrency!r}")
        self.concurrency = int(self.concurrency)
        self.P = np.asarray(self.P, dtype=np.float64)
        self.C = np.asarray(self.C, dtype=np.float64)
        if self.P.shape != (M, M):
            raise ProfileError(f"transition must be {M}x{M}, got shape {self.P.shape}")
        if self.C.shape != (M, M):
            raise ProfileError(f"committed_tokens must be {M}x{M}, got shape {self.C.shape}")
        if not np.all(np.isfinite(self.P)) or np.any(self.P < -1e-12) or np.any(self.P > 1 + 1e-12):
            raise ProfileError("transition entries must be probabilities in [0, 1]")
        rows = self.P.sum(axis=1)
        if np.any(np.abs(rows - 1.0) > 1e-6):
            raise ProfileError(f"transition rows must sum to 1, got row sums {rows.tolist()}")
        self.P = np.clip(self.P, 0.0, 1.0)
        self.P = self.P / self.P.sum(axis=1, keepdims=True)
        if not np.all(np.isfinite(self.C)) or np.any(self.C < 0):
            raise ProfileError("committed_tokens entries must be finite and >= 0")
        if len(self.latency) != M:
            raise ProfileError(f"need a step latency for each of the {M} models")
        lat = []
        for name, tab in zip(self.models, self.latency):
            if not tab:
                raise ProfileError(f"empty latency table for model {name!r}")
            clean = {}
            for b, L in tab.items():
                b = int(b)
                L = float(L)
                if b < 1 or not math.isfinite(L) or L <= 0:
                    raise ProfileError(f"latency of {name!r} at batch {b}: need b >= 1 and L > 0 s, got {L}")
                clean[b] = L
            lat.append(dict(sorted(clean.items())))
        self.latency = lat
        if not (isinstance(self.quantum_s, (int, float)) and self.quantum_s > 0 and math.isfinite(self.quantum_s)):
            raise ProfileError(f"quantum_s must be a positive number of seconds, got {self.quantum_s!r}")
        self.quantum_s = float(self.quantum_s)
        if self.max_batch is None:
            self.max_batch = tuple([self.concurrency] * M)
        else:
            if len(self.max_batch) != M or any(int(c) < 1 for c in self.max_batch):
                raise ProfileError("max_batch must give an integer >= 1 for each model")
            self.max_batch = tuple(min(int(c), self.concurrency) for c in self.max_batch)
        for name, B in self.fixed_thresholds.items():
            if name not in self.models:
                raise ProfileError(f"fixed_thresholds names unknown model {name!r}")
            if not isinstance(B, (int, np.integer)) or isinstance(B, bool) or B < 1:
                raise ProfileError(f"fixed threshold of {name!r} must be an integer >= 1, got {B!r}")
        self.fixed_thresholds = {k: int(v) for k, v in self.fixed_thresholds.items()}
        if self.latency_models is not None:
            if len(self.latency_models) != M:
                raise ProfileError("latency_models must have one entry (or None) per model")
            for i, lm in enumerate(self.latency_models):
                if lm is not None and max(self.latency[i]) < self.max_batch[i]:
                    self.latency[i] = lm.table(self.max_batch[i])  # e.g. after with_(concurrency=…)
        if self.run_lengths is not None and len(self.run_lengths) != M:
            raise ProfileError("run_lengths must have one entry (or None) per model")

    # ------------------------------------------------------------------ basic properties
    @property
    def M(self) -> int:
        """Number of models."""
        return len(self.models)

    @property
    def N(self) -> int:
        """Closed population (concurrency)."""
        return self.concurrency

    def index(self, name: str) -> int:
        """Index of model ``name``; raises ProfileError if unknown."""
        try:
            return self.models.index(name)
        except ValueError:
            raise ProfileError(f"unknown model {name!r}; models are {list(self.models)}") from None

    def latency_s(self, i: int, b: int) -> float:
        """L_i(b) in seconds for batch size b ≥ 1 (table rule in the module docstring)."""
        tab = self.latency[i]
        if b in tab:
            return tab[b]
        keys = list(tab)
        if b <= keys[0]:
            return tab[keys[0]]
        if b >= keys[-1]:
            if len(keys) == 1:
                return tab[keys[-1]]
            k0, k1, k2 = keys[0], keys[-2], keys[-1]
            slope = max((tab[k2] - tab[k1]) / (k2 - k1), (tab[k2] - tab[k0]) / (k2 - k0), 0.01 * tab[k2])
            return tab[k2] + slope * (b - k2)
        hi = next(k for k in keys if k > b)
        lo = max(k for k in keys if k < b)
        w = (b - lo) / (hi - lo)
        return (1 - w) * tab[lo] + w * tab[hi]

    def expected_tokens_per_request_step(self) -> np.ndarray:
        """(M,) float64: Σ_j p_ij c_ij, expected tokens committed per request per step of model i."""
        return (self.P * self.C).sum(axis=1)

    def quanta(self, reduce_gcd: bool = True) -> Quanta:
        """Discretise L_i(b) into integer quanta d_i(b) = max(1, round(L_i(b)/δ)) for b ≤ max_batch[i].

        With ``reduce_gcd`` the d are divided by their greatest common divisor g and the quantum
        becomes g·δ: an exact re-scaling of the same chain that shrinks the range of r_i.
        """
        raw = []
        err = 0.0
        for i in range(self.M):
            d = np.zeros(self.max_batch[i] + 1, dtype=np.int64)
            for b in range(1, self.max_batch[i] + 1):
                L = self.latency_s(i, b)
                d[b] = max(1, int(round(L / self.quantum_s)))
                err = max(err, abs(d[b] * self.quantum_s - L) / L)
            raw.append(d)
        g = 1
        if reduce_gcd:
            g = reduce(math.gcd, [int(x) for d in raw for x in d[1:]], 0) or 1
        return Quanta(d=[d // g for d in raw], quantum_s=self.quantum_s * g, max_rel_error=err)

    # ------------------------------------------------------------------ thresholds
    def thresholds_vector(self, B: Any) -> np.ndarray:
        """Normalise thresholds to an (M,) int64 array; accepts a sequence or {model name: B_i}.

        Models missing from a dict take their fixed threshold if one is set; otherwise
        ProfileError.
        """
        if isinstance(B, Mapping):
            out = []
            for name in self.models:
                if name in B:
                    out.append(int(B[name]))
                elif name in self.fixed_thresholds:
                    out.append(self.fixed_thresholds[name])
                else:
                    raise ProfileError(f"no threshold given for model {name!r}")
            unknown = set(B) - set(self.models)
            if unknown:
                raise ProfileError(f"thresholds name unknown models {sorted(unknown)}")
            return np.asarray(out, dtype=np.int64)
        arr = np.asarray(list(B), dtype=np.int64)
        if arr.shape != (self.M,):
            raise ProfileError(f"need {self.M} thresholds, got {list(B)!r}")
        return arr

    def thresholds_dict(self, B: Sequence[int]) -> Dict[str, int]:
        """{model name: B_i} from an (M,) sequence."""
        return {name: int(b) for name, b in zip(self.models, B)}

    def with_(self, **changes: Any) -> "System":
        """Copy with fields replaced (validated again)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ profile I/O
    @classmethod
    def from_profile(cls, profile: Mapping[str, Any]) -> "System":
        """Build a System from a PROFILE.json dict (format in :mod:`scheduler_model.profile`).

        Raises:
            ProfileError: missing or ill-typed fields, wrong shapes, bad probabilities.
        """
        if not isinstance(profile, Mapping):
            raise ProfileError("profile must be a JSON object")
        for key in ("models", "concurrency", "step_latency_s", "transition", "committed_tokens"):
            if key not in profile:
                raise ProfileError(f"profile lacks required field {key!r}")
        models = profile["models"]
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise ProfileError("'models' must be a list of strings")
        lat_field = profile["step_latency_s"]
        if not isinstance(lat_field, Mapping):
            raise ProfileError("'step_latency_s' must be an object {model: seconds | {batch: seconds}}")
        model_field = profile.get("step_latency_model") or {}
        if not isinstance(model_field, Mapping):
            raise ProfileError("'step_latency_model' must be an object {model: latency model}")
        unknown = set(model_field) - set(models)
        if unknown:
            raise ProfileError(f"'step_latency_model' names unknown models {sorted(unknown)}")
        latency = []
        for m in models:
            if m in model_field:
                latency.append(None)  # filled from the model below, once max_batch is known
                continue
            if m not in lat_field:
                raise ProfileError(f"'step_latency_s' lacks model {m!r}")
            v = lat_field[m]
            if isinstance(v, bool):
                raise ProfileError(f"bad latency for {m!r}: {v!r}")
            if isinstance(v, (int, float)):
                latency.append({1: float(v)})
            elif isinstance(v, Mapping):
                try:
                    latency.append({int(b): float(L) for b, L in v.items()})
                except (TypeError, ValueError) as exc:
                    raise ProfileError(f"bad latency table for {m!r}: {exc}") from None
            else:
                raise ProfileError(f"latency of {m!r} must be a number or a table by batch size")
        try:
            P = np.asarray(profile["transition"], dtype=np.float64)
            C = np.asarray(profile["committed_tokens"], dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise ProfileError(f"transition / committed_tokens must be numeric matrices: {exc}") from None
        max_batch = None
        if "max_batch_size" in profile:
            mb = profile["max_batch_size"]
            try:
                if isinstance(mb, Mapping):
                    max_batch = tuple(int(mb.get(m, profile["concurrency"])) for m in models)
                else:
                    max_batch = tuple([int(mb)] * len(models))
            except (TypeError, ValueError):
                raise ProfileError(f"'max_batch_size' must be an integer or {{model: integer}}, got {mb!r}") from None
        run_lengths = None
        if profile.get("run_lengths"):
            rl = profile["run_lengths"]
            if not isinstance(rl, Mapping):
                raise ProfileError("'run_lengths' must be an object {model: [lengths] | {length: weight}}")
            run_lengths = [parse_run_lengths(rl[m], m) if m in rl else None for m in models]
        lat_models = None
        if model_field:
            from .latency import StepLatencyModel

            conc = profile["concurrency"]
            lat_models = []
            for i, m in enumerate(models):
                if m not in model_field:
                    lat_models.append(None)
                    continue
                lm = StepLatencyModel.from_json(model_field[m], m)
                lat_models.append(lm)
                if isinstance(conc, bool) or not isinstance(conc, (int, np.integer)) or conc < 1:
                    conc = 1  # concurrency is validated (with its own message) by the constructor
                top = min(max_batch[i], conc) if max_batch is not None else conc
                latency[i] = lm.table(max(1, min(int(top), 100_000)))
        fixed = profile.get("fixed_thresholds") or {}
        if not isinstance(fixed, Mapping):
            raise ProfileError("'fixed_thresholds' must be an object {model: B}")
        return cls(
            models=tuple(models),
            concurrency=profile["concurrency"],
            latency=latency,
            P=P,
            C=C,
            quantum_s=profile.get("quantum_s", DEFAULT_QUANTUM_S),
            max_batch=max_batch,
            run_lengths=run_lengths,
            fixed_thresholds=dict(fixed),
            latency_models=lat_models,
        )


def parse_run_lengths(spec: Any, model: str = "?") -> Tuple[np.ndarray, np.ndarray]:
    """Parse a run-length distribution: a list of observed lengths or {length: weight}.

    Returns:
        (lengths int64 array of distinct values ≥ 1, probabilities float64 array summing to 1).
    Raises:
        ProfileError: empty, non-positive lengths or weights.
    """
    try:
        if isinstance(spec, Mapping):
            items = [(int(k), float(v)) for k, v in spec.items()]
        else:
            vals, counts = np.unique(np.asarray(list(spec), dtype=np.int64), return_counts=True)
            items = list(zip(vals.tolist(), counts.astype(float).tolist()))
    except (TypeError, ValueError) as exc:
        raise ProfileError(f"bad run_lengths for {model!r}: {exc}") from None
    items = [(k, w) for k, w in items if w > 0]
    if not items or any(k < 1 for k, _ in items):
        raise ProfileError(f"run_lengths for {model!r} must be non-empty with lengths >= 1")
    lengths = np.asarray([k for k, _ in items], dtype=np.int64)
    w = np.asarray([w for _, w in items], dtype=np.float64)
    return lengths, w / w.sum()
