"""Tiny random Hugging Face checkpoints (Llama variants and the other model families jserve
serves; and a tokenizer) for loader and parity tests.

Everything is built locally (no hub access) and cached per process: ``tiny_llama_dir`` writes
each variant once into a temp dir, ``tiny_llama_model`` keeps the torch model it came from.
Cached directories and models are shared between tests: treat them as read-only.
"""
from __future__ import annotations

import atexit
import copy
import functools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the hub

import torch  # noqa: E402
import transformers  # noqa: E402
from tokenizers import (  # noqa: E402
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)

_COMMON: dict[str, Any] = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                               vocab_size=512, head_dim=16, num_attention_heads=4,
                               bos_token_id=1, eos_token_id=2)
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}

# HF LlamaConfig kwargs per family. transformers 5 takes rope settings as ``rope_parameters``
# (rope_theta inside it) and writes them to config.json under that key.
CONFIGS: dict[str, dict[str, Any]] = {
    "llama2": dict(_COMMON, num_key_value_heads=4,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "llama3": dict(_COMMON, num_key_value_heads=2, eos_token_id=[2, 3],
                   rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    # max_position_embeddings far above original_max_position_embeddings, so scaling matters.
    "llama31": dict(_COMMON, num_key_value_heads=2, eos_token_id=[2, 3],
                    max_position_embeddings=512, rope_parameters=_LLAMA3_ROPE),
    "llama32": dict(_COMMON, num_key_value_heads=2, eos_token_id=[2, 3],
                    max_position_embeddings=512, rope_parameters=dict(_LLAMA3_ROPE, factor=32.0),
                    tie_word_embeddings=True),
}

# Depth is where a per-layer indexing mistake in the stacked weights / KV cache shows: one
# 16-layer model checked against transformers like the families above (not in the matrix).
DEEP_CONFIGS: dict[str, dict[str, Any]] = {
    "llama3-16layers": dict(CONFIGS["llama3"], num_hidden_layers=16),
}

# The other families (jserve.model.families), on shapes off the usual ones: GQA ratios other
# than 4 and head_dim not 64/128. Qwen2: 6 query heads on 1 KV head (tp=2 copies it), head_dim
# 24, tied embeddings, rope theta 1e6, q/k/v biases. Qwen3: 6 on 2, head_dim 40 (not
# hidden / heads), q/k norms. Weights drawn 10x wider than HF's default: at 0.02 the tied
# Qwen2 only repeats the prompt's last token, which a broken layer would do too.
GEMMA3_WINDOW = 20  # shorter than the 45-token prompt, over a page boundary
FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2": dict(_COMMON, initializer_range=0.2, hidden_size=144, num_attention_heads=6,
                  num_key_value_heads=1, head_dim=24, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen3": dict(_COMMON, initializer_range=0.2, num_attention_heads=6, num_key_value_heads=2,
                  head_dim=40, rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
    # Gemma 3: 6 query heads on 2 KV heads, head_dim 20 beside hidden / heads = 16, scores
    # scaled by 32 ** -0.5, local layers (window GEMMA3_WINDOW) and one global layer in
    # four (the third: a pipeline stage's first layer is a local one in either stage), RoPE
    # bases 1000 (local) and 50000 with linear scaling 4 (global), logits (up to ~0.8)
    # capped at 0.6. HF's initializer_range: wider weights only repeat the last token.
    "gemma3": dict(_COMMON, hidden_size=96, num_hidden_layers=4,
                   num_attention_heads=6, num_key_value_heads=2, head_dim=20,
                   query_pre_attn_scalar=32, sliding_window=GEMMA3_WINDOW,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                "sliding_attention"],
                   final_logit_softcapping=0.6, pad_token_id=0, bos_token_id=2,
                   eos_token_id=1,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                       "rope_theta": 50000.0},
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 1000.0}}),
    # Mixtral: 4 experts, top-2, the experts' MLPs 96 wide, 6 query heads on 2 KV heads;
    # weights drawn wide like Qwen's so that the router's choices vary from token to token.
    "mixtral": dict(_COMMON, initializer_range=0.2, intermediate_size=96,
                    num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                    num_local_experts=4, num_experts_per_tok=2,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # Qwen2-MoE: 4 experts 48 wide, top-2 not renormalised (its default), a shared expert 80
    # wide under its sigmoid gate, q/k/v biases, 6 query heads on 2 KV heads. Qwen3-MoE: 8
    # experts 32 wide, top-3 renormalised (what the released models set), q/k norms,
    # head_dim 40. Wide weights as Mixtral's.
    "qwen2_moe": dict(_COMMON, initializer_range=0.2, num_attention_heads=6,
                      num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=48, shared_expert_intermediate_size=80,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen3_moe": dict(_COMMON, initializer_range=0.2, num_attention_heads=6,
                      num_key_value_heads=2, head_dim=40, num_experts=8, num_experts_per_tok=3,
                      moe_intermediate_size=32, norm_topk_prob=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # gpt-oss: 4 experts 48 wide, top-2 (softmax over the chosen logits), the router's and
    # the experts' biases, a sink logit per head, windowed (GEMMA3_WINDOW) and full layers
    # in turn, YaRN RoPE stretching a 32-token original context 4 times (so its ramp and
    # cos/sin factor matter at these prompts), 6 query heads on 2 KV heads. Its SwiGLU
    # clamp at 1.5 bites at these weights (gpt-oss's own limit is 7).
    "gpt_oss": dict(_COMMON, initializer_range=0.2, intermediate_size=48,
                    num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=GEMMA3_WINDOW,
                    layer_types=["sliding_attention", "full_attention"], swiglu_limit=1.5,
                    max_position_embeddings=128,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0,
                                     "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False,
                                     "original_max_position_embeddings": 32}),
}
# Qwen2-MoE on 4 query heads (2 KV heads): tp=4 splits it (tests/test_multihost.py; not in
# FAMILY_CONFIGS' matrix, whose 6 heads tp=4 cannot split).
EXTRA_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2_moe-4heads": dict(FAMILY_CONFIGS["qwen2_moe"], num_attention_heads=4,
                             num_key_value_heads=2),
}
# Sliding-window checkpoints (tests/test_sliding_window.py; not in FAMILY_CONFIGS, whose
# every entry runs test_model_families' whole matrix). Mistral: 6 query heads on 2 KV heads,
# head_dim 20 beside hidden / heads = 16, window 24 (under two pages of 16, shorter than the
# 100-token prompt). Qwen2 with use_sliding_window: the layers from max_window_layers (1)
# on are windowed, layer 0 is not.
SWA_WINDOW = 24
WINDOWED_CONFIGS: dict[str, dict[str, Any]] = {
    "mistral": dict(_COMMON, initializer_range=0.2, hidden_size=96, num_attention_heads=6,
                    num_key_value_heads=2, head_dim=20, sliding_window=SWA_WINDOW,
                    max_position_embeddings=512,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "qwen2-swa": dict(FAMILY_CONFIGS["qwen2"], use_sliding_window=True,
                      sliding_window=SWA_WINDOW, max_window_layers=1),
}
# transformers (config, model) class names by config name; Llama where not listed.
_HF_CLASSES = {"mistral": ("MistralConfig", "MistralForCausalLM"),
               "qwen2-swa": ("Qwen2Config", "Qwen2ForCausalLM"),
               "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
               "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
               "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
               "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
               "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
               "qwen2_moe-4heads": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
               "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
               "gpt_oss": ("GptOssConfig", "GptOssForCausalLM")}

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|eot_id|>"]  # ids 0..3, matching the configs above

CHAT_TEMPLATE = (
    "{% for message in messages %}\n"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}\n"
    "{{ bos_token if loop.first else '' }}<|{{ message['role'] }}|>\n"
    "    {% if message['role'] == 'system' %}{{ message['content'] | tojson }}"
    "{% else %}{{ message['content'] | trim }}{% endif %}{{ eos_token }}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today?",
    "JAX compiles numerical programs with XLA for accelerators.",
    "Paged attention keeps the key value cache in fixed size blocks.",
    "Grüße aus Köln, naïve café, déjà vu — ünïcödé text.",
    "日本語のテキストと絵文字 🙂 も少し。",
    "def forward(x): return x @ w + b  # code, too",
]


