"""LoRA layers of PaddleFormers 1.2 and PaddleNLP 2.8 models: found, checked, and read at export time.

Both frameworks wrap a model in ``LoRAModel`` (``.model`` is the base model object) and replace each
targeted ``nn.Linear`` in place by a ``LoRALinear`` (``ColumnParallelLoRALinear`` /
``RowParallelLoRALinear`` under tensor parallelism, ``*SequenceParallel*`` variants) that keeps the
original ``weight`` ``[in, out]`` and adds ``lora_A [in, r]``, ``lora_B [r, out]`` and a float
``scaling`` (``alpha / r``, ``alpha / sqrt(r)`` with rslora, 1 with PaddleNLP's PiSSA). Its forward
is ``x @ W + (x @ A @ B) * scaling`` unless the layer is ``merged`` (``W`` already holds the update:
PaddleFormers' ``merge()``, PaddleNLP's ``merge_weights`` after ``eval()``) or, in PaddleFormers,
``disable_lora`` is set; PaddleNLP's PiSSA layers rewrite ``W`` into a residual at their first forward
(``apply_pissa``), and until then compute ``x @ W``. What a layer computes *now* is what it exports.

Other LoRA layer classes (PaddleNLP's ``LoRAMergedLinear``, convolutions, MoE experts, quantized and
PaddleFleet variants) follow other rules: a model holding one is refused, naming it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from ...assemble.mapping import MappingError

_FRAMEWORKS = ("paddleformers", "paddlenlp")
# classes whose forward is x @ W + (x @ A @ B) * scaling over their own local blocks
SUPPORTED = ("LoRALinear", "ColumnParallelLoRALinear", "RowParallelLoRALinear",
             "ColumnSequenceParallelLoRALinear", "RowSequenceParallelLoRALinear")


class LoraError(MappingError):
    """A LoRA model the exporter cannot export as asked; nothing was written."""


def _framework(obj) -> Optional[str]:
    root = type(obj).__module__.split(".")[0]
    return root if root in _FRAMEWORKS else None


def is_lora_wrapper(model) -> bool:
    """A framework's ``LoRAModel`` (its ``.model`` is the base model)."""
    return (type(model).__name__ == "LoRAModel" and _framework(model) is not None
            and ".peft" in type(model).__module__ and getattr(model, "model", None) is not None)


def _is_lora_class(layer) -> bool:
    return "LoRA" in type(layer).__name__ and ".peft" in type(layer).__module__


@dataclass
class LoraLayer:
    """One LoRA layer of the model and the keys of its tensors in the sharded state dict."""

    name: str  # the layer's name under the base model (named_sublayers)
    layer: object
    weight_key: str = ""
    a_key: str = ""
    b_key: str = ""

    @property
    def r(self) -> int:
        return int(self.layer.r)

    @property
    def alpha(self) -> float:
        return self.layer.lora_alpha

    @property
    def scaling(self) -> float:
        return float(self.layer.scaling)

    def state(self) -> str:
        """``active`` (the update applies), ``merged`` (W holds it), ``disabled`` (PaddleFormers'
        disable_lora) or ``pissa_pending`` (PaddleNLP PiSSA before its first forward: computes x @ W)."""
        if getattr(self.layer, "merged", False):
            return "merged"
        if getattr(self.layer, "disable_lora", False):
            return "disabled"
        if getattr(self.layer, "pissa", False) and not getattr(self.layer, "apply_pissa", True):
            return "pissa_pending"
        return "active"

    @property
    def pissa(self) -> bool:
        return bool(getattr(self.layer, "pissa", False))


def find_lora_layers(model) -> List[LoraLayer]:
    """Every LoRA layer of ``model`` (the base model, or the ``LoRAModel`` wrapping it); a
    :class:`LoraError` naming the first layer of a class this package cannot merge."""
    if is_lora_wrapper(model):
        model = model.model
    found, unsupported = [], []
    for name, layer in model.named_sublayers():
        if not _is_lora_class(layer):
            continue
        cls = type(layer).__name__
        if cls not in SUPPORTED or not all(hasattr(layer, a) for a in ("lora_A", "lora_B", "weight", "scaling", "r")):
            unsupported.append((name, f"{type(layer).__module__}.{cls}"))
            continue
        found.append(LoraLayer(name, layer))
    if unsupported:
        name, cls = unsupported[0]
        more = f" (and {len(unsupported) - 1} more)" if len(unsupported) > 1 else ""
        raise LoraError(
            f"LoRA layer {name!r} is a {cls}{more}: the exporter merges {', '.join(SUPPORTED)} only "
            "(x @ W + (x @ lora_A @ lora_B) * scaling); merge the model yourself and export the merged base model")
    for lay in found:
        a, b, w = lay.layer.lora_A, lay.layer.lora_B, lay.layer.weight
        if len(w.shape) != 2 or len(a.shape) != 2 or len(b.shape) != 2 or a.shape[1] != lay.r or b.shape[0] != lay.r:
            raise LoraError(f"LoRA layer {lay.name!r}: weight {list(w.shape)}, lora_A {list(a.shape)}, lora_B "
                            f"{list(b.shape)} do not fit r={lay.r} (expected W [in, out], A [in, r], B [r, out])")
    return found


def attach_keys(layers: List[LoraLayer], sharded_state_dict) -> None:
    """Each layer's weight, lora_A and lora_B keys, found by tensor identity (pipeline stages rename)."""
    by_id: Dict[int, str] = {id(sw.local_tensor): k for k, sw in sharded_state_dict.items()}
    for lay in layers:
        keys = [by_id.get(id(getattr(lay.layer, a))) for a in ("weight", "lora_A", "lora_B")]
        if None in keys:
            missing = [a for a, k in zip(("weight", "lora_A", "lora_B"), keys) if k is None]
            raise LoraError(f"LoRA layer {lay.name!r}: its {missing} are not in the model's sharded_state_dict()")
        lay.weight_key, lay.a_key, lay.b_key = keys


def lora_config_of(model) -> dict:
    """The wrapper's ``LoRAConfig`` fields that describe the run (empty for a bare base model)."""
    cfg = getattr(model, "lora_config", None) if is_lora_wrapper(model) else None
    out = {}
    for key in ("r", "lora_alpha", "rslora", "pissa", "target_modules", "base_model_name_or_path", "lora_dropout"):
        v = getattr(cfg, key, None) if cfg is not None else None
        if v is not None:
            out[key] = list(v) if isinstance(v, (list, tuple)) else v
    return out


def describe(layers, states: dict, config: dict, framework: str, mode: str) -> dict:
    """The manifest's ``model.lora``: what was exported, with which r, alpha and scaling, the layers' states."""
    one = lambda values: values[0] if len(set(values)) == 1 else sorted(set(values))  # noqa: E731
    out = {"export": "merged" if mode == "merge" else "base weights", "framework": framework, "layers": len(layers)}
    if layers:
        out.update(r=one([lay.r for lay in layers]), lora_alpha=one([lay.alpha for lay in layers]),
                   scaling=one([lay.scaling for lay in layers]))
    out.update({k: v for k, v in config.items() if k in ("rslora", "pissa", "target_modules")})
    out["targets"] = sorted({lay.name.rsplit(".", 1)[-1] for lay in layers})
    out["states"] = dict(sorted(states.items()))
    return out


__all__ = ["LoraError", "describe", "LoraLayer", "SUPPORTED", "attach_keys", "find_lora_layers", "is_lora_wrapper",
           "lora_config_of"]
