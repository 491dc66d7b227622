"""Checkpoints' chat templates: the gateway's prompt for a conversation is, string for string and
id for id, what transformers' ``apply_chat_template`` makes of the same tokenizer folder (Llama 3's
headers, ChatML with a default system prompt and a template switch, a template that refuses a
conversation, named templates, chat_template.jinja)."""

import json

import pytest

from engine.chat_template import ChatTemplateError
from engine.tokenizer import HFTokenizer

LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CHATML = """{% if messages[0]['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif %}
{% for message in messages %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
    {% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}
<think>

</think>

{% endif %}
{% endif %}"""  # (block tags on lines of their own, one indented: trim_blocks and lstrip_blocks matter)
STRICT = (
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}[INST] {{ message['content'] | tojson }} [/INST]"
    "{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
SPECIALS = ["<s>", "</s>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>"]
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there, how are you?"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "  What is the weather?  "},
     {"role": "assistant", "content": "Il fait beau."}, {"role": "user", "content": "Et demain? «café» 東京"}],
]


def _folder(tmp_path, template=None, jinja_file=None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["hello there how are you what is the weather", "answer in french il fait beau et demain"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    eos = {"__type": "AddedToken", "content": "</s>", "lstrip": False, "normalized": False, "rstrip": False,
           "single_word": False, "special": True}  # (older checkpoints' form)
    cfg = {"bos_token": "<s>", "eos_token": eos, "tokenizer_class": "PreTrainedTokenizerFast"}
    if template is not None:
        cfg["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    if jinja_file is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja_file)
    return str(tmp_path)


def _transformers(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("template", [LLAMA3, CHATML, STRICT], ids=["llama3", "chatml", "strict"])
def test_the_prompt_is_transformers_prompt_text_and_ids(tmp_path, template):
    folder = _folder(tmp_path, template)
    ours, theirs = HFTokenizer(folder), _transformers(folder)
    for msgs in CONVERSATIONS:
        for gen in (True, False):
            if template is STRICT and len(msgs) > 1:
                msgs = [m for m in msgs if m["role"] != "system"]
            want = theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == want
            ids = theirs.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen, return_dict=False)
            assert ours.encode_chat(msgs, add_generation_prompt=gen) == list(ids)
    if template is LLAMA3:  # the template's BOS, once; special tokens as themselves
        ids = ours.encode_chat(CONVERSATIONS[0])
        assert ids[0] == ours.bos_token_id and ids.count(ours.bos_token_id) == 1
        assert ids[1] == ours.backend.token_to_id("<|start_header_id|>")


def test_template_switches_reach_the_template(tmp_path):
    folder = _folder(tmp_path, CHATML)
    ours, theirs = HFTokenizer(folder), _transformers(folder)
    msgs = CONVERSATIONS[0]
    got = ours.apply_chat_template(msgs, enable_thinking=False)
    assert got.endswith("<think>\n\n</think>\n\n")
    assert got == theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)


def test_a_template_refusing_the_conversation_is_a_value_error_with_its_message(tmp_path):
    ours = HFTokenizer(_folder(tmp_path, STRICT))
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ours.encode_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ValueError, match="failed on these messages"):
        HFTokenizer(_folder(tmp_path, "{{ messages[5]['content'] }}")).encode_chat([{"role": "user", "content": "a"}])
    with pytest.raises(ValueError, match="does not parse"):
        HFTokenizer(_folder(tmp_path, "{% for %}"))


def test_named_templates_and_chat_template_jinja(tmp_path):
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": LLAMA3}]
    assert HFTokenizer(_folder(tmp_path, named)).apply_chat_template(CONVERSATIONS[0]).startswith("<s><|start_header_id|>")
    (tmp_path / "x").mkdir()
    folder = _folder(tmp_path / "x", LLAMA3, jinja_file=CHATML)
    assert HFTokenizer(folder).apply_chat_template(CONVERSATIONS[0]).startswith("<|im_start|>system")


def test_without_a_template_the_plain_prompt_with_bos(tmp_path):
    ours = HFTokenizer(_folder(tmp_path))
    assert ours.chat_template is None
    assert ours.apply_chat_template(CONVERSATIONS[0]) == "<|user|>\nHello there, how are you?\n<|assistant|>\n"
    assert ours.encode_chat(CONVERSATIONS[0])[0] == ours.bos_token_id


def test_the_gateway_renders_with_the_checkpoints_template_and_refuses_what_it_refuses(tmp_path):
    """Text parts joined by newlines, chat_template_kwargs and add_generation_prompt reach the
    template; a conversation the template refuses is a 400 naming messages."""
    from engine.serve.gateway import Gateway
    from engine.serve.openai_protocol import BadRequest, parse_request

    folder = _folder(tmp_path, CHATML)
    gw = Gateway(folder, [], ["127.0.0.1:1"])
    theirs = _transformers(folder)
    body = {"model": folder, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                                                      {"type": "text", "text": "there"}]}],
            "chat_template_kwargs": {"enable_thinking": False}}
    want = theirs.apply_chat_template([{"role": "user", "content": "Hello\nthere"}], tokenize=True,
                                      add_generation_prompt=True, enable_thinking=False, return_dict=False)
    assert gw.encode(parse_request(body, True, folder)) == list(want)
    no_gen = gw.encode(parse_request({**body, "add_generation_prompt": False}, True, folder))
    assert theirs.decode(no_gen).endswith("<|im_end|>\n")
    for bad in ({"chat_template_kwargs": {"messages": []}}, {"chat_template_kwargs": [1]},
                {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
                {"messages": [{"role": "user", "content": 5}]}, {"continue_final_message": True}):
        with pytest.raises(BadRequest):
            parse_request({**body, **bad}, True, folder)
    (tmp_path / "s").mkdir()
    strict = Gateway(_folder(tmp_path / "s", STRICT), [], ["127.0.0.1:1"])
    req = parse_request({"model": "m", "messages": [{"role": "assistant", "content": "hi"}]}, True, "m")
    with pytest.raises(BadRequest, match="roles must alternate") as e:
        strict.encode(req)
    assert e.value.param == "messages"


TOOLS_TEMPLATE = """{% if tools %}<|im_start|>system
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% endif %}
{% for message in messages %}<|im_start|>{{ message.role }}
{% if message.tool_calls %}{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}{% else %}{{ message.content }}{% endif %}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_tools_and_tool_calls_reach_the_template_as_transformers_gives_them(tmp_path):
    """The request's tools, an assistant's calls (their JSON-text arguments as an object, as vLLM
    gives them to templates) and the tool's answer, through the gateway's parsing."""
    from engine.serve.gateway import Gateway
    from engine.serve.openai_protocol import parse_request

    folder = _folder(tmp_path, TOOLS_TEMPLATE)
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Météo d'une ville",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msgs = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    gw = Gateway(folder, [], ["127.0.0.1:1"], tool_parser="hermes")
    got = gw.encode(parse_request({"model": folder, "messages": msgs, "tools": [tool]}, True, folder))
    theirs = _transformers(folder)
    want_msgs = [msgs[0], {**msgs[1], "content": "", "tool_calls": [
        {**call, "function": {**call["function"], "arguments": {"city": "Paris"}}}]}, msgs[2]]
    want = theirs.apply_chat_template(want_msgs, tools=[tool], tokenize=True, add_generation_prompt=True,
                                      return_dict=False)
    assert got == list(want)
    assert "Météo" in theirs.decode(got) and '"arguments": {"city": "Paris"}' in theirs.decode(got)


@pytest.mark.parametrize("template", [LLAMA3, CHATML], ids=["llama3", "chatml"])
def test_continue_final_message_is_transformers(tmp_path, template):
    """The prompt ends inside the final (assistant) message, as transformers' continue_final_message."""
    folder = _folder(tmp_path, template)
    ours, theirs = HFTokenizer(folder), _transformers(folder)
    msgs = CONVERSATIONS[0] + [{"role": "assistant", "content": "Fine, and the weather is "}]
    want = theirs.apply_chat_template(msgs, tokenize=False, continue_final_message=True)
    assert ours.apply_chat_template(msgs, continue_final_message=True) == want
    assert want.rstrip().endswith("Fine, and the weather is")  # (chatml keeps the trailing space, llama3 trims)
    with pytest.raises(ChatTemplateError, match="does not show the final message"):
        HFTokenizer(_folder(tmp_path, "{{ messages[0]['content'] }}")).apply_chat_template(
            msgs, continue_final_message=True)


def test_the_plain_prompt_honours_the_generation_prompt_and_continuation():
    from engine.tokenizer import plain_chat_prompt

    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "well"}]
    assert plain_chat_prompt(msgs) == "<|user|>\nhi\n<|assistant|>\nwell\n<|assistant|>\n"
    assert plain_chat_prompt(msgs, add_generation_prompt=False) == "<|user|>\nhi\n<|assistant|>\nwell\n"
    assert plain_chat_prompt(msgs, continue_final_message=True) == "<|user|>\nhi\n<|assistant|>\nwell"


