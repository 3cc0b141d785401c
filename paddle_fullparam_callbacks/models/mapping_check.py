"""A wrong mapping never ships: what the destinations of a name mapping must look like, checked
before the first byte (``check_layout``), for every architecture and every source of a mapping
(a preset, a framework's own, a user's).

A mapping that runs without error can still write the wrong tensors: a transpose left out, q and
k swapped, a fused projection split on the wrong axis or before its transpose, a macro's temporary
left behind under its temporary name, an expert never written. transformers then loads what it
finds (a missing key is initialised at random, a mis-shaped one refused only sometimes). The
checks here need no transformers, only the names, the shapes and the model's config:

1. **Every destination is named by a statement** of the mapping (placeholders such as
   ``$LAYER_ID`` match any index) or passes through under its own name (checked elsewhere); a
   name only a macro's expansion made (``fused_ffn_tmp.GATE_0``), or one marked temporary
   (``__tmp__``), is refused.
2. **Shapes by role**, in the conventions transformers' decoder layers share
   (``layers.N.self_attn.{q,k,v,o}_proj``, ``layers.N.mlp[...].{gate,up,down}_proj``, norms,
   embeddings, the LM head), from the text model's config (``text_config`` of a multimodal one):
   q ``[heads * head_dim, hidden]``, k/v ``[kv_heads * head_dim, hidden]``, o ``[hidden, heads *
   head_dim]``, gate/up ``[intermediate, hidden]``, down ``[hidden, intermediate]`` with the same
   intermediate as its gate/up, norms ``[hidden]``. Tensors of a vision or audio tower are not
   checked by these rules (their sizes are their tower's).
3. **Complete groups**: an attention with q, k or v has all of q/k/v/o (``out_proj`` counts as o;
   or a fused qkv), an MLP with some of gate/up/down has all of them (or a fused gate_up); a
   layer's experts are ``0 .. E-1`` for every expert tensor, E the config's number of experts.

Where transformers can be imported (``paddle-fullparam verify --transformers``, the zoo), the
snapshot is also compared with the architecture's class instantiated on the meta device.
"""
from __future__ import annotations

import re
from collections import defaultdict
from typing import Dict, Iterable, List, Optional, Tuple

from ..assemble.mapping import MappingError

_PLACEHOLDER = re.compile(r"\$[A-Z_]+")
_TEMPORARY = re.compile(r"(^|\.)__|tmp", re.IGNORECASE)
_TOWER = re.compile(r"(^|\.)(visual|vision[a-z_]*|vit|image[a-z_]*|audio[a-z_]*|mm_projector|resampler|mlp_AR)(\.|$)")
_LAYER = re.compile(r"^(?P<prefix>.*?\blayers\.\d+\.)(?P<role>.+)$")
_EXPERT = re.compile(r"^(?P<head>.*\.experts\.)(?P<id>\d+)(?P<tail>\..+)$")
_EXPERT_COUNT = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
_MIXTRAL = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")  # Mixtral's names of gate/down/up
_W = {"w1": "gate", "w2": "down", "w3": "up"}


def _names(side: str) -> List[str]:
    """The tensor names of one side of an AOA statement (options, macros, ``_`` and ``^T`` left out)."""
    out = []
    for token in side.split(","):
        token = token.strip().split("^")[0].strip()
        if not token or "=" in token or token == "_" or "." not in token:
            continue
        out.append(token)
    return out


def _named_patterns(aoa_config: Optional[dict]) -> List["re.Pattern[str]"]:
    cfg = aoa_config or {}
    reverse = bool(cfg.get("aoa_config_reverse"))
    patterns = []
    for stmt in cfg.get("aoa_statements") or []:
        if "->" not in stmt:
            continue
        left, right = stmt.split("->", 1)
        for name in _names(left if reverse else right):
            parts = _PLACEHOLDER.split(name)
            patterns.append(re.compile("^" + r"\d+".join(re.escape(p) for p in parts) + "$"))
    return patterns


def _temporaries(names: Iterable[str], passthrough: Iterable[str], aoa_config: Optional[dict]) -> List[str]:
    passed = set(passthrough)
    patterns = _named_patterns(aoa_config)
    bad = []
    for n in names:
        if n in passed:
            continue
        if _TEMPORARY.search(n) or (aoa_config is not None and not any(p.match(n) for p in patterns)):
            bad.append(n)
    return bad


def _int(config: dict, *keys) -> Optional[int]:
    for k in keys:
        v = config.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _text_config(hf_config: Optional[dict]) -> dict:
    cfg = hf_config or {}
    text = cfg.get("text_config")
    return text if isinstance(text, dict) else cfg


_MLA = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim")  # multi-head latent attention: its own sizes


