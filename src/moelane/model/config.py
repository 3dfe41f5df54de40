"""Typed model configs: the `config.json` keys a family reads, their defaults and their checks, read once at load.

A family's config is a `@dataclass(frozen=True, slots=True, kw_only=True)` subclass of `Config` whose fields are the
keys it reads, as mlx-lm's `ModelArgs` are: `from_dict` reads each field from the key of its name (or from the first
of the keys `key(...)` lists that is there), gives it its default where the key is absent or null (`keep_null`: a
null stays None, where transformers reads null as "none"), ignores every other key, and checks each value against
the field's type and `low` bound, raising one line that names the key. A family's `check()` then checks what relates
keys to each other. Nothing reads config.json after that.

The keys every family reads are declared once, here, with the default most families' transformers configs give them;
a family whose transformers default differs redeclares the field with its own, once. `n_experts`, `top_k` and
`expert_width` are every MoE family's, under the keys it spells them with; `dense_width` is the dense layers' MLP.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass
from typing import Any, Self

from moelane.errors import ModelLoadError
from moelane.model.rope import Rope, rope_parameters

ACTIVATIONS = ("silu", "swish")  # every family's MLPs and experts are SwiGLU
WINDOW = "a positive number of positions"  # what a `sliding_window` must be


def key(
    *names: str, default: Any = MISSING, keep_null: bool = False, low: float | None = None, what: str | None = None
) -> Any:
    """A config field read from the first of `names` (none: the field's own name) that config.json has, not null;
    `default` where it has none (none given: required). `keep_null`: a null is read as None rather than the default.
    `low`: the least value allowed; `what`: how an error says what the value must be."""
    return dataclasses.field(default=default, metadata=dict(names=names, keep_null=keep_null, low=low, what=what))


def fixed(default: Any) -> Any:
    """A field config.json does not set: the family says what it is (a dense family's `n_experts`: 0)."""
    return dataclasses.field(default=default, metadata=dict(fixed=True))


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """The keys every family reads. Subclasses add theirs and override `check`, `moe_layers` and, where the releases
    need it, `prepare` (the family's `build` then reads nothing but these fields)."""

    model_type: str
    vocab_size: int = key(low=1)
    hidden_size: int = key(low=1)
    num_hidden_layers: int = key(low=1)
    num_attention_heads: int = key(low=1)
    num_key_value_heads: int | None = key(default=None, low=1)  # None: as many as the query heads (no GQA)
    head_dim: int | None = key(default=None, low=1)  # None: hidden_size / num_attention_heads
    hidden_act: str = "silu"
    rms_norm_eps: float = key(default=1e-6, low=0)
    max_position_embeddings: int = key(default=2048, low=1)
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_parameters: dict[str, Any] | None = None  # transformers 5's place for theta and scaling
    rope_scaling: dict[str, Any] | None = None  # transformers 4's
    original_max_position_embeddings: int | None = key(default=None, low=1)  # (Phi-3's place for it)
    quantization_config: dict[str, Any] | None = None
    dtype: str | None = key("dtype", "torch_dtype", default=None)  # the checkpoint's (transformers 4: torch_dtype)
    moelane_compute_dtype: str | None = None  # the dtype the shipped models are meant to run in
    dense_width: int | None = key("intermediate_size", default=None, low=1)  # the dense layers' MLP
    n_experts: int = fixed(0)
    top_k: int | None = fixed(None)
    expert_width: int | None = fixed(None)

    def __post_init__(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(f"unsupported hidden_act {self.hidden_act!r} (supported: silu)")
        if self.n_experts > 0 and (self.top_k is None or not 1 <= self.top_k <= self.n_experts):
            name = keys_of(type(self))["top_k"][0]
            raise ModelLoadError(f"{name} must be 1 to the {self.n_experts} experts, got {self.top_k}")
        moe_layers = self.moe_layers()
        if moe_layers and self.expert_width is None:
            raise self.missing("expert_width")
        if len(moe_layers) < self.num_hidden_layers and self.dense_width is None:
            raise self.missing("dense_width")
        self.check()

    def check(self) -> None:
        """What a family checks beyond each value's type and bound (one line per problem: ModelLoadError)."""

    def moe_layers(self) -> list[int]:
        """The layers whose feed-forward block is MoE: by default every layer, where there are experts."""
        return list(range(self.num_hidden_layers)) if self.n_experts > 0 else []

    @property
    def k(self) -> int:
        """`top_k`, of a config with experts (where it is checked to be there)."""
        assert self.top_k is not None
        return self.top_k

    @property
    def moe_width(self) -> int:
        """`expert_width`, of a config with MoE layers (where it is checked to be there)."""
        assert self.expert_width is not None
        return self.expert_width

    @property
    def n_kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        """Each attention head's width: `head_dim`, or hidden_size / num_attention_heads."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def rope(self, dim: int | None = None) -> Rope:
        """The rotary embedding of `rope_params()` over `dim` dims of each head (None: all `head_size` of them)."""
        return Rope.build(self.rope_params(), dim or self.head_size, self.max_position_embeddings)

    def rope_params(self) -> dict[str, Any]:
        """rope_theta and the scaling, wherever config.json keeps them (`rope.rope_parameters`)."""
        keys = ("rope_parameters", "rope_scaling", "original_max_position_embeddings")
        return rope_parameters({name: getattr(self, name) for name in keys}, self.rope_theta)

    def missing(self, name: str) -> ModelLoadError:
        """The error for a field the config needs but has no value for (named by its first key)."""
        return missing(self.model_type, keys_of(type(self))[name][0])

    @classmethod
    def prepare(cls, d: Mapping[str, Any]) -> Mapping[str, Any]:
        """config.json's object as `from_dict` reads it: a family whose releases nest or spell keys otherwise than
        its fields says how here."""
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Self:
        """The config of config.json's object `d` (unknown keys ignored); ModelLoadError, one line, for a missing
        required key or a value of the wrong type or range."""
        d = cls.prepare(d)
        model_type = str(d.get("model_type"))
        values: dict[str, Any] = {"model_type": model_type}
        hints, keys = typing.get_type_hints(cls), keys_of(cls)
        for f in dataclasses.fields(cls):
            names = keys.get(f.name)
            if names is None:  # (model_type, and what the family fixes)
                continue
            found = next((name for name in names if d.get(name) is not None), None)
            if found is None:
                if f.metadata.get("keep_null") and any(name in d for name in names):
                    values[f.name] = None
                elif f.default is MISSING and f.default_factory is MISSING:
                    raise missing(model_type, names[0])
                continue
            values[f.name] = checked(model_type, found, d[found], hints[f.name], f.metadata)
        return cls(**values)

    @classmethod
    def keys(cls) -> dict[str, tuple[str, ...]]:
        """Each field read from config.json, and the keys it is read from (in order of precedence)."""
        return dict(keys_of(cls))

    @classmethod
    def required(cls) -> list[str]:
        """The keys config.json must have (the first spelling of each)."""
        by_name = {f.name: f for f in dataclasses.fields(cls)}
        return [names[0] for name, names in keys_of(cls).items()
                if by_name[name].default is MISSING and by_name[name].default_factory is MISSING]  # fmt: skip


def missing(model_type: str, name: str) -> ModelLoadError:
    return ModelLoadError(f"config.json is missing or has a bad value for {name!r} ({model_type} needs it)")


def keys_of(cls: type[Config]) -> dict[str, tuple[str, ...]]:
    """Each field read from config.json -> the keys it is read from."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.name != "model_type" and not f.metadata.get("fixed"):
            out[f.name] = tuple(f.metadata.get("names") or (f.name,))
    return out


def checked(model_type: str, name: str, value: Any, hint: Any, meta: Mapping[str, Any]) -> Any:
    """`value` if it has the type `hint` (ints taken as floats where floats are asked for) and is at least the
    field's `low`; else ModelLoadError naming the key."""
    ok, value = conforms(value, hint)
    low = meta.get("low")
    if ok and low is not None and isinstance(value, int | float) and value < low:
        ok = False
    if not ok:
        what = meta.get("what") or describe(hint, low)
        raise ModelLoadError(f"config.json: {model_type} {name} must be {what}, got {value!r}")
    return value


def conforms(value: Any, hint: Any) -> tuple[bool, Any]:
    """(whether `value` is of type `hint`, the value as the field keeps it)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        for arg in args:
            ok, kept = conforms(value, arg)
            if ok:
                return True, kept
        return False, value
    if hint is Any:
        return True, value
    if hint is type(None):
        return value is None, value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return number, float(value) if number else value
    if hint is str:
        return isinstance(value, str), value
    if origin is list:
        return isinstance(value, list) and all(conforms(v, args[0])[0] for v in value), value
    if origin is dict:
        return isinstance(value, dict), value
    raise TypeError(f"config field type {hint!r} is not one `from_dict` checks")


def describe(hint: Any, low: float | None = None) -> str:
    bound = "" if low is None else f" >= {low:g}"
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return " or ".join(describe(a, low) for a in args)
    if hint is int:
        return f"a whole number{bound}"
    if hint is float:
        return f"a number{bound}"
    names: dict[Any, str] = {bool: "true or false", str: "a string", dict: "an object"}
    if typing.get_origin(hint) is list:
        return f"a list of {describe(args[0]).removeprefix('a ')}s" if args and args[0] is not Any else "a list"
    return names.get(typing.get_origin(hint) or hint, str(hint))