def tiny_hf_config(name: str) -> transformers.PretrainedConfig:
    known = CONFIGS | DEEP_CONFIGS | FAMILY_CONFIGS | EXTRA_CONFIGS | WINDOWED_CONFIGS
    if name not in known:
        raise KeyError(f"unknown tiny config {name!r}; choose from {sorted(known)}")
    return getattr(transformers, _HF_CLASSES.get(name, ("LlamaConfig",))[0])(**known[name])


@functools.cache
def tiny_llama_model(name: str) -> transformers.PreTrainedModel:
    """The float32 torch model behind ``tiny_llama_dir(name)`` (a Llama, or the family
    ``FAMILY_CONFIGS`` names), seeded, in eval mode.

    Norm weights (q/k norms too) are jittered away from HF's all-ones init and biases away
    from its zeros, so a mixed-up norm or bias shows in parity.
    """
    torch.manual_seed(0)
    model_class = getattr(transformers, _HF_CLASSES.get(name, (None, "LlamaForCausalLM"))[1])
    model = model_class(tiny_hf_config(name)).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(("norm.weight", ".bias", "_bias")):
                p.add_(0.1 * torch.randn_like(p))
    return model


def write_tiny_tokenizer(out_dir: Path) -> Path:
    """A byte-level BPE tokenizer.json with a Llama-like BOS post-processor, plus its config."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_TRAINING_TEXT, trainer)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                      special_tokens=[("<s>", 1)]),
    ])
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        # The AddedToken dict form older Llama configs use.
        "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": False,
                      "normalized": False, "rstrip": False, "single_word": False},
        "unk_token": "<unk>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def write_tiny_llama(name: str, out_dir: Path, *, max_shard_size: str | None = None,
                     with_tokenizer: bool = False, dtype: str = "float32") -> Path:
    """``save_pretrained`` the tiny model ``name`` (optionally sharded, bf16, with tokenizer)."""
    model = tiny_llama_model(name)
    if dtype != "float32":
        model = copy.deepcopy(model).to(getattr(torch, dtype))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out_dir, **kwargs)
    if with_tokenizer:
        write_tiny_tokenizer(out_dir)
    return out_dir


@functools.cache
def _cache_root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="jserve-tiny-hf-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@functools.cache
def tiny_llama_dir(name: str, *, max_shard_size: str | None = None,
                   with_tokenizer: bool = False, dtype: str = "float32") -> Path:
    """Process-wide cached ``write_tiny_llama``: each variant is written once. Read-only."""
    variant = "-".join([name, dtype, f"shard{max_shard_size}" if max_shard_size else "single",
                        "tok" if with_tokenizer else "notok"])
    return write_tiny_llama(name, _cache_root() / variant, max_shard_size=max_shard_size,
                            with_tokenizer=with_tokenizer, dtype=dtype)


@functools.cache
def tiny_tokenizer_dir() -> Path:
    """A directory holding only the tiny tokenizer files. Read-only."""
    return write_tiny_tokenizer(_cache_root() / "tokenizer")


# -- a Llama-3-style chat checkpoint (the kind a user brings) ------------------------------
# Byte-level BPE trained here, Llama 3's pre-tokenizer split and special tokens (after the
# trained vocabulary, as in Llama 3), its header-style chat template with a tools section,
# EOS on <|end_of_text|>, <|eom_id|> and <|eot_id|> (Llama 3.1 instruct's generation config),
# and an embedding padded past the tokenizer's vocabulary.
LLAMA3_SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                         "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
                         "<|finetune_right_pad_id|>"]
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

LLAMA3_CHAT_TEMPLATE = (  # no newline right after a block tag: trim_blocks would eat it
    "{{ bos_token }}"
    "{% if tools is not none %}<|start_header_id|>system<|end_header_id|>\n\n"
    "Environment: ipython\nYou may call these functions:"
    "{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{{ '\\n' }}"
    "To call one, answer with {\"name\": function name, \"parameters\": its arguments}."
    "<|eot_id|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n"
    "{{ m.content }}<|eot_id|>"
    "{% elif m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for c in m.tool_calls %}"
    "{{ {'name': c.function.name, 'parameters': c.function.arguments} | tojson }}"
    "{% if not loop.last %}; {% endif %}{% endfor %}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{{ m.content | trim }}<|eot_id|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}")


def _llama3_corpus() -> list[str]:
    """Prose, code and JSON (objects, tool calls, arrays), so that merges span quotes,
    braces, keys and digits as a real vocabulary's do."""
    words = ["alpha", "beta", "gamma", "Paris", "Oslo", "Lima", "weather", "city", "days",
             "zone", "name", "parameters", "get_weather", "get_time", "true", "false", "null"]
    docs = list(_TRAINING_TEXT)
    for i in range(200):
        a, b = words[i % len(words)], words[(i * 7 + 3) % len(words)]
        docs += [
            json.dumps({"name": a, "age": i % 97, "tags": [b, a[:3]], "ok": i % 2 == 0}),
            json.dumps([{"name": "get_weather", "parameters": {"city": b, "days": i % 7}}]),
            json.dumps({a: {b: [i, i * 31 % 1000, -i / 8]}}, separators=(",", ":")),
            f"The {a} of {b} is {i * 13 % 1000}; call {a}_{b}({i}) -> {b.upper()}-{i:04d}.",
            f"<p class=\"{a}\">{b} & {a}</p>\n  if x[{i}] != '{b}': y += {i}\n",
        ]
    return docs


