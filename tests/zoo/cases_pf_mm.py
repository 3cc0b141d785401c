"""PaddleFormers 1.2 multimodal (image-text-to-text) architectures that build on CPU.

Each is trained 3 steps on text by the real Trainer, with its processor as the trainer's
``processing_class`` and the callback attached at defaults; then transformers loads the snapshot as
written (``AutoModelForImageTextToText``), and its logits on text and on one 16x16 image are
compared with Paddle's (``hf_mm.py``). ``extra["multimodal"]`` says how (``mm_zoo.py``):

- ``image``: the image inputs' layout, ``"flat"`` (patches x C*T*P*P, the Qwen family and GLM) or
  ``"patches"`` (patches x C x P x P, PaddleOCR-VL);
- ``processor``: PaddleFormers' processor, image processor and video processor classes (module
  path and name); ``tokens``: the special tokens of its tokenizer, in id order from 500 up (the
  ids of the tiny configs).

One image of 16x16 pixels with patch size 4 is a 4x4 grid of patches, merged 2x2 into 4 image tokens.
"""
from case import ZooCase

TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)
IMG, VID, VSTART, VEND = 500, 501, 502, 503
QWEN_IDS = dict(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VSTART, vision_end_token_id=VEND)
QWEN_TOKENS = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|endoftext|>",
               "<|im_start|>", "<|im_end|>"]
GLM_TOKENS = ["<|image|>", "<|video|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>",
              "<|end_of_video|>", "<|endoftext|>"]
VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
              temporal_patch_size=2, out_hidden_size=64)
PF = "paddleformers.transformers"
QWEN25_RELOAD = ("PaddleFormers 1.2's own mapping writes the q/k/v biases as model.language_model.layers.N.* and its "
                 "loader cannot read them back ('qkv_proj.bias should be assigned before'); its own "
                 "save_pretrained(save_to_hf=True) does not reload either")
ERNIE_VL = r"cannot load PaddleFormers' Ernie4.5-VL-MoE config.json \(model_type 'ernie4_5_moe_vl'"


def mm(id, module, config_class, model_class, config, hf_class, image, processor, tokens, **kw):
    extra = dict(kw.pop("extra", {}), multimodal={"image": image, "processor": processor, "tokens": tokens})
    return ZooCase(id, "paddleformers", f"{PF}.{module}", config_class, model_class, config, hf_class,
                   extra=extra, **kw)


def proc(module, processor, image_processor, video_processor=None):
    base = f"{PF}.{module}"
    return {"processor": (f"{base}.processor", processor), "image": image_processor,
            "video": video_processor}


