"""Build the benchmark models in OUT_DIR (default ./bench-models).

1. Train a small byte-level BPE tokenizer (tokenizers lib) on local English text
   (docstrings of CPython's Lib/*.py + /usr/share/common-licenses).
2. qwen2-0.5b-random: Qwen2ForCausalLM with the Qwen2.5-0.5B shape, random weights
   (torch.manual_seed(0), default HF init), saved bf16 safetensors + tokenizer.
3. llama-tiny-random: LlamaForCausalLM hidden 64, 2 layers, 4 heads, 2 kv heads,
   intermediate 128, vocab = tokenizer size, same tokenizer.
4. With --models naming them (not built by default, they are large):
   gemma3-1b-random, Gemma3ForCausalLM with Gemma 3 1B's shape (26 layers of
   1152, 4 heads of 256 and 1 KV head, every 6th layer global, window 512;
   its vocabulary is the tokenizer's, as llama.cpp's Gemma 3 converter cuts
   the embedding to the tokenizer, not Gemma's 262144); phi4-mini-random, Phi3ForCausalLM with Phi-4-mini's shape
   (32 layers of 3072, 24 heads and 8 KV heads of 128, partial rotary 0.75,
   LongRoPE over a 4096-token original context, vocab 200064, tied head).
   Random weights in bf16, the same tokenizer.
5. Pooling models (with --models naming them): bert-base-random, BertModel
   with BERT-base's shape (12 layers of 768, 12 heads, FFN 3072, 512
   positions; the tokenizer's <|im_start|> / <|im_end|> as CLS / SEP;
   sentence-transformers files: mean pooling, normalised); nomic-embed-random,
   NomicBertModel with nomic-embed-text-v1.5's shape (12 layers of 768, 12
   heads, SwiGLU FFN 3072, rotary base 1000, 2048 positions; the same
   tokenizer and pooling); mpnet-base-random, MPNetModel with
   all-mpnet-base-v2's shape (12 layers of 768, 12 heads, FFN 3072, 514
   positions, relative position bias; the same tokenizer and pooling);
   embeddinggemma-random, Gemma3TextModel with EmbeddingGemma-300m's shape
   and bidirectional attention (24 layers of 768, 3 heads and 1 KV head of
   256, FFN 1152, local window 512 and every 6th layer global; the bench
   tokenizer's vocabulary, mean pooling, normalised); qwen3-embed-random,
   a Qwen3 base model with Qwen3-Embedding-0.6B's shape (28 layers of 1024,
   16 heads and 8 KV heads of 128, FFN 3072; last-token pooling, normalised),
   saved without a head as Qwen3-Embedding is (config: Qwen3Model). float32 weights.
6. qwen3-moe-random (with --models=qwen3-moe): Qwen3MoeForCausalLM shaped like
   Qwen3-30B-A3B scaled to a small machine: 24 layers of 1024, 16 heads and 4
   KV heads of 64, 64 experts with 8 active (top-k renormalised), expert FFN
   384, the tokenizer's vocabulary, untied head. 1.89B parameters in all,
   0.37B active per token (experts 0.23B, attention 0.13B); bf16 weights.
7. Hybrid recurrent models (with --models naming them), random bf16 weights, the
   tokenizer's vocabulary (8192: the embedding, also the tied head, is 17M of each):
   qwen3.5-2b-random (--models=qwen3.5-2b), Qwen3_5ForCausalLM with Qwen3.5-2B's
   text shape: 24 layers of 2048, every 4th full attention (layers 3, 7, ..., 23:
   8 heads and 2 KV heads of 256, gated output, partial rotary 0.25, rope theta
   1e7), the other 18 Gated DeltaNet (16 key and 16 value heads of 128, conv kernel
   4), FFN 6144, tied head, 32768 positions (the real model allows 262144; the
   shape is the same). 1.39B parameters: MLPs 0.91B, DeltaNet 0.38B, attention
   0.09B (the real 248320-token embedding would make it 1.88B).
   lfm2-1.2b-random (--models=lfm2-1.2b), Lfm2ForCausalLM with LFM2-1.2B's shape:
   16 layers of 2048, attention at layers 2, 5, 8, 10, 12, 14 (32 heads and 8 KV
   heads of 64, rope theta 1e6), short convolutions (3 taps) elsewhere, FFN 12288
   auto-adjusted to 8192 (block_multiple_of 256), tied head, 128000 positions.
   1.05B parameters: MLPs 0.81B, convolution blocks 0.17B, attention 0.06B (the
   real 65536-token embedding would make it 1.17B).
9. Hybrid mixture-of-experts models (with --models naming them), random bf16
   weights, the tokenizer's vocabulary:
   qwen3.5-moe-random (--models=qwen3.5-moe), Qwen3_5MoeForCausalLM shaped like
   Qwen3.5-35B-A3B scaled as qwen3-moe-random is: 24 layers of 1024, every 4th
   gated attention (8 heads and 2 KV heads of 256, partial rotary 0.25), the
   other 18 Gated DeltaNet (8 key and 16 value heads of 128, conv kernel 4),
   every MLP 64 experts with 8 active (softmax, renormalised) of FFN 384 plus a
   gated shared expert of 384, untied head. 2.05B parameters, 0.41B active
   per token.
   lfm2-moe-random (--models=lfm2-moe), Lfm2MoeForCausalLM shaped like
   LFM2-8B-A1B scaled down: 16 layers of 1024, attention at layers 2, 5, 8,
   10, 12, 14 (16 heads and 4 KV heads of 64), short convolutions (3 taps)
   elsewhere, the first 2 layers with a dense FFN of 3072, the other 14 with
   32 experts, 4 active (sigmoid scores with an expert bias, renormalised) of
   FFN 768, tied head (llama.cpp's converter cannot write an untied LFM2-MoE
   head). 1.14B parameters, 0.18B active per token.
   granite4-h-350m-random (--models=granite4-h-350m), GraniteMoeHybridForCausalLM
   shaped like granite-4.0-h-350m: 32 layers of 768, attention (12 heads and 4
   KV heads of 64, no rotary) at layers 7, 15, 23, 31 and Mamba-2 elsewhere
   (48 heads of 32 channels, one group of 128 states, 4 taps, expand 2), the
   dense MLP of 2048, Granite's multipliers (embedding 12, attention 1/64,
   residual 0.246, logits 3), tied head; config.json's layer_types written as
   the released configs write them ("mamba", "attention"), which llama.cpp's
   converter reads. 0.27B parameters: Mamba-2 0.11B, MLPs 0.15B, attention
   0.006B (the real 100352-token embedding would make it 0.34B).
8. llama3.2-1b-random (with --models=llama3.2-1b): LlamaForCausalLM with Llama
   3.2 1B's shape: 16 layers of 2048, 32 heads and 8 KV heads of 64, FFN 8192,
   rope theta 500000 with Llama 3's frequency scaling (factor 32, low / high
   frequency factors 1 / 4, over an 8192-token original context), RMSNorm eps
   1e-5, tied head, 131072 positions; random bf16 weights, the tokenizer's
   vocabulary. 0.99B parameters: MLPs 0.81B, attention 0.17B (the real
   128256-token embedding would make it 1.24B).
9. gpt-oss-random and gpt-oss-mxfp4-random (with --models=gpt-oss):
   GptOssForCausalLM shaped like gpt-oss-20b scaled down: 12 layers of 1024,
   16 heads and 4 KV heads of 64 with sinks, sliding (128) and full layers
   alternating, 32 experts with 4 active of FFN 1024 (biases, the clamped
   SwiGLU), the tokenizer's vocabulary, untied head. 1.24B parameters, 0.19B
   active per token. The first folder holds the experts in bf16; the second
   holds them in MXFP4 as the released checkpoints do (`*_blocks` /
   `*_scales`, quantized by fastllm's mxfp4 quantizer; `quantization_config`
   "mxfp4").
Usage: python benches/make_bench_model.py [OUT_DIR] [--models=qwen2,tiny,gemma3-1b,phi4-mini,bert-base,nomic-embed,mpnet-base,embeddinggemma,qwen3-embed,qwen3-moe,qwen3.5-2b,lfm2-1.2b,granite4-h-350m,llama3.2-1b,qwen3.5-moe,lfm2-moe,gpt-oss]
(default qwen2,tiny; needs torch, transformers, tokenizers; `pip install "fastllm[bench]"`
has them)
"""