def _byte_level_bpe(vocab_size: int, special_tokens: tuple[str, ...] = ()):
    """An untrained byte-level BPE with Llama 3's pre-tokenizer split, and its trainer
    (``special_tokens`` take the first ids)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                    special_tokens=list(special_tokens),
                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet())


def write_llama3_tokenizer(out_dir: Path, vocab_size: int = 1200) -> Path:
    """A trained byte-level BPE tokenizer.json in Llama 3's layout, its tokenizer_config.json
    (BOS, EOS <|eot_id|>, the chat template) beside it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok, trainer = _byte_level_bpe(vocab_size)
    tok.train_from_iterator(_llama3_corpus(), trainer)
    tok.add_special_tokens(LLAMA3_SPECIAL_TOKENS)
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                      special_tokens=[(bos, tok.token_to_id(bos))]),
    ])
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos,
              "eos_token": "<|eot_id|>", "clean_up_tokenization_spaces": True,
              "model_max_length": 2048, "chat_template": LLAMA3_CHAT_TEMPLATE}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def write_llama3_chat_checkpoint(out_dir: Path) -> Path:
    """A random-weight ``LlamaForCausalLM`` (2 layers, hidden 64) saved by transformers with
    ``write_llama3_tokenizer``'s tokenizer: config.json, generation_config.json (its three
    EOS ids), model.safetensors, tokenizer.json, tokenizer_config.json."""
    write_llama3_tokenizer(out_dir)
    tok = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    n = tok.get_vocab_size(with_added_tokens=True)
    ids = {t: tok.token_to_id(t) for t in LLAMA3_SPECIAL_TOKENS}
    config = transformers.LlamaConfig(**dict(
        _COMMON, num_key_value_heads=2, vocab_size=(n // 64 + 1) * 64,  # padded, as Qwen's
        max_position_embeddings=2048, bos_token_id=ids["<|begin_of_text|>"],
        eos_token_id=[ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]],
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}))
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(out_dir)
    return out_dir