def test_any_template_renders_or_is_a_chat_template_error():
    """A request's template is code: templates drawn from Jinja's pieces (loops, macros calling
    themselves, divisions by zero, ranges the sandbox refuses, attributes it hides, unclosed
    tags) render to text or raise ``ChatTemplateError`` (a 400 at the gateway), nothing else."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import strategies as st

    from engine.chat_template import ChatTemplate

    pieces = ["{{", "}}", "{%", "%}", " for m in messages ", " endfor ", " if ", " endif ", " else ", "m.content",
              "1/0", "raise_exception('x')", " macro f() ", " endmacro ", "f()", "range(10**6)", "messages",
              "|tojson", "|upper", " ", "x", "'a'*3", "[0]", "[9]", ".role", "loop.index", " set y = 1 ", "tools",
              "add_generation_prompt", "bos_token", "strftime_now('%Y')", "messages.__class__", "(", ")", "~", "+",
              "-1", "10**400", "{{ f() }}", "{% macro f() %}{{ f() }}{% endmacro %}", "{" * 50, "[" * 400]

    @hypothesis.settings(max_examples=600, deadline=None, derandomize=True)
    @hypothesis.given(st.lists(st.sampled_from(pieces), max_size=12).map("".join))
    def check(source):
        try:
            ChatTemplate(source, {"bos_token": "<s>"}).render([{"role": "user", "content": "hi"}], tools=[])
        except ChatTemplateError:
            pass

    check()
