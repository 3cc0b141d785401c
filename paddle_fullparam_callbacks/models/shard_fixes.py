"""Sharded state dicts that contradict the layers holding the parameters: corrected, or refused.

A model's ``sharded_state_dict()`` says, for every parameter, which block of which global tensor
this rank holds. The exporter trusts it. Some models get it wrong for tensor-parallel parameters:
PaddleNLP 2.8.1's ``LlamaLMHead`` (the LM head of a vocab-parallel ``ParallelCrossEntropy`` model)
is a plain ``nn.Layer`` whose ``weight`` is ``[hidden, vocab / tp]`` on every mp rank, marked by
PaddleNLP with ``is_distributed=True`` and ``split_axis=1``, but it has no ``sharded_state_dict``
override, so Paddle's generic ``Layer.sharded_state_dict`` reports it as a replicated
``[hidden, vocab / tp]`` tensor at ``[0, 0]`` on every rank. The ranks' different halves then look
like replicas that disagree, and the export refuses.

The rule (:func:`resolve_shard`, pure, no Paddle needed)
------------------------------------------------------
Only parameters Paddle marks ``is_distributed`` in a job whose model-parallel (mp) group has
more than one rank are examined; everything else stands as the model reports it. The split axis
must be *proven*, from any of:

* the parameter's ``split_axis`` attribute (Paddle's mp layers and PaddleNLP's LM heads set it
  together with ``is_distributed``);
* the class of the layer that owns the parameter (:data:`LAYER_SPLIT_AXES`: Paddle's
  ``VocabParallelEmbedding`` weight 0, ``ColumnParallelLinear`` weight 1 / bias 0,
  ``RowParallelLinear`` weight 0, their sequence-parallel variants, PaddleNLP's ``LlamaLMHead``
  weight 1), looked up along the class's MRO and only for classes defined by Paddle,
  PaddleNLP or PaddleFormers;
* the framework's own checkpoint split actions (``_get_tensor_parallel_mappings(config,
  is_split=True)``: ``is_column=True`` splits the last axis, ``False`` axis 0).

A parameter marked ``is_distributed`` with none of these (expert-parallel experts are marked so,
and their entries are right) is left alone. Then, with ``axis`` the proven axis, ``n`` the mp
degree and ``r`` this rank's mp rank, the parameter's true place is global shape ``local`` with
``local[axis] * n`` along ``axis``, at offset ``r * local[axis]`` along ``axis`` (Paddle's mp
layers and PaddleNLP's split functions give rank ``r`` the ``r``-th equal block):

* the dict already says that: it stands;
* the dict says the parameter is whole (global == local, "replicated"), or gives the right global
  shape at a wrong offset, and every piece of evidence agrees on the axis and on the degree
  (a layer's ``world_size``, its config's ``tensor_parallel_degree``): corrected, with a warning;
* anything else (the marks disagree on the axis, a layer says it is split over another number of
  ranks, the dict gives a third global shape): :class:`ShardLayoutError`, naming the parameter, what
  the dict says and what the marks say.

The thin layer (:func:`fix_sharded_state_dict`, :func:`fixed_sharded_state_dict`) reads these
facts from the live model: the mp group from fleet's hybrid communicate group (the group Paddle's
own ``make_tp_sharded_weight_for_checkpoint`` uses), the owning layer by parameter identity.

The decisions depend only on facts every rank of an mp group shares (local and reported global
shapes, marks, degree), so a refusal is raised on every rank of the mp group that holds the
parameter, and at ``on_train_begin`` (the callback's first planning), before training starts.
With pipeline parallelism the ranks of other stages do not hold that parameter and go on into the
planning's first collective; the job stops when the refusing ranks exit (on CPU/gloo the waiting
rank's collective fails at once and ``paddle.distributed.launch`` exits with status 1), or after
``export.timeout_s``.
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..assemble.mapping import MappingError

logger = logging.getLogger("paddle_fullparam_callbacks")

# class name -> {parameter attribute: split axis}, for classes of these packages only
LAYER_SPLIT_AXES: Dict[str, Dict[str, int]] = {
    "VocabParallelEmbedding": {"weight": 0},
    "ColumnParallelLinear": {"weight": 1, "bias": 0},
    "ColumnSequenceParallelLinear": {"weight": 1, "bias": 0},
    "RowParallelLinear": {"weight": 0},
    "RowSequenceParallelLinear": {"weight": 0},
    # PaddleNLP 2.8.1 llama/modeling.py: weight [hidden, vocab / tp], is_distributed and split_axis=1
    # when vocab % tp == 0 (whatever tensor_parallel_output says: that only decides whether the
    # logits are gathered); no sharded_state_dict override
    "LlamaLMHead": {"weight": 1},
}
_TRUSTED_PACKAGES = ("paddle", "paddlenlp", "paddleformers")


class ShardLayoutError(MappingError):
    """A sharded state dict entry contradicts the layer that holds the parameter, and the
    contradiction cannot be resolved with certainty."""


@dataclass(frozen=True)
class ShardFix:
    """A corrected entry: what the dict said, what the parameter's layer proves."""

    key: str
    local_shape: Tuple[int, ...]
    reported_global_shape: Tuple[int, ...]
    reported_offset: Tuple[int, ...]
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    axis: int
    mp_rank: int
    mp_degree: int
    evidence: Tuple[str, ...] = field(default=())

    def describe(self) -> str:
        said = _said(self.local_shape, self.reported_global_shape, self.reported_offset, self.mp_rank)
        return (f"parameter {self.key!r}: sharded_state_dict says {said}, but the parameter is split over "
                f"{self.mp_degree} ranks along axis {self.axis} ({'; '.join(self.evidence)}): "
                f"exported as global {list(self.global_shape)} at {list(self.global_offset)} (mp rank {self.mp_rank})")


