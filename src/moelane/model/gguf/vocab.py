"""A GGUF's tokenizer (`tokenizer.ggml.*`) as a `tokenizers.Tokenizer`, the one moelane's `Tokenizer` wraps.

- "gpt2" vocabularies (byte-level BPE: GPT-2, Qwen, Llama 3, DeepSeek, GLM, gpt-oss): the tokens (already in the
  byte-level alphabet) and their merges, split first by the pre-tokenizer `tokenizer.ggml.pre` names -- the regular
  expressions of the Hugging Face tokenizer.json the converter read, as llama.cpp's llama-vocab.cpp lists them.
- "llama" vocabularies (SentencePiece): the pieces with byte fallback; the merges are rebuilt from the pieces'
  scores, a pair merging first whose merged piece scores highest, which is how llama.cpp's SPM tokenizer merges.

Tokens of type CONTROL become special added tokens (matched whole, dropped from decoded text), USER_DEFINED ones plain
added tokens (matched whole, kept). A pre-tokenizer this table does not know is refused in one line naming the key.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HfTokenizer

from moelane.errors import ModelLoadError
from moelane.model.gguf.file import GgufFile

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp's token types

# The split expressions of the Hugging Face tokenizer.json files (their alternatives one string each)
QWEN2 = "|".join((r"(?i:'s|'t|'re|'ve|'m|'ll|'d)", r"[^\r\n\p{L}\p{N}]?\p{L}+", r"\p{N}", r" ?[^\s\p{L}\p{N}]+[\r\n]*",
                  r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"))  # fmt: skip
LLAMA3 = QWEN2.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
GPT4O = "|".join((
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+",
))  # fmt: skip
DEEPSEEK3 = (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+", "|".join((
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+", r"[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+",
    r" ?[\p{P}\p{S}]+[\r\n]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+",
)))  # fmt: skip

# tokenizer.ggml.pre -> the regular expressions that split text before BPE, in turn (GPT-2's own: ByteLevel's)
PRE_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("gpt-2", "olmo", "mpt", "phi-2"), ()),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), (QWEN2,)),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "dbrx", "smaug-bpe", "glm4", "chatglm-bpe"), (LLAMA3,)),
    **dict.fromkeys(("gpt-4o", "llama4"), (GPT4O,)),
    "deepseek-v3": DEEPSEEK3,
}
IGNORE_MERGES = ("llama-bpe", "llama3", "llama-v3", "dbrx", "smaug-bpe")  # (a word in the vocabulary is one token)


def gguf_tokenizer(f: GgufFile, n_embeddings: int) -> tuple[HfTokenizer, dict[str, Any]]:
    """The tokenizer, and the tokenizer_config.json entries moelane's `Tokenizer` reads (eos/bos tokens, chat
    template). ModelLoadError if the vocabulary holds more tokens than the model has embeddings."""
    meta = f.metadata
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ModelLoadError(f"GGUF metadata has no tokenizer.ggml.tokens ({f.path.name})")
    if len(tokens) > n_embeddings:
        raise ModelLoadError(f"vocabulary mismatch: tokenizer.ggml.tokens has {len(tokens)} tokens, token_embd.weight "
                             f"embeds {n_embeddings}")  # fmt: skip
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tok = byte_level(tokens, meta.get("tokenizer.ggml.merges") or [], meta.get("tokenizer.ggml.pre", "default"))
    elif kind == "llama":
        tok = sentencepiece(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens), types, meta)
    else:
        raise ModelLoadError(f"unsupported GGUF tokenizer {kind!r} (tokenizer.ggml.model; supported: gpt2, llama)")
    add_special(tok, tokens, types)
    return tok, token_config(meta, tokens)


def byte_level(tokens: list[str], merges: list[str], pre: str) -> HfTokenizer:
    if pre not in PRE_SPLITS:
        raise ModelLoadError(f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre; supported: "
                             f"{', '.join(PRE_SPLITS)})")  # fmt: skip
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = HfTokenizer(models.BPE(vocab, pairs, ignore_merges=pre in IGNORE_MERGES))  # type: ignore[arg-type]
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in PRE_SPLITS[pre]]
    byte_split = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not splits)
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_split])
    tok.decoder = decoders.ByteLevel()
    return tok


def sentencepiece(tokens: list[str], scores: list[float], types: list[int], meta: dict[str, Any]) -> HfTokenizer:
    """A SentencePiece vocabulary as BPE with byte fallback: every split of a NORMAL piece into two pieces of the
    vocabulary is a merge, ranked by the merged piece's score (highest first; ties by the pieces' ids)."""
    vocab = {token: i for i, token in enumerate(tokens)}
    ranked = []
    for token, score, kind in zip(tokens, scores, types, strict=False):
        if kind != NORMAL:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
    model = models.BPE(vocab, merges, unk_token=unk_token, byte_fallback=True, fuse_unk=True)
    tok = HfTokenizer(model)
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    tok.normalizer = normalizers.Sequence([*([normalizers.Prepend("▁")] if prefix else []),
                                           normalizers.Replace(" ", "▁")])  # fmt: skip
    strip = [decoders.Strip(" ", 1, 0)] if prefix else []
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return tok


def add_special(tok: HfTokenizer, tokens: list[str], types: list[int]) -> None:
    """CONTROL tokens as special added tokens, USER_DEFINED ones as plain added tokens (both matched whole)."""
    typed = list(zip(tokens, types, strict=False))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in typed if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in typed if k == USER_DEFINED])


def token_config(meta: dict[str, Any], tokens: list[str]) -> dict[str, Any]:
    """The tokenizer_config.json entries of the metadata: eos and bos tokens, the chat template."""
    config: dict[str, Any] = {}
    for name in ("eos", "bos"):
        tid = meta.get(f"tokenizer.ggml.{name}_token_id")
        if isinstance(tid, int) and 0 <= tid < len(tokens):
            config[f"{name}_token"] = tokens[tid]
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    return config


def stop_ids(meta: dict[str, Any]) -> frozenset[int]:
    """The ids that end a reply: end of sequence, and end of turn or message where the vocabulary has them."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return frozenset(v for key in keys if isinstance(v := meta.get(key), int))