@functools.cache
def llama3_chat_dir() -> Path:
    """Process-wide cached ``write_llama3_chat_checkpoint``. Read-only."""
    return write_llama3_chat_checkpoint(_cache_root() / "llama3-chat")


# -- a gpt-oss checkpoint speaking harmony ---------------------------------------------------
# Harmony's special tokens after a trained byte-level BPE, EOS on <|return|>, <|call|> and
# <|endoftext|> (gpt-oss's generation config), and a harmony chat template of our own: a
# developer message listing the tools, each turn <|start|>ROLE<|message|>...<|end|>, an
# assistant turn's reasoning on the analysis channel and its answer on final, its calls on
# commentary to=functions.NAME; the generation prompt ends with <|start|>assistant.
HARMONY_SPECIAL_TOKENS = ["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>",
                          "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
                          "<|call|>"]
HARMONY_CHAT_TEMPLATE = (
    "{% if tools %}<|start|>developer<|message|># Tools{% for t in tools %}"
    "{{ '\\n' }}functions.{{ t.function.name }}: {{ t.function.description }}{% endfor %}"
    "<|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}"
    "{% if m.reasoning_content %}<|start|>assistant<|channel|>analysis<|message|>"
    "{{ m.reasoning_content }}<|end|>{% endif %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<|start|>assistant<|channel|>commentary"
    " to=functions.{{ c.function.name }} <|constrain|>json<|message|>"
    "{{ c.function.arguments }}<|call|>{% endfor %}"
    "{% else %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{% endif %}"
    "{% elif m.role == 'tool' %}<|start|>functions.{{ m.name }} to=assistant<|channel|>"
    "commentary<|message|>{{ m.content }}<|end|>"
    "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")