def _said(local, glob, off, mp_rank) -> str:
    where = "on every mp rank" if tuple(glob) == tuple(local) and not any(off) else f"on mp rank {mp_rank}"
    return f"global {list(glob)} at {list(off)} {where}"


def resolve_shard(key: str, local_shape: Sequence[int], global_shape: Sequence[int], global_offset: Sequence[int],
                  is_distributed: bool, split_axis: Optional[int], mp_rank: int, mp_degree: int, *,
                  layer_axes: Optional[Mapping[str, int]] = None, framework_axes: Optional[Mapping[str, int]] = None,
                  degrees: Optional[Mapping[str, int]] = None) -> Optional[ShardFix]:
    """The corrected place of one sharded-state-dict entry, ``None`` when it stands; raises
    :class:`ShardLayoutError` when it contradicts the parameter's marks beyond certain repair.

    ``split_axis``: the parameter's own attribute (``None`` if unset). ``layer_axes``: {"layer
    LlamaLMHead": 1, ...}, the axis the owning layer's class splits this parameter on.
    ``framework_axes``: {"paddlenlp split action (is_column=True)": 1}. ``degrees``: {"layer
    world_size": 2, ...}, what the layer or its config say about the number of ranks it is split over.
    """
    local = tuple(int(d) for d in local_shape)
    glob = tuple(int(d) for d in global_shape)
    off = tuple(int(d) for d in global_offset)
    if not is_distributed or mp_degree <= 1:
        return None
    ndim = len(local)
    said = _said(local, glob, off, mp_rank)
    marks: Dict[str, int] = {}
    if split_axis is not None:
        marks[f"split_axis={split_axis}"] = int(split_axis)
    for label, ax in (layer_axes or {}).items():
        marks[label] = int(ax)
    paddle_marks = dict(marks)  # Paddle's own marks: the attribute and the layer class
    for label, ax in (framework_axes or {}).items():
        marks[label] = int(ax)
    if not marks:
        return None  # is_distributed alone does not say "split over the mp group" (expert parallelism marks experts so)
    evidence = ("is_distributed=True",) + tuple(label if label.startswith("split_axis=") else f"{label}: axis {ax}"
                                                for label, ax in marks.items())
    listing = "; ".join(evidence)

    def refuse(why: str):
        raise ShardLayoutError(f"parameter {key!r}: sharded_state_dict says {said}, but the parameter is split over "
                               f"{mp_degree} ranks ({listing}): {why}; refusing to export it")

    if len(glob) != ndim or len(off) != ndim:
        refuse(f"the dict's global shape has {len(glob)} dimensions and the local tensor {ndim}")
    if not 0 <= mp_rank < mp_degree:
        refuse(f"mp rank {mp_rank} is outside the mp group of {mp_degree}")
    bad = {label: ax for label, ax in marks.items() if not -ndim <= ax < ndim}
    if bad:
        refuse(f"{', '.join(bad)} names an axis outside the {ndim}-d tensor")
    norm = {label: ax % ndim for label, ax in marks.items()}

    def layout(axis: int):
        g, o = list(local), [0] * ndim
        g[axis] = local[axis] * mp_degree
        o[axis] = mp_rank * local[axis]
        return tuple(g), tuple(o)

    paddle_axes = {norm[label] for label in paddle_marks}
    if len(paddle_axes) == 1 and (glob, off) == layout(next(iter(paddle_axes))):
        return None  # the dict says what Paddle's marks say
    axes = set(norm.values())
    if len(axes) > 1:
        refuse("the marks disagree on the split axis, so its global shape cannot be known")
    axis = axes.pop()
    other = {label: n for label, n in (degrees or {}).items() if int(n) != mp_degree}
    if other:
        refuse("; ".join(f"{label} says {n} ranks" for label, n in other.items())
               + f", the model-parallel group has {mp_degree}")
    want_g, want_o = layout(axis)
    if (glob, off) == (want_g, want_o):
        return None
    if glob not in (local, want_g):
        refuse(f"along axis {axis} that makes global {list(want_g)} at {list(want_o)}, and the dict's global shape is "
               "neither that nor the local shape")
    return ShardFix(key, local, glob, off, want_g, want_o, axis, mp_rank, mp_degree, evidence)


