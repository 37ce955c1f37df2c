"""Embeddings (issue 61): ``runner="pooling"`` on tiny Qwen3 embedding checkpoints written by
sentence-transformers (a ``Qwen3Model``, a trained tokenizer): ``LLM.embed`` and ``POST
/v1/embeddings`` through the official ``openai`` client give sentence-transformers'
vectors within float32 tolerance (last-token and mean pooling, prompts chunked across
steps, prefix-cache hits, Matryoshka ``dimensions``, float and base64), field by field
refusals, and no KV page left."""
from __future__ import annotations

import base64
import dataclasses
import json

import httpx2 as httpx
import numpy as np
import openai
import pytest

import conftest
from conftest import Served
from hf_models import qwen3_cross_encoder_dir, qwen3_embedding_dir
from jserve import LLM, SamplingParams
from jserve.pooling import PoolingSpec, finish, read_spec

TEXTS = ["Hello world",
         "JAX compiles numerical programs with XLA for accelerators, one step at a time.",
         "a", "Paged attention keeps the key value cache in fixed size blocks. " * 3]
TOL = 2e-6


@pytest.fixture(scope="module")
def st_models():
    from sentence_transformers import SentenceTransformer
    return {mode: SentenceTransformer(str(qwen3_embedding_dir(mode)), device="cpu")
            for mode in ("lasttoken", "mean")}


def test_the_checkpoints_pooling_is_read_from_its_sentence_transformers_files(tmp_path):
    assert read_spec(qwen3_embedding_dir("lasttoken")) == PoolingSpec("last", True, (16, 32))
    assert read_spec(qwen3_embedding_dir("mean")) == PoolingSpec("mean", True, ())
    assert read_spec(None) == PoolingSpec()
    d = tmp_path / "m"
    (d / "1_Pooling").mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"is_matryoshka": True}))
    modules = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (d / "modules.json").write_text(json.dumps(modules))
    old_style = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
                 "pooling_mode_lasttoken": False}
    (d / "1_Pooling" / "config.json").write_text(json.dumps(old_style))
    assert read_spec(d) == PoolingSpec("mean", False, None)  # no Normalize module
    assert read_spec(d).check_dimensions(7, 64) is None  # is_matryoshka: any size
    for bad, words in (({"pooling_mode": "cls"}, "'cls'"),
                       ({"pooling_mode": "lasttoken", "include_prompt": False}, "include_prompt"),
                       ({**old_style, "pooling_mode_lasttoken": True},
                        "['mean_tokens', 'lasttoken']")):
        (d / "1_Pooling" / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="not supported by jserve") as e:
            read_spec(d)
        assert words in str(e.value)
    spec = PoolingSpec("last", True, (16, 32))
    assert spec.check_dimensions(16, 64) is None and spec.check_dimensions(64, 64) is None
    assert "one of [16, 32]" in spec.check_dimensions(20, 64)
    assert "[1, 64]" in spec.check_dimensions(65, 64)
    assert "not trained" in PoolingSpec().check_dimensions(16, 64)
    v = np.array([3.0, 4.0, 12.0])
    np.testing.assert_allclose(finish(v, PoolingSpec(), 2), [0.6, 0.8])  # cut, then normed


