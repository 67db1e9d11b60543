"""Declared settings: each setting of a model is declared once, on its dataclass field.

A field made with :func:`param` carries a :class:`Param`: the setting's doc, unit, range and the
name of its config parameter, beside the field's default.  From these declarations

* the dataclass checks its values (:func:`check_ranges`, from ``__post_init__``),
* its docstring lists its attributes (:func:`documented`),
* the Triton adapter reads a model's ``config.pbtxt`` parameters
  (:func:`tokenrouter.triton.settings.read_declared`), and
* a test holds docs/configuration.md to them (:func:`shown_default`).

This module holds no setting itself: :mod:`tokenrouter.engine.config` declares the engine's and
the decode loop's, :mod:`tokenrouter.engine.sampling` the limits on a request's sampling parameters,
:mod:`tokenrouter.routing.online_bstar` and :mod:`tokenrouter.routing.curve` the router's online
adaptation and the channel's CURVE keys, :mod:`tokenrouter.triton.settings` those of the model and
router processes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Tuple

__all__ = ["Param", "param", "declarations", "check_ranges", "documented", "shown_default"]

#: ``Param.unset`` when no parameter value stands for None
NOTHING = object()


@dataclass(frozen=True)
class Param:
    """The declaration of one setting (the field's own default is its default).

    Attributes:
        doc: what it does, one or two sentences.
        unit: the unit of the field's value (``"tokens"``, ``"s"``, ``"requests"``, …); "" for none.
        ge: the smallest value allowed, or None (no lower bound).
        gt: a bound the value must exceed (a strict ``> gt``), or None.
        le: the largest value allowed, or None (no upper bound).
        finite: the value must be a finite number (no ``inf``, no ``nan``).
        choices: the values allowed (strings), or () for any.
        fold_case: the parameter's value is read with surrounding spaces stripped and lower-cased
            (a case-insensitive choice: `` Triton `` reads as ``triton``).
        key: its config parameter in ``config.pbtxt``: "" = the field's name; None = no config
            parameter (set by the code that builds the object).
        kind: the type of the parameter's value (``int``, ``float``, ``bool``, ``str``); None =
            the type of the default (of ``unset`` where the default is None).
        scale: parameter units per field unit (1e6: the parameter is in µs, the field in s).
        clamp: a parameter value below ``ge`` reads as ``ge`` (else it is refused).
        unset: the parameter value that stands for None (``0``, ``""``); :data:`NOTHING` if none.
        shown: the default as the docs write it, where it is not the value itself (e.g. "the
            checkpoint's"); "" = the value.
    """

    doc: str
    unit: str = ""
    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    finite: bool = False
    choices: Tuple[str, ...] = ()
    fold_case: bool = False
    key: Optional[str] = ""
    kind: Optional[type] = None
    scale: float = 1
    clamp: bool = False
    unset: Any = NOTHING
    shown: str = ""

    def parameter(self, name: str) -> Optional[str]:
        """The config parameter of the field ``name`` (None: it has none)."""
        return None if self.key is None else (self.key or name)

    def value_kind(self, default: Any) -> type:
        """The type of the parameter's value for a field whose default is ``default``."""
        if self.kind is not None:
            return self.kind
        return type(self.unset if default is None and self.unset is not NOTHING else default)

    def range_text(self) -> str:
        """The allowed values in words ("" where any value goes): ``one of a, b``, ``>= 0``, ``> 0``,
        ``a finite number > 0``."""
        if self.choices:
            return "one of " + ", ".join(self.choices)
        bounds = [f"{op} {_number(b)}" for op, b in ((">=", self.ge), (">", self.gt), ("<=", self.le))
                  if b is not None]
        return " ".join((["a finite number"] if self.finite else []) + [" and ".join(bounds)] * bool(bounds))

    def allows(self, v: Any) -> bool:
        """Whether the (non-None) value ``v`` is in range."""
        if self.choices:
            return v in self.choices
        if self.finite and not math.isfinite(v):
            return False
        return ((self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
                and (self.le is None or v <= self.le))


def _number(x: float) -> str:
    """``x`` as the docs and errors write a bound: whole numbers in full (33554432), others as ``%g``."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def param(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
          **declaration: Any) -> Any:
    """A dataclass field with default ``default`` (or made by ``default_factory``, for a mutable
    one such as ``{}``; neither: required), declared by ``Param(**declaration)``."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={"param": Param(**declaration)})


def declarations(cls: type) -> Iterator[Tuple[str, Param, Any]]:
    """``(field name, Param, default)`` of each declared field of the dataclass ``cls``, in order
    (a ``default_factory``'s value; ``dataclasses.MISSING`` for a required field)."""
    for f in dataclasses.fields(cls):
        p = f.metadata.get("param")
        if p is not None:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            yield f.name, p, default


def check_ranges(obj: Any) -> None:
    """Check each declared field of the dataclass instance ``obj`` against its range.

    None passes (an unset optional value).

    Raises:
        ValueError: the first field out of range, naming it (and its config parameter where that
            is named otherwise) and the value.
    """
    for name, p, _ in declarations(type(obj)):
        v = getattr(obj, name)
        if v is None:
            continue
        if not p.allows(v):
            key = p.parameter(name)
            label = name if key in (None, name) else f"{name} (config parameter {key})"
            raise ValueError(f"{label} must be {p.range_text()}, got {v!r}")


def shown_default(name: str, p: Param, default: Any) -> str:
    """The default of the field ``name`` as docs/configuration.md writes it, in parameter units.

    ``p.shown`` where set; numbers as such (``5000``, ``0.5``), booleans and strings in backquotes,
    "empty" for an empty string or a None whose ``unset`` is "".
    """
    if p.shown:
        return p.shown
    if default is None and p.unset is not NOTHING:
        default = p.unset
    if isinstance(default, bool):
        return f"`{str(default).lower()}`"
    if isinstance(default, (int, float)):
        v = default * p.scale
        return f"{round(v)}" if float(v).is_integer() else f"{v:g}"
    if default == "":
        return "empty"
    return f"`{default}`"


def documented(cls: type) -> type:
    """Class decorator (outside ``@dataclass``): append an ``Attributes:`` section to ``cls``'s
    docstring, one entry per declared field: its doc, unit, range, default and config parameter."""
    lines = ["", "    Attributes:"]
    for name, p, default in declarations(cls):
        facts = [p.unit] if p.unit else []
        facts += [p.range_text()] if p.range_text() else []
        if default is not dataclasses.MISSING:
            facts.append("default " + (shown_default(name, p, default) if p.scale == 1 else f"{default:g}"))
        key = p.parameter(name)
        facts.append("no config parameter" if key is None else f"config parameter ``{key}``")
        lines.append(f"        {name}: {p.doc} ({'; '.join(facts)})")
    cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n" + "\n".join(lines) + "\n"
    return cls
