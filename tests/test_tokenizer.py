"""moelight.tokenization.tokenizer against transformers on tokenizer.json folders built in-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from moelight.tokenization.byte_tokenizer import ByteTokenizer
from moelight.tokenization.tokenizer import HFTokenizer, TokenizerError, load_tokenizer
from workloads import Request

CORPUS = ["Hello world, this is a small corpus.", "The quick brown fox jumps over the lazy dog!",
          "Mixture of experts models route tokens to experts.", "[INST] What is 2+2? [/INST] It is 4.",
          "Café naïve résumé, übung."] * 20
SPECIALS = ["<unk>", "<s>", "</s>"]
# Mistral-Instruct v0.1 style template.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
TEXTS = ["Hello world", " Hello  world", "Café 東京 <s> x", "a\nb\tc", "", "experts!! route\n\n tokens 🙂",
         "</s>end", "[INST] hi [/INST]"]
CHAT = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Café? 2+2"}]


def build_tokenizer(folder: Path, style: str = "llama", post_processor: bool = True, **config) -> Path:
    """A small byte-fallback BPE laid out like Llama/Mixtral's tokenizer.json (ids 3..258 = bytes)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    if style == "llama":  # transformers-5 Llama layout
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    else:  # the Mixtral-8x7B tokenizer.json layout (legacy normaliser)
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIALS,
                                                        show_progress=False))
    data = json.loads(tok.to_str())
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({f"<0x{b:02X}>": len(SPECIALS) + b for b in range(256)})
    for t, _ in sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(t, len(vocab))
    data["model"]["vocab"] = vocab
    tok = Tokenizer.from_str(json.dumps(data))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1)])
    if post_processor:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 1)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
           "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
           "clean_up_tokenization_spaces": False, "chat_template": MISTRAL_TEMPLATE}
    cfg.update(config)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def transformers_mod():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("llama_tok"))


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("mixtral_tok"), style="mixtral",
                           tokenizer_class="PreTrainedTokenizerFast")


def _ids(x) -> list[int]:
    return list(x["input_ids"]) if hasattr(x, "keys") else list(x)


@pytest.mark.parametrize("loader", ["AutoTokenizer", "PreTrainedTokenizerFast"])
def test_encode_decode_match_transformers(transformers_mod, llama_dir, loader):
    ref = getattr(transformers_mod, loader).from_pretrained(str(llama_dir))
    mine = load_tokenizer(llama_dir)
    assert isinstance(mine, HFTokenizer)
    for text in TEXTS:
        ids = mine.encode(text)
        assert ids == ref.encode(text), text
        assert ids[0] == mine.bos_id == 1
        assert mine.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
        assert mine.encode(text, add_bos=False) == ref.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("style", ["llama", "mixtral", "metaspace"])
def test_an_output_reads_as_it_does_after_its_prompt(transformers_mod, tmp_path, style):
    """A Strip decoder, or a Metaspace one adding its prefix space, drops the first space of a whole text
    only: an output's text is transformers' decode(prompt + output) less decode(prompt), as vLLM's
    incremental detokenizer gives it."""
    folder = build_tokenizer(tmp_path / style, style="llama" if style == "metaspace" else style,
                             tokenizer_class="PreTrainedTokenizerFast")
    if style == "metaspace":  # SentencePiece conversions' default decoder (SpmConverter)
        spec = json.loads((folder / "tokenizer.json").read_text())
        spec["decoder"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": False}
        (folder / "tokenizer.json").write_text(json.dumps(spec))
    ref, mine = transformers_mod.PreTrainedTokenizerFast.from_pretrained(str(folder)), load_tokenizer(folder)
    space = mine.encode("yes", add_bos=False)  # ▁yes: a space in front
    assert mine.decode(space) == "yes"  # alone, the leading space goes
    for prompt in ["Hello", "Café", "x 🙂", "</s>", ""]:
        p = mine.encode(prompt)
        for out in ["yes", " no 🙂", "\n end", "world"]:
            o = mine.encode(out, add_bos=False)
            for skip in (True, False):
                want = ref.decode(p + o, skip_special_tokens=skip)[len(ref.decode(p, skip_special_tokens=skip)):]
                assert mine.decode(o, skip, context=p) == want, (prompt, out, skip)
    assert mine.piece(space[0]) == ref.convert_ids_to_tokens(space[0]).replace("▁", " ")
    assert mine.piece(mine.bos_id) == "<s>" and mine.piece(space[-1]) == mine.decode([space[-1]], False)


def test_mixtral_layout_matches_pretrained_fast(transformers_mod, mixtral_dir):
    ref = transformers_mod.PreTrainedTokenizerFast.from_pretrained(str(mixtral_dir))
    mine = load_tokenizer(mixtral_dir)
    for text in TEXTS:
        assert mine.encode(text) == ref.encode(text), text
        assert mine.decode(mine.encode(text)) == ref.decode(ref.encode(text), skip_special_tokens=True)


@pytest.mark.parametrize("messages", [CHAT[:1], CHAT])
def test_chat_template_matches_transformers(transformers_mod, llama_dir, messages):
    ref = transformers_mod.AutoTokenizer.from_pretrained(str(llama_dir))
    mine = load_tokenizer(llama_dir)
    text = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert mine.render_chat(messages) == text
    assert mine.apply_chat_template(messages) == _ids(
        ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))
    assert mine.apply_chat_template(messages).count(mine.bos_id) == 1  # the template's BOS, not a second