def write_gpt_oss_chat_checkpoint(out_dir: Path) -> Path:
    """A random-weight ``GptOssForCausalLM`` (``FAMILY_CONFIGS["gpt_oss"]``, YaRN to a
    512-token context) saved by transformers with a trained tokenizer holding harmony's special
    tokens and ``HARMONY_CHAT_TEMPLATE``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok, trainer = _byte_level_bpe(1200)
    tok.train_from_iterator(_llama3_corpus(), trainer)
    tok.add_special_tokens(HARMONY_SPECIAL_TOKENS)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|return|>",
              "pad_token": "<|endoftext|>", "model_max_length": 512,
              "chat_template": HARMONY_CHAT_TEMPLATE}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    n = tok.get_vocab_size(with_added_tokens=True)
    ids = {t: tok.token_to_id(t) for t in HARMONY_SPECIAL_TOKENS}
    hf = transformers.GptOssConfig(**dict(
        FAMILY_CONFIGS["gpt_oss"], vocab_size=(n // 64 + 1) * 64, max_position_embeddings=512,
        rope_parameters=dict(FAMILY_CONFIGS["gpt_oss"]["rope_parameters"],
                             original_max_position_embeddings=128),
        bos_token_id=ids["<|startoftext|>"], pad_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|return|>"], ids["<|call|>"], ids["<|endoftext|>"]]))
    torch.manual_seed(0)
    transformers.GptOssForCausalLM(hf).eval().save_pretrained(out_dir)
    return out_dir


@functools.cache
def gpt_oss_chat_dir() -> Path:
    """Process-wide cached ``write_gpt_oss_chat_checkpoint``. Read-only."""
    return write_gpt_oss_chat_checkpoint(_cache_root() / "gpt-oss-chat")


# -- a Qwen-style ChatML checkpoint whose template asks for Hermes tool calls --------------
# ChatML turns (<|im_start|>role ... <|im_end|>), no BOS, EOS <|im_end|> (and <|endoftext|>
# in generation_config.json), <tool_call> and </tool_call> as added tokens that are not special
# (so they decode into the text the parser reads), a template written for these tests that
# lists the tools as JSON lines and asks for <tool_call> blocks (jserve.serving.hermes_tools).
HERMES_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
HERMES_TAGS = ["<tool_call>", "</tool_call>"]

HERMES_CHAT_TEMPLATE = (  # no newline right after a block tag: trim_blocks would eat it
    "{% set first = 1 if messages and messages[0].role == 'system' else 0 %}"
    "{% if tools %}<|im_start|>system\n"
    "{% if first %}{{ messages[0].content }}{{ '\\n\\n' }}{% endif %}"
    "Functions you may call, one JSON signature a line:\n<tools>"
    "{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{{ '\\n' }}</tools>\n"
    "Answer a call as a block of its own:\n<tool_call>\n"
    "{\"name\": the function, \"arguments\": an object of its arguments}\n</tool_call>"
    "<|im_end|>\n"
    "{% elif first %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages[first:] %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}"
    "\n</tool_response><|im_end|>\n"
    "{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{{ m.content or '' }}{% for c in m.tool_calls %}"
    "{% if m.content or not loop.first %}{{ '\\n' }}{% endif %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_chatml_tokenizer(out_dir: Path, tags: list[str], template: str,
                           extra_corpus: list[str] = (), vocab_size: int = 1200) -> Tokenizer:
    """A trained byte-level BPE tokenizer.json (Llama 3's split, as Qwen's is close to it)
    with ChatML's special tokens and ``tags`` as added tokens that are not special, and its
    tokenizer_config.json (EOS <|im_end|>, ``template``); returns the tokenizer."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok, trainer = _byte_level_bpe(vocab_size)
    tok.train_from_iterator(_llama3_corpus() + list(extra_corpus), trainer)
    tok.add_special_tokens(HERMES_SPECIAL_TOKENS)
    tok.add_tokens(tags)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
              "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "clean_up_tokenization_spaces": False, "model_max_length": 2048,
              "chat_template": template}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tok


def write_hermes_tokenizer(out_dir: Path, vocab_size: int = 1200) -> Path:
    """``write_chatml_tokenizer`` with the <tool_call> tags and ``HERMES_CHAT_TEMPLATE``,
    trained on some calls too."""
    calls = [json.dumps({"name": f, "arguments": {"city": c, "days": d}})
             for f in ("get_weather", "get_time") for c in ("Paris", "Oslo", "Lima")
             for d in range(1, 4)]
    write_chatml_tokenizer(out_dir, HERMES_TAGS, HERMES_CHAT_TEMPLATE, calls, vocab_size)
    return out_dir


def save_chatml_model(out_dir: Path, tok: Tokenizer, family: str, seed: int,
                      **config) -> Path:
    """A random-weight model of ``_HF_CLASSES``' ``family`` (Llama where not listed) for
    ``tok``'s vocabulary (the embedding padded past it), EOS <|im_end|> and <|endoftext|>,
    no BOS, saved beside the tokenizer."""
    n = tok.get_vocab_size(with_added_tokens=True)
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    config_cls, model_cls = _HF_CLASSES.get(family, ("LlamaConfig", "LlamaForCausalLM"))
    hf_config = getattr(transformers, config_cls)(**dict(
        config, vocab_size=(n // 64 + 1) * 64, max_position_embeddings=2048,
        bos_token_id=None, eos_token_id=eos))
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(hf_config).eval()
    model.generation_config.eos_token_id = eos
    model.save_pretrained(out_dir)
    return out_dir


def write_hermes_chat_checkpoint(out_dir: Path) -> Path:
    """A random-weight ``LlamaForCausalLM`` (2 layers, hidden 64) with
    ``write_hermes_tokenizer``'s tokenizer (``save_chatml_model``)."""
    write_hermes_tokenizer(out_dir)
    return save_chatml_model(
        out_dir, Tokenizer.from_file(str(out_dir / "tokenizer.json")), "llama", 1,
        **dict(_COMMON, num_key_value_heads=2,
               rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}))