import ast
import glob
import json
import os
import sys
import sysconfig

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

if any(a in ("-h", "--help") for a in sys.argv[1:]):
    print(__doc__)
    sys.exit(0)
ARGS = [a for a in sys.argv[1:] if not a.startswith("--models=")]
if len(ARGS) > 1 or any(a.startswith("-") for a in ARGS):
    sys.exit(f"make_bench_model.py: unexpected arguments {ARGS} (usage: see --help)")
ROOT = ARGS[0] if ARGS else "bench-models"
MODELS = next(
    (a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--models=")), "qwen2,tiny"
).split(",")
QWEN_DIR = os.path.join(ROOT, "qwen2-0.5b-random")
TINY_DIR = os.path.join(ROOT, "llama-tiny-random")
GEMMA3_DIR = os.path.join(ROOT, "gemma3-1b-random")
PHI4_DIR = os.path.join(ROOT, "phi4-mini-random")
BERT_DIR = os.path.join(ROOT, "bert-base-random")
NOMIC_DIR = os.path.join(ROOT, "nomic-embed-random")
MPNET_DIR = os.path.join(ROOT, "mpnet-base-random")
EMBEDDINGGEMMA_DIR = os.path.join(ROOT, "embeddinggemma-random")
QWEN3_EMBED_DIR = os.path.join(ROOT, "qwen3-embed-random")
QWEN3_MOE_DIR = os.path.join(ROOT, "qwen3-moe-random")
QWEN3_5_MOE_DIR = os.path.join(ROOT, "qwen3.5-moe-random")
LFM2_MOE_DIR = os.path.join(ROOT, "lfm2-moe-random")
QWEN3_5_DIR = os.path.join(ROOT, "qwen3.5-2b-random")
LFM2_DIR = os.path.join(ROOT, "lfm2-1.2b-random")
LLAMA3_2_DIR = os.path.join(ROOT, "llama3.2-1b-random")
GRANITE4_H_DIR = os.path.join(ROOT, "granite4-h-350m-random")
GPT_OSS_DIR = os.path.join(ROOT, "gpt-oss-random")
GPT_OSS_MXFP4_DIR = os.path.join(ROOT, "gpt-oss-mxfp4-random")
TOK_VOCAB = 8192
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def corpus():
    libdir = sysconfig.get_paths()["stdlib"]
    n = 0
    for path in sorted(glob.glob(os.path.join(libdir, "*.py"))):
        try:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except Exception:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                d = ast.get_docstring(node)
                if d:
                    n += len(d)
                    yield d
    for path in sorted(glob.glob("/usr/share/common-licenses/*")):
        if os.path.isfile(path):
            with open(path, encoding="utf-8", errors="ignore") as f:
                t = f.read()
            n += len(t)
            yield t
    print(f"corpus chars: {n}", file=sys.stderr)


def build_tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOK_VOCAB,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=32768,
        padding_side="left",
    )
    return fast


