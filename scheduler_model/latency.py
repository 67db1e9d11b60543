"""Step-latency model L_i(step): a monotone fit of step time in decode rows and extend tokens.

The paper's DTMC ("DTMC for B*") needs L_i(b), the time of a step of b requests at model i,
for every b up to N. Measured steps are noisy, cover few batch sizes and mix pure decode steps
with steps that also extend (resumes of 1-2 new tokens after a handoff, prefills of new
prompts). This module fits one model per LLM::

    L(b, x, e) = D(b) + c_step · e + c_tok · x                                   (s)

* b = rows of the step (``batch_size``), x = extend tokens beyond one per row
  (``max(0, extend_tokens − batch_size)`` when the step extended, else 0: with one forward per
  step, a step that extends anything runs every row through extend, one token per decode row),
  e = 1 if the step extended (``extend_tokens > 0``), else 0.
* D(b): piecewise linear through knots k_0 < … < k_m (batch sizes seen often enough), values
  D(k_0) ≤ D(k_1) ≤ … — monotone non-decreasing. Between knots linear. Above k_m it grows with
  slope ``slope_beyond_s`` = max(last segment's slope, mean slope over [k_0, k_m],
  ``min_slope_fraction`` · D(k_m)) — never flat. Below k_0 it falls with the first segment's
  slope but never under the proportional D(k_0)·b/k_0. With one knot only, the cost of a row is
  not identified and D(b) = D(k_0)·b/k_0 beyond it (batching assumed to gain nothing).
* c_step ≥ 0 (s per extending step), c_tok ≥ 0 (s per extra extend token).

Fit: non-negative least squares (``scipy.optimize.nnls``) on the features
[1, r_1(b), …, r_m(b), e, x] with ramps r_j(b) = clip(b − k_{j−1}, 0, k_j − k_{j−1}); every
coefficient but the intercept is a slope or a cost, so non-negativity is exactly monotonicity
in b, x and e. Robust to outliers by iteratively reweighted least squares: 3 Huber iterations
(tuning 1.345) then 5 Tukey-bisquare iterations (tuning 4.685), scale = 1.4826 · MAD of the
residuals (Huber 1981; Beaton & Tukey 1974).

Expected step time for the DTMC (which sees only b): a request in a step is an extending row
with probability q (resume after a handoff, or a new prompt), and a step brings on average x̄
extra extend tokens per row; both are estimated from the step events (q by maximum likelihood
from P(step extends | b) = 1 − (1 − q)^b, x̄ = Σ x / Σ b). Then::

    L̄(b) = D(b) + c_step · (1 − (1 − q)^b) + c_tok · x̄ · b

JSON form (``PROFILE.json`` field ``step_latency_model``, one object per model)::

    {"kind": "piecewise-linear-nnls",
     "row_knots": [1, 2, 4, 8],                  # k_j, batch sizes (rows)
     "decode_latency_s": [0.05, 0.06, 0.07, 0.09],   # D(k_j), s, non-decreasing
     "slope_beyond_s": 0.005,                    # s per row above the last knot
     "extend_step_s": 0.002,                     # c_step, s per step that extends
     "extend_token_s": 0.0004,                   # c_tok, s per extra extend token
     "extend_row_rate": 0.08,                    # q, per request-step
     "extra_extend_tokens_per_row": 1.3,         # x̄, tokens per request-step
     "fit": {"points": 812, "sources": {"events": 800, "calibration": 12},
             "residual_mad_s": 0.003, "batch_sizes": [1, 2, 3, 4, 8]}}   # diagnostics only
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .errors import ProfileError

KIND = "piecewise-linear-nnls"


@dataclasses.dataclass
class StepLatencyModel:
    """Fitted step-latency model of one LLM (formula in the module docstring).

    Attributes:
        row_knots: (m+1,) increasing ints ≥ 1, batch sizes (rows) where D is given.
        decode_latency_s: (m+1,) non-decreasing D(k_j) in seconds, > 0.
        slope_beyond_s: s per row above the last knot (> 0).
        extend_step_s: c_step ≥ 0, s added to a step that runs extend.
        extend_token_s: c_tok ≥ 0, s per extend token beyond one per row.
        extend_row_rate: q in [0, 1], probability that a request-step is an extending row.
        extra_extend_tokens_per_row: x̄ ≥ 0, mean extra extend tokens per request-step.
        fit: diagnostics of the fit (points, sources, residual MAD); not used for prediction.
    """

    row_knots: List[int]
    decode_latency_s: List[float]
    slope_beyond_s: float
    extend_step_s: float = 0.0
    extend_token_s: float = 0.0
    extend_row_rate: float = 0.0
    extra_extend_tokens_per_row: float = 0.0
    fit: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        k = [int(x) for x in self.row_knots]
        v = [float(x) for x in self.decode_latency_s]
        if not k or len(k) != len(v):
            raise ProfileError("latency model: row_knots and decode_latency_s must be non-empty and equally long")
        if k[0] < 1 or any(b <= a for a, b in zip(k, k[1:])):
            raise ProfileError(f"latency model: row_knots must be increasing integers >= 1, got {k}")
        if any(not math.isfinite(x) or x <= 0 for x in v) or any(b < a - 1e-12 for a, b in zip(v, v[1:])):
            raise ProfileError(f"latency model: decode_latency_s must be positive and non-decreasing, got {v}")
        for name in ("slope_beyond_s", "extend_step_s", "extend_token_s", "extra_extend_tokens_per_row"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
                raise ProfileError(f"latency model: {name} must be a number >= 0, got {x!r}")
        if self.slope_beyond_s <= 0:
            raise ProfileError("latency model: slope_beyond_s must be > 0 (no flat extrapolation)")
        q = self.extend_row_rate
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 <= q <= 1:
            raise ProfileError(f"latency model: extend_row_rate must be in [0, 1], got {q!r}")
        self.row_knots, self.decode_latency_s = k, v
        self.slope_beyond_s = float(self.slope_beyond_s)
        self.extend_step_s, self.extend_token_s = float(self.extend_step_s), float(self.extend_token_s)
        self.extend_row_rate = float(q)
        self.extra_extend_tokens_per_row = float(self.extra_extend_tokens_per_row)

    # ------------------------------------------------------------------ prediction
    def decode_s(self, b: Any) -> np.ndarray:
        """D(b) in seconds for rows b ≥ 1 (scalar or array; float64 array of b's shape)."""
        b = np.asarray(b, dtype=np.float64)
        k = np.asarray(self.row_knots, dtype=np.float64)
        v = np.asarray(self.decode_latency_s)
        out = np.interp(b, k, v)
        hi = b > k[-1]
        out = np.where(hi, v[-1] + self.slope_beyond_s * (b - k[-1]), out)
        lo = b < k[0]
        if np.any(lo):
            s0 = (v[1] - v[0]) / (k[1] - k[0]) if len(k) > 1 else 0.0
            down = np.maximum(v[0] - s0 * (k[0] - b), v[0] * b / k[0])
            out = np.where(lo, down, out)
        return out

    def step_s(self, b: Any, extend_tokens: Any = 0) -> np.ndarray:
        """L(b, x, e) in seconds of a step of ``b`` rows that ran ``extend_tokens`` tokens through extend.

        ``extend_tokens`` is the step event's field (0 for a pure decode step); x and e follow the
        module docstring. Arrays broadcast; returns float64.
        """
        b = np.asarray(b, dtype=np.float64)
        ext = np.asarray(extend_tokens, dtype=np.float64)
        e = (ext > 0).astype(np.float64)
        x = np.where(ext > 0, np.maximum(0.0, ext - b), 0.0)
        return self.decode_s(b) + self.extend_step_s * e + self.extend_token_s * x

    def expected_s(self, b: Any) -> np.ndarray:
        """L̄(b) in seconds, the expected step time of b rows under the workload's extend mix (DTMC input)."""
        b = np.asarray(b, dtype=np.float64)
        p_ext = 1.0 - (1.0 - self.extend_row_rate) ** b
        return (self.decode_s(b) + self.extend_step_s * p_ext
                + self.extend_token_s * self.extra_extend_tokens_per_row * b)

    def table(self, max_b: int) -> Dict[int, float]:
        """{b: L̄(b)} for b = 1 … max_b (s)."""
        bs = np.arange(1, int(max_b) + 1)
        return {int(b): float(x) for b, x in zip(bs, self.expected_s(bs))}

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> Dict[str, Any]:
        """The PROFILE.json object (module docstring)."""
        return {"kind": KIND, "row_knots": list(self.row_knots),
                "decode_latency_s": [round(x, 9) for x in self.decode_latency_s],
                "slope_beyond_s": round(self.slope_beyond_s, 9), "extend_step_s": round(self.extend_step_s, 9),
                "extend_token_s": round(self.extend_token_s, 9), "extend_row_rate": round(self.extend_row_rate, 6),
                "extra_extend_tokens_per_row": round(self.extra_extend_tokens_per_row, 6), "fit": self.fit}

    @classmethod
    def from_json(cls, obj: Any, model: str = "?") -> "StepLatencyModel":
        """Parse the PROFILE.json object. Raises ProfileError (wrong kind, missing or bad fields)."""
        if not isinstance(obj, Mapping):
            raise ProfileError(f"step_latency_model of {model!r} must be an object")
        if obj.get("kind") != KIND:
            raise ProfileError(f"step_latency_model of {model!r}: unknown kind {obj.get('kind')!r} (expected {KIND!r})")
        try:
            return cls(row_knots=list(obj["row_knots"]), decode_latency_s=list(obj["decode_latency_s"]),
                       slope_beyond_s=obj["slope_beyond_s"], extend_step_s=obj.get("extend_step_s", 0.0),
                       extend_token_s=obj.get("extend_token_s", 0.0), extend_row_rate=obj.get("extend_row_rate", 0.0),
                       extra_extend_tokens_per_row=obj.get("extra_extend_tokens_per_row", 0.0),
                       fit=dict(obj.get("fit") or {}))
        except KeyError as exc:
            raise ProfileError(f"step_latency_model of {model!r} lacks field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ProfileError(f"step_latency_model of {model!r}: {exc}") from None


# ---------------------------------------------------------------------------- fitting
def _knots(b: np.ndarray, min_points: int, max_knots: int) -> List[int]:
    vals, counts = np.unique(b.astype(np.int64), return_counts=True)
    keep = vals[counts >= min_points]
    if keep.size == 0:
        keep = vals[counts == counts.max()][:1]
    keep = keep.tolist()
    if len(keep) > max_knots:
        grid = np.geomspace(keep[0], keep[-1], max_knots)
        arr = np.asarray(keep)
        keep = sorted({int(arr[np.argmin(np.abs(arr - g))]) for g in grid} | {keep[0], keep[-1]})
    return keep


def _design(b: np.ndarray, e: np.ndarray, x: np.ndarray, knots: Sequence[int]) -> np.ndarray:
    cols = [np.ones_like(b)]
    for lo, hi in zip(knots, knots[1:]):
        cols.append(np.clip(b - lo, 0.0, hi - lo))
    cols += [e, x]
    return np.stack(cols, axis=1)


def _robust_nnls(X: np.ndarray, y: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """IRLS non-negative least squares; returns (coef, final weights)."""
    from scipy.optimize import nnls

    w = np.ones_like(y)
    coef = np.zeros(X.shape[1])
    floor = 1e-6 * max(float(np.median(np.abs(y))), 1e-12)
    for it in range(8):
        sw = np.sqrt(w)
        coef, _ = nnls(X * sw[:, None], y * sw, maxiter=50 * X.shape[1])
        r = y - X @ coef
        s = max(1.4826 * float(np.median(np.abs(r - np.median(r)))), floor)
        if it < 3:
            u = np.abs(r) / (1.345 * s)
            w = np.where(u <= 1, 1.0, 1.0 / np.maximum(u, 1e-300))
        else:
            u = r / (4.685 * s)
            w = np.where(np.abs(u) < 1, (1 - u ** 2) ** 2, 0.0)
        if w.sum() < X.shape[1]:  # pathological: keep the previous weights' fit
            break
    return coef, w


def _extend_rate(b: np.ndarray, e: np.ndarray) -> float:
    """MLE of q in P(step extends | b rows) = 1 − (1 − q)^b."""
    if e.sum() == 0:
        return 0.0
    if e.sum() == len(e):
        return 1.0
    from scipy.optimize import minimize_scalar

    def nll(q: float) -> float:
        p = 1.0 - (1.0 - q) ** b
        return -float(np.sum(e * np.log(np.maximum(p, 1e-300)) + (1 - e) * b * np.log1p(-q)))

    return float(minimize_scalar(nll, bounds=(1e-9, 1 - 1e-9), method="bounded",
                                 options={"xatol": 1e-9}).x)


def fit_step_latency(batch_size: Iterable[int], extend_tokens: Iterable[float], latency_s: Iterable[float], *,
                     workload: Optional[Tuple[Iterable[int], Iterable[float]]] = None,
                     source_counts: Optional[Mapping[str, int]] = None, min_points: int = 3,
                     max_knots: int = 12, min_slope_fraction: float = 0.01) -> StepLatencyModel:
    """Fit :class:`StepLatencyModel` to observed steps (method in the module docstring).

    Args:
        batch_size: (n,) rows of each step, ints ≥ 1.
        extend_tokens: (n,) tokens the step ran through extend (0 = pure decode step).
        latency_s: (n,) step times in seconds, > 0.
        workload: (batch sizes, extend tokens) of the steps that describe the served workload,
            for q and x̄; default: the fitted steps themselves. Calibration points are
            controlled, not the workload, so callers pass the event steps only.
        source_counts: {source: points} recorded in ``fit`` (diagnostics).
        min_points: a batch size becomes a knot if at least this many steps have it.
        max_knots: at most this many knots (geometrically spread over the observed range).
        min_slope_fraction: slope beyond the last knot ≥ this × D(k_m) per row.
    Returns:
        The fitted model.
    Raises:
        ProfileError: no steps, non-positive latency, batch size < 1, negative extend tokens,
            or arrays of different lengths.
    """
    b = np.asarray(list(batch_size), dtype=np.float64)
    ext = np.asarray(list(extend_tokens), dtype=np.float64)
    y = np.asarray(list(latency_s), dtype=np.float64)
    if not (b.shape == ext.shape == y.shape) or b.ndim != 1:
        raise ProfileError("batch_size, extend_tokens and latency_s must be 1-D and equally long")
    if b.size == 0:
        raise ProfileError("cannot fit a step-latency model without steps")
    if np.any(b < 1) or np.any(ext < 0) or np.any(~np.isfinite(y)) or np.any(y <= 0):
        raise ProfileError("steps need batch_size >= 1, extend_tokens >= 0 and latency_s > 0")
    e = (ext > 0).astype(np.float64)
    x = np.where(ext > 0, np.maximum(0.0, ext - b), 0.0)
    knots = _knots(b, min_points, max_knots)
    X = _design(b, e, x, knots)
    coef, w = _robust_nnls(X, y)
    a, slopes, c_step, c_tok = coef[0], coef[1:len(knots)], coef[-2], coef[-1]
    vals = [a]
    for s, lo, hi in zip(slopes, knots, knots[1:]):
        vals.append(vals[-1] + s * (hi - lo))
    if vals[0] <= 0:  # only the extend terms explained the data: keep D positive
        pos = y[e == 0] if np.any(e == 0) else y
        vals = [v + max(float(np.min(pos)) * 1e-3, 1e-9) for v in vals]
    if len(knots) == 1:
        beyond = vals[0] / knots[0]
    else:
        mean_slope = (vals[-1] - vals[0]) / (knots[-1] - knots[0])
        beyond = max(float(slopes[-1]), mean_slope, min_slope_fraction * vals[-1])
    beyond = max(beyond, min_slope_fraction * vals[-1], 1e-12)
    wb, wext = (b, ext) if workload is None else (np.asarray(list(workload[0]), dtype=np.float64),
                                                   np.asarray(list(workload[1]), dtype=np.float64))
    if wb.size:
        we = (wext > 0).astype(np.float64)
        q = _extend_rate(wb, we)
        xbar = float(np.sum(np.where(wext > 0, np.maximum(0.0, wext - wb), 0.0)) / np.sum(wb))
    else:
        q, xbar = 0.0, 0.0
    r = y - X @ coef
    fit = {"points": int(b.size), "batch_sizes": sorted({int(v) for v in b}),
           "residual_mad_s": round(float(np.median(np.abs(r))), 9),
           "downweighted_points": int(np.sum(w < 0.5))}
    if source_counts:
        fit["sources"] = {k: int(v) for k, v in source_counts.items()}
    return StepLatencyModel(row_knots=knots, decode_latency_s=[float(v) for v in vals], slope_beyond_s=beyond,
                            extend_step_s=float(c_step), extend_token_s=float(c_tok), extend_row_rate=q,
                            extra_extend_tokens_per_row=xbar, fit=fit)


def contention_scale(events: Tuple[Sequence[int], Sequence[float], Sequence[float]],
                     calibration: Tuple[Sequence[int], Sequence[float], Sequence[float]],
                     min_points: int = 3) -> float:
    """κ, the factor that brings calibration steps to the level of the steps seen while serving.

    A calibration (:mod:`scheduler_model.calibrate`) times each model alone, on synthetic
    sequences of one context length, while a served step runs while the other models step too
    (sharing memory bandwidth and cores) and over the served contexts.  Fitting both as they
    are would join two curves at the edge of the served batch sizes.  κ is the median, over
    the served steps whose batch size lies within the calibrated range, of ``L_served /
    L_cal(b, extend_tokens)``, where ``L_cal`` is :func:`fit_step_latency` fitted to the
    calibration alone (so decode, resume and prefill steps all count, and batch sizes between
    calibrated ones are interpolated).  Calibration latencies are multiplied by κ before the
    joint fit: the served steps set the level, the calibration the shape beyond them.

    Args:
        events, calibration: (batch sizes, extend tokens, latencies in s), as passed to
            :func:`fit_step_latency` and returned by :func:`calibration_points`.
        min_points: served steps needed within the calibrated range.
    Returns:
        κ > 0; 1.0 when fewer than ``min_points`` served steps fall in the calibrated range or
        the ratios are not finite and positive.
    Raises:
        ProfileError: malformed calibration points (see :func:`fit_step_latency`).
    """
    cb = np.asarray(list(calibration[0]), dtype=np.float64)
    if cb.size == 0:
        return 1.0
    b = np.asarray(list(events[0]), dtype=np.float64)
    x = np.asarray(list(events[1]), dtype=np.float64)
    L = np.asarray(list(events[2]), dtype=np.float64)
    inside = (b >= cb.min()) & (b <= cb.max()) & np.isfinite(L) & (L > 0)
    if int(inside.sum()) < min_points:
        return 1.0
    cal = fit_step_latency(*calibration, workload=([], []), min_points=1)  # every calibrated size a knot
    ratio = L[inside] / cal.step_s(b[inside], x[inside])
    k = float(np.median(ratio))
    return k if np.isfinite(k) and k > 0 else 1.0


# ---------------------------------------------------------------------------- calibration files
def calibration_points(calib: Mapping[str, Any], model: str) -> Tuple[List[int], List[float], List[float]]:
    """(batch sizes, extend tokens, latencies in s) of one model's calibration steps.

    ``calib`` is the JSON written by ``python -m tokenrouter.tools.admin calibrate`` (format in
    :mod:`scheduler_model.calibrate`). Decode steps give (b, 0, L); the resume step of each
    batch size gives (b, extend_tokens, L); prefill steps (rows, extend_tokens, L). Returns
    empty lists if the model is absent.

    Raises:
        ProfileError: malformed calibration object.
    """
    if not isinstance(calib, Mapping) or not isinstance(calib.get("models"), Mapping):
        raise ProfileError("calibration must be an object with a 'models' object")
    entry = calib["models"].get(model)
    if entry is None:
        return [], [], []
    bs: List[int] = []
    ex: List[float] = []
    ls: List[float] = []
    try:
        for row in entry["table"]:
            b = int(row["batch_size"])
            for L in row["decode_latency_s"]:
                bs.append(b), ex.append(0.0), ls.append(float(L))
            if row.get("resume_latency_s") is not None:
                bs.append(b), ex.append(float(row["resume_extend_tokens"])), ls.append(float(row["resume_latency_s"]))
            for pf in row.get("prefill") or []:
                bs.append(int(pf["rows"])), ex.append(float(pf["extend_tokens"])), ls.append(float(pf["latency_s"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ProfileError(f"calibration of {model!r} is malformed: {exc!r}") from None
    return bs, ex, ls
