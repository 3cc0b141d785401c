"""PaddleFormers 1.2 architectures that build on CPU (see README's table for the others).

Tiny configs from a survey of every causal LM PaddleFormers 1.2 ships. ``fuse_rms_norm=False``:
the fused kernel is GPU-only (Gemma3 and Qwen3-Next have their own norm). The ``*Deprecated``
classes are PaddleFormers' pure-Paddle implementations; their modules import ``paddlefleet`` /
``paddlefleet_ops`` at load time (not installable here), so those two imports get stand-ins.
"""
from case import ZooCase

PF = "paddleformers.transformers"
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, fuse_rms_norm=False)
OWN_NORM = {k: v for k, v in TINY.items() if k != "fuse_rms_norm"}  # models with their own RMSNorm class
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
FLEET = ("gpt_provider",)
OPS = ("paddlefleet_ops",)


def pf(id, config_class, model_class, config, hf_class, **kw):
    return ZooCase(id, "paddleformers", PF, config_class, model_class, config, hf_class, **kw)


GEMMA3_RELOAD = ("PaddleFormers 1.2's Gemma3 loader fills lm_head.weight from model.embed_tokens.weight even when "
                 "the model is untied (its _gen_aoa_config: 'model.embed_tokens.weight -> lm_head.weight')")
ERNIE_MOE_CPU = ("its MoE forward needs GPU kernels (expand_modality_expert_id, moe_gate_dispatch_partial_nosoftmaxtopk "
                 "are not registered on CPU)")
CAST = "dtype casts removed"
HEAD = "lm_head.weight exported"

CASES = []
for tied in (False, True):
    t = "tied" if tied else "untied"
    CASES += [
        pf(f"pf-llama-{t}", "LlamaConfig", "LlamaForCausalLM", dict(TINY, tie_word_embeddings=tied), "LlamaForCausalLM", tied=tied),
        pf(f"pf-ernie4_5-{t}", "Ernie4_5Config", "Ernie4_5ForCausalLM", dict(TINY, head_dim=16, tie_word_embeddings=tied),
           "Ernie4_5ForCausalLM", tied=tied),
        pf(f"pf-phi3-{t}", "Phi3Config", "Phi3ForCausalLM", dict(TINY, pad_token_id=511, eos_token_id=510, tie_word_embeddings=tied),
           "Phi3ForCausalLM", tied=tied),
        # PaddleFormers' own Gemma3 mapping is wrong: the package's gemma3_paddleformers preset
        pf(f"pf-gemma3-{t}", "Gemma3TextConfig", "Gemma3ForCausalLM",
           dict(OWN_NORM, head_dim=16, query_pre_attn_scalar=16, sliding_window=8, tie_word_embeddings=tied),
           "Gemma3ForCausalLM", tied=tied, reload=None if tied else GEMMA3_RELOAD),
        pf(f"pf-qwen2-{t}", "Qwen2Config", "Qwen2ForCausalLMDeprecated", dict(TINY, tie_word_embeddings=tied),
           "Qwen2ForCausalLM", tied=tied, shims=FLEET),
    ]
CASES += [
    pf("pf-qwen3", "Qwen3Config", "Qwen3ForCausalLMDeprecated", dict(TINY, head_dim=16), "Qwen3ForCausalLM", shims=FLEET),
    # its eval-mode expert branch is wrong in PaddleFormers 1.2 (a no-op transpose): compare the
    # training-mode forward; tie_word_embeddings=True does not tie it (a separate head is exported)
    pf("pf-gpt_oss", "GptOssConfig", "GptOssForCausalLM",
       dict(TINY, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=16, tie_word_embeddings=True),
       "GptOssForCausalLM", tied=False, extra={"forward_mode": "train"}),
    pf("pf-ernie4_5_moe", "Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
       dict(TINY, head_dim=16, moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_layer_start_index=1,
            moe_num_shared_experts=1, num_nextn_predict_layers=0),
       "Ernie4_5_MoeForCausalLM", train=False, no_forward=ERNIE_MOE_CPU),
    # MoE mappings cast the router to bfloat16 (routing changes in a float32 snapshot): the package
    # removes the cast; tie_word_embeddings=True does not tie these models, and their mappings drop the head
    pf("pf-qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLMDeprecated",
       dict(TINY, **MOE, shared_expert_intermediate_size=64, tie_word_embeddings=True), "Qwen2MoeForCausalLM",
       tied=False, shims=FLEET, extra={"repairs": (CAST, HEAD)}),
    pf("pf-qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLMDeprecated", dict(TINY, head_dim=16, **MOE),
       "Qwen3MoeForCausalLM", shims=FLEET + OPS, extra={"repairs": (CAST,)}),
    pf("pf-glm4_moe", "Glm4MoeConfig", "Glm4MoeForCausalLMDeprecated",
       dict(TINY, head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
            first_k_dense_replace=1, n_group=1, topk_group=1),
       "Glm4MoeForCausalLM", tied=False, shims=FLEET + OPS, extra={"repairs": (CAST,)}),
    pf("pf-deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM",
       dict(TINY, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
            first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=16, num_nextn_predict_layers=0, bos_token_id=1, eos_token_id=2,
            rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32,
                          "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
       "DeepseekV3ForCausalLM", shims=OPS, extra={"repairs": (CAST,)}),
    # PaddleFormers 1.2's Qwen3-Next mapping expects unfused q/k/v and per-expert gate/up that the
    # model does not have: eleven fused tensors would pass through under Paddle names
    pf("pf-qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM",
       dict(OWN_NORM, head_dim=16, **MOE, shared_expert_intermediate_size=32, linear_num_value_heads=4,
            linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, full_attention_interval=2),
       "Qwen3NextForCausalLM", shims=FLEET + OPS,
       refused=r"exports \[.*up_gate_proj.*\] and \d+ more under Paddle names no statement maps"),
]
# PaddleFormers 1.2's mapping writes per-layer statements for shared experts that this config does
# not have (AOAEngine: "...shared_experts.gate_proj.weight should be assigned before"): removed
CASES.append(pf("pf-ernie4_5_moe-no-shared", "Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
                dict(TINY, head_dim=16, moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_layer_start_index=1,
                     moe_num_shared_experts=0, num_nextn_predict_layers=0),
                "Ernie4_5_MoeForCausalLM", train=False, no_forward=ERNIE_MOE_CPU,
                extra={"repairs": ("statement(s) about tensors this model does not have",)}))
