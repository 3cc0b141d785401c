"""Which weights an FP8 snapshot quantizes, declared per Hugging Face architecture (``export.quantization``).

What the architectures' published FP8 checkpoints quantize (DeepSeek-V3, Qwen3 and Qwen3-MoE ``-FP8``,
Qwen3-VL ``-FP8``): the decoder layers' attention and MLP projections, experts and shared experts
included, fused or split as the Hugging Face layout has them. Never the embeddings, the LM head, norms,
biases, MoE router gates, or a vision tower (its modules are not matched: the patterns name the text
decoder's layers). Each declaration is a row of the table below, in the names the mappings of this
folder produce; ``tests/zoo`` exports every architecture of the zoo with it and loads the snapshot in
transformers. An architecture without a row is refused when the job starts, naming it.

config.json's ``modules_to_not_convert`` lists every other 2-D ``.weight`` of the snapshot (router gates, a
vision tower's Linear layers) and the LM head (tied or not), the modules an engine would otherwise replace by
FP8 layers; embeddings are not listed (engines do not convert them).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Iterable, List, Sequence, Tuple

from ...assemble.mapping import MappingError
from ...config.schema import ConfigError

LAYERS = r"model\.layers\.\d+\."  # a causal LM's decoder layers
# an image-text-to-text model's text decoder: transformers 5's layout, or the flat one its mapping may write
# (PaddleFormers' Qwen2.5-VL and PaddleOCR-VL); the vision tower's layers are under visual./model.visual.
TEXT_LAYERS = r"model\.(?:language_model\.)?layers\.\d+\."
DECODER_LAYERS = r"model\.decoder\.layers\.\d+\."  # OPT
BLOCKS = r"transformer\.h\.\d+\."  # GPT-J, CodeGen, Bloom, Falcon, CTRL
ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLA = ("self_attn.q_proj", "self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
       "self_attn.kv_b_proj", "self_attn.o_proj")  # DeepSeek's multi-head latent attention (q_proj without q LoRA)
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FUSED_MLP = ("mlp.gate_up_proj", "mlp.down_proj")
EXPERTS = ("mlp.experts.*.gate_proj", "mlp.experts.*.up_proj", "mlp.experts.*.down_proj")
SHARED_EXPERT = ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj")
SHARED_EXPERTS = ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj")
BLOOM = ("self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")
EMBEDDINGS = r"(.*\.)?([^.]*embed[^.]*|wte|wpe)"  # embedding tables: embed_tokens, pos_embed, position_embedding, ...


@dataclass(frozen=True)
class Fp8Declaration:
    """The weights of ``architecture`` stored as FP8: ``layers`` (a regex of a decoder layer's prefix) followed
    by one of ``modules`` (``*``: an expert's index), then ``.weight``."""

    architecture: str
    layers: str
    modules: Tuple[str, ...]
    embeddings: str = EMBEDDINGS  # module names (regex) that are embedding tables, never listed as not converted
    head: str = "lm_head"  # the LM head's module: always listed, tied (and so not in the snapshot) or not

    @property
    def pattern(self) -> "re.Pattern":
        alternatives = "|".join(re.escape(m).replace(r"\*", r"\d+") for m in self.modules)
        return re.compile(f"{self.layers}(?:{alternatives})\\.weight")

    def __call__(self, tensors: Iterable[Tuple[str, Sequence[int]]]) -> Tuple[List[str], List[str]]:
        """(the weights quantized, the modules of ``modules_to_not_convert``) among ``(name, shape)``."""
        pattern, embedding = self.pattern, re.compile(self.embeddings)
        quantized, others = [], []
        for name, shape in tensors:
            if not name.endswith(".weight") or len(shape) != 2:
                continue
            if pattern.fullmatch(name):
                quantized.append(name)
            elif not embedding.fullmatch(name[:-len(".weight")]):
                others.append(name[:-len(".weight")])
        if self.head not in others:
            others.append(self.head)
        if not quantized:
            raise MappingError(f"export.quantization: the FP8 declaration of {self.architecture} ({self.pattern.pattern}) "
                               "matches none of the snapshot's tensors")
        return quantized, others


def _row(architecture: str, layers: str, *groups: Tuple[str, ...], **kw) -> Tuple[str, Fp8Declaration]:
    return architecture, Fp8Declaration(architecture, layers, tuple(m for g in groups for m in g), **kw)


DECLARATIONS: Dict[str, Fp8Declaration] = dict([
    _row("LlamaForCausalLM", LAYERS, ATTENTION, MLP),
    _row("Qwen2ForCausalLM", LAYERS, ATTENTION, MLP),
    _row("Qwen3ForCausalLM", LAYERS, ATTENTION, MLP),
    _row("Ernie4_5ForCausalLM", LAYERS, ATTENTION, MLP),
    _row("Gemma3ForCausalLM", LAYERS, ATTENTION, MLP),
    _row("GlmForCausalLM", LAYERS, ATTENTION, FUSED_MLP),
    _row("Phi3ForCausalLM", LAYERS, ("self_attn.qkv_proj", "self_attn.o_proj"), FUSED_MLP),
    _row("MixtralForCausalLM", LAYERS, ATTENTION,
         ("block_sparse_moe.experts.*.w1", "block_sparse_moe.experts.*.w2", "block_sparse_moe.experts.*.w3")),
    _row("Qwen2MoeForCausalLM", LAYERS, ATTENTION, MLP, EXPERTS, SHARED_EXPERT),
    _row("Qwen3MoeForCausalLM", LAYERS, ATTENTION, MLP, EXPERTS),
    _row("Glm4MoeForCausalLM", LAYERS, ATTENTION, MLP, EXPERTS, SHARED_EXPERTS),
    _row("DeepseekV3ForCausalLM", LAYERS, MLA, MLP, EXPERTS, SHARED_EXPERTS),
    _row("Ernie4_5_MoeForCausalLM", LAYERS, ATTENTION, MLP, EXPERTS, SHARED_EXPERTS),
    _row("Qwen2_5_VLForConditionalGeneration", TEXT_LAYERS, ATTENTION, MLP),
    _row("Qwen3VLForConditionalGeneration", TEXT_LAYERS, ATTENTION, MLP),
    _row("Glm4vMoeForConditionalGeneration", TEXT_LAYERS, ATTENTION, MLP, EXPERTS, SHARED_EXPERTS),
    _row("PaddleOCRVLForConditionalGeneration", TEXT_LAYERS, ATTENTION, MLP),
    # no published FP8 checkpoints: the same rule, the decoder blocks' attention and MLP projections
    _row("OPTForCausalLM", DECODER_LAYERS, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                            "self_attn.out_proj", "fc1", "fc2")),
    _row("GPTJForCausalLM", BLOCKS, ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj", "mlp.fc_in",
                                     "mlp.fc_out")),
    _row("CodeGenForCausalLM", BLOCKS, ("attn.qkv_proj", "attn.out_proj", "mlp.fc_in", "mlp.fc_out")),
    _row("BloomForCausalLM", BLOCKS, BLOOM),
    _row("FalconForCausalLM", BLOCKS, BLOOM),
    _row("CTRLLMHeadModel", BLOCKS, ("multi_head_attention.Wq", "multi_head_attention.Wk", "multi_head_attention.Wv",
                                     "multi_head_attention.dense", "ffn.0", "ffn.2"),
         embeddings=EMBEDDINGS + r"|transformer\.w"),
])

# architectures this package exports that have no declaration, and why (the refusal says it)
UNDECLARED = {
    "GPT2LMHeadModel": "its projections are Conv1D layers stored [in, out], which no engine loads as FP8 blocks",
    "GptOssForCausalLM": "its experts are fused 3-D tensors stored [in, out] (its published checkpoints are MXFP4)",
}


def fp8_declaration(architecture: str) -> Fp8Declaration:
    """The declaration of ``architecture``; a ConfigError naming ``export.quantization`` and the architecture
    when there is none."""
    found = DECLARATIONS.get(architecture)
    if found is not None:
        return found
    why = UNDECLARED.get(architecture, "no declaration of the weights it quantizes")
    raise ConfigError("export.quantization", f"fp8 is not available for {architecture or 'this model'}: {why}. "
                                             f"Architectures with a declaration: {', '.join(sorted(DECLARATIONS))}")


__all__ = ["DECLARATIONS", "Fp8Declaration", "UNDECLARED", "fp8_declaration"]