@pytest.mark.parametrize("mode", ["lasttoken", "mean"])
def test_llm_embed_equals_sentence_transformers(st_models, mode):
    """8-token steps: the two longer texts are pooled across chunks; the repeated text is a
    prefix-cache hit under last-token pooling (mean runs with the cache off)."""
    llm = LLM(str(qwen3_embedding_dir(mode)), runner="pooling", warmup=False,
              max_num_batched_tokens=8, max_num_seqs=4)
    texts = TEXTS + TEXTS[1:2]
    want = st_models[mode].encode(texts, convert_to_numpy=True)
    out = llm.embed(texts)
    got = np.array([o.outputs.embedding for o in out])
    np.testing.assert_allclose(got, want, atol=TOL)
    tok = st_models[mode].tokenizer
    assert [o.prompt_token_ids for o in out] == [tok(t)["input_ids"] for t in texts]
    assert llm.engine.allocator.prefix_caching == (mode == "lasttoken")
    if mode == "lasttoken":
        short = np.array([o.outputs.embedding for o in llm.embed(TEXTS, dimensions=16)])
        np.testing.assert_allclose(short, st_models[mode].encode(
            TEXTS, truncate_dim=16, normalize_embeddings=True), atol=TOL)
        with pytest.raises(ValueError, match=r"one of \[16, 32\]"):
            llm.embed(TEXTS, dimensions=20)
        with pytest.raises(ValueError, match="call embed"):
            llm.generate("hi")
    alloc = llm.engine.allocator
    alloc.check()
    assert alloc.num_allocated == 0 and not llm.engine.requests  # every request ended


def test_a_base_model_checkpoint_is_refused_for_generation_and_embed_needs_pooling():
    with pytest.raises(ValueError, match="runner='pooling'"):
        LLM(str(qwen3_embedding_dir("mean")), warmup=False)
    with pytest.raises(ValueError, match="pooler_config needs runner='pooling'"):
        LLM("default", warmup=False, pooler_config={"mode": "mean"})
    with pytest.raises(ValueError, match="length_probe is not supported with runner"):
        LLM("default", warmup=False, runner="pooling", probe_layer=0)


# -- served ----------------------------------------------------------------------------------
def _served(*flags: str) -> Served:
    return Served(str(qwen3_embedding_dir("lasttoken")), "--runner", "pooling",
                  "--served-model-name", "emb", "--max-num-batched-tokens", "16", *flags)


@pytest.fixture(scope="module")
def served():
    s = _served()
    yield s
    s.close()


@pytest.fixture(scope="module")
def served_process():
    """The same server with its engine core in a process of its own."""
    s = _served("--engine-process")
    yield s
    s.close()


@pytest.mark.parametrize("which", ["served", "served_process"])
def test_openai_embeddings_equal_sentence_transformers(which, request, st_models):
    """The openai client asks for base64 unless told (and decodes it); float as asked; a
    batch, one text, token ids; ``dimensions``; usage counts every input's tokens."""
    served = request.getfixturevalue(which)
    st = st_models["lasttoken"]
    want = st.encode(TEXTS, convert_to_numpy=True)
    with openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0,
                       timeout=120) as client:
        for fmt in (openai.NOT_GIVEN, "float"):
            r = client.embeddings.create(model="emb", input=TEXTS, encoding_format=fmt)
            got = np.array([d.embedding for d in sorted(r.data, key=lambda d: d.index)])
            np.testing.assert_allclose(got, want, atol=TOL)
        ids = [st.tokenizer(t)["input_ids"] for t in TEXTS]
        assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
        assert r.model == "emb" and [d.index for d in r.data] == [0, 1, 2, 3]
        one = client.embeddings.create(model="emb", input=ids[1], encoding_format="float")
        np.testing.assert_allclose(one.data[0].embedding, want[1], atol=TOL)
        short = client.embeddings.create(model="emb", input=TEXTS[0], dimensions=32,
                                         encoding_format="float")
        np.testing.assert_allclose(short.data[0].embedding, st.encode(
            TEXTS[:1], truncate_dim=32, normalize_embeddings=True)[0], atol=TOL)
    raw = httpx.post(served.url + "/v1/embeddings", timeout=60, json={
        "model": "emb", "input": "a", "encoding_format": "base64"}).json()
    v = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(v, want[2], atol=TOL)
    conftest.wait_blocks_free(served.url)