def save_large(cfg, folder, tok, eos):
    """A large random model built directly in bf16 (half the memory of an
    fp32 build), saved with the tokenizer."""
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, do_sample=False
    )
    print(os.path.basename(folder), "params", sum(p.numel() for p in model.parameters()))
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    del model


def gemma3_1b(V, eos):
    return Gemma3TextConfig(
        vocab_size=V,
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        max_position_embeddings=32768,
        sliding_window=512,
        sliding_window_pattern=6,
        query_pre_attn_scalar=256,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )


def phi4_mini(V, eos):
    half = int(128 * 0.75) // 2  # one LongRoPE factor per rotary frequency
    return Phi3Config(
        vocab_size=200064,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=32,
        num_attention_heads=24,
        num_key_value_heads=8,
        partial_rotary_factor=0.75,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + i / half for i in range(half)],
            "long_factor": [1.0 + 30 * i / half for i in range(half)],
        },
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        sliding_window=None,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )


def qwen3_moe(V, eos):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=V,
        hidden_size=1024,
        intermediate_size=3072,
        moe_intermediate_size=384,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=64,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )


def gpt_oss(V, eos):
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=V,
        hidden_size=1024,
        intermediate_size=1024,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        num_local_experts=32,
        num_experts_per_tok=4,
        sliding_window=128,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )


