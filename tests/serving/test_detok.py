"""The gateway's incremental detokenizer (``_Detok``): whatever the pieces, what it streams joins into
what decoding every token at once gives, cut at the first stop string as the rules say (its twin
below decodes the whole output at every push, as the gateway once did), for the tokenizers models
ship: bytes (random models), byte-level BPE (Llama 3, Qwen, GPT-2), sentencepiece-style Metaspace
(Llama 2, Mistral), word-level; with multi-byte characters split across tokens and special tokens."""

import json
import random

import pytest

from engine.serve.gateway import _Detok
from engine.serve.openai_protocol import tag_tail
from engine.tokenizer import ByteTokenizer, HFTokenizer

CORPUS = ["hello world, the quick brown fox jumps", "naïve café — über straße", "日本語のテキストと絵文字 🙂🚀",
          "def f(x):\n    return x * 2  # done", "STOP here, or stop there; END."] * 30


class Twin:
    """The reference: the whole output decoded at every push, the stop strings looked for in all of it."""

    def __init__(self, tok, stop, include_stop=False, min_tokens=0, skip_special=True):
        self.tok, self.stop, self.include_stop, self.min_tokens = tok, stop, include_stop, min_tokens
        self.skip = skip_special
        self.ids, self.sent, self.stopped = [], 0, False

    def cut(self, text):
        if self.min_tokens and len(self.ids) <= self.min_tokens:
            return text
        floor = len(self.tok.decode(self.ids[:self.min_tokens], self.skip).rstrip("\ufffd")) if self.min_tokens else 0
        found = [(i, -len(s)) for s in self.stop if (i := text.find(s, max(0, floor - len(s) + 1))) >= 0]
        if not found:
            return text
        self.stopped = True
        i, neg = min(found)
        return text[:i - neg if self.include_stop else i]

    def push(self, ids, final=False):
        self.ids += ids
        text = self.cut(self.tok.decode(self.ids, self.skip))
        end = len(text)
        if not self.stopped and not final:
            if text.endswith("\ufffd"):
                end = len(text.rstrip("\ufffd"))
            end -= max((tag_tail(text, s, end) for s in self.stop), default=0)
        out = text[self.sent:end]
        self.sent = max(self.sent, end)
        return out


def _hf(tmp_path, kind: str) -> HFTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if kind == "bytelevel":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<s>", "</s>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    elif kind == "metaspace":
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"] +
                                      [f"<0x{b:02X}>" for b in range(256)])
    else:
        tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(CORPUS, trainer)
    folder = tmp_path / kind
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return HFTokenizer(str(folder))


@pytest.fixture(scope="module", params=["bytes", "bytelevel", "metaspace", "wordlevel"])
def tok(request, tmp_path_factory):
    return ByteTokenizer() if request.param == "bytes" else _hf(tmp_path_factory.mktemp("tok"), request.param)


def _outputs(tok, r: random.Random) -> list[int]:
    """An output: a text of the corpus encoded, sometimes with random tokens and special ones mixed in."""
    text = " ".join(r.choice(CORPUS) for _ in range(r.randrange(1, 6)))
    ids = tok.encode(text)
    vocab = 258 if isinstance(tok, ByteTokenizer) else tok.backend.get_vocab_size()
    for _ in range(r.randrange(0, 4)):  # (a byte split off a character, any token)
        ids.insert(r.randrange(len(ids) + 1), r.randrange(vocab))
    if r.random() < 0.5:  # a special token (BOS, EOS): its text shows only without skip_special_tokens
        ids.insert(r.randrange(len(ids) + 1), r.choice([tok.bos_token_id, tok.eos_token_id]))
    return ids


def test_what_it_streams_is_what_decoding_it_whole_gives(tok):
    r = random.Random(7)
    stops_pool = ["STOP", "stop there", "🙂", "ü", "\n", "END.", "x * 2", "テキ"]
    stopped = 0
    for case in range(300):
        ids = _outputs(tok, r)
        stop = r.sample(stops_pool, r.randrange(0, 3))
        kw = dict(include_stop=r.random() < 0.3, min_tokens=r.choice([0, 0, 1, 5]), skip_special=r.random() < 0.7)
        d, t = _Detok(tok, stop, **kw), Twin(tok, stop, **kw)
        got, want, at = [], [], 0
        while at < len(ids):
            n = r.choice([1, 1, 1, 2, 3, 7])
            piece, at = ids[at:at + n], at + n
            final = at >= len(ids)
            got.append(d.push(piece, final))
            want.append(t.push(piece, final))
        assert "".join(got) == "".join(want), (case, ids, stop, kw)
        assert d.stopped == t.stopped and d.text() == "".join(want)
        stopped += d.stopped
    assert stopped > 50  # (the stop strings were met, not only missed)


def test_a_push_costs_the_same_however_long_the_output():
    """The tokens decoded per push stay a handful (counted, not timed)."""
    tok = ByteTokenizer()
    decoded = []

    class Counting(ByteTokenizer):
        def decode(self, ids, skip_special_tokens=True):
            decoded.append(len(ids))
            return tok.decode(ids, skip_special_tokens)

    d = _Detok(Counting(), ["never"])
    for i in range(20_000):
        d.push([32 + i % 90])
    assert max(decoded) <= 4 and len(d.text()) == 20_000