@pytest.mark.parametrize("body, field, status", [
    ({"input": "x"}, "model", 400),
    ({"model": "nope", "input": "x"}, None, 404),
    ({"model": "emb"}, "input", 400),
    ({"model": "emb", "input": ""}, "input", 400),
    ({"model": "emb", "input": ["a", ""]}, "input", 400),
    ({"model": "emb", "input": [[]]}, "input", 400),
    ({"model": "emb", "input": [1, 99999]}, "input", 400),
    ({"model": "emb", "input": {"text": "a"}}, "input", 400),
    ({"model": "emb", "input": ["a"] * 300}, "input", 400),
    ({"model": "emb", "input": "a", "encoding_format": "int8"}, "encoding_format", 400),
    ({"model": "emb", "input": "a", "dimensions": 20}, "dimensions", 400),
    ({"model": "emb", "input": "a", "dimensions": 0}, "dimensions", 400),
    ({"model": "emb", "input": "a", "dimensions": True}, "dimensions", 400),
    ({"model": "emb", "input": "a", "user": 3}, "user", 400),
    ({"model": "emb", "input": "a", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens",
     400),
    ({"model": "emb", "input": "a" * 5000}, "input", 400),
])
def test_bad_embedding_requests_are_refused_naming_the_field(served, body, field, status):
    r = httpx.post(served.url + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == field, r.json()


def test_an_embedding_server_refuses_generation_and_a_generating_one_embeddings(served):
    for path, body in (("/v1/completions", {"prompt": "a"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "a"}]}),
                       ("/v1/responses", {"input": "a"})):
        r = httpx.post(served.url + path, json={"model": "emb", **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        assert "/v1/embeddings" in r.json()["error"]["message"]
    from jserve.client import Client
    with Client(served.target) as grpc_client:  # gRPC Generate too
        with pytest.raises(Exception, match="embedding model") as e:
            grpc_client.generate("a", SamplingParams(max_tokens=1))
        assert "INVALID_ARGUMENT" in repr(e.value)
    from jserve.serving.app import BackgroundServer, ServerConfig
    from jserve.serving.fake_engine import FakeEngine
    fake = BackgroundServer(FakeEngine(), ServerConfig(port=0, metrics_port=None, http_port=0))
    try:
        r = httpx.post(fake.http_url + "/v1/embeddings", timeout=30,
                       json={"model": "default", "input": "a"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        assert "--runner pooling" in r.json()["error"]["message"]
    finally:
        fake.stop(grace=0)
    conftest.wait_blocks_free(served.url)


@pytest.mark.slow
def test_fuzzed_embedding_bodies_never_get_a_5xx_and_leave_no_page(served):
    """Arbitrary JSON in every field (``test_hostile_input``'s strategies) against the
    embedding server: a 200 with one vector per input, or a 4xx naming why."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    from test_hostile_input import _check_answer, embeddings_body

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=embeddings_body(), named=st.booleans())
    def run(body, named):
        if named and isinstance(body, dict):
            body = {**body, "model": "emb"}
        r = httpx.post(served.url + "/v1/embeddings", content=json.dumps(body), timeout=60,
                       headers={"content-type": "application/json"})
        _check_answer(r)
        if r.status_code == 200:
            n = 1 if isinstance(body["input"], str) or isinstance(body["input"][0], int) \
                else len(body["input"])
            assert len(r.json()["data"]) == n
    run()
    conftest.wait_blocks_free(served.url)


# -- cross-encoders: /v1/score, /v1/rerank, LLM.score -----------------------------------------
QUERY = "what does jax compile"
DOCS = ["JAX compiles programs with XLA", "a b c", TEXTS[3], "Hello world"]


@pytest.fixture(scope="module")
def cross_encoder():
    from sentence_transformers import CrossEncoder
    return CrossEncoder(str(qwen3_cross_encoder_dir()), device="cpu")


def test_llm_score_equals_the_cross_encoders(cross_encoder):
    llm = LLM(str(qwen3_cross_encoder_dir()), runner="pooling", warmup=False,
              max_num_batched_tokens=8)
    assert read_spec(qwen3_cross_encoder_dir()) == PoolingSpec("last", False, (), "sigmoid")
    want = cross_encoder.predict([(QUERY, d) for d in DOCS])
    got = [o.outputs.score for o in llm.score(QUERY, DOCS)]
    np.testing.assert_allclose(got, want, atol=TOL)
    pairwise = [o.outputs.score for o in llm.score(DOCS[:2], DOCS[2:])]
    np.testing.assert_allclose(pairwise, cross_encoder.predict(list(zip(DOCS[:2], DOCS[2:]))),
                               atol=TOL)
    with pytest.raises(ValueError, match="give one text_1"):
        llm.score(DOCS[:2], DOCS[:3])
    with pytest.raises(ValueError, match="call score"):
        llm.embed("a")


@pytest.fixture(scope="module")
def ce_served():
    s = Served(str(qwen3_cross_encoder_dir()), "--runner", "pooling", "--served-model-name",
               "ce", "--max-num-batched-tokens", "16")
    yield s
    s.close()


def test_score_and_rerank_equal_the_cross_encoders(ce_served, cross_encoder):
    """vLLM's shapes: /v1/score's data in pair order; /v1/rerank's results best first,
    ``top_n`` of them, as CrossEncoder.rank orders them."""
    url = ce_served.url
    want = cross_encoder.predict([(QUERY, d) for d in DOCS])
    r = httpx.post(url + "/v1/score", timeout=60,
                   json={"model": "ce", "text_1": QUERY, "text_2": DOCS}).json()
    assert [d["index"] for d in r["data"]] == list(range(len(DOCS)))
    np.testing.assert_allclose([d["score"] for d in r["data"]], want, atol=TOL)
    tok = cross_encoder.tokenizer
    assert r["usage"]["prompt_tokens"] == sum(len(tok(QUERY, d)["input_ids"]) for d in DOCS)
    ranked = cross_encoder.rank(QUERY, DOCS, top_k=3)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        r = httpx.post(url + path, timeout=60, json={"model": "ce", "query": QUERY,
                                                     "documents": DOCS, "top_n": 3}).json()
        assert [x["index"] for x in r["results"]] == [x["corpus_id"] for x in ranked]
        np.testing.assert_allclose([x["relevance_score"] for x in r["results"]],
                                   [x["score"] for x in ranked], atol=TOL)
        assert [x["document"]["text"] for x in r["results"]] == [DOCS[x["corpus_id"]]
                                                                 for x in ranked]
    bare = httpx.post(url + "/score", timeout=60, json={
        "model": "ce", "text_1": DOCS[:2], "text_2": DOCS[2:]}).json()
    np.testing.assert_allclose([d["score"] for d in bare["data"]], cross_encoder.predict(
        list(zip(DOCS[:2], DOCS[2:]))), atol=TOL)
    for body, path, field in (
            ({"text_1": DOCS[:2], "text_2": DOCS[:3]}, "/v1/score", "text_1"),
            ({"text_1": "a"}, "/v1/score", "text_2"),
            ({"text_1": "a", "text_2": [3]}, "/v1/score", "text_2"),
            ({"text_1": "a", "text_2": "a" * 5000}, "/v1/score", "text_2"),
            ({"query": "a", "documents": []}, "/v1/rerank", "documents"),
            ({"query": ["a"], "documents": ["b"]}, "/v1/rerank", "query"),
            ({"query": "a", "documents": ["b"], "top_n": -1}, "/v1/rerank", "top_n"),
            ({"query": "a", "documents": ["b"], "return_documents": 1}, "/v1/rerank",
             "return_documents"),
            ({"input": "a"}, "/v1/embeddings", "model")):
        r = httpx.post(url + path, json={"model": "ce", **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)
    conftest.wait_blocks_free(url)


def test_the_embedding_server_refuses_scores(served):
    r = httpx.post(served.url + "/v1/score", json={"model": "emb", "text_1": "a",
                                                   "text_2": "b"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    assert "not a one-label cross-encoder" in r.json()["error"]["message"]


def test_pooling_spec_is_frozen_and_checked():
    with pytest.raises(ValueError, match="pooling mode"):
        PoolingSpec("cls")
    with pytest.raises(ValueError, match="pooler_config takes"):
        PoolingSpec.of({"pooling_type": "MEAN"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        PoolingSpec().mode = "mean"