QWEN2_VL_IP = (f"{PF}.qwen2_vl.image_processor", "Qwen2VLImageProcessor")
CASES = [
    mm("pf-qwen3_vl", "qwen3_vl", "Qwen3VLConfig", "Qwen3VLForConditionalGenerationDeprecated",
       dict(text_config=dict(TEXT, head_dim=16, fuse_rms_norm=False, bos_token_id=1, eos_token_id=2,
                             rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
            vision_config=dict(VISION, num_position_embeddings=16, deepstack_visual_indexes=[0]), **QWEN_IDS),
       "Qwen3VLForConditionalGeneration", "flat",
       # PaddleFormers 1.2 names Qwen3VLImageProcessor for qwen3_vl but has no such class: Qwen2-VL's, as its own
       # processor falls back to
       proc("qwen3_vl", "Qwen3VLProcessor", QWEN2_VL_IP, (f"{PF}.qwen3_vl.video_processor", "Qwen3VLVideoProcessor")),
       QWEN_TOKENS, shims=("gpt_provider",)),
    # PaddleFormers' PaddleOCRVLConfig keeps no vision_end_token_id (and loses its token ids): flat config
    mm("pf-paddleocr_vl", "paddleocr_vl", "PaddleOCRVLConfig", "PaddleOCRVLForConditionalGeneration",
       dict(TEXT, head_dim=16, fuse_rms_norm=False, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                               patch_size=4, image_size=16, spatial_merge_size=2, temporal_patch_size=1),
            image_token_id=IMG, video_token_id=VID, vision_start_token_id=VSTART, pad_token_id=0, bos_token_id=1,
            eos_token_id=2),
       "PaddleOCRVLForConditionalGeneration", "patches",
       proc("paddleocr_vl", "PaddleOCRVLProcessor", (f"{PF}.paddleocr_vl.image_processor", "PaddleOCRVLImageProcessor")),
       QWEN_TOKENS, shims=("triton",)),
    # PaddleFormers' mapping splits q/k/v and the dense gate/up after transposing them and never transposes
    # the experts' gate/up: repaired (repairs_fused.py); its router cast to bfloat16 removed
    mm("pf-glm4v_moe", "glm4v_moe", "Glm4vMoeConfig", "Glm4vMoeForConditionalGeneration",
       dict(text_config=dict(TEXT, fuse_rms_norm=False, moe_intermediate_size=32, num_experts_per_tok=2,
                             n_shared_experts=1, n_routed_experts=4, first_k_dense_replace=1, n_group=1, topk_group=1,
                             partial_rotary_factor=0.5, bos_token_id=1, eos_token_id=2,
                             rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.5}),
            vision_config=dict(VISION, image_size=16, fuse_rms_norm=False),
            image_token_id=IMG, video_token_id=VID, image_start_token_id=VSTART, image_end_token_id=VEND,
            video_start_token_id=504, video_end_token_id=505),
       "Glm4vMoeForConditionalGeneration", "flat",
       proc("glm4v_moe", "Glm4vProcessor", (f"{PF}.glm4v_moe.image_processor", "Glm4vImageProcessor"),
            (f"{PF}.glm4v_moe.video_processor", "Glm4vVideoProcessor")),
       GLM_TOKENS, shims=("gpt_provider", "paddlefleet_ops"),
       extra={"repairs": ("fused split applied to the transposed tensor", "never transpose their parts",
                          "dtype casts removed")}),
    # refused before the first byte: no config.json transformers can load as written, and no forward here
    # to check a translation against (docs/models.md, "What is refused")
    mm("pf-ernie4_5_vl_moe", "ernie4_5_moe_vl", "Ernie4_5_VLConfig", "Ernie4_5_VLMoeForConditionalGeneration",
       dict(TEXT, head_dim=16, fuse_rms_norm=False, moe_num_experts=[4, 4], moe_k=2, moe_intermediate_size=[32, 32],
            moe_layer_start_index=1, moe_num_shared_experts=0, num_nextn_predict_layers=0, moe_capacity=[64, 64, 64],
            vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=4,
                               spatial_merge_size=2, in_channels=3),
            pixel_hidden_size=32, im_patch_id=IMG, mm_vocab_size=0, max_text_id=512, rope_3d=True, freq_allocation=2,
            pad_token_id=0, bos_token_id=1, eos_token_id=2),
       "Ernie4_5_VLMoeForConditionalGeneration", "flat", None, QWEN_TOKENS, refused=ERNIE_VL),
    # last: after its failed reload, PaddleFormers reloads nothing more in the same process
    mm("pf-qwen2_5_vl", "qwen2_5_vl", "Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration",
       dict(text_config=dict(TEXT, fuse_rms_norm=False, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                             bos_token_id=1, eos_token_id=2),
            vision_config=dict(VISION, window_size=16, fullatt_block_indexes=[1], fuse_rms_norm=False), **QWEN_IDS),
       "Qwen2_5_VLForConditionalGeneration", "flat",
       proc("qwen2_5_vl", "Qwen2_5_VLProcessor", QWEN2_VL_IP, (f"{PF}.qwen2_vl.video_processor", "Qwen2VLVideoProcessor")),
       QWEN_TOKENS, reload=QWEN25_RELOAD),
]