def write_mxfp4_copy(src, dst):
    """``src`` (a gpt-oss folder with bf16 experts) copied to ``dst`` with its
    experts in MXFP4 in the released checkpoints' layout: ``*_blocks`` [experts,
    rows, groups, 16] with codes 2i / 2i + 1 in byte i's low / high nibble,
    ``*_scales`` [experts, rows, groups] of E8M0 exponents."""
    import shutil

    from safetensors.torch import load_file, save_file

    from fastllm import _core

    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and f != "model.safetensors.index.json":
            shutil.copy(os.path.join(src, f), dst)
    for f in sorted(glob.glob(os.path.join(src, "*.safetensors"))):
        state = load_file(f)
        for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            stacked = state.pop(name).transpose(1, 2)  # [experts, out, in]
            experts, rows, k = stacked.shape
            blocks, scales = [], []
            for w in stacked:
                q = _core.QuantizedLinear(w.contiguous(), format="mxfp4").to_blocks()
                q = torch.frombuffer(bytearray(q), dtype=torch.uint8).reshape(rows, k // 32, 17)
                lo, hi = q[..., 1:] & 15, q[..., 1:] >> 4  # codes 0..15 and 16..31
                codes = torch.cat([lo, hi], dim=-1)
                blocks.append(codes[..., 0::2] | (codes[..., 1::2] << 4))
                scales.append(q[..., 0])
            state[name + "_blocks"] = torch.stack(blocks)
            state[name + "_scales"] = torch.stack(scales)
        save_file(state, os.path.join(dst, os.path.basename(f)), metadata={"format": "pt"})
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as fh:
            meta = json.load(fh)
        renamed = {}
        for n, file in meta["weight_map"].items():
            if n.endswith(("experts.gate_up_proj", "experts.down_proj")):
                renamed[n + "_blocks"] = renamed[n + "_scales"] = file
            else:
                renamed[n] = file
        meta["weight_map"] = renamed
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as fh:
            json.dump(meta, fh)
    with open(os.path.join(dst, "config.json")) as fh:
        config = json.load(fh)
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)


def qwen3_5_moe(V, eos):
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        vocab_size=V,
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        full_attention_interval=4,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=64,
        num_experts_per_tok=8,
        moe_intermediate_size=384,
        shared_expert_intermediate_size=384,
        max_position_embeddings=32768,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
        },
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )


def lfm2_moe(V, eos):
    from transformers import Lfm2MoeConfig

    attention = [2, 5, 8, 10, 12, 14]
    return Lfm2MoeConfig(
        vocab_size=V,
        hidden_size=1024,
        intermediate_size=3072,
        moe_intermediate_size=768,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        layer_types=["full_attention" if i in attention else "conv" for i in range(16)],
        conv_L_cache=3,
        num_dense_layers=2,
        num_experts=32,
        num_experts_per_tok=4,
        use_expert_bias=True,
        norm_topk_prob=True,
        max_position_embeddings=128000,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )


def qwen3_5_2b(V, eos):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=V,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        full_attention_interval=4,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        max_position_embeddings=32768,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
        },
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )


def lfm2_1_2b(V, eos):
    from transformers import Lfm2Config

    return Lfm2Config(
        vocab_size=V,
        hidden_size=2048,
        intermediate_size=12288,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        full_attn_idxs=[2, 5, 8, 10, 12, 14],
        conv_L_cache=3,
        block_auto_adjust_ff_dim=True,
        block_ffn_dim_multiplier=1.0,
        block_multiple_of=256,
        max_position_embeddings=128000,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )


def granite4_h_350m(V, eos):
    from transformers import GraniteMoeHybridConfig

    attention = (7, 15, 23, 31)
    return GraniteMoeHybridConfig(
        vocab_size=V,
        hidden_size=768,
        intermediate_size=2048,
        shared_intermediate_size=2048,
        num_hidden_layers=32,
        num_attention_heads=12,
        num_key_value_heads=4,
        layer_types=["attention" if i in attention else "mamba" for i in range(32)],
        position_embedding_type=None,
        num_local_experts=0,
        num_experts_per_tok=0,  # else the converter writes 2 used of 0 experts
        mamba_n_heads=48,
        mamba_d_head=32,
        mamba_n_groups=1,
        mamba_d_state=128,
        mamba_d_conv=4,
        mamba_expand=2,
        embedding_multiplier=12.0,
        attention_multiplier=1 / 64,
        residual_multiplier=0.246,
        logits_scaling=3.0,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )


