"""The leader client's wire encoding: requests as Triton's vllm_backend expects them,
responses decoded straight from the protobuf exactly as tritonclient's ``InferResult``
reads them (the reference here), without numpy."""

import json
import struct

import numpy as np
import pytest
from tritonclient.grpc import InferResult, service_pb2
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from proxy.upstream.leader_client import build_openai_request, build_request
from proxy.upstream.triton_grpc import decode_response
from tests.proxy.fake_openai import FakeOpenAIResponse
from tests.proxy.fakes import _inputs, _openai_response, _response


def reference(resp: service_pb2.ModelInferResponse) -> dict:
    """What the proxy read before: tritonclient's InferResult.as_numpy, element 0."""
    result = InferResult(resp)
    out = {}
    for name in ("text_output", "finish_reason", "prompt_tokens", "completion_tokens",
                 "model_version"):  # fmt: skip
        arr = result.as_numpy(name)
        out[name] = None if arr is None or arr.size == 0 else arr.reshape(-1)[0]
    return out


def infer_response(outputs: list[tuple[str, str, np.ndarray]], raw: bool = True):
    resp = service_pb2.ModelInferResponse(model_name="llm", id="r1")
    for name, dtype, arr in outputs:
        t = resp.outputs.add()
        t.name, t.datatype = name, dtype
        t.shape.extend(arr.shape)
        if raw:
            if dtype == "BYTES":
                data = serialize_byte_tensor(arr).item() if arr.size else b""
            else:
                data = arr.tobytes()
            resp.raw_output_contents.append(data)
        elif dtype == "BYTES":
            t.contents.bytes_contents.extend(arr.reshape(-1).tolist())
        else:
            t.contents.int_contents.extend(int(x) for x in arr.reshape(-1))
    return resp


def _b(s: str) -> np.ndarray:
    return np.array([s.encode()], dtype=np.object_)


@pytest.mark.parametrize(
    "text, finish, version",
    [(" tok", "", None), ("", "stop", None), (" größe 10 👟", "length", "2026-11-30"),
     ("\x00nul\n", "", "v1")],
)  # fmt: skip
def test_decode_matches_tritonclient(text, finish, version):
    resp = _response("llm", "r1", text, finish, 17, 3, version).infer_response
    ref = reference(resp)
    d = decode_response(resp)
    assert d.text == ref["text_output"].decode() == text
    assert d.finish_reason == (finish or None)
    assert d.prompt_tokens == int(ref["prompt_tokens"]) == 17
    assert d.completion_tokens == int(ref["completion_tokens"]) == 3
    assert d.model_version == version
    if version is not None:
        assert ref["model_version"].decode() == version


def test_decode_skips_other_outputs_and_reads_any_integer_width():
    resp = infer_response([
        ("logprobs", "BYTES", _b("[-0.1]")),
        ("token_ids", "INT64", np.array([5, 6, 7], dtype=np.int64)),
        ("text_output", "BYTES", _b("hi")),
        ("completion_tokens", "INT64", np.array([2**40], dtype=np.int64)),
        ("prompt_tokens", "UINT32", np.array([9], dtype=np.uint32)),
        ("finish_reason", "BYTES", _b("None")),
    ])  # fmt: skip
    d = decode_response(resp)
    assert (d.text, d.finish_reason, d.prompt_tokens, d.completion_tokens) == ("hi", None, 9, 2**40)
    assert d.model_version is None


def test_decode_empty_and_missing_tensors():
    resp = infer_response([
        ("text_output", "BYTES", np.array([], dtype=np.object_)),
        ("prompt_tokens", "INT32", np.array([], dtype=np.int32)),
    ])  # fmt: skip
    assert reference(resp)["text_output"] is None
    d = decode_response(resp)
    assert (d.text, d.finish_reason, d.prompt_tokens, d.completion_tokens) == ("", None, None, None)


def test_decode_typed_contents_when_no_raw_contents():
    resp = infer_response(
        [("text_output", "BYTES", _b("x")), ("finish_reason", "BYTES", _b("stop")),
         ("completion_tokens", "INT32", np.array([4], dtype=np.int32))],
        raw=False,
    )  # fmt: skip
    d = decode_response(resp)
    assert (d.text, d.finish_reason, d.completion_tokens) == ("x", "stop", 4)


