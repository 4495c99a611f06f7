"""The config table behind :mod:`harness.models.zoo`: one tiny config per mlx-lm text model type.

Every type starts from :data:`BASE` (hidden 64, 4 heads of 16, vocab 256, 2 layers, 4 experts
of 2 active, MLA ranks 32/16), kept to the keys that type's own ``ModelArgs`` dataclass declares,
then :data:`OVERRIDES` adds what the architecture needs (layer patterns, hybrid intervals,
required fields without a generic value). Types whose ``ModelArgs`` wraps a ``text_config``
get BASE inside it, filtered by the text args class in :data:`TEXT_ARGS`.
"""

from __future__ import annotations

VOCAB = 256
H, HEADS, KV, HD = 64, 4, 2, 16

BASE = {
    # sizes, under every spelling the modules use
    "hidden_size": H, "d_model": H, "n_embd": H, "hidden_dim": H, "model_dim": H, "dim": H,
    "num_hidden_layers": 2, "num_layers": 2, "n_layer": 2, "n_layers": 2, "num_transformer_layers": 2,
    "intermediate_size": 128, "ffn_hidden_size": 128, "n_inner": 128, "ff_intermediate_size": 128,
    "num_attention_heads": HEADS, "n_head": HEADS, "n_heads": HEADS, "num_heads": HEADS,
    "num_key_value_heads": KV, "num_kv_heads": KV, "n_kv_heads": KV, "num_attention_groups": KV,
    "head_dim": HD, "vocab_size": VOCAB,
    "max_position_embeddings": 4096, "n_positions": 4096, "n_ctx": 4096, "block_size": 4096,
    "model_max_length": 4096,
    "rms_norm_eps": 1e-5, "norm_eps": 1e-5, "layer_norm_eps": 1e-5, "layer_norm_epsilon": 1e-5,
    "layernorm_epsilon": 1e-5,
    "rope_theta": 10000.0, "rotary_emb_base": 10000.0, "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False, "use_bias": False, "use_qkv_bias": False,
    "partial_rotary_factor": 1.0, "rotary_pct": 1.0, "rope_scaling": None,
    # mixture of experts: 4 experts, 2 active, one shared
    "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "top_k_experts": 2, "moe_k": 2,
    "moe_intermediate_size": 32, "expert_ffn_hidden_size": 32, "shared_expert_intermediate_size": 32,
    "n_shared_experts": 1, "num_shared_experts": 1, "num_shared_expert": 1,
    "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 1.0,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_layer_freq": 1,
    # multi-head latent attention
    "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    # state-space / linear attention
    "state_size": 16, "ssm_state_size": 16, "conv_kernel": 4, "time_step_rank": 8, "n_groups": 1,
    "use_conv_bias": True, "mamba_d_conv": 4, "mamba_d_state": 16, "mamba_expand": 2,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
}

# text_config wrappers: "module:Class" of the args their text_config is read with
TEXT_ARGS = {
    "gemma3": "gemma3_text:ModelArgs", "gemma3n": "gemma3n:TextConfig", "gemma4": "gemma4_text:ModelArgs",
    "kimi_k25": "deepseek_v3:ModelArgs", "kimi_vl": "kimi_vl:TextArgs", "llama4": "llama4:TextArgs",
    "lfm2-vl": "lfm2:ModelArgs", "mistral3": "llama:ModelArgs", "pixtral": "llama:ModelArgs",
    "qwen2_vl": "qwen2:ModelArgs", "qwen3_vl": "qwen3:ModelArgs", "qwen3_vl_moe": "qwen3_moe:ModelArgs",
    "qwen3_5": "qwen3_5:TextModelArgs", "qwen3_5_moe": "qwen3_5:TextModelArgs",
    "prism_hadamard_qwen35": "qwen3_5:TextModelArgs", "kimi_k3": "kimi_k3:TextArgs",
    "muse_spark": "muse_spark:TextArgs", "minimax_m3_vl": "minimax_m3_vl:TextArgs",
}

# types that are not a text LM mlx-lm can build here (why, for the table)
SKIP = {
    "olmo": "imports ai2-olmo (hf_olmo), not installed",
    "prism_hadamard_qwen35": "a 2-bit Hadamard-rotated qwen3_5 pack (needs its packed module manifest), not plain weights",
}

L4 = {"num_hidden_layers": 4}

