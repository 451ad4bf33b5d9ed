"""`LLM.get_tokenizer()` answers as transformers' AutoTokenizer does on the same folder (special tokens, token
strings, vocabulary sizes, decode's forms), so the idioms of vLLM scripts port over; the byte-level
tokenizer answers in ByT5's convention; anything else is an AttributeError that says what there is."""

from __future__ import annotations

import pytest

from moelight import LLM
from moelight.api.hf_style_tokenizer import HFStyleTokenizer
from moelight.tokenization.byte_tokenizer import ByteTokenizer
from moelight.tokenization.tokenizer import HFTokenizer
from tests.test_tokenizer import build_tokenizer

# tokenizer_config.json variations: extra special tokens (a list, the legacy list, a named dict), a model's own
# *_token, a pad token that is another special, model_max_length
CONFIGS = [{}, {"additional_special_tokens": ["<unk>"], "model_max_length": 100},
           {"extra_special_tokens": {"image_token": "</s>"}, "pad_token": "<unk>"}]
ATTRIBUTES = {
    "eos_token": lambda t: t.eos_token, "bos_token": lambda t: t.bos_token, "pad_token": lambda t: t.pad_token,
    "unk_token": lambda t: t.unk_token, "sep_token": lambda t: t.sep_token, "unk_token_id": lambda t: t.unk_token_id,
    "special_tokens_map": lambda t: t.special_tokens_map, "all_special_tokens": lambda t: t.all_special_tokens,
    "all_special_ids": lambda t: t.all_special_ids, "vocab_size": lambda t: t.vocab_size, "len": len,
    "get_vocab": lambda t: t.get_vocab(), "model_max_length": lambda t: t.model_max_length,
    "convert_tokens_to_ids": lambda t: t.convert_tokens_to_ids(["</s>", "▁w", "not-a-token"]),
    "convert_tokens_to_ids one": lambda t: t.convert_tokens_to_ids("</s>"),
    "convert_ids_to_tokens": lambda t: t.convert_ids_to_tokens([1, 300, 2, 10**6]),
    "convert_ids_to_tokens skip": lambda t: t.convert_ids_to_tokens([1, 300, 2], skip_special_tokens=True),
    "tokenize": lambda t: t.tokenize("Hello world, café"),
    "tokenize with specials": lambda t: t.tokenize("Hello world", add_special_tokens=True),
    "decode one id": lambda t: t.decode(300), "decode": lambda t: t.decode([1, 300, 301, 2]),
    "decode batch": lambda t: t.decode([[1, 300], [301, 2]], skip_special_tokens=True),
}


@pytest.mark.parametrize("config", CONFIGS)
def test_answers_as_transformers_on_the_same_folder(tmp_path, config):
    transformers = pytest.importorskip("transformers")
    folder = build_tokenizer(tmp_path / "tok", **config)
    ours = HFStyleTokenizer(HFTokenizer(folder), name_or_path=str(folder))
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    for name, read in ATTRIBUTES.items():
        assert read(ours) == read(ref), name
    assert getattr(ours, "image_token", None) == getattr(ref, "image_token", None)


def test_the_llama_3_stop_token_idiom_and_name_or_path(tmp_path):
    """`stop_token_ids=[tok.convert_tokens_to_ids('<|eot_id|>')]`; name_or_path is what the LLM was given; without
    a tokenizer (skip_tokenizer_init) there is none to get, as in vLLM."""
    folder = build_tokenizer(tmp_path / "tok")
    tok = LLM("tiny", load_format="dummy", hardware="cpu-server", tokenizer=str(folder)).get_tokenizer()
    assert tok.convert_tokens_to_ids("</s>") == tok.eos_token_id == 2 and tok.name_or_path == str(folder)
    assert LLM("tiny", load_format="dummy", hardware="cpu-server").get_tokenizer().name_or_path == "tiny"
    with pytest.raises(ValueError, match="skip_tokenizer_init=True, so it has no tokenizer"):
        LLM("tiny", load_format="dummy", hardware="cpu-server", skip_tokenizer_init=True).get_tokenizer()


def test_the_byte_tokenizer_answers_in_byt5s_convention():
    """transformers' byte tokenizer (ByT5): byte b's token is chr(b), the specials have names; 256 base ids."""
    tok = HFStyleTokenizer(ByteTokenizer())
    assert (tok.pad_token, tok.bos_token, tok.eos_token, tok.unk_token) == ("<pad>", "<s>", "</s>", None)
    assert tok.all_special_ids == [1, 2, 0] and tok.convert_tokens_to_ids("</s>") == tok.eos_token_id == 2
    assert tok.tokenize("hé") == ["h", "Ã", "©"] and tok.convert_tokens_to_ids(tok.tokenize("hé")) == tok.encode(
        "hé", add_special_tokens=False)
    assert tok.convert_ids_to_tokens([1, ord("a") + 3, 10**6]) == ["<s>", "a", None]
    assert (tok.vocab_size, len(tok), len(tok.get_vocab())) == (256, 259, 259)
    assert tok.decode(ord("a") + 3) == "a" and tok.convert_tokens_to_ids("ab") is None


def test_anything_else_names_the_class_and_what_it_offers():
    tok = HFStyleTokenizer(ByteTokenizer())
    assert tok.render_chat([{"role": "user", "content": "hi"}]).startswith("<|user|>")  # moelight's own
    with pytest.raises(AttributeError, match=r"'sp_model': moelight's tokenizer \(HFStyleTokenizer over "
                                             r"ByteTokenizer\).*offers transformers' encode, decode"):
        tok.sp_model  # noqa: B018
