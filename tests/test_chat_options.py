"""How messages become a prompt (runtime.request.ChatOptions): template variables, the
assistant's turn opened or not, a final assistant message continued. The oracle is transformers'
apply_chat_template on the same tokenizer; the engine's prompt ids come back through
prompt_logprobs."""

import shutil

import pytest

from helpers import make_engine
from runtime import ChatOptions, Request, SamplingParams

FAMILY = "qwen2"
# Like Qwen 3's: a variable that closes the thinking block up front.
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if shout is defined and shout %}{{ m['content'] | upper }}{% else %}{{ m['content'] }}{% endif %}"
            "{% if not (loop.last and continue_final_message is defined and continue_final_message) %}<|im_end|>\n"
            "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
            "{% endif %}{{ suffix | default('') }}")
SCORED = SamplingParams(max_tokens=1, prompt_logprobs=0)
QUESTION = [{"role": "user", "content": "Name a river."}]
STARTED = [*QUESTION, {"role": "assistant", "content": "The river"}]


@pytest.fixture(scope="module")
def engine(tiny_chat, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(tiny_chat.dir(FAMILY), model_dir)
    (model_dir / "chat_template.jinja").write_text(TEMPLATE)
    return make_engine(model_dir)


def transformers_ids(engine, messages, **options):
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False, **options)
    return engine.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("messages, options", [
    (QUESTION, {}),
    (QUESTION, {"template_kwargs": {"enable_thinking": False}}),
    (QUESTION, {"template_kwargs": {"enable_thinking": True, "suffix": "Sure."}}),
    (QUESTION, {"add_generation_prompt": False}),
    (STARTED, {"add_generation_prompt": False, "continue_final_message": True}),
])
def test_messages_render_as_transformers_renders_them(engine, messages, options):
    [done] = engine.generate([Request("r", messages=messages, params=SCORED, chat=ChatOptions(**options))])
    assert done.error is None, done.error
    want = transformers_ids(engine, messages, add_generation_prompt=options.get("add_generation_prompt", True),
                            continue_final_message=options.get("continue_final_message", False),
                            **options.get("template_kwargs", {}))
    assert done.prompt_token_ids == want
    if options.get("template_kwargs", {}).get("enable_thinking") is False:
        assert engine.tokenizer.decode(want).endswith("<think>\n\n</think>\n\n")
    if options.get("continue_final_message"):
        assert engine.tokenizer.decode(want).endswith("The river")


def test_the_defaults_are_the_plain_generation_prompt(engine):
    [done] = engine.generate([Request("r", messages=QUESTION, params=SCORED)])
    assert done.prompt_token_ids == transformers_ids(engine, QUESTION, add_generation_prompt=True)


def test_continuing_a_message_the_template_does_not_end_with_is_an_error_completion(engine):
    """transformers refuses when the final message is not in the text (here the template
    upper-cases it); one request's error, the others run."""
    refused, ok = engine.generate([
        Request("refused", messages=STARTED, params=SCORED,
                chat=ChatOptions(template_kwargs={"shout": True}, add_generation_prompt=False,
                                 continue_final_message=True)),
        Request("ok", messages=QUESTION, params=SCORED)])
    assert refused.finish_reason == "error" and refused.invalid
    assert refused.error.startswith("messages: ")
    assert ok.error is None


@pytest.mark.parametrize("options, message", [
    ({"continue_final_message": True}, "continue_final_message must come with add_generation_prompt false"),
    ({"template_kwargs": {"tokenize": True}}, "chat_template_kwargs must hold template variables, not ['tokenize']"),
    ({"template_kwargs": {"add_generation_prompt": False}}, "not ['add_generation_prompt']"),
    ({"template_kwargs": {"tools": 5}}, "not ['tools']"),  # apply_chat_template's, not a variable
    ({"template_kwargs": {"documents": [{"text": "x"}]}}, "not ['documents']"),
    ({"template_kwargs": ["enable_thinking"]}, "chat_template_kwargs must map names to values"),
    ({"template_kwargs": {1: True}}, "chat_template_kwargs must map names to values"),
    ({"add_generation_prompt": 1}, "add_generation_prompt must be a bool"),
    ({"continue_final_message": "yes"}, "continue_final_message must be a bool"),
])
def test_options_that_cannot_be_honoured_are_refused(options, message):
    with pytest.raises(ValueError) as refused:
        ChatOptions(**options)
    assert message in str(refused.value)


def test_every_parameter_of_apply_chat_template_but_the_template_s_inputs_is_refused():
    """The list of names that are not template variables follows transformers' signature:
    what a newer transformers adds (sanitize_control_tokens, say) must be refused, not passed."""
    import inspect

    from transformers import PreTrainedTokenizerBase

    from runtime.request import _NOT_TEMPLATE_VARIABLES

    params = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters)
    assert params - {"self", "kwargs", "tools", "documents"} <= _NOT_TEMPLATE_VARIABLES


@pytest.mark.parametrize("template, takes_parts", [
    ("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}", True),
    ("{% set loop_messages = messages[1:] %}{% for m in loop_messages %}{% for p in m['content'] %}{{ p }}"
     "{% endfor %}{% endfor %}", True),
    ("{% for m in messages[::-1] | list %}{% for p in m.content | reverse %}{{ p }}{% endfor %}{% endfor %}", True),
    ("{% macro r(c) %}{% for i in c %}{{ i.text }}{% endfor %}{% endmacro %}{% for m in messages %}{{ r(m.content) }}"
     "{% endfor %}", True),
    # a loop in a macro nested in one given a content: the outer macro's parameters still hold
    ("{% macro render(x) %}{% macro inner(y) %}{% for z in x %}{{ z.text }}{% endfor %}{% endmacro %}{{ inner(1) }}"
     "{% endmacro %}{% for m in messages %}{{ render(m.content) }}{% endfor %}", True),
    ("{% for m in messages %}{% set content = m.content %}{% for p in content %}{{ p }}{% endfor %}{% endfor %}", True),
    # not a loop over each message's content
    ("{% for m in messages %}{% set c = m.content %}{% for p in c %}{{ p }}{% endfor %}{% endfor %}", False),
    ("{% for p in messages[0]['content'] %}{{ p }}{% endfor %}", False),
    ("{% for t in tools %}{% for x in t.content %}{{ x }}{% endfor %}{% endfor %}", False),
    ("{% for m in messages %}{{ m.content }}{% endfor %}{% for item in content or [] %}{{ item }}{% endfor %}", False),
    ("{% macro r(c) %}{% for i in content %}{{ i }}{% endfor %}{% endmacro %}{% for m in messages %}{{ r(1) }}"
     "{% endfor %}", False),
    # a name bound other than plainly: vLLM's reading gives up, and takes a string
    ("{% set ns = namespace(x=[]) %}{% set ns.x = messages %}{% for m in messages %}{% for p in m.content %}"
     "{{ p.text }}{% endfor %}{% endfor %}", False),
    ("{% for m in messages %}{% for p in m.content %}{{ p }}{% endfor %}{% endfor %}{% for a, b in messages %}"
     "{% endfor %}", False),
    ("{% for m in messages %", False),  # no template jinja can read
])
def test_which_templates_take_text_parts_is_vllms_answer(template, takes_parts):
    """vLLM 0.32's rule (renderers/hf.py _detect_content_format), which runtime/chat.py follows."""
    from types import SimpleNamespace

    from runtime.chat import ChatRules
    assert ChatRules(SimpleNamespace(chat_template=template)).takes_parts is takes_parts
