"""The server's pieces without a server: chat prompts through a real chat template, validation
errors reshaped as OpenAI's, the tokens/s window."""

from __future__ import annotations

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from moectl.data.tokenizer_train import default_tokenizer_dir
from moectl.server.api_errors import APIError, validation_error
from moectl.server.metrics import Throughput
from moectl.server.prompts import chat_ids, completion_ids, plain_chat
from moectl.server.protocol import ChatCompletionRequest

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{{ raise_exception('tool messages are not supported') }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def templated():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(default_tokenizer_dir()))
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def test_a_chat_goes_through_the_tokenizers_template_once(templated):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = "<|bos|><|system|>Be brief.\n<|user|>Hi\n<|assistant|>"
    expected = templated.encode(text, add_special_tokens=False)
    assert chat_ids(templated, messages) == expected
    assert expected.count(templated.bos_token_id) == 1  # the template's BOS, none added again


def test_chat_template_kwargs_reach_the_template(templated):
    """vLLM's ``chat_template_kwargs`` (Qwen3's ``enable_thinking``, say) are the template's variables;
    the ones the server sets itself are refused."""
    thinking = templated.chat_template
    templated.chat_template = thinking.replace("<|assistant|>", "<|assistant|>{% if not think %}<|nothink|>{% endif %}")
    try:
        messages = [{"role": "user", "content": "Hi"}]
        quiet = templated.decode(chat_ids(templated, messages, {"think": False}))
        loud = templated.decode(chat_ids(templated, messages, {"think": True}))
        with pytest.raises(APIError, match="may not set add_generation_prompt") as err:
            chat_ids(templated, messages, {"add_generation_prompt": False})
    finally:
        templated.chat_template = thinking
    assert quiet.endswith("<|assistant|><|nothink|>") and loud.endswith("<|assistant|>")
    assert err.value.status == 400 and err.value.param == "chat_template_kwargs"


def test_a_template_that_refuses_the_messages_is_a_400(templated):
    with pytest.raises(APIError, match="chat template refused these messages: tool messages") as err:
        chat_ids(templated, [{"role": "tool", "content": "x"}])
    assert err.value.status == 400 and err.value.param == "messages"


def test_without_a_template_the_plain_transcript():
    from moectl.models.load import ByteTokenizer

    messages = [{"role": "user", "content": "Hi"}]
    assert plain_chat(messages) == "user: Hi\nassistant:"
    assert chat_ids(ByteTokenizer(), messages) == ByteTokenizer().encode("user: Hi\nassistant:")
    assert completion_ids(ByteTokenizer(), "") == [ByteTokenizer.bos_token_id]  # an empty prompt: BOS


def test_chat_content_parts_and_max_completion_tokens():
    body = ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        max_completion_tokens=7,
    )
    body.check()
    assert body.messages[0].text() == "ab" and body.max_tokens == 7
    image = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(APIError, match="'image_url' is not supported"):
        image.check()


def test_validation_errors_name_the_field():
    try:
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "robot", "content": "x"}]})
    except ValidationError as err:
        refused = validation_error(RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in err.errors()]))
    assert refused.status == 400 and refused.param == "messages.0.role"
    assert refused.message.startswith("messages.0.role: Input should be")


def test_throughput_counts_the_window_only(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("moectl.server.metrics.time.monotonic", lambda: clock[0])
    rate = Throughput(window=10.0)
    clock[0] = 105.0
    rate.add(50)
    assert rate.rate() == pytest.approx(50 / 5.0)  # younger than the window: over its age
    clock[0] = 112.0
    rate.add(30)
    assert rate.rate() == pytest.approx((50 + 30) / 10.0)
    clock[0] = 116.0
    assert rate.rate() == pytest.approx(30 / 10.0)  # the 50 left the window


def test_reasoning_effort_reaches_the_template_as_vllm_passes_it(templated):
    """OpenAI's ``reasoning_effort`` (gpt-oss's template reads it) is a template variable; an explicit
    ``chat_template_kwargs`` entry wins."""
    effort = templated.chat_template
    templated.chat_template = effort.replace("<|assistant|>", "<|assistant|>{{ reasoning_effort | default('none') }}")
    try:
        messages = [{"role": "user", "content": "Hi"}]
        body = ChatCompletionRequest(model="m", messages=messages, reasoning_effort="high")
        high = templated.decode(chat_ids(templated, messages, body.template_kwargs()))
        plain = ChatCompletionRequest(model="m", messages=messages)
        none = templated.decode(chat_ids(templated, messages, plain.template_kwargs()))
        both = ChatCompletionRequest(
            model="m", messages=messages, reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"}
        )
        low = templated.decode(chat_ids(templated, messages, both.template_kwargs()))
    finally:
        templated.chat_template = effort
    assert high.endswith("<|assistant|>high") and none.endswith("<|assistant|>none") and low.endswith("low")


@pytest.mark.parametrize(
    ("extra", "refused"),
    [
        ({"use_beam_search": True}, True),
        ({"use_beam_search": False}, False),
        ({"guided_json": {"type": "object"}}, True),
        ({"guided_choice": None}, False),
        ({"prompt_logprobs": 1}, True),
        ({"skip_special_tokens": False}, True),
        ({"skip_special_tokens": True}, False),
        ({"include_stop_str_in_output": True}, True),
        ({"add_generation_prompt": False}, True),
        ({"bad_words": []}, False),
        ({"bad_words": ["x"]}, True),
        ({"user": "someone", "parallel_tool_calls": True}, False),
    ],
)
def test_vllm_extras_that_would_change_the_answer_are_refused(extra, refused):
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}], **extra)
    if not refused:
        body.check()
        return
    with pytest.raises(APIError) as err:
        body.check()
    name = next(iter(extra))
    assert err.value.status == 400 and err.value.param == name and "not supported" in str(err.value)
    if name == "prompt_logprobs":
        assert "echo and logprobs" in str(err.value)