@functools.cache
def hermes_chat_dir() -> Path:
    """Process-wide cached ``write_hermes_chat_checkpoint``. Read-only."""
    return write_hermes_chat_checkpoint(_cache_root() / "hermes-chat")


# -- a Mistral-style [INST] chat checkpoint (sliding-window attention) ----------------------
# SentencePiece-era special tokens <unk>, <s>, </s> and the [INST] / [/INST] control tokens,
# BOS from the template (not the post-processor), a template written for these tests in
# Mistral's shape: a system message goes in front of the first user turn, an assistant turn
# ends with EOS.
MISTRAL_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]

MISTRAL_CHAT_TEMPLATE = (
    "{% set system = messages[0].content if messages and messages[0].role == 'system' "
    "else none %}"
    "{{ bos_token }}"
    "{% for m in messages if m.role != 'system' %}"
    "{% if m.role == 'user' %}[INST] "
    "{% if system and loop.first %}{{ system }}{{ '\\n\\n' }}{% endif %}"
    "{{ m.content | trim }} [/INST]"
    "{% elif m.role == 'assistant' %} {{ m.content | trim }}{{ eos_token }}"
    "{% else %}{{ raise_exception('roles are system, user and assistant') }}{% endif %}"
    "{% endfor %}")


# Mistral 7B v0.3's tool calling: its control tokens and a template in its shape (the tools
# before the last user turn, calls as [TOOL_CALLS] and a JSON array, results as
# [TOOL_RESULTS]), which refuses call ids that are not nine characters, as Mistral's do.
MISTRAL_TOOL_TOKENS = ["[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                       "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
_NINE = ("{% if {id} is not defined or {id} | length != 9 %}"
         "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
         "{% endif %}")
MISTRAL_TOOLS_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}"
    "{% if tools and loop.last %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}[INST] {{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS] ["
    "{% for c in m.tool_calls %}" + _NINE.replace("{id}", "c.id") +
    "{{ {'name': c.function.name, 'arguments': c.function.arguments, 'id': c.id} | tojson }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}"
    "{% elif m.role == 'assistant' %} {{ m.content }}{{ eos_token }}"
    "{% elif m.role == 'tool' %}" + _NINE.replace("{id}", "m.tool_call_id") +
    "[TOOL_RESULTS] {{ {'content': m.content, 'call_id': m.tool_call_id} | tojson }}"
    "[/TOOL_RESULTS]"
    "{% else %}{{ raise_exception('roles are user, assistant and tool') }}{% endif %}"
    "{% endfor %}")