def _expectations(cfg: dict) -> Dict[str, Tuple[Optional[int], Optional[int]]]:
    """role -> (rows, columns) expected (None: not checked), for the decoder conventions."""
    hidden, heads = _int(cfg, "hidden_size"), _int(cfg, "num_attention_heads")
    kv = _int(cfg, "num_key_value_heads") or heads
    head_dim = _int(cfg, "head_dim") or (hidden // heads if hidden and heads and hidden % heads == 0 else None)
    q = heads * head_dim if heads and head_dim else None
    k = kv * head_dim if kv and head_dim else None
    if any(key in cfg for key in _MLA):
        q = k = None  # per-head sizes of their own (qk_nope + qk_rope, v_head_dim): the inputs are still checked
    return {"q_proj": (q, hidden), "k_proj": (k, hidden), "v_proj": (k, hidden), "o_proj": (hidden, q),
            "gate_proj": (None, hidden), "up_proj": (None, hidden), "down_proj": (hidden, None)}


def _role_shapes(shapes: Dict[str, tuple], cfg: dict) -> List[str]:
    expect = _expectations(cfg)
    hidden, vocab = _int(cfg, "hidden_size"), _int(cfg, "vocab_size")
    inner = {"": _int(cfg, "intermediate_size"), "experts": _int(cfg, "moe_intermediate_size")}
    problems = []

    def want(name, got, rows, cols):
        exp = [rows, cols][: len(got)]
        if len(got) != 2 or any(e is not None and e != g for e, g in zip(exp, got)):
            problems.append(f"{name} is {list(got)}, expected [{rows or '?'}, {cols or '?'}]")

    mlp_inner: Dict[str, set] = defaultdict(set)
    for name, shape in shapes.items():
        if _TOWER.search(name):
            continue
        m = _LAYER.match(name)
        if m is None:
            if vocab and hidden and re.search(r"(^|\.)(embed_tokens|lm_head)\.weight$", name):
                want(name, shape, vocab, hidden)
            elif hidden and re.search(r"(^|\.)norm\.weight$", name) and shape != (hidden,):
                problems.append(f"{name} is {list(shape)}, expected [{hidden}]")
            continue
        role = _MIXTRAL.sub(lambda e: f"mlp.experts.{e.group(1)}.{_W[e.group(2)]}_proj.weight", m.group("role"))
        proj = re.match(r"^(self_attn|mlp)\.(?:(.*)\.)?(q|k|v|o|gate|up|down)_proj\.weight$", role)
        if proj is not None:
            part = proj.group(3) + "_proj"
            rows, cols = expect[part]
            if part in ("gate_proj", "up_proj", "down_proj"):
                kind = "experts" if re.search(r"(^|\.)experts\.\d+$", proj.group(2) or "") else ""
                size = inner[kind] if not (proj.group(2) or "").startswith("shared") else None
                rows, cols = (size, cols) if part != "down_proj" else (rows, size)
                group = m.group("prefix") + "mlp." + (proj.group(2) + "." if proj.group(2) else "")
                if len(shape) == 2:
                    mlp_inner[group].add(shape[1] if part == "down_proj" else shape[0])
            want(name, shape, rows, cols)
        elif hidden and re.match(r"^[a-z_]*layernorm\.weight$", role) and shape != (hidden,):
            problems.append(f"{name} is {list(shape)}, expected [{hidden}]")
    for group, sizes in mlp_inner.items():
        if len(sizes) > 1:
            problems.append(f"{group}{{gate,up,down}}_proj disagree on the intermediate size: {sorted(sizes)}")
    return problems


def _groups(names: Iterable[str], cfg: dict) -> List[str]:
    present = set(names)
    problems = []
    by_prefix: Dict[str, set] = defaultdict(set)
    for n in present:
        m = re.match(r"^(?P<g>.*\.(self_attn|attention|mlp|mlp\.[\w.]*?))\.(?P<p>[a-z_]+)_proj\.weight$", n)
        if m and not _TOWER.search(n):
            by_prefix[m.group("g")].add("o" if m.group("p") == "out" else m.group("p"))  # OPT, GPT-J: out_proj
    for group, parts in sorted(by_prefix.items()):
        if parts & {"q", "k", "v"} and "qkv" not in parts and not {"q", "k", "v", "o"} <= parts:
            problems.append(f"{group} has {sorted(p + '_proj' for p in parts & {'q', 'k', 'v', 'o'})} "
                            "but not all of q/k/v/o_proj")
        if parts & {"gate", "up", "down"} and "gate_up" not in parts and not {"gate", "up", "down"} <= parts:
            problems.append(f"{group} has {sorted(p + '_proj' for p in parts & {'gate', 'up', 'down'})} "
                            "but not all of gate/up/down_proj")
    experts: Dict[Tuple[str, str], set] = defaultdict(set)
    for n in present:
        m = _EXPERT.match(n)
        if m:
            experts[(m.group("head"), m.group("tail"))].add(int(m.group("id")))
    count = _int(cfg, *_EXPERT_COUNT)
    sizes = {len(ids) for ids in experts.values()}
    for (head, tail), ids in sorted(experts.items()):
        want = count or max(sizes)
        if ids != set(range(want)):
            missing = sorted(set(range(want)) - ids)
            extra = sorted(ids - set(range(want)))
            problems.append(f"{head}N{tail}: experts {missing} missing" + (f", {extra} unexpected" if extra else "")
                            + f" (the config has {want} experts)")
    return problems


def check_layout(dmap, aoa_config: Optional[dict], hf_config: Optional[dict], source: str) -> None:
    """Raise MappingError naming what is wrong with the destinations of ``dmap`` (see the module)."""
    shapes = {s.name: tuple(int(d) for d in s.shape) for s in dmap.specs}
    problems = []
    temporary = _temporaries(shapes, dmap.passthrough, aoa_config)
    if temporary:
        more = f" and {len(temporary) - 3} more" if len(temporary) > 3 else ""
        problems.append(f"{temporary[:3]}{more} are named by no statement (temporaries of a statement's expansion)")
    cfg = _text_config(hf_config)
    problems += _role_shapes(shapes, cfg) + _groups(shapes, cfg)
    if problems:
        more = f"; and {len(problems) - 6} more" if len(problems) > 6 else ""
        raise MappingError(
            f"the name mapping ({source}) would write a snapshot transformers cannot use as the model: "
            + "; ".join(problems[:6]) + more
            + ". Nothing was written. Give a corrected mapping with export.aoa (a preset, a file or a list of statements)"
        )
