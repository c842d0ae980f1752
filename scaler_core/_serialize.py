"""State in and out: a versioned JSON-safe dict, and PyTorch's state_dict.

Loading validates exactly as construction does, and builds nothing until every
check has passed: a bad checkpoint raises :class:`InvalidStateError` and leaves
nothing half-loaded. Saving runs the same checks on what it writes, so every dict
:func:`to_dict` writes, :func:`from_dict` reads: a state no load would accept
(built by hand, as ``ScalerState`` checks nothing) is refused when saved, with the
message its load would give, not at resume.

Three dicts are read, told apart by their keys: scaler-core's checkpoint (a
``"schema"`` key); ``torch.amp.GradScaler.state_dict()`` (PyTorch's five keys);
and ``scaler_core.torch.GradScaler.state_dict()`` (those five and
:data:`TORCH_STATE_KEY`, holding a checkpoint). No array library is imported: the
drop-in writes Python numbers in every entry.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

from ._config import ScalerConfig, shown
from ._errors import InvalidArgumentError, InvalidConfigError, InvalidStateError
from ._f32 import INT32_MAX, f32, is_normal_f32
from ._state import DATA_FIELDS, LAST_KIND_CODES, SPIKE_FIELDS, ScalerState

__all__ = [
    "FORMATS",
    "SCHEMA",
    "SCHEMA_VERSION",
    "TORCH_STATE_KEY",
    "from_dict",
    "from_torch_state_dict",
    "load_dict",
    "to_dict",
    "with_torch_entries",
]

SCHEMA = "scaler_core.state"
#: The key under which ``scaler_core.torch.GradScaler.state_dict()`` holds
#: :func:`to_dict`'s checkpoint, beside PyTorch's five entries.
TORCH_STATE_KEY = "scaler_core"
#: Version 2 added spike skipping: the config's ``spike_threshold`` and
#: ``spike_window``, the state's window statistics and ``last_kind``. A config
#: with ``growth_delay`` set (DeepSpeed's preset) adds that key to its config; a
#: config without it is written without the key, as before it existed, so a
#: scaler-core that does not know the knob refuses only the checkpoints that need it.
SCHEMA_VERSION = 2
#: The versions :func:`from_dict` reads.
READABLE_VERSIONS = (1, 2)
_TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(ScalerConfig))
_SPIKE_CONFIG_FIELDS = ("spike_threshold", "spike_window")
#: Config keys written only when they differ from their default.
_OPTIONAL_CONFIG_FIELDS = ("growth_delay",)
_STATE_KEYS = tuple(name for name in DATA_FIELDS if name != "failure")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ScalerConfig)}
#: Per version: the config keys and the state keys a checkpoint holds.
_KEYS = {
    1: (
        tuple(
            f
            for f in _CONFIG_FIELDS
            if f not in _SPIKE_CONFIG_FIELDS and f not in _OPTIONAL_CONFIG_FIELDS
        ),
        tuple(k for k in _STATE_KEYS if k not in SPIKE_FIELDS),
    ),
    2: (tuple(f for f in _CONFIG_FIELDS if f not in _OPTIONAL_CONFIG_FIELDS), _STATE_KEYS),
}


#: What :func:`to_dict` writes: scaler-core's own checkpoint, or PyTorch's state dict.
FORMATS = ("scaler_core", "torch")


def to_dict(state: ScalerState, *, format: str = "scaler_core") -> dict[str, Any]:
    """The state as a JSON-safe dict: scaler-core's checkpoint, or PyTorch's.

    ``format="scaler_core"`` (the default) writes every field, with a schema name
    and version. ``format="torch"`` writes the five keys of
    ``torch.amp.GradScaler.state_dict()``: only PyTorch's fields survive, and knobs
    PyTorch lacks (floors, hysteresis, ...) are dropped. :func:`from_dict` reads
    both. A device state is read back to the host first; a recorded failure raises.

    What is written is checked as :func:`from_dict` checks it when it is read (for
    ``"torch"``, against ``state``'s config), before anything is returned: a run
    that saves can resume. A state no load would accept (one built by hand with a
    field out of range, such as Megatron's hysteresis tracker of ``-1``; see
    ``hysteresis_tracker`` in :class:`ScalerState`) is refused with the message
    its load would give.

    Raises:
        InvalidArgumentError: ``format`` is not one of :data:`FORMATS`.
        InvalidStateError: ``from_dict`` would refuse what would be written (the
            message names the key, the value and the range it must be in), or a
            field holds no number of its kind.
        ScaleCollapseError: A device transition recorded a failure in ``state``.

    >>> from scaler_core import init
    >>> d = to_dict(init())
    >>> d["schema"], d["version"], d["state"]["scale"]
    ('scaler_core.state', 2, 65536.0)
    >>> to_dict(init(), format="torch")["_growth_tracker"]
    0
    """
    if format not in FORMATS:
        raise InvalidArgumentError(
            f"format={format!r}, but it must be one of {list(FORMATS)}: 'scaler_core' for "
            f"every field, 'torch' for torch.amp.GradScaler.state_dict()'s keys"
        )
    if format == "torch":
        out = _to_torch(state)
        from_torch_state_dict(out, state.config)  # raises what loading it would raise
        return out
    host = state.to_host()
    config = host.config.to_dict()
    for name in _OPTIONAL_CONFIG_FIELDS:
        if config[name] == _DEFAULTS[name]:
            del config[name]
    out = {
        "schema": SCHEMA,
        "version": SCHEMA_VERSION,
        "config": config,
        "state": {name: getattr(host, name) for name in _STATE_KEYS},
    }
    _checkpoint(out, "checkpoint")  # raises what loading it would raise
    return out


def _bad(where: str, value: object, must: str) -> InvalidStateError:
    return InvalidStateError(f"{where}={shown(value)}, but it must be {must}")


def _mapping(where: str, data: object) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise _bad(where, data, "a dict")
    if not data:
        raise _bad(where, data, "a non-empty dict (was the checkpoint saved empty?)")
    return data


def _exact_keys(where: str, data: Mapping[str, Any], keys: tuple[str, ...]) -> None:
    missing = [k for k in keys if k not in data]
    extra = sorted(shown(k) for k in data if k not in keys)
    if missing or extra:
        raise InvalidStateError(
            f"{where} has missing keys {missing!r} and unknown keys [{', '.join(extra)}]; "
            f"expected exactly {list(keys)!r}"
        )


def _int_field(where: str, value: object, low: int, high: int, why: str = "") -> int:
    must = f"an int in [{low}, {high}]{why}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _bad(where, value, must)
    if not low <= int(value) <= high:
        raise _bad(where, value, must)
    return int(value)


#: Why the hysteresis tracker's range starts at 1, for its messages.
_HYSTERESIS_WHY = (
    " (the overflows left before a backoff: 1 backs off at the next one; Megatron's "
    "own tracker counts on to 0, -1, ... where this one stays at 1, with the same "
    "decisions, so build a state from Megatron's with max(1, its tracker))"
)


def _scale_field(where: str, value: object, config: ScalerConfig) -> float:
    low = config.min_scale
    high = config.max_scale
    must = (
        f"a positive, finite, normal float32 in [{low if low is not None else 'FLT_MIN'}, "
        f"{high if high is not None else 'FLT_MAX'}]"
    )
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _bad(where, value, must)
    try:
        exact = float(value)
        scale = f32(exact)
    except (OverflowError, ValueError):
        raise _bad(where, value, must) from None
    if not is_normal_f32(scale):
        raise _bad(where, value, must)
    if scale != exact:  # as the config refuses it: exactly a float32, never rounded
        raise _bad(where, value, f"exactly representable in float32; use {scale!r}")
    if (low is not None and scale < low) or (high is not None and scale > high):
        raise _bad(where, value, must)
    return scale


def _tracker_field(where: str, value: object) -> int:
    """A growth tracker: any int32 count >= 0. At or past ``growth_interval`` is a state
    PyTorch reaches (``set_growth_interval`` below the tracker) and the rules follow
    PyTorch from there (they grow only when ``tracker + 1 == growth_interval``, so it
    counts on until a backoff): refused, it would make the drop-in's own
    ``state_dict()`` unloadable."""
    return _int_field(where, value, 0, INT32_MAX)


def _stat_field(where: str, value: object, *, low: float) -> float:
    """A window statistic: exactly a float32, finite, 0 or normal (never subnormal: a
    device that flushes subnormals would read it as 0), and at least ``low``."""
    must = "0.0 or a finite, normal float32" + (" >= 0.0" if low == 0 else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _bad(where, value, must)
    try:
        exact = float(value)
        out = f32(exact)
    except (OverflowError, ValueError):
        raise _bad(where, value, must) from None
    if not (out == 0 or is_normal_f32(abs(out))) or out < low:
        raise _bad(where, value, must)
    if out != exact:
        raise _bad(where, value, f"exactly representable in float32; use {out!r}")
    return 0.0 if out == 0 else out


def _config(where: str, data: object, keys: tuple[str, ...] = _CONFIG_FIELDS) -> ScalerConfig:
    fields = _mapping(where, data)
    if keys is _KEYS[SCHEMA_VERSION][0]:  # the optional keys the current version may hold
        keys = keys + tuple(f for f in _OPTIONAL_CONFIG_FIELDS if f in fields)
    _exact_keys(where, fields, keys)
    try:
        return ScalerConfig(**fields)
    except InvalidConfigError as exc:
        raise InvalidStateError(f"{where}: {exc}") from exc


def _format(data: object) -> str:
    """Which dict ``data`` is: ``"scaler_core"`` (a checkpoint, or anything that is
    not one of the others, for :func:`_checkpoint` to refuse), ``"torch"`` (PyTorch's
    state dict) or ``"dropin"`` (``scaler_core.torch.GradScaler.state_dict()``)."""
    if not isinstance(data, Mapping) or "schema" in data:
        return "scaler_core"
    if TORCH_STATE_KEY in data:
        return "dropin"
    return "torch" if set(data) & set(_TORCH_KEYS) else "scaler_core"


def from_dict(data: Mapping[str, Any], config: ScalerConfig | None = None) -> ScalerState:
    """Rebuild a state from any dict a scaler of this project saves, validating every field.

    A scaler-core checkpoint (:func:`to_dict`; it has a ``"schema"`` key) carries
    its own config; the current version and version 1 are read (version 1 was
    written before spike skipping existed: its config gets spike skipping off, its
    state a fresh window). A ``torch.amp.GradScaler.state_dict()`` gives the
    scale, the factors, the interval and the growth tracker; every other knob
    comes from ``config`` (defaults when omitted), and ``init_scale`` becomes the
    saved scale. A ``scaler_core.torch.GradScaler.state_dict()`` (PyTorch's five
    entries and a checkpoint under :data:`TORCH_STATE_KEY`) is read as that class
    loads it: the checkpoint gives every field, and PyTorch's entries win where
    they are edited (see :func:`with_torch_entries`).

    Raises:
        InvalidStateError: ``data`` is empty (a disabled GradScaler saves ``{}``),
            partial, of another schema or version, wrongly typed, or out of range
            (the message names the key); or ``config`` is given with a dict that
            carries its own (a scaler-core checkpoint, the drop-in's dict).

    >>> from scaler_core import init
    >>> from_dict(to_dict(init())) == init()
    True
    >>> from_dict(to_dict(init(), format="torch")) == init()
    True
    >>> from_dict({**to_dict(init(), format="torch"), "scaler_core": to_dict(init())}) == init()
    True
    """
    kind = _format(data)
    if kind == "torch":
        return from_torch_state_dict(data, config)
    if config is not None:
        what = (
            "a scaler_core checkpoint"
            if kind == "scaler_core"
            else f"a scaler_core.torch.GradScaler.state_dict(), whose {TORCH_STATE_KEY!r} entry"
        )
        raise _bad(
            "config",
            config,
            f"None with {what}, which carries its own config (config= is for a "
            f"torch.amp.GradScaler.state_dict())",
        )
    if kind == "dropin":
        return _from_dropin(data)
    return _checkpoint(data, "checkpoint")


def load_dict(data: Mapping[str, Any], config: ScalerConfig) -> ScalerState:
    """What a scaler whose policy is ``config`` loads from ``data``, as :func:`from_dict`
    reads it: a ``torch.amp.GradScaler.state_dict()`` keeps ``config`` for every knob it
    lacks (PyTorch's four numbers and tracker replace theirs); a dict that carries its
    own config (a scaler-core checkpoint, the drop-in's dict) brings it.

    Raises:
        InvalidStateError: As :func:`from_dict`.
    """
    return from_dict(data, config if _format(data) == "torch" else None)


def _from_dropin(data: Mapping[str, Any]) -> ScalerState:
    """A ``scaler_core.torch.GradScaler.state_dict()``: its checkpoint, then PyTorch's
    entries applied over it (they win), each checked and named by its key."""
    payload = _checkpoint(data[TORCH_STATE_KEY], f"state_dict[{TORCH_STATE_KEY!r}]")
    return with_torch_entries(payload, {k: v for k, v in data.items() if k != TORCH_STATE_KEY})


def _checkpoint(data: object, root: str) -> ScalerState:
    """A scaler-core checkpoint read and checked, its keys named from ``root``."""
    data = _mapping(root, data)
    _exact_keys(root, data, ("schema", "version", "config", "state"))
    if type(data["schema"]) is not str or data["schema"] != SCHEMA:
        raise _bad(f"{root}['schema']", data["schema"], repr(SCHEMA))
    version = data["version"]
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise _bad(
            f"{root}['version']",
            version,
            f"one of {list(READABLE_VERSIONS)} (this scaler-core reads versions up to "
            f"{SCHEMA_VERSION}; upgrade it)",
        )
    config_keys, state_keys = _KEYS[version]
    config = _config(f"{root}['config']", data["config"], config_keys)
    fields = _mapping(f"{root}['state']", data["state"])
    _exact_keys(f"{root}['state']", fields, state_keys)

    def w(key: str) -> str:
        return f"{root}['state'][{key!r}]"

    scale = _scale_field(w("scale"), fields["scale"], config)
    growth = _tracker_field(w("growth_tracker"), fields["growth_tracker"])
    hyst = _int_field(
        w("hysteresis_tracker"), fields["hysteresis_tracker"], 1, config.hysteresis, _HYSTERESIS_WHY
    )
    steps = _int_field(w("steps"), fields["steps"], 0, INT32_MAX)
    skipped = _int_field(w("skipped_steps"), fields["skipped_steps"], 0, steps)
    limit = (
        skipped
        if config.max_consecutive_skips is None
        else min(skipped, config.max_consecutive_skips)
    )
    consec = _int_field(w("consecutive_skips"), fields["consecutive_skips"], 0, limit)
    if not config.dynamic and scale != config.init_scale:
        raise _bad(w("scale"), scale, f"init_scale={config.init_scale!r} for a static config")
    if version == 1:
        return ScalerState(config, scale, growth, hyst, steps, skipped, consec, 0)
    mean = _stat_field(w("norm_mean"), fields["norm_mean"], low=-math.inf)
    var = _stat_field(w("norm_var"), fields["norm_var"], low=0.0)
    count = _int_field(w("norm_count"), fields["norm_count"], 0, config.spike_window)
    kind = fields["last_kind"]
    integral = isinstance(kind, numbers.Integral) and not isinstance(kind, bool)
    if not integral or kind not in LAST_KIND_CODES:
        raise _bad(
            w("last_kind"),
            kind,
            f"0 or the code of a StepKind that does not fail, one of {sorted(LAST_KIND_CODES)}",
        )
    return ScalerState(
        config,
        scale,
        growth,
        hyst,
        steps,
        skipped,
        consec,
        0,
        norm_mean=mean,
        norm_var=var,
        norm_count=count,
        last_kind=int(kind),
    )


def _to_torch(state: ScalerState) -> dict[str, Any]:
    """The state in the format of ``torch.amp.GradScaler.state_dict()``."""
    host = state.to_host()
    cfg = host.config
    return {
        "scale": host.scale,
        "growth_factor": cfg.growth_factor,
        "backoff_factor": cfg.backoff_factor,
        "growth_interval": cfg.growth_interval,
        "_growth_tracker": host.growth_tracker,
    }


def _torch_field(base: ScalerConfig, field: str, key: str, value: Any) -> None:
    """Check one key of a PyTorch state dict as the config field it becomes, by its key."""
    try:
        dataclasses.replace(base, **{field: value})  # validated as the constructor does
    except InvalidConfigError as exc:
        must = str(exc).split(", but it must be ", 1)[-1]
        raise _bad(f"state_dict[{key!r}]", value, must) from exc


def from_torch_state_dict(
    data: Mapping[str, Any], config: ScalerConfig | None = None
) -> ScalerState:
    """A state from ``torch.amp.GradScaler.state_dict()`` (see :func:`from_dict`),
    ``data`` read as that format whatever its keys.

    Raises:
        InvalidStateError: ``data`` is empty (a disabled GradScaler saves
            ``{}``), partial, wrongly typed or out of range.
    """
    data = _mapping("state_dict", data)
    _exact_keys("state_dict", data, _TORCH_KEYS)
    base = ScalerConfig() if config is None else config
    if not isinstance(base, ScalerConfig):
        raise _bad("config", base, "a ScalerConfig or None")
    values = {
        "init_scale": data["scale"],
        "growth_factor": data["growth_factor"],
        "backoff_factor": data["backoff_factor"],
        "growth_interval": data["growth_interval"],
    }
    for field, key in zip(values, _TORCH_KEYS, strict=False):  # each key named as saved
        _torch_field(base, field, key, values[field])
    try:
        cfg = dataclasses.replace(base, **values)
    except InvalidConfigError as exc:  # the keys are fine alone, not together
        raise InvalidStateError(f"state_dict: {exc}") from exc
    growth = _tracker_field("state_dict['_growth_tracker']", data["_growth_tracker"])
    return ScalerState(cfg, cfg.init_scale, growth, cfg.hysteresis, 0, 0, 0, 0)


def with_torch_entries(state: ScalerState, data: Mapping[str, Any]) -> ScalerState:
    """``state`` with the five entries of a ``torch.amp.GradScaler.state_dict()`` applied.

    The rule for a dict holding both (what ``scaler_core.torch.GradScaler.state_dict()``
    saves): PyTorch's entries win, as PyTorch's class loads them, so an edited
    ``scale``, factor, interval or tracker takes effect; ``state`` (the scaler-core
    payload) supplies every other field. Unedited entries give ``state`` back. Each
    entry is validated as :func:`from_dict` validates a PyTorch state dict, against
    ``state``'s config (its bounds, a static scale), before anything is built.

    Raises:
        InvalidStateError: An entry is missing, unknown, wrongly typed or out of range;
            the message names it by its key.
    """
    data = _mapping("state_dict", data)
    _exact_keys("state_dict", data, _TORCH_KEYS)
    base = state.config
    values = {
        "growth_factor": data["growth_factor"],
        "backoff_factor": data["backoff_factor"],
        "growth_interval": data["growth_interval"],
    }
    for field, value in values.items():  # each key named as saved
        _torch_field(base, field, field, value)
    try:
        cfg = dataclasses.replace(base, **values)
    except InvalidConfigError as exc:  # the keys are fine alone, not together
        raise InvalidStateError(f"state_dict: {exc}") from exc
    cfg = base if cfg == base else cfg
    where = "state_dict['scale']"
    scale = _scale_field(where, data["scale"], cfg)
    if not cfg.dynamic and scale != cfg.init_scale:
        raise _bad(where, data["scale"], f"init_scale={cfg.init_scale!r} for a static config")
    growth = _tracker_field("state_dict['_growth_tracker']", data["_growth_tracker"])
    return dataclasses.replace(state, config=cfg, scale=scale, growth_tracker=growth)
