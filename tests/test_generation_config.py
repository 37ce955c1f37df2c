"""A checkpoint's generation_config.json as the default sampling of requests that leave the
fields unset (vLLM's ``--generation-config auto``): read as transformers writes it, checked as
a request's fields are, offline (``LLM.generate`` without params) and served (HTTP and gRPC,
``max_new_tokens`` a cap on every request), and off with ``--generation-config vllm``."""
from __future__ import annotations

import shutil

import pytest
import transformers

from jserve.sampling.generation_config import capped, generation_defaults, read_generation_config
from jserve.sampling.params import SamplingParams


def _checkpoint(tmp_path, **generation) -> str:
    """The Llama 3 chat checkpoint with a generation_config.json transformers writes."""
    from hf_models import llama3_chat_dir
    out = tmp_path / "ckpt"
    shutil.copytree(llama3_chat_dir(), out)
    transformers.GenerationConfig(eos_token_id=[1173, 1176, 1177], **generation) \
        .save_pretrained(out)
    return str(out)


QWEN_STYLE = dict(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05,
                  max_new_tokens=64)


def test_the_sampling_keys_are_read_as_the_request_fields_they_default(tmp_path):
    d = _checkpoint(tmp_path, **QWEN_STYLE)
    want = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
            "max_tokens": 64}
    assert read_generation_config(d) == want  # EOS ids, do_sample: not sampling defaults
    assert generation_defaults("auto", d) == want
    assert generation_defaults("vllm", d) == {}
    assert generation_defaults("auto", None) == {}  # the built-in random model has none
    assert generation_defaults("vllm", d, {"temperature": 0.2}) == {"temperature": 0.2}
    assert generation_defaults(d, None, {"max_new_tokens": 8}) == {**want, "max_tokens": 8}
    with pytest.raises(ValueError, match="'seed' is not one of the sampling keys"):
        generation_defaults("auto", d, {"seed": 1})
    with pytest.raises(ValueError, match="must be 'auto', 'vllm' or a directory"):
        generation_defaults(str(tmp_path / "missing"), d)


@pytest.mark.parametrize("bad, words", [
    ('{"temperature": -1}', ["generation_config.json", "temperature must be"]),
    ('{"top_p": 0}', ["top_p must be"]),
    ('{"max_new_tokens": 0}', ["max_new_tokens must be"]),
    ('{"top_k": 1e400}', ["top_k must be"]),
    ("[1, 2]", ["not a JSON object"]),
    ("{", ["not a JSON object"]),
])
def test_a_bad_value_is_refused_naming_the_file_and_key(tmp_path, bad, words):
    (tmp_path / "generation_config.json").write_text(bad)
    with pytest.raises(ValueError) as e:
        read_generation_config(tmp_path)
    assert all(w in str(e.value) for w in words), e.value


def test_max_new_tokens_caps_max_tokens_below_min_tokens_only():
    p = SamplingParams(max_tokens=100, min_tokens=3)
    assert capped(p, {"max_tokens": 64}).max_tokens == 64
    assert capped(p, {"max_tokens": 200}) is p and capped(p, {}) is p
    assert capped(SamplingParams(max_tokens=100, min_tokens=80), {"max_tokens": 64}) \
        .max_tokens == 80


def test_grpc_unset_fields_take_the_defaults_and_max_tokens_is_capped():
    from jserve.proto import generate_pb2 as pb
    from jserve.serving.protocol import params_from_proto
    d = {"top_k": 1, "temperature": 0.7, "max_tokens": 5}
    unset = params_from_proto(pb.SamplingParams(), d)
    assert (unset.top_k, unset.temperature, unset.max_tokens) == (1, 0.7, 5)
    given = params_from_proto(pb.SamplingParams(temperature=0.0, top_k=0, max_tokens=50), d)
    assert (given.top_k, given.temperature, given.max_tokens) == (0, 0.0, 5)
    assert params_from_proto(pb.SamplingParams(max_tokens=3), d).max_tokens == 3
    assert params_from_proto(pb.SamplingParams(min_tokens=9), d).max_tokens == 9
    assert params_from_proto(pb.SamplingParams()).max_tokens == 16  # no defaults: offline's


# top_k 1 samples the argmax after the penalty: the same tokens as greedy with it, so the
# defaults' effect is exact.
ARGMAX = dict(do_sample=True, top_k=1, repetition_penalty=1.3, max_new_tokens=5)
EXPLICIT = dict(temperature=0.0, repetition_penalty=1.3, max_tokens=5)


def test_offline_generate_without_params_samples_as_the_model_says(tmp_path):
    from jserve import LLM
    d = _checkpoint(tmp_path, **ARGMAX)
    small = dict(max_model_len=256, max_num_seqs=2, max_num_batched_tokens=32, warmup=False)
    llm = LLM(d, **small)
    prompt = "The quick brown fox"
    got = llm.generate(prompt)[0]
    assert got.token_ids == llm.generate(prompt, SamplingParams(**EXPLICIT))[0].token_ids
    assert len(got.token_ids) == 5
    plain = LLM(d, generation_config="vllm", **small).get_default_sampling_params()
    assert (plain.temperature, plain.top_k, plain.max_tokens) == (1.0, 0, 16)


@pytest.mark.slow
def test_served_requests_default_to_the_model_and_are_capped(tmp_path):
    import openai

    from conftest import Served
    from jserve.client import Client
    from jserve.proto import generate_pb2 as pb
    d = _checkpoint(tmp_path, **ARGMAX)
    served = Served(d, "--served-model-name", "m", "--max-model-len", "256")
    try:
        said = [served.proc.stdout.readline() for _ in range(2)][1]
        assert "generation_config.json: max_tokens=5, repetition_penalty=1.3, top_k=1 (" in said
        messages = [{"role": "user", "content": "Name three colours."}]
        with openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0) as client:
            plain = client.chat.completions.create(model="m", messages=messages)
            explicit = client.chat.completions.create(
                model="m", messages=messages, temperature=0, max_tokens=5,
                extra_body={"repetition_penalty": 1.3})
            asked_more = client.completions.create(model="m", prompt="Once upon",
                                                   max_tokens=50, temperature=0)
        assert plain.choices[0].message.content == explicit.choices[0].message.content
        assert plain.usage.completion_tokens == explicit.usage.completion_tokens == 5
        assert (asked_more.usage.completion_tokens, asked_more.choices[0].finish_reason) == (
            5, "length")  # max_new_tokens caps what a request asks
        with Client(served.target) as c:  # gRPC: unset fields take the defaults too
            raw = c.generate(pb.GenerateRequest(text="Once upon"))
            want = c.generate("Once upon", SamplingParams(**EXPLICIT))
        assert raw.token_ids == want.token_ids and len(raw.token_ids) == 5
    finally:
        served.close()