# ---- the live model ---------------------------------------------------------------------------

def mp_coordinates() -> Tuple[int, int]:
    """(this rank's mp rank, the mp degree) from fleet's hybrid communicate group; (0, 1) without one."""
    try:
        from paddle.distributed.fleet.base import topology as tp
    except Exception:  # pragma: no cover - Paddle without fleet
        return 0, 1
    hcg = getattr(tp, "_HYBRID_PARALLEL_GROUP", None)
    if hcg is None:
        return 0, 1
    return int(hcg.get_model_parallel_rank()), int(hcg.get_model_parallel_world_size())


def _trusted(cls) -> bool:
    return (getattr(cls, "__module__", "") or "").split(".")[0] in _TRUSTED_PACKAGES


def _owners(model) -> Dict[int, Tuple[object, str]]:
    """{id(parameter): (the layer holding it, its attribute name)}."""
    out: Dict[int, Tuple[object, str]] = {}
    for _, layer in model.named_sublayers(include_self=True):
        for attr, p in layer.named_parameters(include_sublayers=False):
            out.setdefault(id(p), (layer, attr))
    return out


def layer_split_axis(layer, attr: str) -> Optional[Tuple[str, int]]:
    """("layer ClassName", axis) when the layer's class (or a Paddle/PaddleNLP/PaddleFormers base
    class) is known to split ``attr`` over the mp group, else None."""
    for cls in type(layer).__mro__:
        table = LAYER_SPLIT_AXES.get(cls.__name__)
        if table is not None and _trusted(cls):
            if attr in table:
                return f"layer {type(layer).__name__}", table[attr]
            return None
    return None


def _layer_degrees(layer) -> Dict[str, int]:
    out = {}
    ws = getattr(layer, "world_size", None)
    if isinstance(ws, int) and not isinstance(ws, bool):
        out[f"layer {type(layer).__name__} world_size"] = ws
    cfg = getattr(layer, "config", None)
    tpd = getattr(cfg, "tensor_parallel_degree", None) if cfg is not None else None
    if isinstance(tpd, int) and not isinstance(tpd, bool) and tpd > 0:
        out[f"layer {type(layer).__name__} config.tensor_parallel_degree"] = tpd
    return out


