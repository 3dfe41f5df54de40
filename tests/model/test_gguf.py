"""GGUF files (llama.cpp's format) load as the safetensors folder they were converted from.

Each case writes a tiny random transformers model as a GGUF the way llama.cpp's converter does (`gguf_helpers`:
its names, metadata and layouts) and loads both with `moelane.load`:
- F32: the logits equal the safetensors load's (<= 1e-4) -- names, layouts and config all mapped back;
- Q8_0, Q4_0 and K-quants at `default_tier="native"`, `quantize="none"`: the logits equal those of an F32 GGUF
  holding the values the quantised file decodes to (bit for bit), so the quantised tensors are decoded as the `gguf`
  package decodes them, experts included (Q8_0 / Q4_0 experts and projections held as their own codes by default:
  test_gguf_codes.py);
- the tokenizer encodes as the Hugging Face tokenizer it was converted from, the chat template and EOS come along;
- a split file, the pager at half the experts' bytes, and `moelane run --model x.gguf` work;
- a truncated file, an unknown architecture, an unreadable tensor type and a vocabulary larger than the embeddings
  are each one ModelLoadError naming the tensor or the key.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import moelane
from moelane.errors import ModelLoadError
from tests.gguf_helpers import write_gguf
from tests.helpers import CHAT_TEMPLATE, TEXT, check_pages_as_resident, random_model
from tests.kernels.helpers import code_like

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss"]
PROMPT = [1, 5, 9, 33, 2, 100, 7, 8, 44, 45, 46, 290, 13, 0]
# llama.cpp runs every layer of the Qwen MoEs with experts; rows the blocks of 32 divide for the quantised files
ALL_MOE = {"qwen3_moe": dict(mlp_only_layers=[]), "qwen2_moe": dict(mlp_only_layers=[])}
BLOCKS_32 = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=64,
                 moe_intermediate_size=32, shared_expert_intermediate_size=32)  # fmt: skip
MLA_32 = dict(num_key_value_heads=4)  # (MLA: as many key heads as query heads)


def model(tmp: Path, family: str, **overrides: Any) -> Path:
    return random_model(family, tmp / "hf", **{**ALL_MOE.get(family, {}), **overrides})


def quantisable(family: str) -> dict[str, Any]:
    over = {**BLOCKS_32, **(MLA_32 if family.startswith("deepseek") else {})}
    if family in ("mixtral", "olmoe", "gpt_oss"):  # (their expert width is intermediate_size)
        over["intermediate_size"] = 32
    return over


def logits(path: Path) -> torch.Tensor:
    with torch.no_grad():
        return moelane.load(path).logits(PROMPT)


@pytest.mark.parametrize("family", [*FAMILIES, "llama", "qwen3"])
def test_f32_gguf_logits_match_the_safetensors_load(tmp_path: Path, family: str) -> None:
    folder = model(tmp_path, family)
    gguf = write_gguf(folder, tmp_path / "m.gguf")
    assert (logits(gguf) - logits(folder)).abs().max().item() <= 1e-4


LLAMA_CPP = os.environ.get("MOELANE_LLAMA_CPP")  # a llama.cpp tree (vendor/llama.cpp of llama-cpp-python's sdist)


@pytest.mark.slow
@pytest.mark.skipif(not LLAMA_CPP, reason="MOELANE_LLAMA_CPP (a llama.cpp tree with convert_hf_to_gguf.py) not set")
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "olmoe"])  # (its converter rejects the test tokenizer)
def test_llama_cpp_converter_files_load_as_their_folders(tmp_path: Path, family: str) -> None:
    """Files written by llama.cpp's own converter, not this file's writer: the same logits as the folder."""
    from tests.gguf_helpers import convert_with_llama_cpp

    assert LLAMA_CPP is not None
    folder = model(tmp_path, family)
    gguf = convert_with_llama_cpp(folder, tmp_path / "m.gguf", Path(LLAMA_CPP))
    assert (logits(gguf) - logits(folder)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_fused_gate_up_experts_load_as_separate_ones(tmp_path: Path, family: str) -> None:
    over = quantisable(family)
    separate = write_gguf(model(tmp_path, family, **over), tmp_path / "s.gguf", "Q8_0")
    fused = write_gguf(tmp_path / "hf", tmp_path / "f.gguf", "Q8_0", fuse_gate_up=True)
    lm = moelane.load(fused)
    assert "gate_up" in lm.expert_handles[lm.moe_layers[0]][0].tensors
    with torch.no_grad():
        assert torch.equal(lm.logits(PROMPT), logits(separate))


def check_decodes_as_gguf(
    tmp_path: Path, family: str, qtype: str, monkeypatch: pytest.MonkeyPatch, **overrides: Any
) -> None:
    """A `qtype` file's logits, all its tensors decoded (native experts, `quantize="none"`), equal those of the F32
    file of its decoded values; its experts are stored blocks. With the default `quantize="auto"` (Q8_0 / Q4_0
    projections held as their codes) the logits are those of the decoded file whose projections see their inputs as
    the codes' integer products do, within 1% (other block types' projections are then requantised:
    test_gguf_codes.py)."""
    folder = model(tmp_path, family, **overrides)
    quantised = write_gguf(folder, tmp_path / "q.gguf", qtype)
    decoded = write_gguf(folder, tmp_path / "d.gguf", qtype, roundtrip=True)
    lm = moelane.load(quantised, default_tier="native", quantize="none")
    assert lm.provider.kind == "native"
    first = lm.expert_handles[lm.moe_layers[0]][0]
    assert first.layout == ("gguf_pairs" if family == "gpt_oss" else "gguf")
    assert {ref.dtype for ref in first.tensors.values()} == {qtype}
    with torch.no_grad():
        got = lm.logits(PROMPT)
        assert torch.equal(got, logits(decoded))
        if qtype in ("Q8_0", "Q4_0"):
            auto = moelane.load(quantised, default_tier="native")
            # int8 / int4 products see their inputs as int8 codes: so does the decoded reference
            code_like(lm.model, auto.model, monkeypatch)
            got = lm.logits(PROMPT)
            tolerance = 1e-2 * got.abs().max().item()  # (an input a rounding apart may take the next code)
            assert (auto.logits(PROMPT) - got).abs().max().item() <= tolerance


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_quantised_gguf_decodes_as_the_gguf_package(
    tmp_path: Path, qtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_decodes_as_gguf(tmp_path, "qwen3_moe", qtype, monkeypatch, **quantisable("qwen3_moe"))


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("family", FAMILIES[1:])
def test_quantised_gguf_of_every_family(
    tmp_path: Path, family: str, qtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_decodes_as_gguf(tmp_path, family, qtype, monkeypatch, **quantisable(family))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_k_quant_experts_decode_as_the_gguf_package(
    tmp_path: Path, qtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """K-quants (blocks of 256): random blocks, as the `gguf` package cannot quantise them."""
    over = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, moe_intermediate_size=256,
                num_experts=4, num_hidden_layers=2)  # fmt: skip
    check_decodes_as_gguf(tmp_path, "qwen3_moe", qtype, monkeypatch, **over)


def test_tokenizer_and_chat_template_come_from_the_metadata(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as HfTokenizer

    folder = model(tmp_path, "qwen3_moe")
    lm = moelane.load(write_gguf(folder, tmp_path / "m.gguf"))
    theirs = HfTokenizer.from_file(str(folder / "tokenizer.json"))
    for text in (TEXT, "  leading spaces,\ttabs\n\nand <|endoftext|> inside", "naïve café 3.14 -- 'quoted' don't"):
        assert lm.tokenizer.encode(text) == theirs.encode(text, add_special_tokens=False).ids
        ids = lm.tokenizer.encode(text)
        assert lm.tokenizer.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert lm.tokenizer.chat_template == CHAT_TEMPLATE
    assert lm.tokenizer.eos_ids == frozenset({theirs.token_to_id("<|endoftext|>")})


def test_split_gguf_loads_as_one_file(tmp_path: Path) -> None:
    folder = model(tmp_path, "qwen3_moe")
    first = write_gguf(folder, tmp_path / "m.gguf", split_tensors=8)
    assert re.fullmatch(r"m-00001-of-0000[2-9]\.gguf", first.name)
    lm = moelane.load(first)
    assert len({ref.path for hs in lm.expert_handles.values() for h in hs for ref in h.tensors.values()}) > 1
    with torch.no_grad():
        assert torch.equal(lm.logits(PROMPT), logits(write_gguf(folder, tmp_path / "whole.gguf")))


def test_quantised_experts_page_from_the_gguf(tmp_path: Path) -> None:
    """With half the experts' bytes the pager reads each expert's blocks from the file, and decodes as all-resident
    (Q4_0: its experts held at int4, ~1/7 of their float32 bytes)."""
    gguf = write_gguf(model(tmp_path, "qwen3_moe", **quantisable("qwen3_moe")), tmp_path / "q.gguf", "Q4_0")
    check_pages_as_resident(gguf, PROMPT, expert_memory="7%")


def test_int4_tier_of_a_q8_0_gguf_encodes_its_decoded_values(tmp_path: Path) -> None:
    """The int4 tier file of a Q8_0 file, built beside the GGUF, holds the same experts as one built from the F32 file
    of the values the blocks decode to."""
    folder = model(tmp_path, "qwen3_moe", **quantisable("qwen3_moe"))
    (tmp_path / "q").mkdir()
    (tmp_path / "d").mkdir()
    quantised = write_gguf(folder, tmp_path / "q" / "m.gguf", "Q8_0")
    decoded = write_gguf(folder, tmp_path / "d" / "m.gguf", "Q8_0", roundtrip=True)
    with torch.no_grad():
        ours = moelane.load(quantised, default_tier="int4", quantize="none").logits(PROMPT)
        assert torch.equal(ours, moelane.load(decoded, default_tier="int4").logits(PROMPT))
    assert (tmp_path / "q" / ".moelane" / "m.experts-int4.bin").is_file()


def test_moelane_run_takes_a_gguf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from moelane.commands import main

    gguf = write_gguf(model(tmp_path, "qwen3_moe", **quantisable("qwen3_moe")), tmp_path / "q.gguf", "Q8_0")
    assert main(["run", "--model", str(gguf), "--max-tokens", "4", "--drafter", "none", "hi"]) == 0


def test_truncated_gguf_names_the_tensor(tmp_path: Path) -> None:
    gguf = write_gguf(model(tmp_path, "qwen3_moe"), tmp_path / "m.gguf")
    data = gguf.read_bytes()
    gguf.write_bytes(data[: len(data) - 100])
    with pytest.raises(ModelLoadError, match=r"truncated GGUF file m\.gguf: tensor \S+ ends"):
        moelane.load(gguf)
    gguf.write_bytes(data[:1000])
    with pytest.raises(ModelLoadError, match=r"m\.gguf"):
        moelane.load(gguf)


def rewrite(path: Path, arch: str | None = None, retype: dict[str, Any] | None = None,
            keys: dict[str, list[Any]] | None = None) -> Path:  # fmt: skip
    """A copy of the GGUF at `path`: under another architecture name, some tensors replaced (name: (data, type)),
    some array keys replaced."""
    import gguf

    reader, retype, keys = gguf.GGUFReader(path), retype or {}, keys or {}
    writer = gguf.GGUFWriter(path.with_name("edited.gguf"), arch or reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture" and name not in keys:
            array = field.types[0] == gguf.GGUFValueType.ARRAY
            writer.add_key_value(name, field.contents(), field.types[0], sub_type=field.types[-1] if array else None)
    for name, value in keys.items():
        writer.add_array(name, value)
    for t in reader.tensors:
        data, kind = retype.get(t.name, (np.array(t.data), t.tensor_type))
        writer.add_tensor(t.name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.with_name("edited.gguf")


def test_unknown_architecture_is_refused_naming_the_key(tmp_path: Path) -> None:
    edited = rewrite(write_gguf(model(tmp_path, "qwen3_moe"), tmp_path / "m.gguf"), arch="mamba")
    with pytest.raises(ModelLoadError, match=r"unsupported GGUF architecture 'mamba' \(general.architecture"):
        moelane.load(edited)


def test_unreadable_tensor_type_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    from gguf import GGMLQuantizationType

    path = write_gguf(model(tmp_path, "qwen3_moe"), tmp_path / "m.gguf")
    ints = np.zeros((96, 48), dtype=np.int32)
    edited = rewrite(path, retype={"blk.0.attn_q.weight": (ints, GGMLQuantizationType.I32)})
    with pytest.raises(ModelLoadError, match=r"GGUF tensor blk\.0\.attn_q\.weight has type I32"):
        moelane.load(edited)


def test_vocabulary_larger_than_the_embeddings_is_refused(tmp_path: Path) -> None:
    import gguf

    path = write_gguf(model(tmp_path, "qwen3_moe"), tmp_path / "m.gguf")
    tokens = gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].contents()
    edited = rewrite(path, keys={"tokenizer.ggml.tokens": [*tokens, "<extra-1>", "<extra-2>"]})
    with pytest.raises(ModelLoadError, match=r"vocabulary mismatch: tokenizer\.ggml\.tokens has 302 tokens"):
        moelane.load(edited)


SAMPLES = (TEXT, "  leading spaces,\ttabs\n\nand 12345 digits", "naïve café 3.14 -- 'quoted' don't I'LL 东京タワー")


def vocab_only(path: Path, tokenizer: Any, pre: str | None) -> Path:
    """A GGUF holding a vocabulary and nothing else but an embedding: the converter's gpt2 vocabulary (`pre` given),
    or its SentencePiece one, scores falling with the id as a SentencePiece BPE model's do."""
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    by_id = {i: t for t, i in tokenizer.get_vocab(with_added_tokens=True).items()}
    added = tokenizer.get_added_tokens_decoder()
    tokens = [by_id[i] for i in range(len(by_id))]
    kinds = [gguf.TokenType.CONTROL if i in added else gguf.TokenType.NORMAL for i in range(len(tokens))]
    if pre is None:
        kinds = [gguf.TokenType.BYTE if re.fullmatch(r"<0x[0-9A-F]{2}>", tokens[i]) else k for i, k in enumerate(kinds)]
        writer.add_tokenizer_model("llama")
        writer.add_token_scores([-float(i) for i in range(len(tokens))])
        writer.add_unk_token_id(tokenizer.token_to_id("<unk>"))
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        model = json.loads(tokenizer.to_str())["model"]
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    writer.add_token_list(tokens)
    writer.add_token_types(kinds)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def byte_level_tokenizer(pre: str) -> Any:
    """A byte-level BPE trained with the pre-tokenizer of the Hugging Face releases that llama.cpp names `pre`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from moelane.model.gguf.vocab import PRE_SPLITS

    tok = Tokenizer(models.BPE(ignore_merges=pre == "llama-bpe"))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_SPLITS[pre]]
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(False, use_regex=not splits)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)  # fmt: skip
    tok.train_from_iterator([*SAMPLES] * 4, trainer)
    return tok


def sentencepiece_tokenizer() -> Any:
    """A Llama-style BPE with byte fallback, as transformers writes a SentencePiece model's tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])  # fmt: skip
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False)
    tok.pre_tokenizer = pre_tokenizers.Metaspace()  # (while training only: pieces within words, as SentencePiece's)
    tok.train_from_iterator([*SAMPLES[:2]] * 4, trainer)
    tok.pre_tokenizer = None
    return tok


@pytest.mark.parametrize("pre", ["gpt-2", "qwen2", "llama-bpe", "gpt-4o", "deepseek-v3", None])
def test_vocabularies_encode_as_the_tokenizer_they_were_converted_from(tmp_path: Path, pre: str | None) -> None:
    from moelane.model.gguf.file import open_gguf
    from moelane.model.gguf.vocab import gguf_tokenizer

    theirs = sentencepiece_tokenizer() if pre is None else byte_level_tokenizer(pre)
    ours, _ = gguf_tokenizer(open_gguf(vocab_only(tmp_path / "v.gguf", theirs, pre)), theirs.get_vocab_size())
    for text in (*SAMPLES, "unseen words: zebra 🦙 Ω"):
        ids = theirs.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_special_tokens=False).ids == ids, text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
