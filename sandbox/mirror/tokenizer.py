"""A tiny byte-level BPE tokenizer in the shape of Qwen2's, built without any library.

Qwen2 ships ``vocab.json`` + ``merges.txt`` (for the slow ``Qwen2Tokenizer``), ``tokenizer.json``
(for ``Qwen2TokenizerFast``, which vLLM 0.6.3 loads through ``AutoTokenizer``) and
``tokenizer_config.json``. We produce all four. The merges are learnt here, deterministically,
from a short built-in corpus, so the vocabulary is real BPE (every merge's parts and result are
in the vocabulary, which the ``tokenizers`` library checks on load), not random strings.
"""

from __future__ import annotations

import re
from collections import Counter
from itertools import pairwise

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Qwen2-Instruct's chat template: a default system turn, then ChatML.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Qwen2's pre-tokenizer split, verbatim (it runs in the Rust `tokenizers`, which knows \p{L}).
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# An ASCII approximation of the same split for training (Python's re has no \p{L}).
_TRAIN_SPLIT = re.compile(
    r"'s|'t|'re|'ve|'m|'ll|'d|[^\r\n A-Za-z0-9]?[A-Za-z]+| ?[A-Za-z]+|[0-9]"
    r"| ?[^\sA-Za-z0-9]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The training text: plain sentences about what this project does, so common words merge.
CORPUS = """\
The server runs a large language model with tensor parallel across two GPUs joined by NVLink.
The model is downloaded in shards, and every shard is checked against its checksum before use.
When a connection drops in the middle of a file, the download resumes from the last good byte.
The service listens behind nginx, which streams tokens to the client without buffering them.
A health check returns two hundred when the engine is ready; then one token is generated.
Prometheus reads the metrics: requests running, requests waiting, cache usage, and latency.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
System messages come first in the chat template, then the user, then the assistant reply.
You are a helpful assistant. Hello, world! How are you today? I am fine, thank you.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 128 256 512 4096 32768 131072.
The configuration is data, not code; the same inputs give the same files and the same hashes.
"""

# Enough merges to give a few hundred tokens; training stops early if pairs run out.
DEFAULT_MERGES = 400


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, used by every byte-level BPE."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


def _byte_level_words(text: str) -> Counter[tuple[str, ...]]:
    table = bytes_to_unicode()
    words: Counter[tuple[str, ...]] = Counter()
    for piece in _TRAIN_SPLIT.findall(text):
        words[tuple(table[b] for b in piece.encode("utf-8"))] += 1
    return words


def _best_pair(words: Counter[tuple[str, ...]]) -> tuple[tuple[str, str], int] | None:
    pairs: Counter[tuple[str, str]] = Counter()
    for word, count in words.items():
        for pair in pairwise(word):
            pairs[pair] += count
    if not pairs:
        return None
    # Ties broken by the pair itself so the result never depends on dict order.
    pair, count = min(pairs.items(), key=lambda item: (-item[1], item[0]))
    return pair, count


def _apply_merge(words: Counter[tuple[str, ...]], pair: tuple[str, str]) -> Counter:
    merged: Counter[tuple[str, ...]] = Counter()
    joined = pair[0] + pair[1]
    for word, count in words.items():
        out: list[str] = []
        i = 0
        while i < len(word):
            if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
                out.append(joined)
                i += 2
            else:
                out.append(word[i])
                i += 1
        merged[tuple(out)] += count
    return merged


def train_bpe(text: str = CORPUS, num_merges: int = DEFAULT_MERGES
              ) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Learn byte-level BPE merges; return ``(vocab token->id, merges in rank order)``.

    Ids 0-255 are the byte alphabet in GPT-2/Qwen order, merged tokens follow in merge order.
    Training stops when every word of the corpus is a single token.
    """
    vocab = {char: idx for idx, char in enumerate(bytes_to_unicode().values())}
    merges: list[tuple[str, str]] = []
    words = _byte_level_words(text)
    while len(merges) < num_merges:
        best = _best_pair(words)
        if best is None:
            break
        pair = best[0]
        merges.append(pair)
        vocab.setdefault(pair[0] + pair[1], len(vocab))
        words = _apply_merge(words, pair)
    return vocab, merges


def special_token_ids(vocab: dict[str, int]) -> dict[str, int]:
    """Special tokens come right after the BPE vocabulary, as in Qwen2 (151643, 151644, ...)."""
    return {token: len(vocab) + i for i, token in enumerate(SPECIAL_TOKENS)}


def _added_token(token_id: int, content: str) -> dict[str, object]:
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": True}


def tokenizer_json(vocab: dict[str, int], merges: list[tuple[str, str]]) -> dict[str, object]:
    """The ``tokenizers`` serialisation, laid out like Qwen2's own tokenizer.json."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                  "use_regex": False}
    specials = special_token_ids(vocab)
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [_added_token(i, t) for t, i in specials.items()],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT_REGEX},
             "behavior": "Isolated", "invert": False},
            byte_level,
        ]},
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": "", "end_of_word_suffix": "",
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [f"{a} {b}" for a, b in merges]},
    }


def tokenizer_config(vocab: dict[str, int], model_max_length: int) -> dict[str, object]:
    """``tokenizer_config.json`` as Qwen2 ships it (slow class named; fast one is derived)."""
    specials = special_token_ids(vocab)
    decoder = {str(i): {k: v for k, v in _added_token(i, t).items() if k != "id"}
               for t, i in specials.items()}
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def merges_txt(merges: list[tuple[str, str]]) -> str:
    return "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)
