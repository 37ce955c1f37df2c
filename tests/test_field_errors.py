"""A refused field travels as a ``FieldError`` from where it is raised to both front ends:
HTTP's ``error.param`` and gRPC's ``BadRequest`` detail name it, and nothing reads the
message to find it (the messages below are built to mislead any reader that did)."""
from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from jserve import SamplingParams, serving
from jserve.client import Client, bad_field
from jserve.fields import FieldError
from jserve.serving.app import BackgroundServer, ServerConfig
from jserve.serving.fake_engine import FakeEngine

# Each message starts with a word that is another field and holds the context check's old
# wording, so a front end that looked at the text would name the wrong field.
MODEL = "m"
MISLEADING = "top_k (3) + max_tokens (5) exceeds the context: seed=1"


class Refusing(FakeEngine):
    """A fake engine whose intake refuses ``field`` with a misleading message."""

    field = "stop"

    def prepare(self, prompt, params=None):
        raise FieldError(self.field, MISLEADING)


@pytest.fixture(scope="module")
def server():
    engine = Refusing()
    bg = BackgroundServer(engine, ServerConfig(host="127.0.0.1", port=0, http_port=0,
                                               metrics_port=None,
                                               served_model_names=(MODEL,)))
    yield bg, engine
    bg.stop(grace=0)


def _http_error(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    return e.value.code, json.loads(e.value.read())["error"]


@pytest.mark.parametrize("field, http_param, grpc_field", [
    ("stop", "stop", "sampling_params.stop"),              # a SamplingParams field: renamed
    ("max_tokens", "max_tokens", "sampling_params.max_tokens"),
    ("prompt", "prompt", "prompt"),                         # the request's own: as raised
])
def test_the_field_reaches_http_and_grpc_as_raised(server, field, http_param, grpc_field):
    bg, engine = server
    engine.field = field
    status, err = _http_error(f"{bg.http_url}/v1/completions",
                              {"model": MODEL, "prompt": "hi", "max_tokens": 4})
    assert (status, err["param"], err["code"]) == (400, http_param, "invalid_argument"), err
    assert err["message"] == f"{field}: {MISLEADING}"
    with Client(bg.target) as c, pytest.raises(grpc.RpcError) as e:
        c.generate("hi", SamplingParams(max_tokens=4), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_field(e.value) == grpc_field
    assert e.value.details() == f"{grpc_field}: {MISLEADING}"


def test_the_chat_endpoint_names_its_own_length_field(server):
    bg, engine = server
    engine.field = "max_tokens"
    _, err = _http_error(f"{bg.http_url}/v1/chat/completions",
                         {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                          "max_completion_tokens": 4})
    assert err["param"] == "max_completion_tokens"
    assert err["message"] == f"max_completion_tokens: {MISLEADING}"


def test_a_field_error_renames_its_top_field_by_position():
    e = FieldError("structured_output.regex", "structured_output.regex is not valid")
    assert e.top == "structured_output"
    r = e.renamed("sampling_params.structured_output")
    assert (r.field, r.message) == ("sampling_params.structured_output.regex",
                                    "sampling_params.structured_output.regex is not valid")
    assert FieldError("n", "a message of no field").message == "n: a message of no field"
    assert isinstance(e, ValueError)  # the offline API's callers catch ValueError


def test_no_front_end_reads_a_message_to_find_its_field():
    """The patterns the text-parsing front ends used: none is left in the serving code."""
    src = "\n".join(p.read_text() for p in Path(serving.__file__).parent.glob("*.py"))
    for pattern in (r'" \+ max_tokens \("', r"message\.split\(", r"\.message\.partition",
                    r"str\(e\)\.(startswith|split|partition)", r"field_message",
                    r"message\.replace\("):
        assert not re.search(pattern, src), pattern


def test_a_field_error_crosses_processes_whole():
    import pickle

    e = pickle.loads(pickle.dumps(FieldError("structured_output.regex", MISLEADING)))
    assert isinstance(e, FieldError)
    assert (e.field, e.message) == ("structured_output.regex",
                                    f"structured_output.regex: {MISLEADING}")
    assert str(e) == e.message


def test_a_constraint_refusal_is_renamed_by_position_never_inside_its_text():
    from jserve.serving.http_protocol import constraint_message

    msg = ("structured_output.json must be a JSON schema object or true, got "
           "['structured_output']")
    tail = msg[len("structured_output.json"):]
    assert constraint_message("structured_outputs", "structured_output.json", msg) == \
        "structured_outputs.json" + tail
    assert constraint_message("guided_json", "structured_output.json", msg) == \
        "guided_json" + tail
    assert constraint_message("guided_json", "structured_output", "structured_output must "
                              "set one") == "guided_json must set one"
    assert constraint_message("response_format", "structured_output.json", msg) == \
        "response_format: " + msg
