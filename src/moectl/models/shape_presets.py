"""The public shapes of real MoE language models, as transformers config values (data only).

One dict per model, in the keys of its transformers ``model_type`` (transformers 5 spelling:
``rope_parameters`` holds the RoPE base and scaling). Every figure is from the model's released
``config.json``; where a figure was checked against a second public source, the source is named.
RoPE *scaling* changes no tensor shape; it is kept where it was verified and dropped otherwise
(said per preset). ``PUBLISHED`` holds the parameter counts the model's authors state, with the
convention they count "active" parameters in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # allenai/OLMoE-1B-7B-0924 config.json. Expert width 1024 = int(0.5 * d_model) as in OLMo-core's
    # TransformerConfig.olmoe_1B_7B (allenai/EMO: src/olmo_core/nn/transformer/config.py).
    "olmoe-1b-7b": {
        "model_type": "olmoe",
        "vocab_size": 50304,
        "hidden_size": 2048,
        "intermediate_size": 1024,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "router_aux_loss_coef": 0.01,
        "clip_qkv": None,
        "attention_bias": False,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "pad_token_id": 1,
        "bos_token_id": None,
        "eos_token_id": 50279,
    },
    # Qwen/Qwen3-30B-A3B config.json; checked against zyzshishui/slime scripts/models/qwen3-30B-A3B.sh
    # and AI-Hypercomputer/maxtext src/MaxText/configs/models/qwen3-30b-a3b.yml (whose RoPE base
    # 1e7 is the 2507 update's; the original release uses 1e6, as slime has).
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,  # dense MLP width: unused, every layer is MoE
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
        "attention_bias": False,
        "use_sliding_window": False,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    # openai/gpt-oss-20b config.json, bf16 (dequantised: no quantization_config); checked against
    # AI-Hypercomputer/maxtext src/MaxText/configs/models/gpt-oss-20b.yml.
    "gpt-oss-20b": {
        "model_type": "gpt_oss",
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "router_aux_loss_coef": 0.9,
        "swiglu_limit": 7.0,
        "attention_bias": True,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "pad_token_id": 199999,
        "eos_token_id": 200002,
    },
    # deepseek-ai/DeepSeek-V2-Lite config.json; checked against AI-Hypercomputer/maxtext
    # src/MaxText/configs/models/deepseek2-16b.yml (27 layers, 1 dense, 64 routed + 2 shared
    # experts of width 1408, top-6, MLA without query compression).
    "deepseek-v2-lite": {
        "model_type": "deepseek_v2",
        "vocab_size": 102400,
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "num_experts_per_tok": 6,
        "first_k_dense_replace": 1,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096,
        },
        "max_position_embeddings": 163840,
        "tie_word_embeddings": False,
        "bos_token_id": 100000,
        "eos_token_id": 100001,
    },
    # mistralai/Mixtral-8x7B-v0.1 config.json; checked against AI-Hypercomputer/maxtext
    # src/MaxText/configs/models/mixtral-8x7b.yml.
    "mixtral-8x7b": {
        "model_type": "mixtral",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # microsoft/Phi-3.5-MoE-instruct config.json (listed in xinyuwei-david/david-share
    # Deep-Learning/Phi-3.5-MoE-and-Mini-Fine-tuning/README.md): LayerNorm with bias (eps read from
    # rms_norm_eps), biased attention and LM head. Its "longrope" scaling (long/short factor lists,
    # original context 4096) is dropped: it has no parameters and changes no shape.
    "phi-3.5-moe": {
        "model_type": "phimoe",
        "vocab_size": 32064,
        "hidden_size": 4096,
        "intermediate_size": 6400,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 16,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.0,
        "router_jitter_noise": 0.01,
        "input_jitter_noise": 0.01,
        "attention_bias": True,
        "lm_head_bias": True,
        "sliding_window": 131072,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 32000,
    },
    # deepseek-ai/DeepSeek-V3 config.json; checked against AI-Hypercomputer/maxtext
    # src/MaxText/configs/models/deepseek3-671b.yml. The released checkpoint also holds one
    # multi-token-prediction layer (num_nextn_predict_layers=1, ~14B more parameters: the 685B
    # on its model card); transformers builds no MTP module, so neither does moectl.
    "deepseek-v3": {
        "model_type": "deepseek_v3",
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "n_group": 8,
        "topk_group": 4,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "num_nextn_predict_layers": 1,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
        },
        "max_position_embeddings": 163840,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
    },
    # EMO's 1B-active / 14B-total MoE (allenai/EMO). Its blocks are remote code
    # (src/hf_trust_remote_code/emo/modeling_emo.py, EmoSparseMoeBlock); the run scripts train
    # OLMo-core's olmoe_1B_7B (d_model 2048, 16 layers, 16 heads, expert width 1024, top-8,
    # RoPE base 5e5, eps 1e-6; src/olmo_core/nn/transformer/config.py) with num_experts=128,
    # num_shared_experts=1 ("1 out of 8 will be shared"), pre-norm and no QK-norm
    # (scripts/models_routerfixed/emo_1b14b_130b_routerfixed_keepaux.sh), and
    # the dolma2 tokenizer padded to 100352 (EmoConfig defaults; TokenizerConfig.dolma2 = 100278).
    # Closest transformers family: Qwen2-MoE, not OLMoE. EMO's block keeps its shared expert as the
    # last of its 128 experts: softmax over the 127 routed logits, top-7, no renormalisation, plus
    # the shared expert always on with weight 1 — Qwen2-MoE's rule exactly, except that Qwen2-MoE
    # weighs its shared expert by a learned sigmoid (2048 parameters a layer). OLMoE would add a
    # QK-norm EMO dropped and would let the shared expert compete in the top-8. Same parameter
    # count as EMO's up to those 2048 a layer; checkpoint names follow Qwen2-MoE, not EMO's own.
    "emo-1b-14b": {
        "model_type": "qwen2_moe",
        "vocab_size": 100352,
        "hidden_size": 2048,
        "intermediate_size": 1024,  # dense MLP width: unused, every layer is MoE
        "moe_intermediate_size": 1024,
        "shared_expert_intermediate_size": 1024,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_experts": 127,
        "num_experts_per_tok": 7,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "qkv_bias": False,
        "use_sliding_window": False,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "pad_token_id": 100277,
        "bos_token_id": None,
        "eos_token_id": 100257,
    },
}


@dataclass(frozen=True)
class Published:
    """Parameter counts as the model's authors state them, with their precision.

    ``total`` and ``active`` are strings as published ("6.9B"); ``active_counts_embedding`` says
    whether the published active figure counts the input embedding table (OLMoE, Qwen and Mistral
    count it; OpenAI and DeepSeek do not — their figures are only reached without it).
    """

    total: str
    active: str
    active_counts_embedding: bool
    source: str
    active_tolerance: float = 0.02  # relative; wider only where a published figure is truncated


PUBLISHED: dict[str, Published] = {
    "olmoe-1b-7b": Published("6.9B", "1.3B", True, "OLMoE paper (arXiv 2409.02060), Table 1"),
    "qwen3-30b-a3b": Published("30.5B", "3.3B", True, "Qwen3-30B-A3B model card"),
    "gpt-oss-20b": Published("20.9B", "3.6B", False, "gpt-oss model card (20.91B total, 3.61B active)"),
    # Counted without the embedding table the active figure is 2.451B: DeepSeek's "2.4B" is
    # truncated, not rounded (its 15.7B total is met to 0.04%), so it is 2.1% off.
    "deepseek-v2-lite": Published("15.7B", "2.4B", False, "DeepSeek-V2 paper, DeepSeek-V2-Lite", 0.025),
    "mixtral-8x7b": Published("46.7B", "12.9B", True, "Mixtral of Experts announcement"),
    "phi-3.5-moe": Published("41.9B", "6.6B", True, "Phi-3.5-MoE-instruct model card"),
    "deepseek-v3": Published("671B", "37B", False, "DeepSeek-V3 technical report"),
    "emo-1b-14b": Published("14B", "1B", True, "EMO paper §4.1 (a '1B-active, 14B-total' MoE)"),
}
