"""A trained byte-level BPE tokenizer in Llama 3's layout for the benchmark checkpoints that
another server must load too (``bench_checkpoint.llama_bpe_checkpoint``): a real vocabulary
(32K merges, as Llama 2 / Mistral) tokenizes and detokenizes at the cost a user's does, where
the byte tokenizer would flatter both servers. Trained offline on this machine's Python
standard library sources, so nothing is downloaded; the approach is the tests' Llama 3
tokenizer's (``tests/hf_models.py``), kept here so the scripts do not import the tests."""
from __future__ import annotations

import glob
import json
import re
import sysconfig
from pathlib import Path

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
                  "<|finetune_right_pad_id|>"]
BOS, EOT = "<|begin_of_text|>", "<|eot_id|>"
EOS_TOKENS = ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")  # generation_config's, as Llama 3
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
         r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_TEMPLATE = (  # Llama 3's turns, without tools
    "{{ bos_token }}{% for m in messages %}"
    "<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def corpus_files(max_bytes: int = 12 << 20) -> list[Path]:
    """The standard library's ``.py`` files in sorted order up to ``max_bytes`` (the system
    Python's under /usr/lib/python3*, else this interpreter's), so that one machine always
    trains the same vocabulary."""
    roots = sorted(glob.glob("/usr/lib/python3.*/"),
                   key=lambda r: int(re.match(r"\d*", r.split("python3.")[-1]).group() or 0))
    files, total = [], 0
    for path in sorted(Path((roots or [sysconfig.get_paths()["stdlib"]])[-1]).rglob("*.py")):
        if {"site-packages", "dist-packages"} & set(path.parts) or not path.is_file():
            continue
        files.append(path)
        total += path.stat().st_size
        if total >= max_bytes:
            break
    return files


def _texts(files: list[Path]):
    for path in files:
        yield path.read_text(encoding="utf-8", errors="replace")


def write_tokenizer(out_dir: Path, vocab_size: int = 32000, model_max_length: int = 16384):
    """tokenizer.json (``vocab_size`` ids in all, the special tokens last as in Llama 3) and
    tokenizer_config.json (BOS, EOS <|eot_id|>, the chat template) in ``out_dir``; the ids
    of the special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIAL_TOKENS),
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_texts(corpus_files()), trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(f"the corpus gave {tok.get_vocab_size(with_added_tokens=True)} "
                           f"tokens, not {vocab_size}: it is too small")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                      special_tokens=[(BOS, tok.token_to_id(BOS))])])
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS,
              "eos_token": EOT, "clean_up_tokenization_spaces": False,
              "model_max_length": model_max_length, "chat_template": CHAT_TEMPLATE}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
