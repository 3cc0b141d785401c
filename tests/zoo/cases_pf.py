"""PaddleFormers 1.2 architectures that build on CPU (see README's table for the others)."""
from case import ZooCase

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)

CASES = [
    ZooCase("pf-llama-untied", "paddleformers", "paddleformers.transformers", "LlamaConfig", "LlamaForCausalLM",
            dict(TINY, fuse_rms_norm=False, tie_word_embeddings=False), "LlamaForCausalLM"),
    ZooCase("pf-llama-tied", "paddleformers", "paddleformers.transformers", "LlamaConfig", "LlamaForCausalLM",
            dict(TINY, fuse_rms_norm=False, tie_word_embeddings=True), "LlamaForCausalLM"),
]
