"""PaddleNLP 2.8.1 Llama-like families: presets of ``models/mappings/paddlenlp_llama.py``.

Llama in its four fuse combinations (GQA, MHA, MQA), Mixtral (forward broken on Paddle 3.3.1:
names/shapes only), ChatGLMv2 -> HF GlmForCausalLM, QWen (Qwen-1) -> HF Qwen2ForCausalLM.

Reload: PaddleNLP 2.8.1 ``from_pretrained(dir, convert_from_torch=True)`` reads a single-file
snapshot (``model.safetensors``, no index) back with identical logits, fused Llama configs included;
a sharded one it rejects ("The state dictionary of the model you are trying to load is corrupted").
"""
from case import ZooCase

_M = "paddlenlp.transformers"
_LLAMA = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
_RELOAD_HF_ONLY = "snapshot is a different Hugging Face architecture; PaddleNLP 2.8.1 has no class that loads it"

CASES = [
    ZooCase(
        id="pnlp-llama-unfused-gqa", framework="paddlenlp", module=_M,
        config_class="LlamaConfig", model_class="LlamaForCausalLM",
        config=dict(_LLAMA), hf_class="LlamaForCausalLM", tied=False,
    ),
    ZooCase(
        id="pnlp-llama-qkvfused-mha", framework="paddlenlp", module=_M,
        config_class="LlamaConfig", model_class="LlamaForCausalLM",
        config=dict(_LLAMA, num_key_value_heads=4, fuse_attention_qkv=True),
        hf_class="LlamaForCausalLM", tied=False,
        notes="qkv_proj interleaved per kv group: [q x groups, k, v] x kv_heads",
    ),
    ZooCase(
        id="pnlp-llama-ffnfused-gqa", framework="paddlenlp", module=_M,
        config_class="LlamaConfig", model_class="LlamaForCausalLM",
        config=dict(_LLAMA, fuse_attention_ffn=True),
        hf_class="LlamaForCausalLM", tied=False,
        notes="gate_up_fused_proj = [gate, up] on one process",
    ),
    ZooCase(
        id="pnlp-llama-bothfused-gqa", framework="paddlenlp", module=_M,
        config_class="LlamaConfig", model_class="LlamaForCausalLM",
        config=dict(_LLAMA, fuse_attention_qkv=True, fuse_attention_ffn=True),
        hf_class="LlamaForCausalLM", tied=False,
    ),
    ZooCase(
        id="pnlp-llama-bothfused-mqa", framework="paddlenlp", module=_M,
        config_class="LlamaConfig", model_class="LlamaForCausalLM",
        config=dict(_LLAMA, num_attention_heads=8, num_key_value_heads=1, fuse_attention_qkv=True, fuse_attention_ffn=True),
        hf_class="LlamaForCausalLM", tied=False,
    ),
    ZooCase(
        id="pnlp-llama-tieclaimed", framework="paddlenlp", module=_M,
        config_class="LlamaConfig", model_class="LlamaForCausalLM",
        config=dict(_LLAMA, tie_word_embeddings=True, fuse_attention_qkv=True),
        hf_class="LlamaForCausalLM", tied=False,
        notes="PaddleNLP 2.8 Llama accepts tie_word_embeddings=True but keeps a separate [hidden, vocab] LM head: "
              "exported untied",
    ),
    ZooCase(
        id="pnlp-llama-rope-linear", framework="paddlenlp", module=_M,
        config_class="LlamaConfig", model_class="LlamaForCausalLM",
        config=dict(_LLAMA, rope_scaling_type="linear", rope_scaling_factor=2.0, fuse_attention_qkv=True),
        hf_class="LlamaForCausalLM", tied=False,
        notes="rope_scaling {rope_type: linear, factor: 2}; ntk -> rope_theta, dynamic_ntk -> dynamic (checked in scratch)",
    ),
    ZooCase(
        id="pnlp-mixtral", framework="paddlenlp", module=_M,
        config_class="MixtralConfig", model_class="MixtralForCausalLM",
        config=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=128, num_local_experts=4, num_experts_per_tok=2),
        hf_class="MixtralForCausalLM",
        no_forward=("PaddleNLP 2.8.1 MixtralSparseMoeBlock.forward fails on Paddle 3.3.1 (paddle.where returns 1-D "
                    "indices: 'Broadcast dimension mismatch ... X = [n, 64] and Y = [n]'); with that one shape fixed "
                    "(scratch) logits match to 3.6e-7"),
        train=False, tied=False,
        notes="snapshot uses per-expert block_sparse_moe.experts.E.w1/w2/w3 names, as transformers 5.24's own "
              "save_pretrained writes Mixtral; it fuses them to mlp.experts.gate_up_proj/down_proj on load",
    ),
    ZooCase(
        id="pnlp-chatglm2-glm", framework="paddlenlp", module=_M,
        config_class="ChatGLMv2Config", model_class="ChatGLMv2ForCausalLM",
        config=dict(num_hidden_layers=2, vocab_size=512, hidden_size=64, ffn_hidden_size=128, kv_channels=16,
                    num_attention_heads=4, multi_query_group_num=2, add_qkv_bias=True, max_sequence_length=128,
                    tie_word_embeddings=False),
        hf_class="GlmForCausalLM", tied=False, reload=_RELOAD_HF_ONLY,
        notes="tie_word_embeddings=False is required: PaddleNLP's default True is never honoured by ChatGLMv2, and "
              "the package takes the claim at its word (no get_output_embeddings); the preset refuses it",
    ),
    ZooCase(
        id="pnlp-qwen1-qwen2", framework="paddlenlp", module=_M,
        config_class="QWenConfig", model_class="QWenForCausalLM",
        config=dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    kv_channels=16, seq_length=128, max_position_embeddings=128),
        hf_class="Qwen2ForCausalLM", tied=False, reload=_RELOAD_HF_ONLY,
        notes="same logits up to seq_length (Qwen-1's dynamic NTK / log-n scaling only act beyond it)",
    ),
]