def write_mistral_chat_checkpoint(out_dir: Path, tool_tokens: bool = False) -> Path:
    """A random-weight ``MistralForCausalLM`` (``WINDOWED_CONFIGS["mistral"]``'s shape and
    window, the embedding padded past the vocabulary) with a trained byte-level BPE,
    Mistral's special tokens and ``MISTRAL_CHAT_TEMPLATE``; ``tool_tokens``: also its tool
    control tokens and ``MISTRAL_TOOLS_TEMPLATE``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok, trainer = _byte_level_bpe(1200)
    tok.train_from_iterator(_llama3_corpus(), trainer)
    tok.add_special_tokens(MISTRAL_SPECIAL_TOKENS + (MISTRAL_TOOL_TOKENS if tool_tokens else []))
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "clean_up_tokenization_spaces": False, "model_max_length": 2048,
        "chat_template": MISTRAL_TOOLS_TEMPLATE if tool_tokens else MISTRAL_CHAT_TEMPLATE},
        indent=2))
    n = tok.get_vocab_size(with_added_tokens=True)
    config = transformers.MistralConfig(**dict(
        WINDOWED_CONFIGS["mistral"], vocab_size=(n // 64 + 1) * 64,
        bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>")))
    torch.manual_seed(2)
    transformers.MistralForCausalLM(config).eval().save_pretrained(out_dir)
    return out_dir


@functools.cache
def mistral_chat_dir() -> Path:
    """Process-wide cached ``write_mistral_chat_checkpoint``. Read-only."""
    return write_mistral_chat_checkpoint(_cache_root() / "mistral-chat")


@functools.cache
def mistral_tools_dir() -> Path:
    """Process-wide cached ``write_mistral_chat_checkpoint(tool_tokens=True)``. Read-only."""
    return write_mistral_chat_checkpoint(_cache_root() / "mistral-tools", tool_tokens=True)


# -- a Gemma-3-style chat checkpoint -------------------------------------------------------
# FAMILY_CONFIGS["gemma3"]'s model with a byte-level BPE whose first ids are Gemma's special
# tokens (<pad> 0, <eos> 1, <bos> 2 as the config says, then the turn markers), a template
# written for these tests in Gemma's turn format (<start_of_turn>user|model ... <end_of_turn>,
# a system message folded into the first user turn, roles alternating), and EOS on <eos> and
# <end_of_turn> in generation_config.json (config.json: <eos> only), as Gemma 3 instruct has.
GEMMA_SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")

GEMMA_CHAT_TEMPLATE = (  # no newline right after a block tag: trim_blocks would eat it
    "{{ bos_token }}"
    "{% set first = 1 if messages and messages[0].role == 'system' else 0 %}"
    "{% for m in messages[first:] %}"
    "{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{% if loop.first and first %}{{ messages[0].content | trim }}\n\n{% endif %}"
    "{{ m.content | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def write_gemma3_chat_checkpoint(out_dir: Path) -> Path:
    """``tiny_llama_model("gemma3")`` saved with a Gemma-style tokenizer and chat template."""
    write_tiny_llama("gemma3", out_dir)
    tok, trainer = _byte_level_bpe(480, GEMMA_SPECIAL_TOKENS)
    tok.train_from_iterator(_llama3_corpus(), trainer)
    assert [tok.token_to_id(t) for t in GEMMA_SPECIAL_TOKENS] == list(range(6))
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                      special_tokens=[("<bos>", 2)])])
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
              "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
              "clean_up_tokenization_spaces": False, "model_max_length": 2048,
              "chat_template": GEMMA_CHAT_TEMPLATE}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    transformers.GenerationConfig(bos_token_id=2, pad_token_id=0,
                                  eos_token_id=[1, 5]).save_pretrained(out_dir)
    return out_dir


@functools.cache
def gemma3_chat_dir() -> Path:
    """Process-wide cached ``write_gemma3_chat_checkpoint``. Read-only."""
    return write_gemma3_chat_checkpoint(_cache_root() / "gemma3-chat")


# -- a Qwen3 thinking checkpoint: ChatML, <think> and </think> as added tokens -----------------
# As Qwen3's: the tags are added tokens that are not special (they decode into the text the
# reasoning parser reads), the template's enable_thinking=false closes an empty block at the
# end of the generation prompt; this template's own open_thinking=true leaves one open there
# instead (as DeepSeek-R1's and QwQ's templates do).
THINK_TAGS = ["<think>", "</think>"]
THINKING_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% elif open_thinking is defined and open_thinking %}<think>\n{% endif %}{% endif %}")


def write_qwen3_moe_chat_checkpoint(out_dir: Path) -> Path:
    """A random-weight ``Qwen3MoeForCausalLM`` (FAMILY_CONFIGS' shape) with
    ``write_hermes_tokenizer``'s tokenizer: what a Qwen3-30B-A3B is served as (ChatML, Hermes
    tool calls)."""
    write_hermes_tokenizer(out_dir)
    return save_chatml_model(out_dir, Tokenizer.from_file(str(out_dir / "tokenizer.json")),
                             "qwen3_moe", 5, **FAMILY_CONFIGS["qwen3_moe"])


@functools.cache
def qwen3_moe_chat_dir() -> Path:
    """Process-wide cached ``write_qwen3_moe_chat_checkpoint``. Read-only."""
    return write_qwen3_moe_chat_checkpoint(_cache_root() / "qwen3-moe-chat")


def write_qwen3_thinking_checkpoint(out_dir: Path) -> Path:
    """A random-weight ``Qwen3ForCausalLM`` (FAMILY_CONFIGS' shape) with a ChatML tokenizer
    (``write_chatml_tokenizer``) whose added tokens are the think tags, and
    ``THINKING_CHAT_TEMPLATE``."""
    tok = write_chatml_tokenizer(out_dir, THINK_TAGS, THINKING_CHAT_TEMPLATE)
    return save_chatml_model(out_dir, tok, "qwen3", 3, **FAMILY_CONFIGS["qwen3"])


@functools.cache
def qwen3_thinking_dir() -> Path:
    """Process-wide cached ``write_qwen3_thinking_checkpoint``. Read-only."""
    return write_qwen3_thinking_checkpoint(_cache_root() / "qwen3-thinking")


# -- embedding checkpoints, written by sentence-transformers -----------------------------------
def write_qwen3_embedding_checkpoint(out_dir: Path, pooling: str = "lasttoken",
                                     matryoshka: list[int] | None = None,
                                     **sizes) -> Path:
    """A random-weight ``Qwen3Model`` (FAMILY_CONFIGS' shape) saved by sentence-transformers
    as Qwen3-Embedding is: Transformer, Pooling (``pooling``), Normalize; a trained ChatML
    tokenizer whose post-processor ends every input with <|endoftext|> (Qwen3-Embedding's
    last-token pooling reads it) and no chat template (so sentence-transformers encodes
    plain text). ``matryoshka``: config.json's ``matryoshka_dimensions``; ``sizes``: Qwen3Config
    fields over FAMILY_CONFIGS' (scripts/bench_embeddings.py's larger model)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Normalize,
        Pooling,
        Transformer,
    )
    src = out_dir.with_name(out_dir.name + "-src")
    tok = write_chatml_tokenizer(src, [], None)
    eot = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", eot)])
    tok.save(str(src / "tokenizer.json"))
    n = tok.get_vocab_size(with_added_tokens=True)
    extra = {"matryoshka_dimensions": matryoshka} if matryoshka else {}
    config = transformers.Qwen3Config(**dict(
        FAMILY_CONFIGS["qwen3"], vocab_size=(n // 64 + 1) * 64, max_position_embeddings=2048,
        bos_token_id=None, eos_token_id=eot, **extra, **sizes))
    torch.manual_seed(7)
    transformers.Qwen3Model(config).eval().save_pretrained(src)
    module = Transformer(str(src))
    model = SentenceTransformer(modules=[
        module, Pooling(config.hidden_size, pooling_mode=pooling), Normalize()], device="cpu")
    model.save(str(out_dir))
    shutil.rmtree(src)
    return out_dir


@functools.cache
def qwen3_embedding_dir(pooling: str = "lasttoken") -> Path:
    """Process-wide cached ``write_qwen3_embedding_checkpoint`` (the last-token one with
    Matryoshka sizes 16 and 32). Read-only."""
    return write_qwen3_embedding_checkpoint(
        _cache_root() / f"qwen3-embedding-{pooling}", pooling,
        [16, 32] if pooling == "lasttoken" else None)


def write_qwen3_cross_encoder_checkpoint(out_dir: Path) -> Path:
    """A random-weight one-label ``Qwen3ForSequenceClassification`` saved by
    sentence-transformers' ``CrossEncoder`` (activation Sigmoid), with the ChatML tokenizer
    of ``write_qwen3_embedding_checkpoint`` whose post-processor joins a pair as
    ``A <|endoftext|> B <|endoftext|>``. Its pad token (which transformers' classifier
    needs: it pools the last token that is not one) is <|im_start|>, which no input holds,
    so the last token is pooled, as jserve does."""
    from sentence_transformers import CrossEncoder
    src = out_dir.with_name(out_dir.name + "-src")
    tok = write_chatml_tokenizer(src, [], None)
    eot = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", pair="$A <|endoftext|> $B:1 <|endoftext|>:1",
        special_tokens=[("<|endoftext|>", eot)])
    tok.save(str(src / "tokenizer.json"))
    tok_config = json.loads((src / "tokenizer_config.json").read_text())
    tok_config["pad_token"] = "<|im_start|>"  # what a batch is padded with, too
    (src / "tokenizer_config.json").write_text(json.dumps(tok_config))
    n = tok.get_vocab_size(with_added_tokens=True)
    config = transformers.Qwen3Config(**dict(
        FAMILY_CONFIGS["qwen3"], vocab_size=(n // 64 + 1) * 64, max_position_embeddings=2048,
        bos_token_id=None, eos_token_id=eot, pad_token_id=tok.token_to_id("<|im_start|>"),
        num_labels=1))
    torch.manual_seed(11)
    transformers.Qwen3ForSequenceClassification(config).eval().save_pretrained(src)
    CrossEncoder(str(src), device="cpu").save(str(out_dir))
    shutil.rmtree(src)
    return out_dir


@functools.cache
def qwen3_cross_encoder_dir() -> Path:
    """Process-wide cached ``write_qwen3_cross_encoder_checkpoint``. Read-only."""
    return write_qwen3_cross_encoder_checkpoint(_cache_root() / "qwen3-cross-encoder")