def test_chat_template_raise_exception(llama_dir):
    tok = load_tokenizer(llama_dir)
    with pytest.raises(TokenizerError, match="roles must alternate"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_chat_template_jinja_file_and_sandbox(tmp_path):
    d = build_tokenizer(tmp_path / "t", chat_template=None)
    (d / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}>{{ m.content | tojson }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")
    tok = load_tokenizer(d)
    assert tok.render_chat([{"role": "user", "content": "é<b>"}]) == '<user>"é<b>"<assistant>'
    (d / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(Exception, match="unsafe|access"):
        load_tokenizer(d).render_chat([{"role": "user", "content": "x"}])


def test_no_template_single_user_turn_falls_back(tmp_path):
    tok = load_tokenizer(build_tokenizer(tmp_path / "t", chat_template=None))
    assert not tok.has_chat_template
    assert tok.apply_chat_template([{"role": "user", "content": "Hello world"}]) == tok.encode("Hello world")
    with pytest.raises(TokenizerError, match="no chat_template") as e:
        tok.apply_chat_template(CHAT)
    assert str(tmp_path / "t") in str(e.value)


def test_generation_config_eos_list(tmp_path):
    d = build_tokenizer(tmp_path / "t")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    tok = load_tokenizer(d)
    assert tok.eos_id == 2
    assert tok.eos_ids == frozenset({2, 7})
    assert tok.vocab_size == Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab_size(True)


def test_flags_apply_without_post_processor(tmp_path):
    tok = load_tokenizer(build_tokenizer(tmp_path / "a", post_processor=False, add_eos_token=True))
    ids = tok.encode("Hello")
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    tok = load_tokenizer(build_tokenizer(tmp_path / "b", post_processor=False, add_bos_token=False))
    assert tok.bos_id not in tok.encode("Hello")


def test_special_tokens_as_added_token_dicts(tmp_path):
    d = build_tokenizer(tmp_path / "t", bos_token={"content": "<s>", "special": True},
                        eos_token={"content": "</s>", "special": True})
    tok = load_tokenizer(d)
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    assert tok.render_chat(CHAT[:1]).startswith("<s>[INST]")


def test_missing_tokenizer_json(tmp_path):
    (tmp_path / "model").mkdir()
    with pytest.raises(TokenizerError) as e:
        load_tokenizer(tmp_path / "model")
    msg = str(e.value)
    assert str(tmp_path / "model") in msg and "tokenizer.json" in msg and "--tokenizer byte" in msg
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")


def test_encode_request(llama_dir):
    tok = load_tokenizer(llama_dir)
    assert tok.encode_request(Request(id="a", prompt="Hello world")) == tok.encode("Hello world")
    assert tok.encode_request(Request(id="b", messages=CHAT)) == tok.apply_chat_template(CHAT)


# ----------------------------------------------------------------------------- byte tokenizer


def test_byte_tokenizer_roundtrip():
    tok = ByteTokenizer()
    text = "Héllo, 東京 🙂\n"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and len(ids) == 1 + len(text.encode())
    assert all(3 <= i < 259 for i in ids[1:])
    assert tok.decode(ids + [tok.eos_id, tok.pad_id]) == text
    assert tok.encode("ab", add_bos=False) == [ord("a") + 3, ord("b") + 3]
    assert tok.vocab_size == 259 and tok.eos_ids == frozenset({2})


def test_byte_tokenizer_bad_bytes_and_out_of_range_ids():
    tok = ByteTokenizer(model_vocab_size=512)
    assert tok.decode([0xFF + 3, ord("a") + 3]) == "\ufffda"
    assert tok.decode([300, ord("b") + 3]) == "\ufffdb"


def test_byte_tokenizer_vocab_must_fit():
    with pytest.raises(TokenizerError, match="259"):
        ByteTokenizer(model_vocab_size=128)
    ByteTokenizer(model_vocab_size=259)


def test_byte_tokenizer_chat():
    tok = ByteTokenizer()
    ids = tok.apply_chat_template(CHAT)
    text = tok.decode(ids)
    assert text.startswith("<|user|>\nHi there\n<|assistant|>\nHello!\n") and text.endswith("<|assistant|>\n")
    assert ids[0] == tok.bos_id


def test_load_byte_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 200}))
    with pytest.raises(TokenizerError, match="vocab_size is 200"):
        load_tokenizer(tmp_path, kind="byte")
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    assert isinstance(load_tokenizer(tmp_path, kind="byte"), ByteTokenizer)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ByteTokenizer"}))
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    assert isinstance(load_tokenizer(None, kind="byte"), ByteTokenizer)