SW, FA = "sliding_attention", "full_attention"
MLA = {"kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16}
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
QWEN35 = {**L4, "full_attention_interval": 2}

OVERRIDES: dict[str, dict] = {
    # --- hybrids: >= 2 recurrent layers and >= 1 attention layer ---
    "qwen3_next": QWEN35,
    "qwen3_5": {"text_config": QWEN35},
    "qwen3_5_moe": {"text_config": QWEN35},
    "lfm2": {**L4, "conv_bias": False, "conv_L_cache": 3, "block_dim": 64, "block_multiple_of": 16,
             "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": False, "block_ff_dim": 128,
             "layer_types": ["conv", "conv", FA, "conv"]},
    "lfm2-vl": {"text_config": {"model_type": "lfm2", **L4, "conv_bias": False, "conv_L_cache": 3,
                                "block_dim": 64, "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.0,
                                "block_auto_adjust_ff_dim": False, "block_ff_dim": 128,
                                "layer_types": ["conv", "conv", FA, "conv"]}},
    "lfm2_moe": {**L4, "use_expert_bias": True, "num_dense_layers": 1, "conv_bias": False, "conv_L_cache": 3,
                 "layer_types": ["conv", FA, "conv", "conv"]},
    # time_step_limit: 0.30.4 requires it (0.32 defaults to no limit)
    "nemotron_h": {"mamba_num_heads": 4, "mamba_head_dim": 16, "mamba_proj_bias": False, "n_groups": 1,
                   "time_step_limit": [0.0, 1e9],
                   "hybrid_override_pattern": list("M*M-"), "num_hidden_layers": 4},
    "granitemoehybrid": {**L4, "embedding_multiplier": 1.0, "attention_multiplier": 0.0625, "logits_scaling": 1.0,
                         "residual_multiplier": 1.0, "layer_types": ["mamba", "attention", "mamba", "mamba"],
                         "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_proj_bias": False, "mamba_d_state": 16,
                         "mamba_d_conv": 4, "mamba_n_groups": 1, "mamba_conv_bias": True,
                         "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 64},
    "falcon_h1": {**L4, "mamba_d_head": 16, "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_state": 16,
                  "mamba_chunk_size": 16},
    "jamba": {**L4, "attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 1,
              "expert_layer_period": 2},
    "mamba2": {"num_heads": 4, "head_dim": 32, "intermediate_size": 128, "time_step_limit": [0.0, 1e9],
               "time_step_rank": 8},
    "rwkv7": {"head_dim": 16, "a_low_rank_dim": 16, "v_low_rank_dim": 16, "gate_low_rank_dim": 16,
              "decay_low_rank_dim": 16},
    "recurrent_gemma": {**L4, "conv1d_width": 4, "logits_soft_cap": 30.0, "attention_window_size": 16,
                        "num_key_value_heads": 1, "block_types": ["recurrent", "recurrent", "attention"]},
    "plamo2": {**L4, "hidden_size_per_head": 16, "mamba_d_state": 16, "mamba_num_heads": 4,
               "mamba_chunk_size": 16, "mamba_step": 2, "attention_window_size": 4096},
    "kimi_linear": {**L4, **MLA, "q_lora_rank": None, "num_experts_per_token": 2, "num_shared_experts": 1,
                    "first_k_dense_replace": 1,
                    "linear_attn_config": {"kda_layers": [1, 2, 4], "full_attn_layers": [3], "num_heads": 4,
                                           "head_dim": 16, "short_conv_kernel_size": 4}},
    "kimi_k3": {"text_config": {**L4, **MLA, "q_lora_rank": None, "num_experts": 4, "num_experts_per_token": 2,
                                "moe_intermediate_size": 32, "num_shared_experts": 1, "first_k_dense_replace": 1,
                                "linear_attn_config": {"kda_layers": [1, 2, 4], "full_attn_layers": [3],
                                                       "num_heads": 4, "head_dim": 16,
                                                       "short_conv_kernel_size": 4}}},
    "baichuan_m1": {**L4, "sliding_window": 8, "sliding_window_layers": [0, 2], "conv_window": 2},
    "bailing_moe_linear": {**L4, "layer_group_size": 2, "group_norm_size": 1},
    "bailing_hybrid": {**L4, "layer_group_size": 2, "group_norm_size": 1, "partial_rotary_factor": 1.0},
    "olmo_hybrid": {**L4, "linear_allow_neg_eigval": True, "layer_types": ["linear_attention", FA] * 2},
    # --- sliding windows, shared KV, chunked attention ---
    "gpt_oss": {"sliding_window": 128, **L4, "layer_types": [SW, FA] * 2},
    "gemma3_text": {**L4, "sliding_window": 8, "sliding_window_pattern": 2, "query_pre_attn_scalar": 16},
    "gemma3": {"text_config": {"model_type": "gemma3_text", **L4, "sliding_window": 8,
                               "sliding_window_pattern": 2, "query_pre_attn_scalar": 16}},
    "gemma4_text": {**L4, "head_dim": 16, "global_head_dim": 32, "num_kv_shared_layers": 2,
                    "sliding_window": 8, "layer_types": [SW, FA, SW, FA], "hidden_size_per_layer_input": 16,
                    "vocab_size_per_layer_input": 256, "num_key_value_heads": 1},
    "gemma4": {"text_config": {"model_type": "gemma4_text", **L4, "head_dim": 16, "global_head_dim": 32,
                               "num_kv_shared_layers": 2, "sliding_window": 8, "layer_types": [SW, FA, SW, FA],
                               "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 256,
                               "num_key_value_heads": 1}},
    "gemma3n": {"text_config": {"model_type": "gemma3n_text", **L4, "num_kv_shared_layers": 2,
                                "vocab_size_per_layer_input": 256, "sliding_window": 8,
                                "rope_local_base_freq": 10000.0, "final_logit_softcapping": 30.0,
                                "layer_types": [SW, FA, SW, FA], "activation_sparsity_pattern": [0.0] * 4,
                                "hidden_size_per_layer_input": 16, "altup_num_inputs": 2,
                                "altup_coef_clip": 120.0, "altup_correct_scale": True, "altup_active_idx": 0,
                                "laurel_rank": 8, "num_key_value_heads": 1}},
    "llama4": {"text_config": {"model_type": "llama4_text", **L4, "attention_chunk_size": 8,
                               "interleave_moe_layer_step": 2, "intermediate_size_mlp": 128,
                               "num_local_experts": 4, "num_experts_per_tok": 1, "use_qk_norm": True,
                               "no_rope_layers": [1, 1, 1, 0], "rope_scaling": None}},
    "llama4_text": {**L4, "intermediate_size_mlp": 128, "no_rope_layers": [1, 1, 1, 0], "use_qk_norm": True,
                    "attention_chunk_size": 8, "num_local_experts": 4, "num_experts_per_tok": 1},
    "plamo3": {**L4, "sliding_window": 8, "sliding_window_pattern": 2},
    "muse_glimmer": {**L4, "sliding_window": 8},
    "cohere2": {**L4, "sliding_window": 8, "sliding_window_pattern": 2},
    "exaone4": {**L4, "sliding_window": 8, "sliding_window_pattern": "LLLG", "rope_scaling": None,
                "layer_types": [SW, SW, SW, FA]},  # transformers' Exaone4Config reads the pattern as int
    "exaone_moe": {**L4, "sliding_window": 8, "layer_types": [SW, SW, SW, FA],
                   "is_moe_layer": [False, True, True, True]},
    "olmo3": {**L4, "sliding_window": 8},
    "mellum": {**L4, "sliding_window": 8, "layer_types": [SW, FA] * 2, "rope_parameters": {SW: ROPE, FA: ROPE}},
    "gear": {**L4, "layer_types": [SW, FA] * 2, "sliding_window": 8},
    "afmoe": {**L4, "layer_types": [SW, FA] * 2, "sliding_window": 8, "num_dense_layers": 1},
    "spark2_5": {**L4, "sliding_window": 8, "layer_types": [SW, FA] * 2,
                 "rope_parameters": {SW: ROPE, FA: ROPE}},
    "ministral3": {"rope_parameters": {**ROPE, "llama_4_scaling_beta": 0.1,
                                       "original_max_position_embeddings": 4096}},
    "step3p5": {**L4, "num_attention_groups": 2, "moe_num_experts": 4, "moe_top_k": 2, "moe_intermediate_size": 32,
                "share_expert_dim": 32, "sliding_window": 8, "layer_types": [SW, FA] * 2, "moe_layers_enum": "1,2,3"},
    "mimo_v2_flash": {**L4, "hybrid_layer_pattern": [1, 0, 1, 0], "moe_layer_freq": [0, 1, 1, 1],
                      "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
                      "sliding_window_size": 8, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                      "swa_rope_theta": 10000.0, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2,
                      "swa_head_dim": 16, "swa_v_head_dim": 16, "partial_rotary_factor": 1},
    "muse_spark": {"audio_config": {"out_hidden_size": 64}, "text_config": {"head_dim": 16, "post_norm_eps": 1e-5, "rope_parameters": ROPE,
                                   "layer_rope_theta": [10000.0] * 2, "layer_types": [SW, FA],
                                   "sliding_window": 8, "final_logit_softcapping": 30.0,
                                   "output_multiplier": 1.0, "num_local_experts": 4, "num_shared_experts": 0, "num_experts_per_tok": 2,
                                   "moe_hidden_size": 32, "moe_intermediate_size": 32,
                                   "mlp_layer_types": ["sparse", "sparse"]}},
    # --- latent attention (MLA) and sparse indexers ---
    "deepseek_v2": {**MLA, "rope_scaling": {"type": "yarn", "factor": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                           "original_max_position_embeddings": 4096}},
    "deepseek_v32": {"index_n_heads": 2, "index_head_dim": 32, "index_topk": 8},
    # DeepSeek-V4-style: a sliding window per layer, compressed KV groups (ratio 4) written by layer 1
    "deepseek_v41": {**L4, "head_dim": 32, "o_groups": 2, "o_lora_rank": 16, "sliding_window": 8,
                     "compress_ratios": [0, 4, 4, 0], "kv_source_layer_ids": [1], "index_source_layer_ids": [1],
                     "index_n_heads": 2, "index_head_dim": 32, "index_topk": 4, "candidate_topk_blocks": 0},
    "glm_moe_dsa": {**MLA, "index_head_dim": 32, "index_n_heads": 2, "index_topk": 8, "topk_method": "noaux_tc",
                    "scoring_func": "sigmoid", "rope_parameters": ROPE},
    "longcat_flash": {**MLA, "attention_method": "MLA", "zero_expert_type": "identity", "zero_expert_num": 1,
                      "mla_scale_q_lora": True, "mla_scale_kv_lora": True},
    "longcat_flash_ngram": {**MLA, "ngram_vocab_size_ratio": 2, "zero_expert_num": 1, "mla_scale_q_lora": True, "mla_scale_kv_lora": True},
    "mistral4": {**MLA, "rope_parameters": {**ROPE, "llama_4_scaling_beta": 0.1,
                                            "original_max_position_embeddings": 4096}},
    "minimax_m3_vl": {"text_config": {"moe_layer_freq": [0, 1], "mlp_layer_types": ["dense", "sparse"],
                                      "dense_intermediate_size": 128, "shared_intermediate_size": 32,
                                      "head_dim": 16, "layer_types": [FA, FA]}},
    # --- required fields without a generic value ---
    "afm7": {"num_kv_reuse_layers": 1, "num_layers": 3},
    "apertus": {"post_norm": False, "qk_norm": True},
    "dbrx": {"ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
             "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0}},
    "glm4_moe": {"use_qk_norm": True},
    "granite": {"logits_scaling": 1.0, "attention_multiplier": 0.0625, "embedding_multiplier": 1.0,
                "residual_multiplier": 1.0},
    "granitemoe": {"logits_scaling": 1.0, "attention_multiplier": 0.0625, "embedding_multiplier": 1.0,
                   "residual_multiplier": 1.0},
    "gptj": {"rotary_dim": 8},
    "phixtral": {"rotary_dim": 8, "num_vocab": 256},
    "hunyuan": {"rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"}, "use_mixed_mlp_moe": True, "use_qk_norm": True, "use_cla": False, "cla_share_factor": 2,
                "moe_intermediate_size": 32},
    "minicpm": {"dim_model_base": 64, "scale_depth": 1.4, "scale_emb": 1.0},
    "minicpm3": {**MLA, "rope_scaling": {"original_max_position_embeddings": 4096, "short_factor": 1.0,
                                         "long_factor": 1.0}, "dim_model_base": 64, "scale_depth": 1.4, "scale_emb": 1.0},
    "minimax": {"shared_intermediate_size": 32, "rotary_dim": 16},
    "nemotron": {"hidden_act": "relu2"},
    "nemotron-nas": {"block_configs": [{"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.0}},
                                       {"attention": {"no_op": True}, "ffn": {"ffn_mult": 1.0}}]},
    "openelm": {"ffn_dim_divisor": 16, "num_query_heads": [4, 4], "num_kv_heads": [2, 2],
                "ffn_multipliers": [1.0, 1.0]},
    # Model.__call__ writes -inf at logits ids 100256..100351 (unchecked scatter: segfault if vocab is smaller)
    "phi3small": {"vocab_size": 100352, "dense_attention_every_n_layers": 2, "gegelu_limit": 20.0, "mup_width_multiplier": 1.0,
                  "mup_embedding_multiplier": 1.0},
    "plamo": {"n_shared_head": 2},
    "qwen": {"kv_channels": 16},
}
