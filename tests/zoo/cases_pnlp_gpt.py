"""PaddleNLP 2.8.1 GPT-family causal LMs (presets in models/mappings/paddlenlp_gpt.py).

None of these embeddings has a Paddle padding_idx. Ties: GPT and Bloom always use the word embedding
as LM head (Bloom's config flag only decides whether the snapshot carries a copy of it); RW, OPT,
GPT-J and CodeGen always have their own head; CTRL follows tie_word_embeddings.
"""
from case import ZooCase

M = "paddlenlp.transformers"

GPT = dict(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
           max_position_embeddings=64)
BLOOM = dict(vocab_size=512, hidden_size=32, n_layer=2, n_head=4)
RW = dict(vocab_size=512, hidden_size=32, n_layer=2, n_head=4)  # n_head a power of two: alibi slopes are exact in bf16
OPT = dict(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
           max_position_embeddings=64, word_embed_proj_dim=32)
CTRL = dict(vocab_size=512, n_embd=32, n_layer=2, n_head=4, dff=64, n_positions=64)
GPTJ = dict(vocab_size=512, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64, n_inner=64,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
CODEGEN = dict(vocab_size=512, n_embd=64, n_layer=2, n_head=8, rotary_dim=4, n_positions=64, n_ctx=64, n_inner=128,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)

_NO_CONVERSION = "PaddleNLP 2.8.1 {cls} has no _get_name_mappings: from_pretrained(convert_from_torch=True) raises NotImplementedError"
_MASK = ("PaddleNLP 2.8.1 {cls} forward fails on Paddle 3.3.1: {where} builds its causal mask as float and "
         "paddle.where needs a bool condition ('ValueError: The `condition` is expected to be a boolean Tensor'); "
         "with pad_token_id=None it fails earlier in paddle.cast(input_ids == None). With the mask cast to bool and "
         "an all-ones attention_mask the logits match transformers to 2e-6")

CASES = [
    ZooCase("pnlp-gpt-tied", "paddlenlp", M, "GPTConfig", "GPTForCausalLM", dict(GPT), "GPT2LMHeadModel",
            tied=True,
            notes="the LM head is always the word embedding, whatever tie_word_embeddings says"),
    ZooCase("pnlp-gpt-fusedqkv-tied", "paddlenlp", M, "GPTConfig", "GPTForCausalLM",
            dict(GPT, fuse_attention_qkv=True), "GPT2LMHeadModel", tied=True,
            notes="qkv_proj stored per head [q_h, k_h, v_h]; regrouped into c_attn [q | k | v]"),
    # Bloom and OPT keep their head's matrix as `decoder_weight` and have no get_output_embeddings:
    # the tie is decided by identity of the parameters, not by the config's flag
    ZooCase("pnlp-bloom-tied", "paddlenlp", M, "BloomConfig", "BloomForCausalLM", dict(BLOOM), "BloomForCausalLM",
            tied=True),
    ZooCase("pnlp-bloom-config-untied", "paddlenlp", M, "BloomConfig", "BloomForCausalLM",
            dict(BLOOM, tie_word_embeddings=False), "BloomForCausalLM", tied=True,
            notes="BloomLMHead is the word embedding whatever the config says: the snapshot says tied"),
    ZooCase("pnlp-rw-untied", "paddlenlp", M, "RWConfig", "RWForCausalLM", dict(RW), "FalconForCausalLM",
            tied=False, notes="RW never ties its CausalLMHead (config.tie_word_embeddings is not acted on)"),
    ZooCase("pnlp-rw-mq-alibi-parallel-untied", "paddlenlp", M, "RWConfig", "RWForCausalLM",
            dict(RW, multi_query=True, alibi=True, parallel_attn=True, bias=True), "FalconForCausalLM", tied=False),
    ZooCase("pnlp-opt-untied", "paddlenlp", M, "OPTConfig", "OPTForCausalLM",
            dict(OPT), "OPTForCausalLM", tied=False,
            reload=("PaddleNLP 2.8.1 OPTForCausalLM._get_name_mappings has no lm_head.weight -> lm_head.decoder_weight "
                    "entry: the LM head is re-initialised on reload (also with a single-file copy)"),
            notes="the config's default tie_word_embeddings=True is not acted on: lm_head.decoder_weight is its own"),
    ZooCase("pnlp-ctrl-tied", "paddlenlp", M, "CTRLConfig", "CTRLLMHeadModel", dict(CTRL), "CTRLLMHeadModel",
            tied=True, reload=_NO_CONVERSION.format(cls="CTRLLMHeadModel"),
            notes="ctrl.pos_encoding.weight (frozen sinusoid table) is not exported: transformers recomputes it"),
    ZooCase("pnlp-ctrl-untied", "paddlenlp", M, "CTRLConfig", "CTRLLMHeadModel",
            dict(CTRL, tie_word_embeddings=False), "CTRLLMHeadModel", tied=False,
            reload=_NO_CONVERSION.format(cls="CTRLLMHeadModel")),
    ZooCase("pnlp-gptj-untied", "paddlenlp", M, "GPTJConfig", "GPTJForCausalLM", dict(GPTJ), "GPTJForCausalLM",
            no_forward=_MASK.format(cls="GPTJForCausalLM", where="GPTJAttention._attn (its 'bias' buffer)"),
            train=False, tied=False, reload=_NO_CONVERSION.format(cls="GPTJForCausalLM")),
    ZooCase("pnlp-codegen-untied", "paddlenlp", M, "CodeGenConfig", "CodeGenForCausalLM", dict(CODEGEN),
            "CodeGenForCausalLM",
            no_forward=_MASK.format(cls="CodeGenForCausalLM", where="CodeGenAttention._attn (self.causal_mask)"),
            train=False, tied=False, reload=_NO_CONVERSION.format(cls="CodeGenForCausalLM"),
            notes="n_head=8: two heads per mp_num block of the fused qkv_proj"),
]