def framework_split_axes(model) -> Callable[[str, int], Optional[Tuple[str, int]]]:
    """A lookup ``(key, ndim) -> (label, axis)`` from the framework's own checkpoint split actions
    (PaddleNLP / PaddleFormers ``_get_tensor_parallel_mappings(config, is_split=True)``), or one
    that always answers None."""
    fn = getattr(type(model), "_get_tensor_parallel_mappings", None)
    config = getattr(model, "config", None)
    degree = getattr(config, "tensor_parallel_degree", None) if config is not None else None
    actions: Dict[str, object] = {}
    if callable(fn) and isinstance(degree, int) and degree > 1:
        try:
            actions = dict(fn(config, is_split=True) or {})
        except Exception as e:  # a framework version with another signature: no evidence from it
            logger.debug("%s._get_tensor_parallel_mappings failed: %s", type(model).__name__, e)
    prefix = getattr(model, "base_model_prefix", "") or ""
    framework = (type(model).__module__ or "").split(".")[0]

    def lookup(key: str, ndim: int):
        names = [key]
        if prefix and key.startswith(prefix + "."):
            names.append(key[len(prefix) + 1:])
        for name in names:
            kw = getattr(actions.get(name), "keywords", None)
            if isinstance(kw, dict) and isinstance(kw.get("is_column"), bool):
                return (f"{framework} split action (is_column={kw['is_column']})",
                        ndim - 1 if kw["is_column"] else 0)
        return None

    return lookup


def fix_sharded_state_dict(model, sharded_state_dict: Mapping, mp_rank: Optional[int] = None,
                           mp_degree: Optional[int] = None, _framework=None) -> Tuple[dict, List[ShardFix]]:
    """The model's sharded state dict with every entry that contradicts its parameter's layer
    corrected (:func:`resolve_shard`), and the corrections; raises :class:`ShardLayoutError` for a
    contradiction that cannot be resolved. ``mp_rank``/``mp_degree`` default to fleet's mp group.
    Entries are copied, never changed in place; the dict is returned as is when nothing changes."""
    if mp_rank is None or mp_degree is None:
        r, n = mp_coordinates()
        mp_rank = r if mp_rank is None else mp_rank
        mp_degree = n if mp_degree is None else mp_degree
    if mp_degree <= 1:
        return dict(sharded_state_dict), []
    candidates = [k for k, sw in sharded_state_dict.items()
                  if getattr(sw.local_tensor, "is_distributed", False) is True and not getattr(sw, "is_flattened", False)]
    if not candidates:
        return dict(sharded_state_dict), []
    owners = _owners(model)
    framework = _framework or framework_split_axes(model)
    out = dict(sharded_state_dict)
    fixes: List[ShardFix] = []
    for key in candidates:
        sw = sharded_state_dict[key]
        t = sw.local_tensor
        local = tuple(int(d) for d in sw.local_shape)
        layer_axes, degrees = {}, {}
        owner = owners.get(id(t))
        if owner is not None:
            found = layer_split_axis(*owner)
            if found is not None:
                layer_axes[found[0]] = found[1]
                degrees.update(_layer_degrees(owner[0]))
        fw = framework(key, len(local))
        split_axis = getattr(t, "split_axis", None)
        fix = resolve_shard(key, local, sw.global_shape, sw.global_offset, True,
                            None if split_axis is None else int(split_axis), mp_rank, mp_degree,
                            layer_axes=layer_axes, framework_axes=dict([fw]) if fw else None, degrees=degrees)
        if fix is not None:
            new = copy.copy(sw)
            new.global_shape = fix.global_shape
            new.global_offset = fix.global_offset
            out[key] = new
            fixes.append(fix)
    return out, fixes


def fixed_sharded_state_dict(model, read: Optional[Callable[[], dict]] = None) -> Callable[[], dict]:
    """``model.sharded_state_dict`` (or ``read``) routed through :func:`fix_sharded_state_dict`
    (what the exporter calls at every export); each corrected parameter is logged once."""
    logged = set()
    cache: Dict[str, object] = {}
    read = read or model.sharded_state_dict

    def sharded_state_dict() -> dict:
        sd = read()
        r, n = mp_coordinates()
        if n <= 1:
            return sd
        if "framework" not in cache:
            cache["framework"] = framework_split_axes(model)
        fixed, fixes = fix_sharded_state_dict(model, sd, r, n, _framework=cache["framework"])
        for f in fixes:
            if f.key not in logged:
                logged.add(f.key)
                logger.warning("%s", f.describe())
        return fixed

    sharded_state_dict.fixes_logged = logged  # for tests and diagnostics
    return sharded_state_dict


__all__ = ["LAYER_SPLIT_AXES", "ShardFix", "ShardLayoutError", "fix_sharded_state_dict", "fixed_sharded_state_dict",
           "framework_split_axes", "layer_split_axis", "mp_coordinates", "resolve_shard"]
