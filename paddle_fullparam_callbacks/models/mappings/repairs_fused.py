"""Framework mappings that split a fused Linear weight in the wrong layout, repaired.

Paddle's ``nn.Linear`` holds its weight as ``[in, out]``, torch's as ``[out, in]``. A fused weight
(q/k/v, gate/up) is fused along Paddle's output axis, and the split macros (``fused_qkv``,
``fused_ffn``) cut it there: a right mapping splits the Paddle tensor first and transposes each
part (PaddleFormers 1.2's Qwen2, Qwen2.5-VL, Qwen3-VL do). A survey of every PaddleFormers 1.2 class
that defines ``_gen_inv_aoa_config`` finds two other forms, both wrong, both repaired here:

- **transpose, then split**: ``X^T -> A, B, fused_ffn`` or ``X^T -> Q, K, V, fused_qkv, ...``
  (Glm4v-MoE's attention and dense MLP: q/k/v of shape [128, 32] instead of [64, 64]), and the
  one-destination ``X^T -> X, fused_ffn`` (Phi3: right on one process, its gate/up halves in the
  wrong order under tensor parallelism). Rewritten as the split of ``X`` followed by one
  ``D^T -> D`` per destination;
- **split, never transposed**: ``X -> A, B, fused_ffn`` where no statement transposes ``A`` or
  ``B`` and ``X`` is the weight of a ``paddle.nn.Linear`` of the model (Glm4v-MoE's shared and
  routed experts: exported as Paddle ``[in, out]``). One ``D^T -> D`` per destination is added.

A plain split of a transposed tensor (``X^T -> A, B, axis=1``, no macro) names its axis and is left
as written. A destination named with placeholders (``$LAYER_ID``, ``$EXPERT_ID``) gets its transposes written
for every source the pattern matches in this model (AOAEngine expands placeholders from the source
names only, and a destination is not a source).
"""
from __future__ import annotations

import re
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

_PLACEHOLDER = re.compile(r"\$([A-Z_]+)")
_SPLIT_MACROS = ("fused_qkv", "fused_ffn")


class _Statement:
    """One AOA statement, parsed as far as these repairs need: ``source[^T] -> names, tags``."""

    def __init__(self, text: str):
        self.text = text
        left, right = text.split("->", 1)
        self.source = left.strip()
        self.transposed = self.source.endswith("^T")
        if self.transposed:
            self.source = self.source[:-2].strip()
        tokens = [t.strip() for t in right.split(",") if t.strip()]
        self.names = [t for t in tokens if "=" not in t and "." in t]
        self.tags = [t for t in tokens if t not in self.names]

    @property
    def single_source(self) -> bool:
        return "," not in self.source and " " not in self.source and bool(self.source)

    @property
    def macro(self) -> bool:
        return any(t in _SPLIT_MACROS for t in self.tags)

    @property
    def is_split(self) -> bool:
        """A split of one tensor by a fused macro (any number of destinations) or into several by axis=."""
        return self.single_source and bool(self.names) and (self.macro or len(self.names) > 1)

    def rewritten(self) -> str:
        """The statement without the transpose of its source, in the framework's spelling."""
        return f"{self.source} -> {', '.join(self.names + self.tags)}"


def _pattern(name: str) -> Tuple[re.Pattern, List[str]]:
    """A regex for a name with placeholders (each a run of digits) and the placeholders in order."""
    names = _PLACEHOLDER.findall(name)
    seen: Set[str] = set()
    parts, pos = [], 0
    for m in _PLACEHOLDER.finditer(name):
        parts.append(re.escape(name[pos:m.start()]))
        key = m.group(1)
        parts.append(f"(?P={key})" if key in seen else f"(?P<{key}>\\d+)")
        seen.add(key)
        pos = m.end()
    parts.append(re.escape(name[pos:]))
    return re.compile("^" + "".join(parts) + "$"), names


def _instances(stmt: _Statement, sources: Iterable[str]) -> List[Dict[str, str]]:
    """The placeholder values of every source of this model the statement's source names."""
    if not _PLACEHOLDER.search(stmt.source):
        return [{}] if stmt.source in sources else []
    rx, _ = _pattern(stmt.source)
    found = {tuple(sorted(m.groupdict().items())) for m in map(rx.match, sources) if m}
    return [dict(v) for v in sorted(found, key=lambda kv: [(k, int(x)) for k, x in kv])]


def _fill(name: str, values: Dict[str, str]) -> str:
    return _PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), name)


def _transposes(stmt: _Statement, sources: Sequence[str]) -> List[str]:
    out = []
    for values in _instances(stmt, sources):
        out += [f"{_fill(d, values)}^T -> {_fill(d, values)}" for d in stmt.names]
    return out


def _transposed_later(statements: Sequence[_Statement]) -> List[re.Pattern]:
    """Patterns of every transposed single source (a split's part transposed by a later statement)."""
    return [_pattern(s.source)[0] for s in statements if s.transposed and s.single_source]


def repair_fused_splits(statements: Sequence[str], sources: Dict[str, Tuple[int, ...]],
                        linear_weights: Optional[Set[str]] = None) -> Tuple[List[str], List[str]]:
    """``statements`` with both wrong forms of the module docstring repaired, and what was done.

    ``sources``: the model's tensor names and global shapes; ``linear_weights``: the names of the
    tensors that are weights of a ``paddle.nn.Linear`` (Paddle layout ``[in, out]``); without them
    only the transpose-then-split form is repaired.
    """
    parsed = [_Statement(s) if "->" in s else None for s in statements]
    names = list(sources)
    out: List[str] = []
    before_split: List[str] = []
    never_transposed: List[str] = []
    later = _transposed_later([p for p in parsed if p is not None])
    for text, stmt in zip(statements, parsed):
        if stmt is None or not stmt.is_split:
            out.append(text)
            continue
        if stmt.transposed and stmt.macro:  # a plain `X^T -> A, B, axis=k` says which axis: as written
            before_split.append(text)
            out.append(stmt.rewritten())
            out += _transposes(stmt, names)
            continue
        out.append(text)
        if stmt.transposed:
            continue
        instances = _instances(stmt, names)
        linear = {_fill(stmt.source, v) for v in instances} & (linear_weights or set())
        parts = [_fill(d, v) for v in instances for d in stmt.names]
        if any(len(sources[n]) == 2 for n in linear) and not any(rx.match(p) for p in parts for rx in later):
            never_transposed.append(text)
            out += _transposes(stmt, names)
    repairs = []
    if before_split:
        repairs.append(
            f"a fused split applied to the transposed tensor in {len(before_split)} statement(s) (it cuts the "
            f"input axis, or under tensor parallelism mixes the ranks' halves): split first, then each part "
            f"transposed, e.g. {before_split[0]!r}")
    if never_transposed:
        repairs.append(
            f"{len(never_transposed)} split statement(s) of paddle.nn.Linear weights never transpose their parts "
            f"(Paddle [in, out], transformers [out, in]): each part transposed, e.g. {never_transposed[0]!r}")
    return out, repairs


def linear_weight_names(model) -> Set[str]:
    """Names of the weights of the model's ``paddle.nn.Linear`` layers (Paddle layout ``[in, out]``),
    as its state dict names them."""
    try:
        from paddle import nn
    except ImportError:  # pragma: no cover - the package needs Paddle to export
        return set()
    out = set()
    for prefix, layer in model.named_sublayers(include_self=True):
        if isinstance(layer, nn.Linear):
            out.add(f"{prefix}.weight" if prefix else "weight")
    return out