def test_decode_invalid_utf8_is_replaced_not_fatal():
    resp = infer_response([("text_output", "BYTES", np.array([b"a\xffb"], dtype=np.object_))])
    assert decode_response(resp).text == "a\ufffdb"


@pytest.mark.parametrize(
    "raw, dtype",
    [(struct.pack("<I", 10) + b"short", "BYTES"), (b"\x01\x00", "BYTES"), (b"\x01", "FP16")],
)
def test_decode_malformed_tensors_raise(raw, dtype):
    resp = service_pb2.ModelInferResponse()
    t = resp.outputs.add()
    t.name, t.datatype = "text_output", dtype
    t.shape.append(1)
    resp.raw_output_contents.append(raw)
    with pytest.raises((ValueError, struct.error)):
        decode_response(resp)


def test_build_request_is_what_vllm_backend_reads():
    sampling = {"max_tokens": 7, "temperature": 0.5, "stop": ["größe"]}
    req = build_request("llm", "rid-1", "héllo 👟", sampling)
    assert (req.model_name, req.id) == ("llm", "rid-1")
    assert [(t.name, t.datatype, list(t.shape)) for t in req.inputs] == [
        ("text_input", "BYTES", [1]), ("stream", "BOOL", [1]),
        ("sampling_parameters", "BYTES", [1]), ("exclude_input_in_output", "BOOL", [1]),
        ("report_progress", "BOOL", [1]),
    ]  # fmt: skip
    values = _inputs(service_pb2.ModelInferRequest.FromString(req.SerializeToString()))
    assert values["text_input"] == "héllo 👟" and values["report_progress"] is True
    assert json.loads(values["sampling_parameters"]) == sampling
    assert values["stream"] is True and values["exclude_input_in_output"] is True
    raw = dict(zip([t.name for t in req.inputs], req.raw_input_contents, strict=True))
    assert deserialize_bytes_tensor(raw["text_input"])[0].decode() == "héllo 👟"


def test_the_priority_input_only_when_nonzero():
    """The traffic class as the leader's INT32 ``priority`` input; real-time (0) is the
    input's default and is not sent."""
    assert "priority" not in [t.name for t in build_request("llm", "r", "x", {}).inputs]
    req = build_request("llm", "r", "x", {}, priority=2)
    assert (req.inputs[-2].name, req.inputs[-2].datatype, list(req.inputs[-2].shape)) == (
        "priority", "INT32", [1])  # fmt: skip
    values = _inputs(service_pb2.ModelInferRequest.FromString(req.SerializeToString()))
    assert values["priority"] == 2


def test_openai_request_and_response_encoding():
    envelope = b'{"endpoint":"completions","token_ids":true,"resume":null,"body":{"p":"\xc3\xa9"}}'
    req = build_openai_request("llm", "rid-2", envelope)
    assert [(t.name, t.datatype, list(t.shape)) for t in req.inputs] == [
        ("openai_request", "BYTES", [1])
    ]
    values = _inputs(service_pb2.ModelInferRequest.FromString(req.SerializeToString()))
    assert values["openai_request"].encode() == envelope
    sent = FakeOpenAIResponse(b"data: {}\n\n", 200, None, [5, 2**40], [1, 2, 3], 3, 1, "v7")
    d = decode_response(_openai_response("llm", "rid-2", sent).infer_response)
    assert (d.status, d.body, d.token_ids, d.prompt_token_ids) == (
        200, b"data: {}\n\n", [5, 2**40], [1, 2, 3])  # fmt: skip
    assert (d.prompt_tokens, d.completion_tokens, d.model_version, d.final) == (3, 1, "v7", False)
    last = decode_response(
        _openai_response("llm", "r", FakeOpenAIResponse(b"", token_ids=[], finish_reason="done"))
        .infer_response
    )  # fmt: skip
    assert last.final and last.token_ids == [] and last.status is None and last.body == b""


def test_openai_body_in_several_elements_and_typed_ids():
    resp = infer_response([
        ("openai_body", "BYTES", np.array([b"data: a\n\n", b"data: b\n\n"], dtype=np.object_)),
        ("openai_status", "INT32", np.array([404], dtype=np.int32)),
    ])  # fmt: skip
    d = decode_response(resp)
    assert d.body == b"data: a\n\ndata: b\n\n" and d.status == 404 and d.final
    typed = infer_response([("token_ids", "INT32", np.array([7, 8], dtype=np.int32))], raw=False)
    assert decode_response(typed).token_ids == [7, 8]
