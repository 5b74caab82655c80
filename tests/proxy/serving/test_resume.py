"""The resumed stream's chunk fix-ups, on chunks as vLLM 0.32 writes them."""

import json

from proxy.serving.resume import ResumedStream, first_event, response_id_suffix

# From vLLM 0.32's OpenAIServingChat (pydantic model_dump_json, exclude_unset).
ORIGIN = (b'data: {"id":"chatcmpl-8ad5","object":"chat.completion.chunk","created":100,'
          b'"model":"demo","choices":[{"index":0,"delta":{"role":"assistant","content":""},'
          b'"logprobs":null,"finish_reason":null}]}\n\n')  # fmt: skip
RESUMED = (
    b'data: {"id":"chatcmpl-8ad5","object":"chat.completion.chunk","created":999,'
    b'"model":"demo","choices":[{"index":0,"delta":{"role":"assistant","content":""},'
    b'"logprobs":null,"finish_reason":null}],"usage":{"prompt_tokens":23,"total_tokens":23,'
    b'"completion_tokens":0}}\n\n'
    b'data: {"id":"chatcmpl-8ad5","object":"chat.completion.chunk","created":999,'
    b'"model":"demo","choices":[{"index":0,"delta":{"content":" \xc3\xa9t\xc3\xa9"},'
    b'"logprobs":null,"finish_reason":"length","stop_reason":null}],"usage":{"prompt_tokens":23,'
    b'"total_tokens":25,"completion_tokens":2}}\n\n'
    b'data: {"id":"chatcmpl-8ad5","object":"chat.completion.chunk","created":999,'
    b'"model":"demo","choices":[],"usage":{"prompt_tokens":23,"total_tokens":25,'
    b'"completion_tokens":2},"system_fingerprint":"vllm-0.32.0"}\n\n'
    b"data: [DONE]\n\n"
)


def events(body: bytes) -> list:
    out = []
    for block in body.split(b"\n\n")[:-1]:
        data = block.removeprefix(b"data: ")
        out.append(data.decode() if data == b"[DONE]" else json.loads(data))
    return out


def test_chat_fixups():
    # The original prompt had 19 tokens; 4 were streamed before the unit failed.
    fixed = events(ResumedStream(first_event(ORIGIN), True, 19, 4).fix(RESUMED))
    assert [e["created"] for e in fixed[:-1]] == [100, 100]  # role chunk dropped
    assert fixed[0]["choices"][0]["delta"] == {"content": " été"}
    usage = {"prompt_tokens": 19, "total_tokens": 25, "completion_tokens": 6}
    assert fixed[0]["usage"] == fixed[1]["usage"] == usage
    assert fixed[1]["system_fingerprint"] == "vllm-0.32.0" and fixed[-1] == "[DONE]"


def test_a_replayed_continuation_already_counts_the_streamed_tokens():
    """``replayed``: the leader fed the 4 streamed tokens through its parser, so its
    usage counts them (and the original prompt); the proxy adds nothing."""
    replayed = RESUMED.replace(b'"prompt_tokens":23', b'"prompt_tokens":19').replace(
        b'"completion_tokens":2', b'"completion_tokens":6').replace(
        b'"total_tokens":25', b'"total_tokens":25')  # fmt: skip
    fixed = events(ResumedStream(first_event(ORIGIN), True, 19, 4, True).fix(replayed))
    assert fixed[1]["usage"] == {"prompt_tokens": 19, "total_tokens": 25, "completion_tokens": 6}


def test_completion_fixups_keep_role_less_chunks_and_clear_repeated_prompt_ids():
    origin = (
        b'data: {"id":"cmpl-7","object":"text_completion","created":5,"model":"m","choices":[]}'
    )
    chunk = (b'data: {"id":"cmpl-7","object":"text_completion","created":6,"model":"m",'
             b'"choices":[{"index":0,"text":" a","prompt_token_ids":[1,2,9]}]}\n\n')  # fmt: skip
    (fixed,) = events(ResumedStream(origin, False, 2, 1).fix(chunk))
    assert fixed["created"] == 5 and fixed["choices"][0] == {
        "index": 0, "text": " a", "prompt_token_ids": None}  # fmt: skip


def test_length_finish_when_nothing_is_left_to_resume():
    stream = ResumedStream(first_event(ORIGIN), True, 19, 8)
    finish, usage, done = events(stream.length_finish(include_usage=True))
    assert finish["id"] == "chatcmpl-8ad5" and finish["created"] == 100
    assert finish["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    assert done == "[DONE]"
    assert events(stream.length_finish(include_usage=False))[-1] == "[DONE]"


def test_response_id_suffix():
    assert response_id_suffix("chatcmpl-abc-1") == "abc-1"
    assert response_id_suffix("cmpl-x") == "x"