def release_layer_types(folder):
    """Granite 4.0's config.json with layer_types in the released configs'
    words ("mamba", "attention"), which llama.cpp's converter reads."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    words = {"linear_attention": "mamba", "full_attention": "attention"}
    cfg["layer_types"] = [words.get(t, t) for t in cfg["layer_types"]]
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


def llama3_2_1b(V, eos):
    return LlamaConfig(
        vocab_size=V,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )


def write_sentence_transformers(folder, pooling, dim):
    """modules.json, 1_Pooling/config.json and 2_Normalize, as sentence-transformers saves them."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    with open(os.path.join(folder, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(folder, "1_Pooling"), exist_ok=True)
    os.makedirs(os.path.join(folder, "2_Normalize"), exist_ok=True)
    modes = {
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_lasttoken": pooling == "last",
    }
    with open(os.path.join(folder, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": dim, **modes}, f)


def pooling_models(tok, V, eos):
    """The BERT-base-, nomic-embed-text-, all-mpnet-base-v2-, EmbeddingGemma- and
    Qwen3-Embedding-0.6B-shaped pooling models."""
    from transformers import (
        BertConfig,
        BertModel,
        Gemma3TextConfig,
        Gemma3TextModel,
        MPNetConfig,
        MPNetModel,
        NomicBertConfig,
        NomicBertModel,
        Qwen3Config,
        Qwen3Model,
    )

    def save_bert_tokenizer(folder, max_len):
        """The tokenizer with BERT's [CLS] A [SEP] B [SEP] template and token types."""
        cls, sep = (
            tok.convert_tokens_to_ids("<|im_start|>"),
            tok.convert_tokens_to_ids("<|im_end|>"),
        )
        btok = Tokenizer.from_str(tok.backend_tokenizer.to_str())
        btok.post_processor = processors.TemplateProcessing(
            single="<|im_start|> $A <|im_end|>",
            pair="<|im_start|> $A <|im_end|> $B:1 <|im_end|>:1",
            special_tokens=[("<|im_start|>", cls), ("<|im_end|>", sep)],
        )
        PreTrainedTokenizerFast(
            tokenizer_object=btok,
            pad_token="<|endoftext|>",
            cls_token="<|im_start|>",
            sep_token="<|im_end|>",
            model_max_length=max_len,
        ).save_pretrained(folder)

    def save_embedder(model, name, folder, max_len):
        """Saves a BERT-tokenized embedding model: mean pooling, normalised."""
        print(name, "params", sum(p.numel() for p in model.parameters()))
        model.save_pretrained(folder, safe_serialization=True)
        save_bert_tokenizer(folder, max_len)
        write_sentence_transformers(folder, "mean", model.config.hidden_size)

    if "bert-base" in MODELS:
        cfg = BertConfig(
            vocab_size=V,
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            intermediate_size=3072,
            max_position_embeddings=512,
            pad_token_id=eos,
        )
        torch.manual_seed(0)
        model = BertModel(cfg, add_pooling_layer=False)
        print("bert-base params", sum(p.numel() for p in model.parameters()))
        model.save_pretrained(BERT_DIR, safe_serialization=True)
        save_bert_tokenizer(BERT_DIR, 512)
        write_sentence_transformers(BERT_DIR, "mean", 768)
    if "nomic-embed" in MODELS:
        cfg = NomicBertConfig(
            vocab_size=V,
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            intermediate_size=3072,
            max_position_embeddings=2048,
            pad_token_id=eos,
        )
        torch.manual_seed(0)
        save_embedder(NomicBertModel(cfg), "nomic-embed", NOMIC_DIR, 2048)
    if "mpnet-base" in MODELS:
        cfg = MPNetConfig(
            vocab_size=V,
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            intermediate_size=3072,
            max_position_embeddings=514,
        )
        torch.manual_seed(0)
        save_embedder(MPNetModel(cfg, add_pooling_layer=False), "mpnet-base", MPNET_DIR, 512)
    if "embeddinggemma" in MODELS:
        cfg = Gemma3TextConfig(
            vocab_size=V,
            hidden_size=768,
            intermediate_size=1152,
            num_hidden_layers=24,
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=256,
            query_pre_attn_scalar=256,
            max_position_embeddings=2048,
            sliding_window=512,
            use_bidirectional_attention=True,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
            pad_token_id=eos,
        )
        torch.manual_seed(0)
        save_embedder(Gemma3TextModel(cfg), "embeddinggemma", EMBEDDINGGEMMA_DIR, 2048)
    if "qwen3-embed" in MODELS:
        cfg = Qwen3Config(
            vocab_size=V,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            bos_token_id=eos,
            eos_token_id=eos,
            pad_token_id=eos,
        )
        torch.manual_seed(0)
        model = Qwen3Model(cfg)
        model.config.architectures = ["Qwen3ForCausalLM"]
        print("qwen3-embed params", sum(p.numel() for p in model.parameters()))
        model.save_pretrained(QWEN3_EMBED_DIR, safe_serialization=True)
        tok.save_pretrained(QWEN3_EMBED_DIR)
        write_sentence_transformers(QWEN3_EMBED_DIR, "last", 1024)


def main():
    os.makedirs(ROOT, exist_ok=True)
    tok = build_tokenizer()
    V = len(tok)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    print("tokenizer size", V, "eos id", eos)
    pooling_models(tok, V, eos)
    built = []
    for name, folder, make in (
        ("gemma3-1b", GEMMA3_DIR, gemma3_1b),
        ("phi4-mini", PHI4_DIR, phi4_mini),
        ("qwen3-moe", QWEN3_MOE_DIR, qwen3_moe),
        ("qwen3.5-2b", QWEN3_5_DIR, qwen3_5_2b),
        ("lfm2-1.2b", LFM2_DIR, lfm2_1_2b),
        ("granite4-h-350m", GRANITE4_H_DIR, granite4_h_350m),
        ("llama3.2-1b", LLAMA3_2_DIR, llama3_2_1b),
        ("qwen3.5-moe", QWEN3_5_MOE_DIR, qwen3_5_moe),
        ("lfm2-moe", LFM2_MOE_DIR, lfm2_moe),
        ("gpt-oss", GPT_OSS_DIR, gpt_oss),
    ):
        if name in MODELS:
            save_large(make(V, eos), folder, tok, eos)
            if name.startswith("granite4"):
                release_layer_types(folder)
            built.append(folder)
            if name == "gpt-oss":
                write_mxfp4_copy(folder, GPT_OSS_MXFP4_DIR)
                built.append(GPT_OSS_MXFP4_DIR)
    if "qwen2" not in MODELS and "tiny" not in MODELS:
        _plain_tokenizer_class(built)
        return

    # ---- bench model: Qwen2.5-0.5B shape ----
    cfg = Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        hidden_act="silu",
        max_position_embeddings=32768,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        use_cache=True,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        use_sliding_window=False,
        sliding_window=32768,
        max_window_layers=24,
        attention_dropout=0.0,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, do_sample=False
    )
    nparams = sum(p.numel() for p in model.parameters())
    print("qwen2 params", nparams)
    model.save_pretrained(QWEN_DIR, safe_serialization=True)
    tok.save_pretrained(QWEN_DIR)
    del model

    # ---- tiny llama ----
    tcfg = LlamaConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    torch.manual_seed(0)
    tiny = LlamaForCausalLM(tcfg).to(torch.bfloat16)
    tiny.config.dtype = torch.bfloat16
    tiny.generation_config = GenerationConfig(
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, do_sample=False
    )
    print("tiny params", sum(p.numel() for p in tiny.parameters()))
    tiny.save_pretrained(TINY_DIR, safe_serialization=True)
    tok.save_pretrained(TINY_DIR)
    _plain_tokenizer_class([QWEN_DIR, TINY_DIR, *built])


def _plain_tokenizer_class(folders):
    # transformers 5 writes tokenizer_class "TokenizersBackend", unknown to transformers 4.x;
    # "PreTrainedTokenizerFast" loads in both (plain tokenizer.json-backed fast tokenizer);
    # Phi-3's converter reads a byte-level vocabulary only under "GPT2Tokenizer".
    for d in folders:
        p = os.path.join(d, "tokenizer_config.json")
        with open(p, encoding="utf-8") as f:
            c = json.load(f)
        c["tokenizer_class"] = "GPT2Tokenizer" if d == PHI4_DIR else "PreTrainedTokenizerFast"
        with open(p, "w", encoding="utf-8") as f:
            json.dump(c, f, indent=2)


if __name__ == "__main__":
    main()
